"""DDP equals single-process training on the same global batch, and PyTorch's own DDP.

Two kinds of rank launches (each costs a second or two, so each does several things): a GPT
trained five AdamW steps by every variant (bucketed DDP on native and ring collectives, the
naive per-parameter all-reduce, torch's DistributedDataParallel), and one for the awkward
cases (no_sync accumulation; frozen, unused and tied parameters; the double-backward error).
"""
import math
from contextlib import nullcontext

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from foundations.comm import Comm, Handle
from ddp import DDP, all_reduce_gradients
from model import build_model
from multiprocess import assert_tensors_close, run_ranks
from napkin.sent import ddp_bytes_per_step

MODEL = dict(n_layer=2, n_embd=64, n_head=4, block_size=32)
GLOBAL_BATCH, SEQ, STEPS, LR = 8, 16, 5, 1e-3   # 8 sequences split over N = 2 or 4 ranks
BUCKET_MB = 0.1                                 # ~0.5 MB of fp32 gradients -> 7 buckets
# Tolerances, fp32. Gradients: each rank's matmuls sum over B/N rows and the all-reduce adds N
# such partial sums, where one process sums all B rows at once: the order of additions differs,
# so a difference of a few ulps of the tensor's largest element (not of each element: a sum
# that cancels to nearly zero has no relative precision). Parameters, a smoke test beside the
# fp64 claim (FP64_ATOL): an AdamW update moves an element by about lr at most, and Adam divides
# by sqrt(v) + eps, so where |g| is near eps those ulps move the update by a sizeable fraction
# of it: 1% of what the STEPS updates move (5e-5), 100x below what a missing or unaveraged
# bucket does. Worst |difference| measured over its uses (2 and 4 ranks, the variants, the
# awkward cases; 2-core Intel Xeon with AVX-512): default 1.9e-6 (27x below the bound), avx2
# 5.0e-6 (10x), avx512 8.1e-7 (62x); 1% of one step's lr, the bound before, was 2.0x above avx2's.
GRAD_TOL = 2e-6                                 # x the tensor's largest |element|
PARAM_TOL = 0.01 * LR * STEPS                   # absolute
# fp64, where equal to one process is exact: the same sums in another order round at 1e-16 of
# their terms, which Adam's division by sqrt(v) + eps amplifies by at most lr / eps = 1e5: every
# parameter within FP64_ATOL of one fp64 process's after STEPS steps, on any CPU.
FP64_ATOL = 1e-10


def _gpt(state=None):
    model = build_model("tiny", **MODEL)
    if state is not None:
        model.load_state_dict(state)
    return model


