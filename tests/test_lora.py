"""LoRA (lora.py): starts as the base, trains only A and B, merges, swaps, composes.

fp32 on the CPU. Merging rounds W0 + (alpha/r) B A once per weight, so merged and unmerged
outputs agree to ~1e-6 (MERGE_ATOL 1e-5); under ddp, zero2, fsdp and tp the reordered
gradient sums keep losses within fp32 noise of one process (test_snapshot's LOSS_RTOL,
WEIGHT_ATOL). A checkpoint holds the adapter and pins its base (path and checksum): it resumes
bit for bit under the strategy that saved it (fsdp's sharded base too), and over no other base,
rank or targets.
"""
import argparse
import copy
import ast
import os
import pathlib
import pydoc
import shutil
from functools import partial

import pytest
import torch
import torch.nn as nn

from running import snapshot
import train
from lora import (LoRALinear, QLoRALinear, adapter_bytes, apply_lora, fold_adapters, load_lora,
                  lora_state_dict, merge_lora, unmerge_lora)
from napkin.memory_math import held_bytes, state_bytes
from mixed_precision import MixedPrecisionOptimizer
from model import GPT, GPTConfig, PRESETS
from multiprocess import run_ranks
from test_snapshot import LOSS_RTOL, RUN, WEIGHT_ATOL, _same_weights, _stderr_of_parse, _weights

CFG = PRESETS["tiny"]
MERGE_ATOL = 1e-5


def _base():
    torch.manual_seed(0)
    return GPT(CFG)


def _tuned(seed, targets=("query", "value"), steps=3):
    """A LoRA model after a few Adam steps on random tokens of `seed`: B is no longer zero."""
    model = apply_lora(_base(), targets=targets, rank=4, alpha=8)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 256, (2, 16), generator=g)
        model(x, x)[1].backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


X = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(7))


def test_starts_exactly_as_the_base_and_trains_only_the_adapters():
    base, model = _base(), apply_lora(_base())
    assert torch.equal(model(X), base(X))                    # B = 0: B A x adds exact zeros
    model(X, X)[1].backward()
    for name, p in model.named_parameters():
        assert p.requires_grad == (".lora_" in name), name
        assert (p.grad is not None) == (".lora_" in name), name
    assert all(layer.lora_B.grad.abs().sum() > 0 for layer in model.modules() if isinstance(layer, LoRALinear))
    # Parameter names of the base are unchanged: a base checkpoint still loads.
    assert set(base.state_dict()) <= set(model.state_dict())


def test_trainable_parameters_match_the_formula():
    model = apply_lora(_base(), targets=("query", "value", "up"), rank=8)
    C = CFG.n_embd
    per_block = 8 * (C + C) * 2 + 8 * (C + 4 * C)            # r (k + d) per adapted matrix
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable == CFG.n_layer * per_block
    assert adapter_bytes(model) == 4 * trainable              # fp32


def _by_hand(x, W0, b, A, B, alpha, r):
    """The paper's h = W0 x + b + (alpha / r) B A x, written out: (..., k) -> (..., d)."""
    return x @ W0.T + b + (alpha / r) * ((x @ A.T) @ B.T)


