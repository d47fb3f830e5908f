"""FSDP as in the talk's QLoRA + FSDP case (fsdp.py): a LoRA model's frozen base sharded 1/N,
a 4-bit NF4 base sharded and all-gathered as its packed bytes, the parameter shards offloaded to
the host, and hybrid sharding (HSDP), each equal to one process (test_fsdp's tolerances and
reasoning), with the bytes a rank holds and sends counted against the formulas; a state round
trip for each; train.py's HSDP checkpoints resumed by plain FSDP and back.
"""
import os

import pytest
import torch
import torch.distributed as dist

import lora
from collectives import Comm
from fsdp import FSDP, FSDPOptimizer
from memory import held_bytes
from multiprocess import assert_tensors_close, run_ranks
from process_groups import make_mesh
from quantization import NF4Weight
from test_fsdp import _check, _load_full_state_dict, _single, _train_fsdp
from test_snapshot import LOSS_RTOL, WEIGHT_ATOL, _same_weights, _train, _weights
from test_zero import ADAMW, CLIP, STEPS, _batches, _gpt

TARGETS = ("query", "value", "up")
BATCH = 12                          # global: equal rows on 2, 3 and 4 ranks


def _lora_gpt(quantize=None, seed=0):
    """The same base (a 4-bit one is not in a state dict: it comes from its base model), the
    adapters' initial A drawn from seed."""
    model = _gpt(0)
    torch.manual_seed(seed)
    return lora.apply_lora(model, targets=TARGETS, rank=4, alpha=8, quantize=quantize)


def _frozen(model) -> list[torch.Tensor]:
    """What FSDP shards as bytes: frozen parameters and the 4-bit codes and scales."""
    return [p for p in model.parameters() if not p.requires_grad] + [
        b for m in model.modules() if isinstance(m, NF4Weight)
        for name, b in m.named_buffers(recurse=False) if name != "levels"]


def _wrap(model, group=None, replicas=None, offload_params=False):
    wrapped = FSDP(model, group=group, replicate_group=replicas, offload_params=offload_params)
    return wrapped, FSDPOptimizer(wrapped, offload=offload_params, **ADAMW)


def _bytes_of_a_step(wrapped, opt, comm, batch) -> int:
    """What comm's counter sees in one clipped training step on this rank's rows."""
    rows = batch.chunk(dist.get_world_size())[dist.get_rank()]
    comm.bytes_sent.clear()
    opt.zero_grad()
    wrapped(rows[:, :-1], rows[:, 1:])[1].backward()
    opt.clip_grad_norm_(CLIP)
    opt.step()
    return sum(comm.bytes_sent.values())


def _round_trip(make, batches):
    """Train 2 steps, save the full state and the optimizer's, load them into a fresh copy
    (other initial weights) and train step 3 in both: the same parameters, bit for bit."""
    runs = []
    for resume in (False, True):
        wrapped, opt = make(0)
        _train_fsdp(wrapped, opt, batches[:2], clip=CLIP)
        if resume:
            weights, state = wrapped.full_state_dict(all_ranks=True), opt.state_dict()
            wrapped, opt = make(1)
            _load_full_state_dict(wrapped, weights)
            opt.load_state_dict(state)
        runs.append(_train_fsdp(wrapped, opt, batches[2:3], clip=CLIP)["params"])
    return runs


def _sharded_base(quantizes):
    """On N ranks: LoRA and QLoRA with the base sharded, QLoRA with the parameters offloaded;
    per variant the training run, the frozen bytes this rank holds and the whole's, the bytes
    sent by one step beside the formula, and a round trip."""
    data, out = _batches(STEPS, BATCH), {}
    for quantize in quantizes:
        for offload in ((False, True) if quantize else (False,)):
            name = f"{quantize or 'lora'}{'_offload' if offload else ''}"
            model, comm = _lora_gpt(quantize), Comm()
            whole = sum(t.numel() * t.element_size() for t in _frozen(model))   # fp32 base or 4-bit
            nf4 = [m for m in model.modules() if isinstance(m, NF4Weight)]
            packed = sum(m.nbytes() for m in nf4)
            quantized = sum(torch.Size(m.shape).numel() for m in nf4)
            wrapped, opt = _wrap(model, comm, offload_params=offload)
            run = _train_fsdp(wrapped, opt, data, clip=CLIP)
            run.update(whole=whole, packed=packed, quantized=quantized, sent=_bytes_of_a_step(wrapped, opt, comm, data[0]),
                       predicted=wrapped.bytes_per_step(),
                       frozen_per_rank=sum(s.untyped_storage().nbytes() for s in wrapped.frozen_shards()),
                       frozen_units=[u.frozen.flat.numel() for u in wrapped.units + wrapped.frozen_units
                                     if u.frozen is not None],
                       left_whole=sum(t.untyped_storage().nbytes() for t in _frozen(model)),
                       device_shards=len(wrapped.device_shards()), held=held_bytes(wrapped, opt),
                       levels=sum({m.levels.untyped_storage().data_ptr(): m.levels.nbytes    # shared
                                   for m in nf4}.values()),
                       round_trip=_round_trip(lambda seed: _wrap(_lora_gpt(quantize, seed), Comm(),
                                                                 offload_params=offload), data))
            out[name] = run
    return out


