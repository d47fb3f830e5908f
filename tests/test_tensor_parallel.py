"""Tensor parallelism (tensor_parallel.py): each split layer, and the whole GPT, equal one process.

Layers run at N=2 and N=4 against the unsplit nn.Linear / nn.Embedding / F.cross_entropy on
the same full weights: outputs, input gradients and this rank's slice of the weight gradient,
separately. The GPT trains a few AdamW steps (fp32, clipped) under tp 2, tp 4, tp 2 x dp 2,
with and without sequence parallelism, against single-process training on the same batches.
"""
import contextlib
import io
import os
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import tensor_parallel as tp
from composition.tensor_parallel_gpt import TensorParallelGPT, vocab_parallel_cross_entropy
from foundations.comm import Comm
from equivalence import AdamDenominators, Fp64AdamW, assert_adam_close, train_noting_adam
from composition.mesh_optimizer import on_mesh
from mixed_precision import DTYPES, DynamicLossScaler, MixedPrecisionOptimizer
from model import GPT, GPTConfig
from multiprocess import assert_mean_close, assert_tensors_close, run_ranks, torchrun_worker
from napkin.sent import tp_bytes_per_step
from foundations.placements import grad_norm, norm_weight, tensor_dim
from foundations.process_groups import make_mesh

# A split matmul sums over in/N features per rank and adds the N partial sums: the same
# numbers in another order, so fp32 rounding at worst (measured: 3e-6 on values of order 1).
LAYER_TOL = 1e-5
# After a few Adam steps that order-of-summation noise grows where Adam divides by a small
# denominator (equivalence.assert_adam_close): each element within MODEL_ATOL x
# max(1, ADAM_AMPLIFIED / d), d its smallest denominator in one process (measured: at most
# 2.0e-6 x that, under ATEN_CPU_CAPABILITY default, avx2 and avx512 alike; the largest
# difference, 9.3e-6, where d fell below ADAM_AMPLIFIED). In fp64 the same arithmetic agrees to
# FP64_ATOL (test_tensor_parallel_in_fp64_is_one_process_up_to_rounding).
MODEL_ATOL = 2e-5
# train.py's 6 steps on real text meet the worst case of that: byte '#' first appears at step 3
# and one element of its embedding gets a gradient that nearly cancels, -4.9e-8 in fp32 where
# fp64 says -4.8e-8, a few times Adam's eps (1e-8). Its first Adam update is lr * g / (|g| + eps),
# which moves by lr * eps * dg / (|g| + eps)^2, about 5e3 x the reordering noise dg: measured
# 2.6e-5 between tp 2 and one process on an Intel Xeon (7.6e-6 between fp32 and fp64 alone).
# Each element within TRAIN_ATOL x max(1, ADAM_AMPLIFIED / d) (measured at most 2.2e-6 x that,
# under default, avx2 and avx512); the mean difference over the whole model stays at fp32 noise
# (measured 5.7e-9, allowed 5e-8), where a real bug would move many elements.
TRAIN_ATOL, TRAIN_MEAN_ATOL = 5e-5, 5e-8
# fp64: the same sums in another order round at 1e-16 of their terms, and Adam amplifies that by
# at most lr / eps = 1e6 (an element whose gradient is near eps): 1e-10 at most, on any CPU
# (measured 5e-14 on the weights after 3 steps, 1e-16 on the norm). Losses are compared in fp64.
FP64_ATOL, FP64_RTOL = 1e-10, 1e-12
CFG = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=64)
B, T, STEPS = 4, 16, 3


def _close(actual, expected, what, atol=LAYER_TOL):
    assert_tensors_close(actual, expected, rtol=LAYER_TOL, atol=atol, what=what)


# ---- layers ------------------------------------------------------------------------------------

