"""The activations kept for backward: the meter (foundations/meters.py) counts what autograd
keeps and nothing else, and the napkin (memory_math.kept_activation_bytes, train.py's header)
is within 15% of what a real train.py run measures, under every option that changes them (a
pipeline's: the most stage 0 holds over its schedule, meters.peak_saved_bytes)."""
import pytest
import torch

from foundations.meters import saved_activation_bytes
from multiprocess import run_ranks, train_logged

QUICK = ["--steps", "1", "--log-every", "1", "--eval-every", "0", "--eval-batches", "1",
         "--seq-len", "32", "--batch-size", "8"]


def test_the_meter_leaves_out_weights_gathered_during_forward():
    """FSDP gathers a unit's weights into memory allocated as its forward begins (fsdp.FlatParams:
    its storage resized from 0) and a matmul saves them for the input's gradient: weights, not
    activations, though their memory did not exist when the meter started."""
    weight = torch.nn.Parameter(torch.randn(16, 16))
    weight.untyped_storage().resize_(0)                     # sharded: nothing held between uses
    x = torch.randn(4, 16, requires_grad=True)

    def forward():
        weight.untyped_storage().resize_(16 * 16 * 4)       # gathered
        with torch.no_grad():
            weight.normal_()
        return (x @ weight.t()).sum()
    kept, _ = saved_activation_bytes(forward, exclude=[weight])
    assert kept == x.nbytes                                 # x alone: the weight is excluded


def _runs(cases: dict, base: str) -> dict:
    """{name: (napkin's bytes, measured bytes)} of train.py on this rank, one step of each case;
    QLoRA's over base (an --export file: the weights --quantize-base stores in 4 bits)."""
    kept = {}
    for name, argv in cases.items():
        init = ["--init-from", base] if "--quantize-base" in argv else []
        history, _ = train_logged([*QUICK, *argv, *init])
        measured = (history["activations"] if "activations" in history else      # cp: its line's
                    {step: cp["activation_bytes"] for step, cp in history["cp"].items()})
        kept[name] = history["napkin_activations"], measured[0]
    return kept


# One process for the cases on one rank, one pair for those on two: train.py's own functions,
# each case one step of tiny (the formula is shape-generic: the table in the report has medium
# and gpt2-small).
ALONE = {"single": [], "checkpointed": ["--checkpoint-activations"],
         "checkpointed every 2nd": ["--checkpoint-activations", "2"], "lora": ["--lora"],
         "lora on every linear": ["--lora", "--lora-targets", "query,key,value,output,up,down,head"],
         "qlora": ["--lora", "--quantize-base", "nf4"], "bf16": ["--precision", "bf16"],
         "experts": ["--experts", "4"]}
TWO = {"ddp": ["--strategy", "ddp"], "zero2 offload": ["--strategy", "zero2", "--offload", "optimizer"],
       "fsdp": ["--strategy", "fsdp"], "fsdp qlora": ["--strategy", "fsdp", "--lora", "--quantize-base", "nf4"],
       "tp": ["--strategy", "tp", "--tp", "2"],
       "tp sequence parallel": ["--strategy", "tp", "--tp", "2", "--sequence-parallel"],
       "experts ep 2": ["--experts", "4", "--ep", "2"],
       "cp ring": ["--strategy", "cp", "--cp", "2"],
       "cp all-gather": ["--strategy", "cp", "--cp", "2", "--cp-attention", "allgather"],
       "pipeline 1f1b": ["--strategy", "pipeline", "--pp", "2"],
       "pipeline gpipe lora": ["--strategy", "pipeline", "--pp", "2", "--schedule", "gpipe", "--lora"],
       "pipeline interleaved checkpointed": ["--strategy", "pipeline", "--pp", "2", "--schedule",
                                             "interleaved", "--checkpoint-activations"]}


@pytest.fixture(scope="module")
def kept(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("base") / "tiny.pt")
    run_ranks(train_logged, 1, [*QUICK, "--export", base])
    return {**run_ranks(_runs, 1, ALONE, base)[0], **run_ranks(_runs, 2, TWO, base)[0]}


@pytest.mark.parametrize("case", [*ALONE, *TWO])
def test_the_napkin_is_within_15_percent_of_the_run(kept, case):
    napkin, measured = kept[case]
    assert 0.85 <= napkin / measured <= 1.15, (case, napkin, measured, napkin / measured)


def test_fsdp_keeps_what_ddp_keeps(kept):
    """The same rows through the same blocks: FSDP's weights, gathered in forward, are not
    activations (the meter once counted them, a different amount at each step as the allocator
    reused their memory: at gpt2-small 10x what the blocks keep)."""
    assert kept["fsdp"][1] == kept["ddp"][1]


def test_the_lectures_rule_under_tensor_parallelism():
    """Korthikanti et al., section 4.2, at s=4, b=2, h=8, a=2 (sbh = 64) in 16 bits: sbh(34 + 5as/h)
    = 2496 bytes a layer; over tp = 2, sbh(10 + 24/2 + 5as/(2h)) = 1568, the norms' and the
    linears' whole inputs not split; with sequence parallelism everything split, 1248."""
    from napkin.memory_math import activation_bytes
    shape = dict(seq_len=4, batch=2, hidden=8, heads=2)
    assert activation_bytes(**shape, tp=2) == 64 * (10 + 12) + 160
    assert activation_bytes(**shape, tp=2, sequence_parallel=True) == 2496 // 2