def _batches(steps, batch, seed=1234):
    """The global batches, (steps, B, T+1) token ids; every process draws the same ones."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (steps, batch, SEQ + 1), generator=g)


def _adamw(module):
    return torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=0.1)


def _params(module):
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def _grads(module):
    return {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}


def _assert_grads_close(actual, expected, what, tol=GRAD_TOL):
    """Each gradient within tol x its largest |element|; a failure names it and its worst spot."""
    assert actual.keys() == expected.keys(), f"{what}: names differ: {set(actual) ^ set(expected)}"
    for name in expected:
        assert_tensors_close({name: actual[name]}, {name: expected[name]}, rtol=0,
                             atol=tol * expected[name].abs().max().item(), what=what)


def _train(model, forward, sync, batches):
    """AdamW over batches (STEPS, B, T+1); forward(x, y) -> loss, sync() after each backward."""
    opt, losses, first_grads = _adamw(model), [], None
    for batch in batches:                                        # (B, T+1)
        loss = forward(batch[:, :-1], batch[:, 1:])
        loss.backward()
        sync()
        if first_grads is None:
            first_grads = _grads(model)
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": first_grads, "params": _params(model)}


# ---- launch 1: the GPT, every variant ----------------------------------------------------------

def _train_gpt():
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from foundations.comm import Comm
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)                # rank 0 starts as the single process does; others differ
    model = _gpt()
    out = {"before_broadcast": _params(model)}
    ddp = DDP(model, bucket_mb=BUCKET_MB)
    out["init"] = _params(model)

    b = GLOBAL_BATCH // n
    batches = _batches(STEPS, GLOBAL_BATCH)[:, rank * b:(rank + 1) * b]     # this rank's slice
    out["launched_in_backward"] = []

    def ddp_sync():                        # every gradient was used: backward launched every bucket
        out["launched_in_backward"].append(ddp.launched)
        ddp.finish_gradient_sync()
    out["ddp"] = _train(model, lambda x, y: ddp(x, y)[1], ddp_sync, batches)
    out["n_buckets"] = len(ddp.buckets)
    fp64 = DDP(_gpt(out["init"]).double(), bucket_mb=BUCKET_MB)               # buckets, reduce in fp64
    out["fp64"] = _train(fp64.module, lambda x, y: fp64(x, y)[1], fp64.finish_gradient_sync, batches)
    naive = _gpt(out["init"])
    out["naive"] = _train(naive, lambda x, y: naive(x, y)[1],
                          lambda: all_reduce_gradients(naive), batches)
    torch_ddp = DistributedDataParallel(_gpt(out["init"]), bucket_cap_mb=BUCKET_MB)
    out["torch"] = _train(torch_ddp.module, lambda x, y: torch_ddp(x, y)[1], lambda: None, batches)

    ring = DDP(_gpt(out["init"]), Comm(ring=True), bucket_mb=BUCKET_MB)
    ring.comm.bytes_sent.clear()                                 # drop the construction broadcast
    out["bytes_sent"] = []

    def ring_sync():
        ring.finish_gradient_sync()
        out["bytes_sent"].append(sum(ring.comm.bytes_sent.values()))
        ring.comm.bytes_sent.clear()
    out["ring"] = _train(ring.module, lambda x, y: ring(x, y)[1], ring_sync, batches)
    out["bytes_per_step"] = ddp_bytes_per_step(ring)
    out["bucket_numels"] = [buffer.numel() for buffer in ring.gradient_buffers()]
    out["n_params"] = len(ring.params)
    return out


@pytest.fixture(scope="module")
def single():
    """The baseline: one process, the whole global batch, rank 0's initial weights (seed 0)."""
    torch.manual_seed(0)
    model = _gpt()
    out = {"init": _params(model)}
    out.update(_train(model, lambda x, y: model(x, y)[1], lambda: None,
                      _batches(STEPS, GLOBAL_BATCH)))
    model = _gpt(out["init"]).double()
    out["fp64"] = _train(model, lambda x, y: model(x, y)[1], lambda: None, _batches(STEPS, GLOBAL_BATCH))
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"N={n}")
def gpt(request):
    return request.param, run_ranks(_train_gpt, request.param)


def test_ranks_start_identical(gpt, single):
    n, ranks = gpt
    for rank, out in enumerate(ranks):
        if rank > 0:                        # the seeds really differed before the broadcast ...
            assert not torch.equal(out["before_broadcast"]["head.weight"],
                                   ranks[0]["before_broadcast"]["head.weight"])
        # ... and after it every rank holds rank 0's weights bit for bit: a broadcast copies bytes
        assert_tensors_close(out["init"], single["init"], rtol=0, atol=0,
                             what=f"N={n} rank {rank} initial")


@pytest.mark.equivalence
def test_matches_single_process(gpt, single):
    """Losses, the first gradient and the parameters after STEPS steps are one process's: in fp64
    to FP64_ATOL (the claim), in fp32 to GRAD_TOL and PARAM_TOL (their causes above)."""
    n, ranks = gpt
    # The loss of the global batch is the mean of the N slices' mean losses (equal slices).
    losses = torch.tensor([out["ddp"]["losses"] for out in ranks]).mean(0)      # (STEPS,)
    torch.testing.assert_close(losses, torch.tensor(single["losses"]), rtol=1e-6, atol=0,
                               msg=lambda m: f"N={n} mean loss per step: {m}")
    for rank, out in enumerate(ranks):
        what = f"N={n} rank {rank}"
        _assert_grads_close(out["ddp"]["grads"], single["grads"], f"{what} gradient of step 0")
        assert_tensors_close(out["ddp"]["params"], single["params"], rtol=0, atol=PARAM_TOL,
                             what=f"{what} parameters after {STEPS} steps")
        assert_tensors_close(out["fp64"]["params"], single["fp64"]["params"], rtol=0, atol=FP64_ATOL,
                             what=f"{what} fp64 parameters after {STEPS} steps")
        # Overlap: all buckets were on the wire before backward returned, none waited for finish.
        assert out["launched_in_backward"] == [out["n_buckets"]] * STEPS
        # Every rank received the same averaged bytes and ran the same update: replicas identical.
        assert_tensors_close(out["ddp"]["params"], ranks[0]["ddp"]["params"], rtol=0, atol=0,
                             what=f"{what} vs rank 0")


