"""FSDP as in the talk's QLoRA + FSDP case (fsdp.py): a LoRA model's frozen base sharded 1/N,
a 4-bit NF4 base sharded and all-gathered as its packed bytes, the parameter shards offloaded to
the host, and hybrid sharding (HSDP), each equal to one process (test_fsdp's tolerances and
reasoning), with the bytes a rank holds and sends counted against the formulas; a state round
trip for each; train.py's HSDP checkpoints resumed by plain FSDP and back; napkin/memory.py's
napkin beside what a rank holds and sends.
"""
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import lora
from foundations.comm import Comm, ring_bytes
from mechanics.fsdp_optimizer import FSDPOptimizer
from napkin.sent import fsdp_bytes_per_step
from napkin.memory_math import comm_bytes, held_bytes, live_numel, live_tensor_bytes, run_state_bytes
from multiprocess import assert_tensors_close, run_ranks
from composition.parallelize import fsdp_with
from foundations.process_groups import make_mesh
from quantization import NF4Weight
from test_fsdp import _check, _load_full_state_dict, _single, _train_fsdp
from test_snapshot import LOSS_RTOL, WEIGHT_ATOL, _same_weights, _train, _weights
from test_zero import ADAMW, CLIP, STEPS, _batches, _gpt

TARGETS = ("query", "value", "up")
BATCH = 12                          # global: equal rows on 2, 3 and 4 ranks
# The sharded-base variants: name -> (quantize, double_quant, offload_params)
VARIANTS = {"lora": (None, False, False), "nf4": ("nf4", False, False),
            "nf4_offload": ("nf4", False, True), "nf4_dq": ("nf4", True, False)}
# napkin/memory.py counts the model as one flat buffer whose root is gathered twice a step; FSDP gathers
# its root once, pads each unit and aligns each frozen tensor to 16 bytes, and FSDPOptimizer
# sends its used-flags and norm (20 to 70 bytes here): the napkin, less the root's second
# gather, is FSDP's formula to this many bytes.
NAPKIN_SLACK = 128


def _lora_gpt(quantize=None, seed=0, double_quant=False):
    """The same base (a 4-bit one is not in a state dict: it comes from its base model), the
    adapters' initial A drawn from seed."""
    model = _gpt(0)
    torch.manual_seed(seed)
    return lora.apply_lora(model, targets=TARGETS, rank=4, alpha=8, quantize=quantize,
                           double_quant=double_quant)


def _frozen(model) -> list[torch.Tensor]:
    """What FSDP shards as bytes: frozen parameters and the 4-bit codes and scales."""
    return [p for p in model.parameters() if not p.requires_grad] + [
        b for m in model.modules() if isinstance(m, NF4Weight)
        for name, b in m.named_buffers(recurse=False) if name != "levels"]


def _wrap(model, group=None, replicas=None, offload_params=False):
    wrapped = fsdp_with(model, replicas, offload_params, group=group)
    return wrapped, FSDPOptimizer(wrapped, offload=offload_params, **ADAMW)


def _napkin(model, world_size, double_quant=False, offload=None, shard_group=None) -> dict:
    """napkin/memory.py's prediction for this model under fsdp: bytes held per rank, and sent per step."""
    numel, quantized = live_numel(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    options = SimpleNamespace(precision="fp32", ep=1, double_quant=double_quant, offload=offload)
    return {"held": run_state_bytes(model, "zero3", options, shard_group or world_size),
            "sent": sum(comm_bytes(numel, "zero3", "fp32", world_size, trainable, quantized,
                                   double_quant, shard_group).values())}


def _root_gather(wrapped) -> int:
    """Bytes of one all-gather of the root unit's trained and frozen flats."""
    return sum(ring_bytes("all_gather", flat.numel() * flat.element_size(), 1, u.comm.world_size)
               for u in wrapped.root_units for flat in u.flats())


def _device_parameter_bytes(wrapped, opt) -> int:
    """Bytes of every parameter storage FSDP holds outside the optimizer's host tensors: the
    module's tensors and the gathered flats (empty between uses), the trained and frozen shards
    and their compute-dtype copies. Offloaded, 0: every shard is in host memory."""
    host = {t.untyped_storage().data_ptr() for t in opt.host_tensors()}
    units = wrapped.units + wrapped.frozen_units
    tensors = [*wrapped.module.parameters(), *(f for u in units for f in u.flats()),
               *(u.master for u in wrapped.units), *wrapped.frozen_shards(), *wrapped.kept_shards()]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
                if t.untyped_storage().nbytes()}
    return sum(nbytes for ptr, nbytes in storages.items() if ptr not in host)


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


