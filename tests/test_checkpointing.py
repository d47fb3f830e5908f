"""Activation checkpointing (checkpointing.py): same gradients, fewer saved activations.

Recomputation runs the same operations on the same inputs with the same random numbers, so
in fp32 on the CPU every gradient is bit for bit the one without checkpointing, dropout on.
"""
import dataclasses

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from checkpointing import checkpoint, checkpoint_blocks
from napkin.memory_math import activation_bytes
from foundations.meters import saved_activation_bytes
from model import GPT, PRESETS
from multiprocess import run_ranks

CFG = dataclasses.replace(PRESETS["tiny"], dropout=0.1)
B, T = 4, 64


def _models(n):
    torch.manual_seed(0)
    first = GPT(CFG)
    models = [first] + [GPT(CFG) for _ in range(n - 1)]
    for m in models[1:]:
        m.load_state_dict(first.state_dict())
    return models


def _torch_checkpoint_blocks(model):
    for block in model.blocks:
        block.forward = lambda x, f=block.forward: torch_checkpoint(f, x, use_reentrant=False)


def _grads(model, x, y):
    torch.manual_seed(1)                          # the same dropout masks in every model
    saved, (_, loss) = saved_activation_bytes(lambda: model(x, y), exclude=list(model.parameters()))
    loss.backward()
    return saved, loss, {n: p.grad for n, p in model.named_parameters()}


def test_gradients_are_bit_exact_with_dropout_and_equal_torch_checkpoint():
    plain, ours, theirs = _models(3)
    checkpoint_blocks(ours)
    _torch_checkpoint_blocks(theirs)
    x, y = torch.randint(0, 256, (B, T)), torch.randint(0, 256, (B, T))
    _, loss, expected = _grads(plain, x, y)
    for model in (ours, theirs):
        _, loss_c, got = _grads(model, x, y)
        assert torch.equal(loss_c, loss)
        for name in expected:                      # exact: the same ops recomputed
            assert torch.equal(got[name], expected[name]), name


def test_non_tensor_arguments_and_frozen_inputs():
    """A frozen input (LoRA behind frozen embeddings) still lets the parameters' gradients flow."""
    torch.manual_seed(0)
    layer = nn.Linear(8, 8)
    x = torch.randn(3, 8)                              # requires_grad=False

    def f(inp, scale, activation):
        return activation(layer(inp)) * scale
    out = checkpoint(f, x, 2.0, torch.tanh, parameters=layer.parameters())
    assert out.requires_grad
    out.sum().backward()
    got = layer.weight.grad.clone()
    layer.weight.grad = None
    f(x, 2.0, torch.tanh).sum().backward()
    assert torch.equal(got, layer.weight.grad)


def test_evaluation_under_no_grad_is_unchanged():
    plain, ours = _models(2)
    checkpoint_blocks(ours)
    plain.eval(), ours.eval()
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert torch.equal(ours(x), plain(x))


@pytest.mark.parametrize("every", [1, 2])
def test_saved_activation_bytes_drop_as_predicted(every):
    """Blocks keep only their input: sbh values per checkpointed block (napkin/memory.py's 2sbh at 16 bits)."""
    plain, ours = _models(2)
    assert checkpoint_blocks(ours, every=every) == CFG.n_layer // every
    x, y = torch.randint(0, 256, (B, T)), torch.randint(0, 256, (B, T))
    kept_plain, _, _ = _grads(plain, x, y)
    kept_ours, _, _ = _grads(ours, x, y)
    per_layer_input = activation_bytes(T, B, CFG.n_embd, CFG.n_head, checkpointing=True,
                                       bytes_per_value=4) - activation_bytes(T, B, CFG.n_embd, CFG.n_head,
                                                                             bytes_per_value=4)
    assert per_layer_input == B * T * CFG.n_embd * 4            # the formula's 2sbh, in fp32
    # Measured per-layer cost without checkpointing: what each checkpointed block stops keeping.
    block_in = torch.randn(B, T, CFG.n_embd, requires_grad=True)
    per_block, _ = saved_activation_bytes(lambda: plain.blocks[0](block_in),
                                          exclude=list(plain.parameters()))
    checkpointed = CFG.n_layer // every
    assert kept_ours == kept_plain - checkpointed * (per_block - per_layer_input)


def test_a_block_keeps_what_the_formula_bounds():
    """sbh(34 + 5as/h) (napkin/memory.py) bounds a block without dropout: no masks are kept, and the
    fused attention recomputes the T x T scores in backward. Measured: 73% of it."""
    block = GPT(dataclasses.replace(CFG, dropout=0.0)).blocks[0]
    block_in = torch.randn(B, T, CFG.n_embd, requires_grad=True)
    kept, _ = saved_activation_bytes(lambda: block(block_in), exclude=list(block.parameters()))
    formula = activation_bytes(T, B, CFG.n_embd, CFG.n_head, bytes_per_value=4)
    assert 0.5 * formula < kept <= formula, (kept, formula)


def _losses(strategy, extra):
    import train
    return train.main(["--strategy", strategy, "--steps", "4", "--log-every", "1", "--eval-every", "0",
                       "--seq-len", "32", "--batch-size", "8", "--dropout", "0.1", *extra])["losses"]


@pytest.mark.parametrize("strategy, extra", [
    ("ddp", []), ("fsdp", []), ("pipeline", ["--pp", "2", "--microbatches", "4"]),
    ("pipeline", ["--pp", "2", "--microbatches", "4", "--schedule", "interleaved"]),
    ("pipeline", ["--pp", "2", "--microbatches", "4", "--schedule", "zb"])])
def test_composes_with_strategies_bit_for_bit(strategy, extra):
    """DDP's and FSDP's gradient hooks fire from inside the recomputation, a pipeline stage
    recomputes its blocks (its chunk's, interleaved) when its micro-batch's gradient arrives, and
    zero bubble's deferred products are filed from the recomputed layers: the same gradients."""
    plain = run_ranks(_losses, 2, strategy, extra)[0]
    assert run_ranks(_losses, 2, strategy, [*extra, "--checkpoint-activations"])[0] == plain