@pytest.mark.parametrize("variant", ["torch", "naive", "ring"])
def test_variants_agree(gpt, variant):
    """torch's DistributedDataParallel, the naive per-parameter all-reduce and ring collectives."""
    n, ranks = gpt
    # N = 2: bit for bit, since a + b = b + a and halving is exact, whoever adds and whenever
    # the division happens (torch divides before summing). N = 4: gloo's and the ring's order
    # of the four additions can depend on where an element sits in its message: an ulp or two.
    grad_tol, param_tol = (0, 0) if n == 2 else (GRAD_TOL, PARAM_TOL)
    for rank, out in enumerate(ranks):
        what = f"N={n} rank {rank} {variant} vs bucketed DDP"
        _assert_grads_close(out[variant]["grads"], out["ddp"]["grads"], f"{what} gradient",
                            tol=grad_tol)
        assert_tensors_close(out[variant]["params"], out["ddp"]["params"], rtol=0, atol=param_tol,
                             what=f"{what} parameters")


def test_bytes_per_step_match_formula(gpt):
    n, ranks = gpt
    numel = sum(p.numel() for p in _gpt().parameters() if p.requires_grad)
    for rank, out in enumerate(ranks):
        buckets = out["bucket_numels"]
        assert len(buckets) > 1 and sum(buckets) == numel   # every gradient once, several buckets
        # Ring all-reduce: each rank sends 2(N-1) chunks of ceil(L/N) elements per bucket, 4 bytes
        # each (fp32), plus the same for the P one-byte "used" flags.
        formula = (sum(2 * (n - 1) * math.ceil(L / n) * 4 for L in buckets)
                   + 2 * (n - 1) * math.ceil(out["n_params"] / n))
        assert out["bytes_per_step"] == formula
        assert out["bytes_sent"] == [formula] * STEPS, f"N={n} rank {rank}"


# ---- launch 2: accumulation, frozen / unused / tied parameters, misuse -------------------------

V, C = 11, 7                                    # odd sizes: buckets need padding to N chunks
AWKWARD_N = 3                                   # odd: a ring index or padding bug 2 ranks hide shows
MICRO, ACCUM = 2, 2                             # sequences per micro-batch, micro-batches per step