def _sharded_base(names):
    """On N ranks, each of VARIANTS named: the training run, the frozen bytes this rank holds
    and the whole's, one more step's bytes sent beside the formula and napkin/memory.py's, the bytes
    held beside napkin/memory.py's, the live bytes before and after that step (offloaded), and a round
    trip."""
    data, out = _batches(STEPS, BATCH), {}
    for name in names:
        quantize, double_quant, offload = VARIANTS[name]
        model, comm = _lora_gpt(quantize, double_quant=double_quant), Comm()
        whole = sum(t.numel() * t.element_size() for t in _frozen(model))   # fp32 base or 4-bit
        nf4 = [m for m in model.modules() if isinstance(m, NF4Weight)]
        packed = sum(m.nbytes() for m in nf4)
        quantized = sum(torch.Size(m.shape).numel() for m in nf4)
        napkin = _napkin(model, comm.world_size, double_quant, "params" if offload else None)
        wrapped, opt = _wrap(model, comm, offload_params=offload)
        run = _train_fsdp(wrapped, opt, data, clip=CLIP)
        count = live_tensor_bytes if offload else lambda: None     # half a second a count
        live_before = count()
        sent = _bytes_of_a_step(wrapped, opt, comm, data[0])
        run.update(whole=whole, packed=packed, quantized=quantized, frozen_tensors=len(_frozen(model)),
                   sent=sent, live=(live_before, count()), predicted=fsdp_bytes_per_step(wrapped),
                   napkin=napkin, root_gather=_root_gather(wrapped),
                   frozen_per_rank=sum(s.untyped_storage().nbytes() for s in wrapped.frozen_shards()),
                   frozen_units=[u.frozen.flat.numel() for u in wrapped.units + wrapped.frozen_units
                                 if u.frozen is not None],
                   left_whole=sum(t.untyped_storage().nbytes() for t in _frozen(model)),
                   device_shards=len(wrapped.device_shards()), held=held_bytes(wrapped, opt),
                   device_parameter_bytes=_device_parameter_bytes(wrapped, opt),
                   levels=sum({m.levels.untyped_storage().data_ptr(): m.levels.nbytes    # shared
                               for m in nf4}.values()),
                   round_trip=_round_trip(lambda seed: _wrap(_lora_gpt(quantize, seed, double_quant),
                                                             Comm(), offload_params=offload), data))
        out[name] = run
    return out


@pytest.fixture(scope="module")
def two():
    return run_ranks(_sharded_base, 2, ["lora", "nf4", "nf4_offload", "nf4_dq"])


@pytest.fixture(scope="module")
def three():
    return run_ranks(_sharded_base, 3, ["nf4", "nf4_offload"])


@pytest.fixture(scope="module")
def single():
    data, out = _batches(STEPS, BATCH), {}
    for name in ("lora", "nf4", "nf4_dq"):
        quantize, double_quant, _ = VARIANTS[name]
        model = _lora_gpt(quantize, double_quant=double_quant)
        out[name] = _single(model, torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], **ADAMW), data, clip=CLIP)
    model = _gpt()
    out["dense"] = _single(model, torch.optim.AdamW(model.parameters(), **ADAMW), data, clip=CLIP)
    return out


def test_lora_with_the_base_sharded_equals_one_process(two, single):
    _check([o["lora"] for o in two], single["lora"], "N=2 LoRA, base sharded")


@pytest.mark.parametrize("n, name", [(2, "nf4"), (3, "nf4"), (2, "nf4_dq")])
def test_qlora_with_the_4_bit_base_sharded_equals_one_process(two, three, single, n, name):
    # The 4-bit codes and scales (with double quantization, the int8 scales and their fp32
    # scales) travel as bytes and are dequantized after the gather: the weights are one
    # process's bit for bit, so test_fsdp's fp32 tolerances hold.
    _check([o[name] for o in (two if n == 2 else three)], single[name], f"N={n} {name}")