@pytest.mark.parametrize("quantized", [False, True])
def test_output_and_gradients_are_the_formula_written_out(quantized):
    """alpha 16, rank 4 (alpha / r = 4, so a scale of 1, r or 1/r shows), B nonzero: the unmerged
    forward, the adapters' gradients, the merged weight and the folded export all equal
    W0 x + b + (alpha / r) B A x computed here; QLoRA's W0 is its dequantized 4-bit copy."""
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(32, 24))                     # k 32 -> d 24
    W0, b = layers[0].weight.detach().clone(), layers[0].bias.detach().clone()
    apply_lora(layers, targets=("0",), rank=4, alpha=16, quantize="nf4" if quantized else None)
    layer = layers[0]
    with torch.no_grad():
        layer.lora_B.normal_()                                    # (24, 4): B A x is not zero
    if quantized:
        assert isinstance(layer, QLoRALinear)
        W0 = layer.base.dequantize()
    A, B = (layer.lora_A.detach().clone().requires_grad_(), layer.lora_B.detach().clone().requires_grad_())
    x = torch.randn(3, 5, 32)
    expected = _by_hand(x, W0, b, A, B, alpha=16, r=4)
    assert (expected - _by_hand(x, W0, b, A, B, alpha=4, r=4)).abs().max() > 1  # the scale shows
    # fp32: the same products, the low-rank one grouped as (x A^T) B^T both here and in the layer
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=1e-5)
    layer(x).square().sum().backward()
    expected.square().sum().backward()
    torch.testing.assert_close(layer.lora_A.grad, A.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.lora_B.grad, B.grad, rtol=1e-5, atol=1e-5)
    # The folded export: W0 + (alpha / r) B A, loaded into a plain nn.Linear.
    update = 16 / 4 * B.detach() @ A.detach()                     # (24, 32)
    folded = fold_adapters(layers.state_dict(), layers)
    torch.testing.assert_close(folded["0.weight"], W0 + update, rtol=0, atol=1e-5)
    if not quantized:                                             # a 4-bit W0 does not merge
        merge_lora(layers)
        torch.testing.assert_close(layer.weight, W0 + update, rtol=0, atol=1e-5)
        torch.testing.assert_close(layer(x), expected.detach(), rtol=0, atol=1e-5)


def test_merged_unmerged_and_folded_outputs_agree():
    model = _tuned(1)
    base_weight = _base().blocks[0].attn.query.weight.detach().clone()
    unmerged = model(X)
    merge_lora(model)
    merged = model(X)
    torch.testing.assert_close(merged, unmerged, rtol=0, atol=MERGE_ATOL)
    unmerge_lora(model)
    torch.testing.assert_close(model.blocks[0].attn.query.weight, base_weight, rtol=0, atol=1e-6)
    plain = GPT(CFG)                                         # no LoRA code: the folded weights
    plain.load_state_dict(fold_adapters(model.state_dict(), model))
    torch.testing.assert_close(plain(X), unmerged, rtol=0, atol=MERGE_ATOL)


def test_adapters_round_trip_and_swap_on_one_base():
    task_a, task_b = _tuned(1), _tuned(2)
    adapter_a, adapter_b = lora_state_dict(task_a), lora_state_dict(task_b)
    assert all(".lora_" in name for name in adapter_a)
    shared = apply_lora(_base(), rank=4, alpha=8)
    for adapter, tuned in ((adapter_a, task_a), (adapter_b, task_b), (adapter_a, task_a)):
        load_lora(shared, adapter)
        assert torch.equal(shared(X), tuned(X))
    merge_lora(shared)                                       # loading unmerges first; W0 + d - d
    load_lora(shared, adapter_b)                             # rounds W0 by ~1e-7, hence atol
    torch.testing.assert_close(shared(X), task_b(X), rtol=0, atol=MERGE_ATOL)


def test_the_tensor_parallel_hook_is_declared_in_the_class_not_patched_on():
    """Issue 56: LoRALinear's split_alongside is a method of its class body. No statement at a
    textbook file's top level sets an attribute on a class (lora.py:265 once did)."""
    assert "split_alongside" in vars(LoRALinear)
    root = pathlib.Path(__file__).resolve().parent.parent
    for path in sorted(root.glob("*.py")):
        patched = [f"{path.name}:{node.lineno}" for node in ast.parse(path.read_text()).body
                   if isinstance(node, ast.Assign)
                   and any(isinstance(target, ast.Attribute) for target in node.targets)]
        assert not patched, f"an attribute set on another object at module level: {patched}"


