"""running/divergence.py: the rules that stop a diverged run, in one line naming its checkpoints.

Used by: train.py. Test: python -m pytest tests/test_snapshot.py -k diverge
"""
import math
import os

import torch

from foundations.process_groups import global_mean
from running.errors import RunError
from running.snapshot import losses


class Divergence:
    """The rules that stop a diverged run (exit 2, one line, the checkpoints and their losses):
      - fp32, bf16: a step whose gradients hold inf or NaN (in fp16 the loss scaler skips those)
      - fp16: --max-skipped steps skipped in a row: the scale has then fallen 2^N-fold (a
        healthy run skips a few at its start while the scale settles), so the gradients
        overflow at any scale
      - a logged or saved loss that is inf or NaN, in any precision
      - a logged or saved loss over --max-loss-growth K x the larger of the run's first one (saved
        in its checkpoints: a resumed run keeps it) and ln V, a uniform guess's loss: from
        scratch (the loss starts at ln V) or fine-tuning (below it) the limit is K ln V, 22 for
        bytes at K = 4, where a healthy run only falls from its start and a diverged one climbs
        to hundreds (fp32 at --lr 10: 6970 at step 1)
    Each is decided from values every rank holds alike (the skip decision, from the global
    norm; the global mean loss), where the loop has them on the host already: no extra sync,
    every rank stops at the same step, and no checkpoint of a diverged run is saved.
    """

    def __init__(self, args, vocab_size: int, first_loss: float | None = None):
        """first_loss: a resumed run's, from its checkpoint (the limit stays the run's start's,
        not a diverged checkpoint's); None: the first loss checked here."""
        self.args, self.floor = args, math.log(vocab_size)
        self.first_loss = first_loss
        self.skipped_in_a_row = 0

    def after_step(self, step: int, applied: bool, loss: torch.Tensor, scale: float):
        args = self.args
        self.skipped_in_a_row = 0 if applied else self.skipped_in_a_row + 1
        if not applied and args.precision != "fp16":
            self.stop(step, f"the loss ({global_mean(loss):.4g}) or the gradients are inf/NaN in "
                            f"{args.precision}")
        if args.max_skipped and self.skipped_in_a_row >= args.max_skipped:
            self.stop(step, f"the fp16 loss scaler skipped {self.skipped_in_a_row} steps in a row "
                            f"(--max-skipped {args.max_skipped}), the scale now {scale:.3g}: the "
                            f"gradients overflow at any scale")

    def check_loss(self, step: int, loss: float):
        """loss: the global mean, at a logged step or before a save."""
        if not math.isfinite(loss):
            self.stop(step, f"the loss is {loss} in {self.args.precision}")
        self.first_loss = loss if self.first_loss is None else self.first_loss
        limit = self.args.max_loss_growth * max(self.first_loss, self.floor)
        if self.args.max_loss_growth and loss > limit:
            self.stop(step, f"the loss {loss:.4g} is over --max-loss-growth "
                            f"{self.args.max_loss_growth:g} x {max(self.first_loss, self.floor):.4g} "
                            f"(the larger of the run's first loss and ln V, a uniform guess's)")

    def stop(self, step: int, why: str):
        saved = losses(self.args.out) if self.args.out else []
        back = ("; the checkpoints and the loss each was saved at: " + ", ".join(
            f"{os.path.basename(p)} ({'?' if v is None else f'{v:.4g}'})" for p, v in saved)
            + f". Resume from one saved before the loss climbed: --resume {saved[0][0]}"
            if saved else "")
        raise RunError(f"step {step}: {why}: the run diverged: lower --lr, keep --clip-grad on, "
                       f"check --data{back}")