def _layers():
    """On each rank: (split layer results, the unsplit reference, computed on every rank)."""
    comm = Comm()
    n, r = comm.world_size, comm.rank
    torch.manual_seed(0)
    x = torch.randn(B, T, 16, requires_grad=True)
    grad_out = torch.randn(B, T, 8)
    full = nn.Linear(16, 8)
    results = {}

    def run(name, layer, inp, weight_slice, bias_slice):
        inp = inp.detach().requires_grad_()
        out = layer(inp)
        out.backward(grad_out if out.shape == grad_out.shape else grad_out.chunk(n, -1)[r])
        results[name] = {"out": out.detach(), "grad_in": inp.grad,
                         "grad_w": layer.weight.grad, "grad_b": layer.bias.grad,
                         "want_w": weight_slice, "want_b": bias_slice}

    ref_out = full(x)
    ref_out.backward(grad_out)
    col = lambda t: t.chunk(n, 0)[r]
    run("column_gathered", tp.ColumnParallelLinear.from_linear(full, comm, gather_output=True),
        x, col(full.weight.grad), col(full.bias.grad))
    run("column_split", tp.ColumnParallelLinear.from_linear(full, comm), x,
        col(full.weight.grad), col(full.bias.grad))
    run("row", tp.RowParallelLinear.from_linear(full, comm, input_is_parallel=False), x,
        full.weight.grad.chunk(n, 1)[r], full.bias.grad)
    # input_is_parallel: each rank gets its slice of x; the input gradient is that slice's.
    row_par = tp.RowParallelLinear.from_linear(full, comm)
    xs = x.detach().chunk(n, -1)[r].requires_grad_()
    out = row_par(xs)
    out.backward(grad_out)
    results["row_parallel_input"] = {"out": out.detach(), "grad_in": xs.grad}

    # A fresh layer's slices put together are the weight nn.Linear draws from the same seed.
    torch.manual_seed(1)
    fresh_col, fresh_row = tp.ColumnParallelLinear(16, 8, comm), tp.RowParallelLinear(8, 16, comm)
    torch.manual_seed(1)
    one_col, one_row = nn.Linear(16, 8), nn.Linear(8, 16)
    results["init"] = {"col": (fresh_col.weight.detach(), col(one_col.weight.detach())),
                       "row": (fresh_row.weight.detach(), one_row.weight.detach().chunk(n, 1)[r])}

    # Embedding and cross-entropy over the vocabulary (V = 12, so N=4 holds 3 rows each).
    emb = nn.Embedding(12, 8)
    idx = torch.randint(0, 12, (B, T))
    emb(idx).backward(grad_out)
    vemb = tp.VocabParallelEmbedding.from_embedding(emb, comm)
    vout = vemb(idx)
    vout.backward(grad_out)
    results["embedding"] = {"out": vout.detach(), "want_out": emb(idx).detach(),
                            "grad_w": vemb.weight.grad, "want_w": col(emb.weight.grad)}
    logits = torch.randn(B * T, 12, requires_grad=True) * 3
    logits.retain_grad()
    targets = torch.randint(0, 12, (B * T,))
    F.cross_entropy(logits, targets).backward()
    mine = logits.detach().chunk(n, -1)[r].requires_grad_()
    loss = vocab_parallel_cross_entropy(mine, targets, comm)
    loss.backward()
    results["cross_entropy"] = {"loss": (loss.detach(), F.cross_entropy(logits, targets).detach()),
                                "grad": (mine.grad, logits.grad.chunk(n, -1)[r])}
    results["reference"] = {"out": ref_out.detach(), "grad_in": x.grad}
    return results


@pytest.fixture(scope="module", params=[2, 4])
def layers(request):
    return request.param, run_ranks(_layers, request.param)


@pytest.mark.equivalence
def test_column_and_row_layers_equal_the_unsplit_linear(layers):
    n, ranks = layers
    for r, res in enumerate(ranks):
        ref = res["reference"]
        for name in ("column_gathered", "row", "column_split"):
            got = res[name]
            want_out = ref["out"].chunk(n, -1)[r] if name == "column_split" else ref["out"]
            _close({"out": got["out"], "grad_in": got["grad_in"]},
                   {"out": want_out, "grad_in": ref["grad_in"]}, f"{name} N={n} rank {r}")
            _close({"w": got["grad_w"], "b": got["grad_b"]},
                   {"w": got["want_w"], "b": got["want_b"]}, f"{name} weight-grad slice N={n} rank {r}")
        got = res["row_parallel_input"]
        _close(got, {"out": ref["out"], "grad_in": ref["grad_in"].chunk(n, -1)[r]}, f"row N={n}")