def _quantized_after_the_split() -> dict:
    """On one rank: a GPT with experts, LoRA on query, value and the routers, quantized by
    apply_lora on the whole model, and again by lora.quantize_split after TensorParallelGPT
    split it over this one rank (each "slice" the whole weight)."""
    from composition.tensor_parallel_gpt import TensorParallelGPT
    from moe import feed_forward
    from quantization import FrozenNF4Linear
    import lora
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=16, experts=2, top_k=1)
    base = GPT(cfg, feed_forward)
    models, rng = [], []
    for split in (False, True):
        model = copy.deepcopy(base)
        torch.manual_seed(1)
        apply_lora(model, targets=("query", "value", "router"), rank=2,
                   quantize=None if split else "nf4", double_quant=True)
        if split:
            TensorParallelGPT(model, after_split=partial(lora.quantize_split, double_quant=True))
        models.append(model)
        rng.append(torch.get_rng_state())
    whole, split = (dict(m.named_modules()) for m in models)
    four_bit = {name: type(m).__name__ for name, m in whole.items()
                if isinstance(m, (QLoRALinear, FrozenNF4Linear))}
    x = torch.randint(cfg.vocab_size, (2, 16))
    return {"rng equal": torch.equal(*rng), "four_bit": four_bit,
            "split kinds": {name: type(split[name]).__name__ for name in four_bit},
            "codes equal": all(torch.equal(a, b) for name in four_bit for a, b in
                               zip(whole[name].base.buffers(), split[name].base.buffers())),
            "logits": [m(x)[0] for m in models]}


def test_quantize_split_makes_apply_lora_s_4_bit_weights_after_the_split():
    """Every weight apply_lora(quantize="nf4") makes 4-bit, quantize_split makes 4-bit after the
    split, with the same codes and scales (double quantization too) where a slice is the whole
    weight: the split layers' slices, the experts left whole (FrozenNF4Linear) and the routers'
    adapters (QLoRALinear, their A the one drawn before: the generator left as it was); the
    same logits."""
    out = run_ranks(_quantized_after_the_split, 1)[0]
    kinds = out["four_bit"]
    assert {k for k in kinds.values()} == {"QLoRALinear", "FrozenNF4Linear"}
    assert any(name.endswith("router") for name in kinds)
    assert any(".experts." in name for name in kinds)
    assert out["split kinds"] == {name: kind if name.endswith("router") or ".experts." in name
                                  else ("RowParallelLinear" if name.endswith(("output", "down"))
                                        else "ColumnParallelLinear")
                                  for name, kind in kinds.items()}
    assert out["rng equal"] and out["codes equal"]
    assert torch.equal(*out["logits"])


def test_bad_lora_settings_name_the_fix():
    with pytest.raises(ValueError, match="choose among"):
        apply_lora(_base(), targets=("qkv",))
    with pytest.raises(ValueError, match="smaller --lora-rank"):
        apply_lora(_base(), rank=1000)
    with pytest.raises(ValueError, match="same --lora-targets"):
        load_lora(apply_lora(_base()), lora_state_dict(_tuned(1, targets=("query",))))


def test_memory_is_the_model_plus_the_trainable_parameters_state():
    """Measured bytes equal napkin/memory.py's: the frozen model once, grads and Adam only for A and B."""
    model = apply_lora(_base())
    optimizer = MixedPrecisionOptimizer(model.parameters(), torch.optim.AdamW, precision="fp32")
    model(X, X)[1].backward()
    optimizer.step()
    n_params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    predicted = state_bytes(n_params, "ddp", "fp32", 1, trainable=trainable)
    held = held_bytes(model, optimizer)
    assert {k: held[k] for k in ("params", "grads", "optimizer")} == \
           {k: predicted[k] for k in ("params", "grads", "optimizer")}
    assert predicted["grads"] == 4 * trainable and predicted["optimizer"] == 8 * trainable


# ---- train.py: pretrain, then fine-tune another text with LoRA, at any world size ------------

LORA = ["--lora", "--lora-rank", "4", "--lora-alpha", "8", "--lr", "5e-3"]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    other = root / "argparse_help.txt"                  # English prose, not Python source
    other.write_text(pydoc.render_doc(argparse, renderer=pydoc.plaintext))
    run_ranks(train.main, 1, [*RUN, "--steps", "20", "--export", str(root / "base.pt")])
    return root, str(other)


def _fine_tune(root, other, strategy, name, extra=()):
    return train.main([*RUN, *LORA, "--strategy", strategy, "--init-from", os.path.join(root, "base.pt"),
                       "--data", other, "--export", os.path.join(root, name + ".pt"), *extra])