@pytest.fixture(scope="module")
def two():
    return run_ranks(_sharded_base, 2, [None, "nf4"])


@pytest.fixture(scope="module")
def three():
    return run_ranks(_sharded_base, 3, ["nf4"])


@pytest.fixture(scope="module")
def single():
    data, out = _batches(STEPS, BATCH), {}
    for quantize in (None, "nf4"):
        model = _lora_gpt(quantize)
        out[quantize or "lora"] = _single(model, torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], **ADAMW), data, clip=CLIP)
    model = _gpt()
    out["dense"] = _single(model, torch.optim.AdamW(model.parameters(), **ADAMW), data, clip=CLIP)
    return out


def test_lora_with_the_base_sharded_equals_one_process(two, single):
    _check([o["lora"] for o in two], single["lora"], "N=2 LoRA, base sharded")


@pytest.mark.parametrize("n", [2, 3])
def test_qlora_with_the_4_bit_base_sharded_equals_one_process(two, three, single, n):
    # The 4-bit codes and scales travel as bytes and are dequantized after the gather: the
    # weights are one process's bit for bit, so test_fsdp's fp32 tolerances hold.
    _check([o["nf4"] for o in (two if n == 2 else three)], single["nf4"], f"N={n} QLoRA")


@pytest.mark.parametrize("n, name", [(2, "lora"), (2, "nf4"), (3, "nf4")])
def test_frozen_bytes_per_rank_are_one_nth(two, three, n, name):
    """Counted live: each rank holds one shard of each unit's frozen bytes and nothing whole
    (the module's frozen tensors have no storage between uses). A unit's bytes are its tensors
    laid end to end, each starting at a multiple of 16 bytes, padded to N equal shards."""
    for o in (two if n == 2 else three):
        run = o[name]
        assert run["left_whole"] == 0
        assert run["frozen_per_rank"] == sum(-(-b // n) for b in run["frozen_units"])
        slack = sum(16 + n for _ in run["frozen_units"]) + 16 * 40      # alignment, padding
        assert run["whole"] / n <= run["frozen_per_rank"] <= run["whole"] / n + slack, run


@pytest.mark.parametrize("n", [2, 3])
def test_the_4_bit_base_goes_over_the_wire_packed(two, three, n):
    """The 4-bit weights are sharded and all-gathered as their packed codes and scales: 4.5 bits
    a weight (a 4-bit code, and a 32-bit scale per block of 64), not the 32 of the LoRA run's fp32
    base. The bytes one step sends equal FSDP.bytes_per_step, whose frozen all-gathers carry each
    unit's frozen bytes: so the QLoRA run's frozen bytes, and what it sends, are the LoRA run's
    less 32 - 4.5 bits for each quantized weight (to the 16-byte alignment of each tensor)."""
    qlora, plain = (two if n == 2 else three)[0]["nf4"], two[0]["lora"]
    assert qlora["packed"] * 8 == 4.5 * qlora["quantized"]
    assert qlora["sent"] == qlora["predicted"]
    saved = plain["whole"] - qlora["whole"]
    assert saved == qlora["quantized"] * 4 - qlora["packed"]
    assert abs(sum(plain["frozen_units"]) - sum(qlora["frozen_units"]) - saved) <= 16 * 40 + 2 * 3 * n
    if n == 2:                                    # the same ranks: the bytes saved on the wire
        gathers = plain["sent"] - qlora["sent"]
        assert abs(gathers - 2 * (n - 1) / n * saved) <= 2 * (16 * 40 + 2 * 3 * n)


def test_parameter_offload_equals_on_device_bit_for_bit(two):
    for o in two:
        offloaded, on_device = o["nf4_offload"], o["nf4"]
        assert offloaded["losses"] == on_device["losses"]
        assert_tensors_close(offloaded["params"], on_device["params"], 0, 0, "offload params vs device")
        # Between steps the device holds no parameter shard: none kept beside the fp32 masters
        # (on the host), the module's tensors empty; what it holds as "params" is the NF4 levels,
        # the format's 16-value constant.
        assert offloaded["device_shards"] == 0 and offloaded["left_whole"] == 0
        assert offloaded["held"]["params"] == offloaded["levels"]
        assert offloaded["held"]["host"] > on_device["held"].get("host", 0)
        assert offloaded["sent"] == offloaded["predicted"]


@pytest.mark.parametrize("name", ["lora", "nf4", "nf4_offload"])
def test_state_round_trip(two, name):
    for o in two:
        straight, resumed = o[name]["round_trip"]
        assert_tensors_close(resumed, straight, 0, 0, f"{name} round trip")


# ---- hybrid sharding: 2 x 2 on 4 ranks ----------------------------------------------------------

def _hybrid():
    """HSDP over 4 ranks: shards within {0, 1} and {2, 3}, copies across; the training run, the
    bytes one step sends beside the formula, the shard sizes, and a round trip."""
    data = _batches(STEPS, BATCH)
    comm = Comm()
    shard, copies = make_mesh(comm, 2)
    wrapped, opt = _wrap(_gpt(), shard, copies)
    run = _train_fsdp(wrapped, opt, data, clip=CLIP)
    run.update(sent=_bytes_of_a_step(wrapped, opt, comm, data[0]), predicted=wrapped.bytes_per_step(),
               shard_numel=sum(u.master.numel() for u in wrapped.units),
               numel=sum(u.flat.numel() for u in wrapped.units),
               round_trip=_round_trip(lambda seed: _wrap(_gpt(seed), *make_mesh(Comm(), 2)), data))
    return run


@pytest.fixture(scope="module")
def hybrid():
    return run_ranks(_hybrid, 4)


def test_hybrid_sharding_equals_one_process(hybrid, single):
    _check(hybrid, single["dense"], "HSDP 2 x 2")


def test_hybrid_sharding_holds_half_and_sends_the_formula(hybrid):
    """Each rank holds 1/2 of the model (its shard group's size, not the world's 4), and sends per
    step: two all-gathers (one for the root) and a reduce-scatter inside its pair, the shard's
    all-reduce across the pairs, the flags and the norm: fsdp.FSDP.bytes_per_step."""
    for run in hybrid:
        assert run["shard_numel"] * 2 == run["numel"]
        assert run["sent"] == run["predicted"]


def test_hybrid_state_round_trip(hybrid):
    for run in hybrid:
        straight, resumed = run["round_trip"]
        assert_tensors_close(resumed, straight, 0, 0, "HSDP round trip")


def _save(root, name, extra):
    return _train(["--strategy", "fsdp", *extra, "--out", os.path.join(root, name), "--save-every", "3",
                   "--export", os.path.join(root, name + ".pt")])


def _resume(root, saved, name, extra):
    import shutil
    target = os.path.join(root, name)
    if dist.get_rank() == 0:                      # as if the run had stopped at step 3
        shutil.copytree(os.path.join(root, saved), target, ignore=shutil.ignore_patterns("ckpt-0000006"))
    dist.barrier()
    return _train(["--strategy", "fsdp", *extra, "--out", target, "--resume", "--export", target + ".pt"])


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hsdp"))
    hsdp = run_ranks(_save, 4, root, "hsdp", ["--shard-group", "2"])[0]
    plain = run_ranks(_save, 2, root, "fsdp", [])[0]
    to_fsdp = run_ranks(_resume, 2, root, "hsdp", "hsdp-to-fsdp", [])[0]
    to_hsdp = run_ranks(_resume, 4, root, "fsdp", "fsdp-to-hsdp", ["--shard-group", "2"])[0]
    return root, hsdp, plain, to_fsdp, to_hsdp


@pytest.mark.parametrize("saved, resumed", [("hsdp", "hsdp-to-fsdp"), ("fsdp", "fsdp-to-hsdp")])
def test_hybrid_checkpoints_resume_under_plain_fsdp_and_back(resharded, saved, resumed):
    root, hsdp, plain, to_fsdp, to_hsdp = resharded
    straight, again = {"hsdp": hsdp, "fsdp": plain}[saved], {"hsdp": to_fsdp, "fsdp": to_hsdp}[saved]
    assert list(again["losses"]) == [3, 4, 5]
    for step, loss in again["losses"].items():
        assert loss == pytest.approx(straight["losses"][step], rel=LOSS_RTOL), step
    _same_weights(_weights(os.path.join(root, resumed + ".pt")), _weights(os.path.join(root, saved + ".pt")),
                  atol=WEIGHT_ATOL)