def test_a_fresh_layer_is_a_slice_of_one_full_init(layers):
    for res in layers[1]:
        for name, (got, want) in res["init"].items():
            assert torch.equal(got, want), name                 # copied, not recomputed: exact


@pytest.mark.equivalence
def test_vocab_parallel_embedding_and_cross_entropy(layers):
    n, ranks = layers
    for r, res in enumerate(ranks):
        e = res["embedding"]
        # Exactly one rank contributes each row and the others add zeros: exact.
        assert torch.equal(e["out"], e["want_out"])
        assert torch.equal(e["grad_w"], e["want_w"])
        ce = res["cross_entropy"]
        _close({k: v[0] for k, v in ce.items()}, {k: v[1] for k, v in ce.items()}, f"cross-entropy N={n}")


# ---- the whole GPT ---------------------------------------------------------------------------

def _batches():
    torch.manual_seed(1)
    return torch.randint(0, CFG.vocab_size, (STEPS, B, T + 1))   # the global batch of each step


ADAMW = dict(lr=1e-2, weight_decay=0.1)


def _optimizer(gpt, tensor=None, precision="fp32"):
    if precision == "fp64":
        return Fp64AdamW(gpt.parameters(), {"tp": tensor}, **ADAMW)
    # fp16: the scale starts low enough for every rank and grows every 2 clean steps, so it moves.
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=2) if precision == "fp16" else None
    optimizer = MixedPrecisionOptimizer(gpt.parameters(), torch.optim.AdamW, precision=precision,
                                        scaler=scaler, **ADAMW)
    return on_mesh([optimizer], {"tp": tensor})    # the norm sums the slices over the group


def _gpt(tied=False, precision="fp32"):
    torch.manual_seed(0)
    dtype = torch.float64 if precision == "fp64" else DTYPES[precision]
    return GPT(GPTConfig(**{**CFG.__dict__, "tie_embeddings": tied})).to(dtype)


def _whole(model_params, n):
    """{name: full tensor} from one tensor-parallel rank's {name: (slice, tp_dim)} of every rank."""
    return {name: torch.cat([ranks[name][0] for ranks in model_params], ranks_dim)
            if (ranks_dim := model_params[0][name][1]) is not None else model_params[0][name][0]
            for name in model_params[0]}


def _gpt_trains(cases):
    return [_gpt_train(*case) for case in cases]


def _gpt_train(tp_size, sequence_parallel, tied=False, precision="fp32"):
    from ddp import DDP
    comm = Comm()
    tensor, data = make_mesh(comm, tp_size)
    gpt = _gpt(tied, precision)
    tp_model = TensorParallelGPT(gpt, tensor, sequence_parallel)
    model = DDP(tp_model, data) if data.world_size > 1 else tp_model
    optimizer = _optimizer(gpt, tensor, precision)
    losses, scales = [], []
    for batch in _batches():
        rows = batch.chunk(data.world_size)[data.rank]           # (B/D, T+1)
        _, loss = model(rows[:, :-1], rows[:, 1:])
        scales.append(optimizer.scaler.scale)
        optimizer.scale_loss(loss).backward()
        if data.world_size > 1:
            model.finish_gradient_sync()
        tp_model.finish_gradient_sync()
        optimizer.clip_grad_norm_(0.5)                            # clipped: the global norm matters
        optimizer.step()
        assert not optimizer.last_step_skipped
        optimizer.zero_grad()
        loss = loss.detach()                                     # fp32, or fp64
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    params = {name: (m.detach(), tensor_dim(p))                        # the fp32 masters
              for (name, p), m in zip(gpt.named_parameters(), optimizer.masters)}
    return {"losses": losses, "params": params, "norm": optimizer.last_grad_norm, "scales": scales}