# Every linear of a block adapted: tensor parallelism then splits A (row layers: output, down)
# as well as B (column layers: query, key, value, up).
ALL_LINEARS = ["--lora-targets", "query,key,value,output,up,down"]


def test_lora_under_every_strategy_equals_one_process(pretrained):
    """ddp and zero2 communicate only the adapters' gradients, fsdp shards only them (the base
    stays whole), tp splits A or B with the layer they adapt, a pipeline stage trains the
    adapters of its own blocks (in two chunks each, interleaved; zero bubble: the adapters' thin
    products defer their gradients to W): the same model."""
    root, other = pretrained
    single = run_ranks(_fine_tune, 1, root, other, "single", "single", ALL_LINEARS)[0]
    assert single["eval_loss"] < single["eval_loss_before"]          # it learns the new text
    pp = ["--pp", "2", "--microbatches", "4"]
    for name, strategy, extra in [("ddp", "ddp", []), ("zero2", "zero2", []), ("fsdp", "fsdp", []),
                                  ("tp", "tp", ["--tp", "2"]), ("pipeline", "pipeline", pp),
                                  ("interleaved", "pipeline", [*pp, "--schedule", "interleaved"]),
                                  ("zb", "pipeline", [*pp, "--schedule", "zb"])]:
        out = run_ranks(_fine_tune, 2, root, other, strategy, name, [*ALL_LINEARS, *extra])[0]
        for step, loss in single["losses"].items():
            assert out["losses"][step] == pytest.approx(loss, rel=LOSS_RTOL), (name, step)
        _same_weights(_weights(root / f"{name}.pt"), _weights(root / "single.pt"), atol=WEIGHT_ATOL)


def test_checkpoint_holds_only_the_adapter_and_resumes_exactly(pretrained):
    root, other = pretrained
    run_dir = str(root / "tuned")
    straight = run_ranks(_fine_tune, 2, root, other, "zero2", "straight")[0]
    run_ranks(_fine_tune, 2, root, other, "zero2", "saved", ["--out", run_dir, "--save-every", "3"])
    meta, parts = train.snapshot.load(os.path.join(run_dir, "ckpt-0000003"))
    names = {p["name"] for part in parts for p in part["pieces"]}
    assert names and all(".lora_" in name for name in names)         # no base weights in it
    assert meta["base"] == os.path.abspath(root / "base.pt")
    os.rename(os.path.join(run_dir, "ckpt-0000006"), os.path.join(run_dir, "later"))
    again = run_ranks(_fine_tune, 2, root, other, "zero2", "resumed", ["--out", run_dir, "--resume"])[0]
    assert again["losses"] == {s: straight["losses"][s] for s in (3, 4, 5)}
    _same_weights(_weights(root / "resumed.pt"), _weights(root / "straight.pt"))
    # The run directory alone gives the merged model (base + adapter), on one process.
    from_dir = train.load_weights(run_dir).state_dict()
    _same_weights(from_dir, _weights(root / "straight.pt"), atol=MERGE_ATOL)


# ---- resuming under fsdp: the frozen base sharded, the adapter continued -------------------------

# name: (the strategy that saved, its flags)
FSDP_RESUMES = {"lora": ("fsdp", []),
                "nf4": ("fsdp", ["--quantize-base", "nf4"]),
                "nf4-offload-dq": ("fsdp", ["--quantize-base", "nf4", "--double-quant",
                                            "--offload", "params"]),
                "tp-to-fsdp": ("tp", ["--tp", "2"])}


def _resume_under_fsdp(root, other):
    """On 2 ranks, each of FSDP_RESUMES: 6 steps saving at 3 (the uninterrupted run), then a copy
    of its run directory cut back to step 3 resumed under fsdp (with the saved run's flags but
    --tp). Returns {name: (uninterrupted history, resumed history)}."""
    out = {}
    for name, (strategy, flags) in FSDP_RESUMES.items():
        saved, resumed = os.path.join(root, name + "-saved"), os.path.join(root, name + "-resumed")
        straight = _fine_tune(root, other, strategy, name + "-saved",
                              [*flags, "--out", saved, "--save-every", "3"])
        if torch.distributed.get_rank() == 0:                  # as if it had stopped at step 3
            shutil.copytree(saved, resumed, ignore=shutil.ignore_patterns("ckpt-0000006"))
        torch.distributed.barrier()
        again = flags if strategy == "fsdp" else []             # tp's flags: --tp 2
        out[name] = straight, _fine_tune(root, other, "fsdp", name + "-resumed",
                                         [*again, "--out", resumed, "--resume"])
    return out