class _Awkward(nn.Module):
    """Every awkward case at once: frozen, used by rank 0 only, used by no rank, tied, a buffer."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, C)
        self.frozen = nn.Linear(C, C).requires_grad_(False)
        self.rank0_only = nn.Linear(C, C)
        self.unused = nn.Linear(C, C)
        self.head = nn.Linear(C, V, bias=False)
        self.head.weight = self.embed.weight                    # tied: input and output embedding
        self.register_buffer("scale", torch.rand(C) + 0.5)

    def forward(self, idx, targets, extra: bool):               # idx: (B, T)
        x = self.frozen(self.embed(idx) * self.scale)           # (B, T, C)
        if extra:
            x = x + torch.tanh(self.rank0_only(x))
        return F.cross_entropy(self.head(x).view(-1, V), targets.reshape(-1))


def _uses_extra(rank, step, micro):
    # Step 0: rank 0 uses rank0_only in its first micro-batch (inside no_sync), so at sync time
    # the gradient sits in .grad without a hook having fired; step 1: in the synced one.
    return rank == 0 and micro == step


def _awkward_cases():
    import torch.distributed as dist
    from foundations.comm import Comm
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}

    # no_sync on the GPT: ACCUM micro-batches per rank equal one big batch on one process
    torch.manual_seed(rank)
    ddp = DDP(_gpt(), bucket_mb=BUCKET_MB)
    rows = _batches(1, n * ACCUM * MICRO, seed=99)[0].view(n, ACCUM, MICRO, SEQ + 1)[rank]
    for micro, batch in enumerate(rows):                                   # (MICRO, T+1)
        with ddp.no_sync() if micro < ACCUM - 1 else nullcontext():
            (ddp(batch[:, :-1], batch[:, 1:])[1] / ACCUM).backward()
    ddp.finish_gradient_sync()
    out["accumulated_grads"] = _grads(ddp.module)

    # frozen, unused, tied: DDP against one process that sees every rank's micro-batches
    torch.manual_seed(rank)
    awkward = DDP(_Awkward(), Comm(ring=True), bucket_mb=256 / 2**20)   # 256-byte buckets: 3
    single = _Awkward()
    single.load_state_dict(awkward.module.state_dict())
    out["buffer"] = awkward.module.scale.clone()
    out["init"] = _params(single)
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, V, (2, n, ACCUM, MICRO, SEQ + 1), generator=g)   # (steps, N, ...)
    opt, single_opt = _adamw(awkward), _adamw(single)
    out["grads"], out["single_grads"], out["bytes_sent"] = [], [], []
    for step in range(2):
        awkward.comm.bytes_sent.clear()
        for r in range(n):
            for micro, batch in enumerate(data[step, r]):
                loss = single(batch[:, :-1], batch[:, 1:], _uses_extra(r, step, micro))
                (loss / (ACCUM * n)).backward()
        for micro, batch in enumerate(data[step, rank]):
            with awkward.no_sync() if micro < ACCUM - 1 else nullcontext():
                loss = awkward(batch[:, :-1], batch[:, 1:], _uses_extra(rank, step, micro))
                (loss / ACCUM).backward()
        awkward.finish_gradient_sync()
        out["grads"].append(_grads(awkward.module))
        out["single_grads"].append(_grads(single))
        out["bytes_sent"].append(sum(awkward.comm.bytes_sent.values()))
        for o in (opt, single_opt):
            o.step()
            o.zero_grad()
    out["params"], out["single_params"] = _params(awkward.module), _params(single)
    names = dict(zip(map(id, awkward.params), awkward.names))
    out["bucket_names"] = [[names[id(p)] for p in bucket.params] for bucket in awkward.buckets]
    out["bucket_numels"] = [buffer.numel() for buffer in awkward.gradient_buffers()]
    out["bytes_per_step"] = ddp_bytes_per_step(awkward)

    # misuse: a second backward without no_sync() or finish_gradient_sync() in between
    x, y = data[0, rank, 0, :, :-1], data[0, rank, 0, :, 1:]
    awkward(x, y, True).backward()
    try:
        awkward(x, y, True).backward()
    except RuntimeError as error:
        out["error"] = str(error)
    awkward.finish_gradient_sync()                           # drains the launched buckets
    try:
        DDP(nn.Linear(2, 2).requires_grad_(False))
    except ValueError as error:
        out["no_params_error"] = str(error)
    linear = nn.Linear(2, 2)
    try:                                       # a part that leaves the bias out: never averaged
        DDP(linear, reductions=[((Comm(), "avg", 1), [linear.weight])])
    except ValueError as error:
        out["unplaced_error"] = str(error)
    return out


@pytest.fixture(scope="module")
def awkward():
    return run_ranks(_awkward_cases, AWKWARD_N)


@pytest.mark.equivalence
def test_no_sync_accumulation_equals_big_batch(awkward):
    torch.manual_seed(0)
    model = _gpt()
    big = _batches(1, AWKWARD_N * ACCUM * MICRO, seed=99)[0]                # (N*ACCUM*MICRO, T+1)
    model(big[:, :-1], big[:, 1:])[1].backward()
    for rank, out in enumerate(awkward):
        # As for one step above: only the order in which the partial gradients are summed differs.
        _assert_grads_close(out["accumulated_grads"], _grads(model), f"rank {rank} accumulated")


def test_frozen_unused_tied(awkward):
    for rank, out in enumerate(awkward):
        # In gradient-arrival order, 256-byte buckets: [unused.bias unused.weight rank0_only.bias]
        # [rank0_only.weight] [embed.weight]. The frozen weight is in none; the tied weight is in
        # one, once (and had its hook fired once per backward for each use, the second firing
        # would have raised the double-backward error).
        assert out["bucket_names"] == [["unused.bias", "unused.weight", "rank0_only.bias"],
                                       ["rank0_only.weight"], ["embed.weight"]]
        # The buffer, seeded per rank like the weights, is rank 0's everywhere.
        torch.testing.assert_close(out["buffer"], awkward[0]["buffer"], rtol=0, atol=0)
        for step, (grads, single) in enumerate(zip(out["grads"], out["single_grads"])):
            # No rank used `unused`: its grad stays None, as in the single process (same names).
            assert "unused.weight" not in grads and "frozen.weight" not in grads
            # The same N x ACCUM micro-batch gradients, added in another order: as for the GPT.
            _assert_grads_close(grads, single, f"rank {rank} step {step} gradient")
        assert_tensors_close(out["params"], out["single_params"], rtol=0, atol=PARAM_TOL,
                             what=f"rank {rank} parameters")
        for name in ("unused.weight", "unused.bias", "frozen.weight"):     # no gradient: no decay
            assert torch.equal(out["params"][name], out["init"][name]), name


def test_padded_bytes_match_formula(awkward):
    # Odd bucket sizes and 5 flags, each padded to N = 3 chunks before the ring sends them.
    n = AWKWARD_N
    formula = sum(2 * (n - 1) * math.ceil(L / n) * 4 for L in [63, 49, 77]) + 2 * (n - 1) * math.ceil(5 / n)
    for out in awkward:
        assert out["bucket_numels"] == [63, 49, 77]
        assert out["bytes_per_step"] == formula
        assert out["bytes_sent"] == [formula, formula]


def test_clear_errors(awkward):
    for out in awkward:
        assert "second gradient" in out["error"] and "no_sync()" in out["error"]
        assert "finish_gradient_sync()" in out["error"]
        assert "no trainable parameters" in out["no_params_error"]


def test_handed_in_reductions_must_place_every_parameter(awkward):
    for out in awkward:
        assert "reductions= places 1 trainable parameters, the module has 2" in out["unplaced_error"]


def _wrapper_builds() -> dict:
    """Each wrapper that hooks gradients (DDP, ZeRO-1, ZeRO-2, FSDP), by name: model -> wrapper."""
    from fsdp import FSDP
    from zero import Zero2Optimizer, ZeroOptimizer
    return {"ddp": lambda m: DDP(m, bucket_mb=BUCKET_MB),
            "zero1": lambda m: ZeroOptimizer(m.parameters(), bucket_mb=BUCKET_MB),
            "zero2": lambda m: Zero2Optimizer(m.parameters(), bucket_mb=BUCKET_MB),
            "fsdp": lambda m: FSDP(m)}


def _wrappers_freed():
    """Each wrapper that hooks gradients, after one backward, dropped: is it, and its model,
    freed? torch keeps post-accumulate hooks where Python's gc does not look, so a hook holding
    its wrapper kept both alive (FlatParams.hook_gradients holds it weakly)."""
    import gc
    import weakref
    alive = {}
    for name, wrap in _wrapper_builds().items():
        model = _gpt()
        wrapper = wrap(model)
        tokens = _batches(1, 2)[0]                               # (B, T+1)
        x, y = tokens[:, :-1], tokens[:, 1:]
        (wrapper if name in ("ddp", "fsdp") else model)(x, y)[1].backward()   # (logits, loss)
        if name == "fsdp":
            wrapper.finish_gradient_sync()
        refs = weakref.ref(wrapper), weakref.ref(model)
        del model, wrapper
        gc.collect()
        alive[name] = [ref() is not None for ref in refs]
    return alive


def test_wrappers_and_their_models_are_freed_when_dropped():
    for name, (wrapper, model) in run_ranks(_wrappers_freed, 1)[0].items():
        assert not wrapper and not model, f"{name}: wrapper alive {wrapper}, model alive {model}"


def _attributes_bolted_on():
    """Each wrapper built, then one step: the attributes that code outside a flat buffer's own
    methods created on it (DDP's and ZeRO's buckets, FSDP's units), as (class, name, file)."""
    import os
    import sys
    from foundations.flat import FlatParams
    bolted = set()

    def traced(self, name, value):
        caller = sys._getframe(1)
        new = name not in vars(self) and not hasattr(type(self), name)   # a property is declared
        if new and caller.f_locals.get("self") is not self:
            bolted.add((type(self).__name__, name, os.path.basename(caller.f_code.co_filename)))
        object.__setattr__(self, name, value)
    FlatParams.__setattr__ = traced
    try:
        for name, wrap in _wrapper_builds().items():
            model = _gpt()
            wrapper = wrap(model)
            tokens = _batches(1, 2)[0]                               # (B, T+1)
            forward = wrapper if name in ("ddp", "fsdp") else model
            forward(tokens[:, :-1], tokens[:, 1:])[1].backward()    # (logits, loss)
            if name in ("ddp", "fsdp"):
                wrapper.finish_gradient_sync()
            else:
                wrapper.step()
    finally:
        del FlatParams.__setattr__
    return bolted


def test_flat_buffers_carry_only_the_attributes_their_classes_declare():
    """Issue 56: FlatParams declares comm, op, divide, replicas, grad_flat, pending and used.
    No strategy adds an attribute to a flat buffer from outside its class (DDP's indices and
    used-flags are DDP's own), so a reader finds every attribute in the class that carries it."""
    assert run_ranks(_attributes_bolted_on, 1)[0] == set()


# ---- gradient_as_bucket_view: backward writes into the buckets, no copy -------------------------

def _grads_in_buckets():
    import sys
    import torch.distributed as dist
    rank, n = dist.get_rank(), dist.get_world_size()
    model = _gpt()
    ddp = DDP(model, bucket_mb=BUCKET_MB)
    reference = _gpt({k: v.clone() for k, v in model.state_dict().items()})
    batch = _batches(1, GLOBAL_BATCH)[0]
    b = GLOBAL_BATCH // n
    x, y = batch[rank * b:(rank + 1) * b, :-1], batch[rank * b:(rank + 1) * b, 1:]
    opt = _adamw(model)
    copies, copy_ = [], torch.Tensor.copy_

    def counted_copy(self, *args, **kwargs):       # a copy made by ddp.py: a gradient copied in
        if sys._getframe(1).f_code.co_filename.endswith("ddp.py"):
            copies.append(self.numel())
        return copy_(self, *args, **kwargs)
    out = {"storage_before_backward": [], "storage_after_sync": [], "copied": []}
    for step in range(2):          # the second after the first's zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
        loss = ddp(x, y)[1]
        slots = {id(p): slot for p, slot in zip(ddp.params, ddp._slot)}
        out["storage_before_backward"].append(all(
            p.grad is not None and p.grad.data_ptr() == slots[id(p)].data_ptr() for p in ddp.params))
        torch.Tensor.copy_ = counted_copy
        try:
            loss.backward()
            ddp.finish_gradient_sync()
        finally:
            torch.Tensor.copy_ = copy_
        out["copied"].append(sum(copies))
        buffers = {bucket.grad_flat.untyped_storage().data_ptr() for bucket in ddp.buckets}
        out["storage_after_sync"].append(all(p.grad.untyped_storage().data_ptr() in buffers
                                             for p in ddp.params))
        if step == 0:
            out["grads"] = _grads(model)
            opt.step()
    reference(batch[:, :-1], batch[:, 1:])[1].backward()        # one process, the whole batch
    out["reference"] = _grads(reference)
    return out


def test_gradients_are_views_into_the_buckets_and_never_copied():
    """As PyTorch's gradient_as_bucket_view: after zero_grad(set_to_none=True) forward points
    every .grad back at its slot, so the second step's backward accumulates into the bucket (0
    elements copied by ddp.py; the first step, before any hook has fired, copies each gradient
    in once), every .grad shares the bucket's storage after the sync, and the gradients equal
    one process's on the whole batch (GRAD_TOL: the average's other order)."""
    for out in run_ranks(_grads_in_buckets, 2):
        assert out["storage_before_backward"] == [False, True]
        assert out["storage_after_sync"] == [True, True]
        assert out["copied"][0] > 0 and out["copied"][1] == out["copied"][0], out["copied"]
        _assert_grads_close(out["grads"], out["reference"], "bucket-view gradients")


# ---- overlap, from below: the reductions each strategy promises to keep in flight ----------------

class _CountingComm(Comm):
    """The world's native Comm, counting its async collectives launched and not yet waited for,
    by name: what a strategy has on the wire while backward computes on."""

    def __init__(self):
        super().__init__()
        self.in_flight = {"all_reduce": 0, "reduce_scatter": 0, "all_gather": 0}

    def _counted(self, name, handle):
        self.in_flight[name] += 1

        def wait():
            handle.wait()
            self.in_flight[name] -= 1
        return Handle(wait)

    def all_reduce(self, tensor, op="sum", async_op=False):
        handle = super().all_reduce(tensor, op, async_op)
        return self._counted("all_reduce", handle) if async_op else handle

    def reduce_scatter(self, output, input, op="sum", async_op=False):
        handle = super().reduce_scatter(output, input, op, async_op)
        return self._counted("reduce_scatter", handle) if async_op else handle

    def all_gather(self, output, input, async_op=False):
        handle = super().all_gather(output, input, async_op)
        return self._counted("all_gather", handle) if async_op else handle


def _in_flight_during_backward():
    """One backward of the GPT under DDP, ZeRO-2 and FSDP (prefetch 1), sampling the reductions
    in flight as each gradient arrives (a hook registered after the strategy's, so it sees what
    the strategy did with that gradient) and, for FSDP, the all-gathers in flight while each
    unit computes (a forward pre-hook after FSDP's, and the backward's gradient hooks)."""
    from fsdp import FSDP
    from zero import Zero2Optimizer
    rows = _batches(1, 2)[0]                                             # (2, T+1)
    x, y = rows[:, :-1], rows[:, 1:]
    out = {}

    def sample(model, params, name, key):
        out[key] = []
        for p in params:
            p.register_post_accumulate_grad_hook(lambda _: out[key].append(comm.in_flight[name]))
        model(x, y)[1].backward()

    comm = _CountingComm()
    ddp = DDP(_gpt(), comm, bucket_mb=BUCKET_MB)
    sample(ddp, ddp.module.parameters(), "all_reduce", "ddp")
    out["ddp_after_backward"], out["ddp_buckets"] = comm.in_flight["all_reduce"], len(ddp.buckets)
    ddp.finish_gradient_sync()

    comm = _CountingComm()
    gpt = _gpt()
    zero2 = Zero2Optimizer(gpt.parameters(), group=comm, bucket_mb=BUCKET_MB)
    sample(gpt, gpt.parameters(), "reduce_scatter", "zero2")
    out["zero2_buckets"] = len(zero2.buckets)

    comm = _CountingComm()
    fsdp = FSDP(_gpt(), group=comm, prefetch=1)
    out["fsdp_gathers_forward"] = []
    for unit in fsdp.forward_order:
        unit.module.register_forward_pre_hook(
            lambda *_: out["fsdp_gathers_forward"].append(comm.in_flight["all_gather"]))
    gathers_backward = out["fsdp_gathers_backward"] = []
    for unit in fsdp.forward_order:
        for p in unit.params:
            p.register_post_accumulate_grad_hook(
                lambda _, u=unit.index: gathers_backward.append((u, comm.in_flight["all_gather"])))
    sample(fsdp, fsdp.module.parameters(), "reduce_scatter", "fsdp")
    out["fsdp_units"] = len(fsdp.reduce_order)
    out["fsdp_order"] = [u.index for u in fsdp.forward_order]
    return out


def test_reductions_in_flight_reach_what_each_strategy_promises():
    """Overlap bounded from below (the memory tests bound it from above): DDP keeps every
    bucket's all-reduce in flight until finish_gradient_sync (none waited during backward);
    ZeRO-2 and FSDP keep MAX_REDUCTIONS_IN_FLIGHT reduce-scatters in flight once that many have
    launched, never fewer; FSDP with prefetch 1 has the next unit's all-gather in flight while
    each unit but the last computes, in forward and in backward."""
    from foundations.flat import MAX_REDUCTIONS_IN_FLIGHT
    for rank, out in enumerate(run_ranks(_in_flight_during_backward, 2)):
        # DDP: in flight at each gradient = buckets launched so far, all of them after backward
        assert out["ddp"] == sorted(out["ddp"]) and out["ddp_buckets"] >= 3, out["ddp"]
        assert out["ddp_after_backward"] == out["ddp_buckets"], (rank, out["ddp_after_backward"])
        for name in ("zero2", "fsdp"):
            assert out[f"{name}_{'buckets' if name == 'zero2' else 'units'}"] > MAX_REDUCTIONS_IN_FLIGHT
            assert max(out[name]) == MAX_REDUCTIONS_IN_FLIGHT, (rank, name, out[name])
            # once K are in flight, each later launch retires the oldest: K stay in flight
            reached = out[name].index(MAX_REDUCTIONS_IN_FLIGHT)
            assert min(out[name][reached:]) == MAX_REDUCTIONS_IN_FLIGHT, (rank, name, out[name])
        # FSDP's prefetch: forward order 0, 1, ..., last; backward the reverse
        assert out["fsdp_gathers_forward"] == [1] * (len(out["fsdp_order"]) - 1) + [0], out
        first = out["fsdp_order"][0]
        assert all(n == (0 if unit == first else 1) for unit, n in out["fsdp_gathers_backward"]), out