def _single(tied=False, precision="fp32"):
    gpt = _gpt(tied, precision)
    optimizer = _optimizer(gpt, precision=precision)
    denominators = AdamDenominators.of(optimizer.optimizer, [name for name, _ in gpt.named_parameters()])
    losses, scales = [], []
    for batch in _batches():
        _, loss = gpt(batch[:, :-1], batch[:, 1:])
        scales.append(optimizer.scaler.scale)
        optimizer.scale_loss(loss).backward()
        optimizer.clip_grad_norm_(0.5)
        optimizer.step()
        assert not optimizer.last_step_skipped
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: m.detach() for (n, _), m in zip(gpt.named_parameters(),
                                                                            optimizer.masters)},
            "norm": optimizer.last_grad_norm, "scales": scales, "denominators": denominators}


@pytest.fixture(scope="module")
def single():
    return _single()


@pytest.mark.equivalence
@pytest.mark.parametrize("world, cases", [(2, [(2, False), (2, True)]), (4, [(4, False), (2, True)])])
def test_gpt_trains_like_one_process(single, world, cases):
    every = run_ranks(_gpt_trains, world, cases)                 # one launch, several meshes
    for i, (tp_size, sp) in enumerate(cases):
        _check_gpt(single, [rank[i] for rank in every], world, tp_size, sp)


@pytest.mark.equivalence
def test_tensor_parallel_in_fp64_is_one_process_up_to_rounding():
    """tp 4, tp 2 x dp 2 with sequence parallelism, and tp 2 x dp 2 with the head tied, in fp64
    (torch's AdamW, clipped by the norm summed over the tensor group in fp64) against one fp64
    process: losses, norm and every weight after 3 steps to fp64's rounding (FP64_*), on any CPU.
    The fp32 tests below bound the same runs by Adam's amplification of fp32's rounding."""
    cases = [(4, False, False, "fp64"), (2, True, False, "fp64"), (2, False, True, "fp64")]
    every = run_ranks(_gpt_trains, 4, cases)
    for i, (tp_size, sp, tied, precision) in enumerate(cases):
        expected, ranks = _single(tied, precision), [rank[i] for rank in every]
        what = f"fp64 tp {tp_size}, sp={sp}, tied={tied}"
        for r, res in enumerate(ranks):
            torch.testing.assert_close(res["losses"], expected["losses"], rtol=FP64_RTOL, atol=0,
                                       msg=lambda m: f"{what} losses, rank {r}: {m}")
            assert res["norm"] == pytest.approx(expected["norm"], rel=FP64_RTOL), what
        for first in range(0, 4, tp_size):                      # each data-parallel replica
            whole = _whole([res["params"] for res in ranks[first: first + tp_size]], tp_size)
            assert_tensors_close(whole, expected["params"], rtol=0, atol=FP64_ATOL,
                                 what=f"{what}, replica {first}")


# 16 bits, one process against two tensor-parallel ranks: split matmuls round their partial sums
# to 16 bits before the all-reduce adds them, so gradients differ by the dtype's rounding, and
# Adam turns a near-zero gradient's rounding into a full step of either sign: up to 2 lr a step
# per element (measured over 3 steps at lr 1e-2: 3.3e-2 in bf16, 2.6e-2 in fp16). The mean over
# the model stays at 0.05 lr (measured 3.2e-4 bf16, 1.0e-4 fp16); a weight left out of the update
# moves it by about lr. Losses: the dtype's rounding of the logits (measured 2e-4 bf16, 6e-5 fp16).
MIXED_ATOL, MIXED_MEAN_ATOL = 2 * STEPS * 1e-2, 0.05 * 1e-2
MIXED_LOSS_RTOL = {"bf16": 1e-3, "fp16": 1e-4}
# Tied head, fp32: the head's gradient reaches every embedding row, some near eps, so more
# elements sit where Adam amplifies: each within TRAIN_ATOL x max(1, ADAM_AMPLIFIED / d)
# (measured at most 2.2e-5 x that: avx512, where the worst element, d = 1.1e-8, moved 6.0e-5;
# 1.9e-5 under avx2, 5.4e-6 under default), the mean at 1.0e-7 (avx512) to 2.9e-8 (default).
TIED_MEAN_ATOL = 2e-7