@pytest.fixture(scope="module")
def fsdp_resumes(pretrained):
    root, other = pretrained
    return root, run_ranks(_resume_under_fsdp, 2, root, other)[0]


@pytest.mark.parametrize("name", ["lora", "nf4", "nf4-offload-dq"])
def test_fsdp_lora_resumes_exactly(fsdp_resumes, name):
    """FSDP shards the frozen base (4-bit or not, on the device or the host): a resume loads the
    adapter into the shards and continues as the uninterrupted run, bit for bit (the same ranks,
    the same sums)."""
    root, runs = fsdp_resumes
    straight, again = runs[name]
    assert list(again["losses"]) == [3, 4, 5]
    assert again["losses"] == {s: straight["losses"][s] for s in (3, 4, 5)}
    assert again["eval_loss"] == straight["eval_loss"]
    _same_weights(_weights(root / f"{name}-resumed.pt"), _weights(root / f"{name}-saved.pt"))


def test_a_tp_lora_checkpoint_resumes_under_fsdp(fsdp_resumes):
    """Saved by tp's split adapters, continued by fsdp's shards: the same model, to the fp32 noise
    of the reordered sums (test_snapshot's LOSS_RTOL, WEIGHT_ATOL)."""
    root, runs = fsdp_resumes
    straight, again = runs["tp-to-fsdp"]
    assert list(again["losses"]) == [3, 4, 5]
    for step, loss in again["losses"].items():
        assert loss == pytest.approx(straight["losses"][step], rel=LOSS_RTOL), step
    _same_weights(_weights(root / "tp-to-fsdp-resumed.pt"), _weights(root / "tp-to-fsdp-saved.pt"),
                  atol=WEIGHT_ATOL)


# ---- a LoRA checkpoint pins its base ----------------------------------------------------------

def _adapters(root, base_file):
    """On one process: a base run directory B saved at step 2; the adapter A over it (3 steps);
    B trained on to step 3; an adapter C over no --init-from (its checkpoint holds the base);
    an adapter E over E/base.pt, a copy of base_file, exported to E.pt."""
    short = [*RUN, "--steps", "3", "--save-every", "3"]
    train.main([*RUN, "--steps", "2", "--out", os.path.join(root, "B")])
    train.main([*short, *LORA, "--init-from", os.path.join(root, "B"), "--out", os.path.join(root, "A")])
    train.main([*RUN, "--steps", "3", "--out", os.path.join(root, "B"), "--resume"])
    train.main([*short, *LORA, "--out", os.path.join(root, "C")])
    os.makedirs(os.path.join(root, "E"))
    shutil.copy(base_file, os.path.join(root, "E", "base.pt"))
    train.main([*short, *LORA, "--init-from", os.path.join(root, "E", "base.pt"), "--out",
                os.path.join(root, "EA"), "--export", os.path.join(root, "E.pt")])


@pytest.fixture(scope="module")
def adapters(pretrained, tmp_path_factory):
    root = tmp_path_factory.mktemp("pinned")
    run_ranks(_adapters, 1, str(root), str(pretrained[0] / "base.pt"))
    return root


def _resume(root, adapter, *flags):
    return ["--out", str(root / adapter), "--resume", str(root / adapter / "ckpt-0000003"),
            *RUN, *LORA, *flags]


def test_a_lora_checkpoint_names_the_concrete_base_it_trained_over(adapters):
    """--init-from B (a run directory) named B's newest checkpoint then, step 2: the adapter's
    base is that checkpoint, not B, whose newest is now step 3."""
    meta = snapshot.read_meta(str(adapters / "A" / "ckpt-0000003"))
    assert meta["base"] == str(adapters / "B" / "ckpt-0000002")
    assert os.path.isdir(adapters / "B" / "ckpt-0000003") and len(meta["base_sha256"]) == 64