@pytest.mark.parametrize("n, name", [(2, "lora"), (2, "nf4"), (3, "nf4"), (2, "nf4_dq")])
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
    base. The bytes one step sends equal napkin/sent.py's fsdp_bytes_per_step, whose frozen all-gathers carry each
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
        # Between steps the device holds no parameter shard. Counted: every parameter storage
        # FSDP holds (module tensors, gathered flats, masters, frozen shards, compute-dtype
        # copies) is empty or one of the optimizer's host tensors; what the device holds as
        # "params" is the NF4 levels, the format's 16-value constant. On device, the shards.
        assert offloaded["device_parameter_bytes"] == 0 and offloaded["device_shards"] == 0
        assert on_device["device_parameter_bytes"] == on_device["held"]["params"] - on_device["levels"] > 0
        assert offloaded["held"]["params"] == offloaded["levels"] and offloaded["left_whole"] == 0
        assert offloaded["held"]["host"] > on_device["held"].get("host", 0)
        # A step leaves nothing behind: every shard's visit to the device (its copy for the
        # all-gather) is freed, as are the gathered units (all live CPU tensors, counted).
        assert offloaded["live"][0] == offloaded["live"][1], offloaded["live"]
        assert offloaded["sent"] == offloaded["predicted"]


@pytest.mark.parametrize("n, name", [(2, "lora"), (2, "nf4"), (2, "nf4_offload"), (2, "nf4_dq"),
                                     (3, "nf4"), (3, "nf4_offload")])
def test_memory_py_predicts_what_a_rank_holds_and_sends(two, three, n, name):
    """What a rank holds is napkin/memory.py's run_state_bytes: the same parameters, gradients,
    optimizer state and host bytes (the NF4 levels too, a 64-byte table left on the device),
    but for each frozen tensor's 16-byte alignment (here only double quantization's int8
    scales need any). What a step
    sends is napkin/sent.py's fsdp_bytes_per_step, and napkin/memory.py's napkin (a 4-bit weight priced as its packed
    bytes) is that plus the root's second gather, to NAPKIN_SLACK."""
    for o in (two if n == 2 else three):
        run = o[name]
        held, napkin = run["held"], run["napkin"]["held"]
        assert (held["grads"], held["optimizer"]) == (napkin["grads"], napkin["optimizer"]), run
        alignment = -(-16 * run["frozen_tensors"] // n) + len(run["frozen_units"])
        assert 0 <= held["params"] - napkin["params"] <= alignment, (held, napkin)
        assert 0 <= held.get("host", 0) - napkin.get("host", 0) <= alignment, (held, napkin)
        assert run["sent"] == run["predicted"]
        # The frozen flats' layout, which the napkin leaves out: each tensor starts at a multiple
        # of 16 bytes and each unit pads to N shards (fsdp_frozen.FrozenBytes), gathered twice.
        layout = 2 * ring_bytes("all_gather", sum(run["frozen_units"]) - run["whole"], 1, n)
        assert abs(run["napkin"]["sent"] + layout - run["root_gather"] - run["predicted"]) <= NAPKIN_SLACK, run


@pytest.mark.parametrize("name", ["lora", "nf4", "nf4_offload"])
def test_state_round_trip(two, name):
    for o in two:
        straight, resumed = o[name]["round_trip"]
        assert_tensors_close(resumed, straight, 0, 0, f"{name} round trip")


# ---- hybrid sharding: 2 x 2 on 4 ranks ----------------------------------------------------------

def _hybrid():
    """HSDP over 4 ranks: shards within {0, 1} and {2, 3}, copies across; the training run, the
    bytes one step sends beside the formula and napkin/memory.py's, the bytes held beside napkin/memory.py's,
    the shard sizes, and a round trip."""
    data = _batches(STEPS, BATCH)
    comm = Comm()
    shard, copies = make_mesh(comm, 2)
    model = _gpt()
    napkin = _napkin(model, comm.world_size, shard_group=2)
    wrapped, opt = _wrap(model, shard, copies)
    run = _train_fsdp(wrapped, opt, data, clip=CLIP)
    run.update(sent=_bytes_of_a_step(wrapped, opt, comm, data[0]), predicted=fsdp_bytes_per_step(wrapped),
               napkin=napkin, root_gather=_root_gather(wrapped), held=held_bytes(wrapped, opt),
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
    all-reduce across the pairs, the flags and the norm: napkin/sent.py's fsdp_bytes_per_step. napkin/memory.py
    --shard-group 2 predicts the bytes held exactly, and its bytes sent, less the root's second
    gather, are the formula to NAPKIN_SLACK."""
    for run in hybrid:
        assert run["shard_numel"] * 2 == run["numel"]
        assert run["sent"] == run["predicted"]
        napkin = run["napkin"]["held"]
        assert run["held"] == {k: napkin[k] for k in ("params", "grads", "optimizer")}, run["held"]
        assert abs(run["napkin"]["sent"] - run["root_gather"] - run["predicted"]) <= NAPKIN_SLACK, run


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