@pytest.mark.equivalence
def test_tied_head_and_16_bit_precisions_like_one_process():
    """The head tied to the token embedding (both split by vocabulary rows: one (V/N, C) weight),
    and bf16 and fp16 (the fp16 loss scale and the skip decision shared by the tensor group),
    each against one process with the same model in the same precision."""
    cases = [(2, False, True, "fp32"), (2, True, False, "bf16"), (2, False, False, "fp16")]
    every = run_ranks(_gpt_trains, 2, cases)
    for i, (tp_size, sp, tied, precision) in enumerate(cases):
        expected, ranks = _single(tied, precision), [rank[i] for rank in every]
        whole = _whole([res["params"] for res in ranks], tp_size)        # fp32 masters
        what = f"tp {tp_size}, sp={sp}, tied={tied}, {precision}"
        if precision == "fp32":
            for r, res in enumerate(ranks):
                torch.testing.assert_close(res["losses"], expected["losses"], rtol=1e-5, atol=0,
                                           msg=lambda m: f"{what} losses, rank {r}: {m}")
            assert_adam_close(whole, expected["params"], expected["denominators"], TRAIN_ATOL, what)
            assert_mean_close(whole, expected["params"], TIED_MEAN_ATOL, what)
            continue
        for r, res in enumerate(ranks):
            assert res["scales"] == expected["scales"], what                 # fp16: 2^10, 2^10, 2^11
            torch.testing.assert_close(res["losses"], expected["losses"], rtol=MIXED_LOSS_RTOL[precision],
                                       atol=0, msg=lambda m: f"{what} losses, rank {r}: {m}")
        assert_tensors_close(whole, expected["params"], rtol=0, atol=MIXED_ATOL, what=what)
        assert_mean_close(whole, expected["params"], MIXED_MEAN_ATOL, what)


def _check_gpt(single, ranks, world, tp_size, sp):
    for r, res in enumerate(ranks):
        torch.testing.assert_close(res["losses"], single["losses"], rtol=1e-5, atol=0,
                                   msg=lambda m: f"losses, rank {r}: {m}")
        assert res["norm"] == pytest.approx(single["norm"], rel=1e-5)
    for first in range(0, world, tp_size):                      # each data-parallel replica
        whole = _whole([res["params"] for res in ranks[first: first + tp_size]], tp_size)
        assert_adam_close(whole, single["params"], single["denominators"], MODEL_ATOL,
                          f"tp {tp_size} x dp {world // tp_size}, sp={sp}, replica {first}")


# ---- communication and activation memory, per block -----------------------------------------

def _traffic(sequence_parallel):
    """Bytes sent in forward, in a whole step and predicted, and activation bytes saved for
    backward, for a 1-block and a 2-block GPT: the difference is one block's."""
    comm = Comm()
    out = {}
    for layers in (1, 2):
        torch.manual_seed(0)
        gpt = GPT(GPTConfig(**{**CFG.__dict__, "n_layer": layers}))
        model = TensorParallelGPT(gpt, comm, sequence_parallel)
        weights = {p.untyped_storage().data_ptr() for p in gpt.parameters()}
        saved = {}

        def pack(t):                 # every tensor autograd keeps for backward, weights aside
            if t.untyped_storage().data_ptr() not in weights:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        batch = _batches()[0]
        comm.bytes_sent.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _, loss = model(batch[:, :-1], batch[:, 1:])
        forward = dict(comm.bytes_sent)
        loss.backward()
        model.finish_gradient_sync()
        params = list(gpt.parameters())
        grad_norm([(p.grad, norm_weight(p, {"tp": comm})) for p in params], [comm], "cpu")
        out[layers] = {"forward": forward, "step": sum(comm.bytes_sent.values()),
                       "predicted": tp_bytes_per_step(model, B, T),
                       "activations": sum(saved.values()),
                       "params": sum(p.numel() for p in params)}
    return out


@pytest.fixture(scope="module")
def traffic():
    return run_ranks(_traffics, 2)[0]


def _traffics():
    return {sp: _traffic(sp) for sp in (False, True)}


def _per_block(result, key):
    one, two = result[1][key], result[2][key]
    return {name: two[name] - one.get(name, 0) for name in two if two[name] != one.get(name, 0)}