def test_a_lora_resume_over_other_weights_is_refused(adapters, pretrained, capsys):
    """The adapter trains on only over the weights it was trained over: the run directory it
    named (since trained on) or another file is refused in one line naming --init-from and the
    checkpoint to give; those weights, wherever they are now, resume."""
    base = adapters / "B" / "ckpt-0000002"
    for other in (adapters / "B", pretrained[0] / "base.pt"):
        err = _stderr_of_parse(_resume(adapters, "A", "--init-from", str(other)), capsys)
        assert err.startswith(f"train.py: error: --init-from {other} holds other weights"), err
        assert f"resume with --init-from {base}" in err and err.count("\n") == 1, err
    train.parse_args(_resume(adapters, "A", "--init-from", str(base)))           # no refusal
    moved = adapters / "moved"
    os.rename(base, moved)
    try:
        err = _stderr_of_parse(_resume(adapters, "A"), capsys)
        assert f"the frozen base {base}: that base is missing (moved or deleted)" in err, err
        assert "pass --init-from a copy" in err, err
        train.parse_args(_resume(adapters, "A", "--init-from", str(moved)))      # the same weights
    finally:
        os.rename(moved, base)


@pytest.mark.parametrize("flags, said", [
    (["--lora-rank", "8"], "--lora-rank: {path}'s adapter was trained with --lora-rank 4, this run "
                           "asks for --lora-rank 8: resume with --lora-rank 4"),
    (["--lora-targets", "query,value,up"], "--lora-targets: {path}'s adapter was trained with "
                                           "--lora-targets query,value, this run asks for "
                                           "--lora-targets query,up,value"),
    (["--quantize-base", "nf4"], "--quantize-base: {path}'s adapter was trained with no --quantize-base"),
], ids=["rank", "targets", "quantize"])
def test_a_lora_resume_with_another_adapter_shape_is_refused(adapters, capsys, flags, said):
    """Another rank would read the saved A and B's first elements as a scrambled adapter, other
    targets find no saved adapter for the new layers: each is one line naming its flag."""
    path = adapters / "A" / "ckpt-0000003"
    err = _stderr_of_parse(_resume(adapters, "A", "--init-from", str(adapters / "B" / "ckpt-0000002"),
                                   *flags), capsys)
    assert err.startswith("train.py: error: " + said.format(path=path)), err


def test_a_lora_resume_of_a_run_without_a_base_refuses_one(adapters, pretrained, capsys):
    """C trained over no --init-from, so its checkpoints hold the frozen weights: a resume that
    names a base would have them silently replaced by the checkpoint's."""
    err = _stderr_of_parse(_resume(adapters, "C", "--init-from", str(pretrained[0] / "base.pt")), capsys)
    assert "started without --init-from" in err and "resume without --init-from" in err, err


def test_exporting_over_the_init_from_file_is_refused(pretrained, capsys):
    base = str(pretrained[0] / "base.pt")
    err = _stderr_of_parse(["--init-from", base, *LORA, "--export", base], capsys)
    assert f"--export {base} is --init-from {base}" in err and "give another path" in err, err


def test_an_adapter_over_a_changed_or_missing_base_is_refused(adapters):
    """E.pt, the adapter merged into its base, written over that base (what an --export onto its
    own --init-from did): the adapter would load over it a second time. Refused, as is a base
    deleted; the base restored, the adapter loads as exported."""
    base, adapter = adapters / "E" / "base.pt", str(adapters / "EA")
    original = base.read_bytes()
    try:
        shutil.copy(adapters / "E.pt", base)
        with pytest.raises(snapshot.CheckpointError, match="whose weights have changed since"):
            train.load_weights(adapter)
        os.remove(base)
        with pytest.raises(snapshot.CheckpointError, match=f"over the base {base}, which is missing"):
            train.load_weights(adapter)
    finally:
        base.write_bytes(original)
    merged = train.load_weights(adapter).state_dict()
    _same_weights(merged, _weights(adapters / "E.pt"), atol=MERGE_ATOL)
