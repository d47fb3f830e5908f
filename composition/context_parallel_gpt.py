"""Context parallelism over the whole GPT: every rank keeps its t = T/cp tokens of each sequence
(context_parallel.SequenceSplit), and each block's attention becomes the ring's or the all-gather's
over the group, while embeddings, norms, MLPs and the loss run on the rank's own tokens. Beside
that, what the attention sends and how long each rank idles, each next to its formula. The split
and both attentions are in context_parallel.py: read it first.
Run: torchrun --nproc_per_node 2 train.py --strategy cp --cp 2.
Test: pytest tests/test_context_parallel.py

Shapes: B batch, T sequence, H heads, D channels per head, C = H x D, cp ranks in the group, r
this rank, t = T/cp tokens per rank.
"""
from functools import partial

import torch
import torch.nn as nn

from foundations.comm import Comm
from context_parallel import ATTENTIONS, KV_COLLECTIVES, SequenceSplit
from foundations.meters import BusyClock, WaitTimedComm, idle_shares, saved_activation_bytes


class ContextParallelGPT(nn.Module):
    """model.py's GPT over sequences split across the group's ranks (group: a Comm, a process group
    or None, the world). Every rank holds the whole model and gets the same rows (B, T); it keeps
    its t = T/cp tokens of each, and each block's attention (model.py's `attend`) becomes
    `attention` ("ring" or "allgather") over the group. zigzag: Llama 3's balanced split."""

    def __init__(self, gpt, group=None, attention: str = "ring", zigzag: bool = True):
        super().__init__()
        if attention not in ATTENTIONS:
            raise ValueError(f"unknown context-parallel attention {attention!r}: choose "
                             f"{' or '.join(ATTENTIONS)}")
        if gpt.cfg.dropout or gpt.cfg.experts and gpt.cfg.routing_group is None:
            raise ValueError("context parallelism here runs a model without dropout, and experts "
                             "routed in groups: its attention has no dropout masks to regenerate "
                             "block by block, and a router sees one rank's tokens only; use "
                             "dropout 0 and a routing group inside one chunk of a sequence")
        self.gpt, self.comm, self.attention = gpt, Comm.from_group(group), attention
        self.split = SequenceSplit(self.comm.world_size, zigzag)
        # The log's idle share, measured from outside the attention: each forward call's seconds
        # (attending) and, within them, the seconds its Comm blocked (waited).
        self.attending, self.waited = BusyClock(), BusyClock()
        # In place, so that model.py's forward (or a pipeline stage's part of it) runs on this
        # rank's tokens: its positions in the sequence, and attention over the group. A Llama
        # (pretrained/llama.py) has no position embedding: each attention rotates its queries
        # and keys by their positions, which must be the tokens' own in the whole sequence.
        if hasattr(gpt, "positions_of"):
            gpt.positions_of = self._my_positions
        for block in gpt.blocks:
            if isinstance(block, nn.Identity):          # another pipeline stage's block
                continue
            block.attn.attend = partial(self._attend, ATTENTIONS[attention])
            if hasattr(block.attn, "positions_of"):
                block.attn.positions_of = self._my_positions
        # True: the next training forward counts the bytes it keeps for backward (saved-tensor
        # hooks) into activation_bytes. build() asks, for train.py's log; off otherwise, since
        # hooks do not nest: ours would hide a caller's own.
        self.count_activations, self.activation_bytes = False, None
        # The K/V bytes per step train.py's batch sends, predicted: build() sets it.
        self.kv_formula = None

    def _attend(self, attention, q, k, v, dropout_p: float):                 # (B, H, t, D) each
        comm = WaitTimedComm(self.comm, self.waited, q.is_cuda)
        with self.attending.timing(q.is_cuda):
            out = attention(q, k, v, comm, self.split)
        comm.stop()             # backward's messages are not counted: the idle share is forward's
        return out

    def _my_positions(self, t: int, device) -> torch.Tensor:      # (t,) of the T = cp x t
        return self.split.positions(self.comm.rank, t * self.comm.world_size, device)

    def local_tokens(self, idx, targets=None):             # (B, T) each -> (B, t) each
        """This rank's tokens of whole sequences (and of their targets, if given)."""
        T = idx.shape[1]
        if T > self.gpt.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size "
                             f"{self.gpt.cfg.block_size}: use a shorter --seq-len or a larger "
                             f"model preset")
        positions = self.split.positions(self.comm.rank, T, idx.device)      # (t,)
        return idx[:, positions], None if targets is None else targets[:, positions]

    def forward(self, idx, targets=None):        # idx: (B, T), the same on the group's ranks
        idx, targets = self.local_tokens(idx, targets)

        def run():
            # model.py's own forward on this rank's tokens: (B, t) -> (B, t, C) -> logits (B, t, V).
            # The loss: the mean over this rank's B x t tokens; every rank holds as many, so the
            # mean over the ranks (DDP's average) is the mean over the whole batch.
            return self.gpt(idx, targets)
        if self.count_activations and self.training and torch.is_grad_enabled():
            self.count_activations = False
            weights = list(self.gpt.parameters())
            self.activation_bytes, result = saved_activation_bytes(run, exclude=weights)
            return result
        return run()

    def idle_shares(self) -> tuple[list[float], list[float]]:
        """(measured, predicted) idle share of each rank in attention's forward compute.

        Measured since the last call: a rank's busy seconds are its attention's forward seconds
        less those its messages blocked it (meters.idle_shares).
        Counting the causal mask's blocks predicts (SequenceSplit.predicted_idle).
        Collective over the group."""
        busy = self.attending.read() - self.waited.read()
        device = next(self.gpt.parameters()).device
        return idle_shares(busy, self.comm.group, device), self.split.predicted_idle()

    def kv_bytes_sent(self) -> int:
        """What the attention sent since the byte counter was last cleared."""
        return sum(self.comm.bytes_sent[name] for name in KV_COLLECTIVES)