def test_one_block_sends_two_all_reduces_forward_or_the_same_bytes_as_pairs(traffic):
    from foundations.comm import ring_bytes
    activation = B * T * CFG.n_embd                              # (B, T, C) fp32 elements
    assert _per_block(traffic[False], "forward") == {"all_reduce": 2 * ring_bytes("all_reduce", activation, 4, 2)}
    pairs = _per_block(traffic[True], "forward")
    assert pairs == {"all_gather": 2 * ring_bytes("all_gather", activation, 4, 2),
                     "reduce_scatter": 2 * ring_bytes("reduce_scatter", activation, 4, 2)}
    assert sum(pairs.values()) == sum(_per_block(traffic[False], "forward").values())
    for sp in (False, True):                                     # the whole step, as predicted
        for layers in (1, 2):
            assert traffic[sp][layers]["step"] == traffic[sp][layers]["predicted"], (sp, layers)


def test_sequence_parallelism_keeps_fewer_activations(traffic):
    plain = traffic[False][2]["activations"] - traffic[False][1]["activations"]
    split = traffic[True][2]["activations"] - traffic[True][1]["activations"]
    print(f"activation bytes kept per block, tp 2: {plain} without, {split} with sequence parallelism")
    # The norms' inputs (B, T, C) each are kept on T/N tokens: at least those 2 x BTC/2 x 4 bytes.
    assert plain - split >= 2 * B * T * CFG.n_embd // 2 * 4, (plain, split)


def test_a_rank_holds_its_share_of_the_parameters(traffic):
    from napkin.memory_math import mesh_params, model_params
    cfg = GPTConfig(**{**CFG.__dict__, "n_layer": 2})
    assert traffic[False][2]["params"] == mesh_params(cfg, tp=2)
    assert mesh_params(cfg) == model_params(cfg)
    block = (mesh_params(cfg, tp=2) - traffic[False][1]["params"])     # one block's share
    assert block == (12 * 32 * 32 + 6 * 32) // 2 + 6 * 32        # matrices halved, norms and row biases whole


# ---- against PyTorch's own tensor parallelism -----------------------------------------------

def _against_torch():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from model import MLP
    comm = Comm()
    torch.manual_seed(0)
    ours = MLP(CFG)
    theirs = MLP(CFG)
    theirs.load_state_dict(ours.state_dict())
    ours.up = tp.ColumnParallelLinear.from_linear(ours.up, comm)
    ours.down = tp.RowParallelLinear.from_linear(ours.down, comm)
    parallelize_module(theirs, init_device_mesh("cpu", (comm.world_size,)),
                       {"up": ColwiseParallel(), "down": RowwiseParallel()})
    x = torch.randn(B, T, CFG.n_embd)
    result = {}
    for name, mlp in (("ours", ours), ("torch", theirs)):
        inp = x.clone().requires_grad_()
        y = mlp(inp)
        y.pow(2).sum().backward()
        local = lambda t: t.to_local() if hasattr(t, "to_local") else t
        result[name] = {"out": local(y).detach().clone(), "grad_in": inp.grad,
                        **{f"{n}.grad": local(p.grad).clone() for n, p in mlp.named_parameters()}}
    return result


@pytest.mark.equivalence
def test_mlp_equals_torch_colwise_rowwise_parallel():
    for r, res in enumerate(run_ranks(_against_torch, 2)):
        _close(res["ours"], res["torch"], f"MLP vs torch.distributed.tensor.parallel, rank {r}")


# ---- train.py --strategy tp: same curve as one process, checkpoints, bad input -------------

RUN = ["--steps", "6", "--log-every", "3", "--eval-every", "0", "--seq-len", "32",
       "--batch-size", "8", "--warmup", "2", "--eval-batches", "1"]
SAVE_AT = 3


def _train(argv):
    import train
    os.environ["WORLD_SIZE"] = str(dist.get_world_size())       # what torchrun would set
    return train.main([*RUN, *argv])


def _copy_first_checkpoint(saved, to):
    if dist.get_rank() == 0:                                     # as if the run stopped at step 3
        shutil.copytree(saved, to, ignore=shutil.ignore_patterns("ckpt-0000006"))
    dist.barrier()


def _straight_and_resumed(root, strategy, extra):
    """Straight (saving at steps 3 and 6: saving leaves a run as it is, tests/test_snapshot.py)
    and resumed from step 3, in a copy of the straight run's directory (test_pipeline too)."""
    path = lambda name: os.path.join(root, name)
    out = {"straight": _train([*strategy, *extra, "--out", path("saved"), "--save-every", str(SAVE_AT),
                               "--export", path("straight.pt")])}
    _copy_first_checkpoint(path("saved"), path("resumed"))
    out["resumed"] = _train([*strategy, *extra, "--out", path("resumed"), "--resume",
                             "--export", path("resumed.pt")])
    return out


def _single_runs(root, split_root, extra=()):
    """One process: straight, and resumed from a split (tp, pipeline or cp) run's step-3
    checkpoint, each with its AdamDenominators ("adam": equivalence.train_noting_adam); extra:
    more flags for both (test_context_parallel's --log-every 1)."""
    _copy_first_checkpoint(os.path.join(split_root, "saved"), os.path.join(root, "from_split"))
    single = [*RUN, "--strategy", "single", *extra]
    straight, _, straight_adam = train_noting_adam([*single, "--export", os.path.join(root, "single.pt")], "tiny")
    from_split, _, from_split_adam = train_noting_adam(
        [*single, "--out", os.path.join(root, "from_split"), "--resume",
         "--export", os.path.join(root, "from_split.pt")], "tiny")
    return {"straight": straight, "from_split": from_split,
            "adam": {"straight": straight_adam, "from_split": from_split_adam}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("tp_runs"))
    tp_root, single_root = os.path.join(root, "tp"), os.path.join(root, "single")
    os.makedirs(tp_root)
    os.makedirs(single_root)
    tp2 = run_ranks(_straight_and_resumed, 2, tp_root, ["--strategy", "tp", "--tp", "2"], [])[0]
    single = run_ranks(_single_runs, 1, single_root, tp_root)[0]
    return {"tp": tp2, "single": single, "tp_root": tp_root, "single_root": single_root}


def _weights(path):
    return torch.load(path, weights_only=True)["state_dict"]


@pytest.mark.equivalence
def test_train_tp2_matches_single_process_step_by_step(runs):
    tp2, single = runs["tp"]["straight"], runs["single"]["straight"]
    # The same sums in another order (split matmuls, the loss over vocabulary halves): fp32 noise.
    torch.testing.assert_close(list(tp2["losses"].values()), list(single["losses"].values()),
                               rtol=1e-5, atol=0)
    tp_weights = _weights(os.path.join(runs["tp_root"], "straight.pt"))
    single_weights = _weights(os.path.join(runs["single_root"], "single.pt"))
    assert_adam_close(tp_weights, single_weights, runs["single"]["adam"]["straight"], TRAIN_ATOL,
                      "tp 2 vs single after 6 steps")
    assert_mean_close(tp_weights, single_weights, TRAIN_MEAN_ATOL, "tp 2 vs single after 6 steps")


def test_tp_resume_is_bit_exact(runs):
    straight, again = runs["tp"]["straight"], runs["tp"]["resumed"]
    assert list(again["losses"]) == [3, 5]                       # logged every 3 steps and the last
    assert again["losses"] == {s: straight["losses"][s] for s in (3, 5)}
    assert again["eval_loss"] == straight["eval_loss"]
    a, b = (_weights(os.path.join(runs["tp_root"], f)) for f in ("resumed.pt", "straight.pt"))
    assert_tensors_close(a, b, rtol=0, atol=0, what="resumed tp 2 vs uninterrupted")


@pytest.mark.equivalence
def test_tp_checkpoint_resumes_and_exports_on_one_process(runs):
    import train
    # Whole parameters in the checkpoint: a single process reads them as its own.
    from_tp, straight = runs["single"]["from_split"], runs["tp"]["straight"]
    torch.testing.assert_close([from_tp["losses"][s] for s in (3, 5)],
                               [straight["losses"][s] for s in (3, 5)], rtol=1e-5, atol=0)
    assert_adam_close(_weights(os.path.join(runs["tp_root"], "straight.pt")),
                      _weights(os.path.join(runs["single_root"], "from_split.pt")),
                      runs["single"]["adam"]["from_split"], MODEL_ATOL, "tp checkpoint resumed on one process")
    exported = os.path.join(runs["tp_root"], "straight.pt")
    model = train.load_weights(exported)                        # no torch.distributed needed
    assert_tensors_close({n: p.detach() for n, p in model.named_parameters()}, _weights(exported),
                         rtol=0, atol=0, what="export loaded")
    from_checkpoint = train.load_weights(os.path.join(runs["tp_root"], "saved"))
    assert_tensors_close({n: p.detach() for n, p in from_checkpoint.named_parameters()},
                         _weights(exported), rtol=0, atol=0, what="tp checkpoint loaded whole")


def _usage_errors(cases):
    """{case: the last line train.py's argparse wrote to stderr on this rank, or 'no error'}."""
    results = {}
    for name, argv in cases.items():
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                _train(argv)
            results[name] = "no error"
        except SystemExit:
            results[name] = err.getvalue().splitlines()[-1]
    return results


def _bad_tp_inputs():
    return _usage_errors({"world": ["--strategy", "tp", "--tp", "3"],
                          "mesh_world": ["--strategy", "zero1", "--tp", "2", "--pp", "2"],
                          "shard_group": ["--strategy", "fsdp", "--tp", "2", "--shard-group", "2"],
                          "sequence": ["--strategy", "tp", "--tp", "2", "--sequence-parallel",
                                       "--seq-len", "33"]})


@pytest.mark.parametrize("case, fix", [
    ("world", "world size 2 is not --tp 3 x a data-parallel size: launch a multiple of 3"),
    ("mesh_world", "world size 2 is not --tp 2 x --pp 2 x a data-parallel size: launch a multiple "
                    "of 4 processes"),
    ("sequence", "use a --seq-len divisible by 2, e.g. 32"),
    ("shard_group", "--shard-group 2 must divide the 1 data x context ranks (world 2 / --tp 2 / --pp 1)"),
])
def test_bad_tp_input_stops_every_rank_with_the_same_message(bad_tp, case, fix):
    assert bad_tp[0][case] == bad_tp[1][case], bad_tp
    assert fix in bad_tp[0][case], bad_tp[0][case]


@pytest.fixture(scope="module")
def bad_tp():
    return run_ranks(_bad_tp_inputs, 2)


def test_model_that_does_not_split_names_the_fix(monkeypatch, capsys):
    import train
    torchrun_worker(monkeypatch, 4)
    with pytest.raises(SystemExit):                              # medium has 6 heads
        train.parse_args(["--strategy", "tp", "--tp", "4", "--model", "medium"])
    err = capsys.readouterr().err
    assert "heads (n_head) = 6 into 4 equal parts, but 6 % 4 = 2: use a --tp that divides" in err
    with pytest.raises(ValueError, match=r"vocabulary \(vocab_size\) = 65 into 2"):
        tp.check_divisible(GPTConfig(n_head=4, n_embd=32, vocab_size=65), 2)


@pytest.mark.parametrize("make", [
    lambda comm: tp.ColumnParallelLinear(8, 5, comm),          # 5 output features over 2 ranks
    lambda comm: tp.RowParallelLinear(5, 8, comm),             # 5 input features
    lambda comm: tp.VocabParallelEmbedding(65, 8, comm),       # 65 rows: rank 1 would look up the wrong ids
])
def test_a_layer_whose_sizes_do_not_divide_is_a_clear_error(make):
    """Used alone (no check_divisible before it), a layer refuses unequal slices: chunk() would
    give rank 0 one row more, and the embedding's rank 1 would start its ids one row early."""
    comm = Comm.__new__(Comm)
    comm.rank, comm.world_size = 1, 2        # rank 1 of 2, no process group needed to build a layer
    with pytest.raises(ValueError, match=r"into 2 equal slices: give the layer sizes that divide by 2"):
        make(comm)
