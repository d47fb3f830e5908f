"""NF4 (quantization.py) and QLoRA (lora.QLoRALinear): the format's levels, its error bound,
its bytes, and a 4-bit layer that computes exactly what LoRA computes on the dequantized weight."""
import pytest
import torch
import torch.nn as nn

import train
from lora import LoRALinear, QLoRALinear, apply_lora, fold_adapters
from napkin.memory_math import live_numel, model_params, nf4_bytes, quantized_params, state_bytes
from model import GPT, PRESETS
from moe import feed_forward
from multiprocess import run_ranks
from quantization import BLOCK, LEVELS, NF4Weight
from test_lora import LORA, RUN, pretrained  # noqa: F401  (the fixture: a base model, another text)

# The QLoRA paper's NF4 table (appendix E; bitsandbytes' constants), printed to float32.
PUBLISHED = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
             -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
             0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
             0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]


def test_levels_are_the_standard_normal_float_ones():
    assert LEVELS.shape == (16,) and LEVELS.dtype == torch.float32
    torch.testing.assert_close(LEVELS, torch.tensor(PUBLISHED), rtol=0, atol=1e-6)


@pytest.mark.parametrize("double_quant", [False, True])
def test_round_trip_error_is_within_half_a_level_gap(double_quant):
    torch.manual_seed(0)
    weight = torch.randn(384, 200) * 0.02               # not a multiple of 64: the last block pads
    nf4 = NF4Weight(weight, double_quant)
    restored = nf4.dequantize()
    assert restored.shape == weight.shape
    # Nearest level: at most half the widest gap (between -1 and the next level) times the block's
    # scale; double quantization adds its own rounding of the scale (1/254 of the largest
    # deviation from the mean scale, times at most 1 for the level).
    padded = torch.nn.functional.pad(weight.reshape(-1), (0, -weight.numel() % BLOCK)).view(-1, BLOCK)
    scale = padded.abs().amax(dim=1)
    bound = scale * (LEVELS[1] - LEVELS[0]) / 2
    if double_quant:
        bound = bound + (scale - scale.mean()).abs().max() / 254 + 1e-7
    error = torch.nn.functional.pad((restored - weight).reshape(-1), (0, -weight.numel() % BLOCK)).view(-1, BLOCK)
    assert (error.abs() <= bound[:, None] + 1e-7).all()
    # The typical error is much smaller than the bound: normal weights sit where levels are dense.
    assert (restored - weight).abs().mean() < 0.1 * scale.mean()


@pytest.mark.parametrize("double_quant, bits", [(False, 4.5), (True, 4.127)])
def test_bytes_are_about_an_eighth_of_fp32(double_quant, bits):
    weight = torch.randn(1024, 1024)
    nf4 = NF4Weight(weight, double_quant)
    assert nf4.nbytes() == nf4_bytes(weight.numel(), double_quant)
    assert 8 * nf4.nbytes() / weight.numel() == pytest.approx(bits, abs=1e-3)   # bits per weight


def test_qlora_layer_equals_lora_on_the_dequantized_weight():
    torch.manual_seed(0)
    linear = nn.Linear(128, 64)
    qlora = QLoRALinear(linear, rank=4, alpha=8)
    with torch.no_grad():
        qlora.lora_B.normal_()                            # a nonzero update, so both paths count
    reference = LoRALinear(nn.Linear(128, 64), rank=4, alpha=8)
    with torch.no_grad():
        reference.weight.copy_(qlora.base.dequantize())
        reference.bias.copy_(qlora.bias)
        reference.lora_A.copy_(qlora.lora_A)
        reference.lora_B.copy_(qlora.lora_B)
    x = torch.randn(3, 5, 128, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out, out_ref = qlora(x), reference(x_ref)
    assert torch.equal(out, out_ref)                      # exact: the same F.linear on the same W
    out.square().sum().backward()
    out_ref.square().sum().backward()
    assert torch.equal(x.grad, x_ref.grad)
    for name in ("lora_A", "lora_B"):
        assert torch.equal(getattr(qlora, name).grad, getattr(reference, name).grad), name
    # Only the adapters train: the 4-bit base is buffers, the bias frozen.
    assert [n for n, p in qlora.named_parameters() if p.requires_grad] == ["lora_A", "lora_B"]
    assert "weight" not in dict(qlora.named_parameters())
    with pytest.raises(ValueError, match="fold_adapters"):
        qlora.merge()


def test_folded_export_is_the_dequantized_base_plus_the_update():
    torch.manual_seed(0)
    model = apply_lora(GPT(PRESETS["tiny"]), rank=4, alpha=8, quantize="nf4", double_quant=True)
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, QLoRALinear):
                layer.lora_B.normal_(std=0.01)
    plain = GPT(PRESETS["tiny"])
    plain.load_state_dict(fold_adapters(model.state_dict(), model))
    x = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(plain(x), model(x), rtol=0, atol=1e-5)   # one fp32 rounding of W0 + BA


def test_qlora_stores_the_whole_frozen_base_in_4_bits():
    """QLoRA on the default targets (query and value): every linear of every block is stored in
    NF4, adapted or not, and nothing else. The bytes of the stored model equal the formula written
    here, 0.5 byte a weight and a 4-byte scale per 64 for each 4-bit matrix, the rest (embeddings,
    norms, biases, the head, the adapters) in fp32; and napkin/memory.py's napkin predicts them."""
    cfg, r = PRESETS["tiny"], 8
    C, L, V, T = cfg.n_embd, cfg.n_layer, cfg.vocab_size, cfg.block_size
    model = apply_lora(GPT(cfg), targets=("query", "value"), rank=r, quantize="nf4")
    four_bit = {n.rsplit(".", 1)[0] for n, m in model.named_modules() if isinstance(m, NF4Weight)}
    assert four_bit == {f"blocks.{i}.{name}" for i in range(L) for name in
                        ("attn.query", "attn.key", "attn.value", "attn.output", "mlp.up", "mlp.down")}
    assert model.head.weight.dtype == torch.float32                    # the head stays as it was
    weights = [C * C] * 4 + [4 * C * C] * 2                            # a block's matrices
    nf4 = L * sum(w // 2 + 4 * (w // BLOCK) for w in weights)
    plain = 2 * V * C + T * C + 2 * C + L * 12 * C   # embeddings, head, final norm; norms, biases
    adapters = L * 2 * r * (C + C)                   # A (r, C) and B (C, r) on query and value
    stored = (sum(p.numel() * p.element_size() for p in model.parameters())
              + sum(m.nbytes() for m in model.modules() if isinstance(m, NF4Weight)))
    assert stored == nf4 + 4 * (plain + adapters) == 861_184           # 0.82 MiB; fp32: 3.40 MiB
    assert live_numel(model)[1] == quantized_params(cfg) == L * sum(weights)
    napkin = state_bytes(model_params(cfg) + adapters, "ddp", "fp32", 1, trainable=adapters,
                         quantized=quantized_params(cfg))
    assert napkin["params"] == stored + LEVELS.numel() * 4     # and NF4's 16 levels, one table
    # A mixture: every expert's matrices in 4 bits too, the routers not (memory_math.quantized_params).
    moe = apply_lora(GPT(PRESETS["tiny-moe"], feed_forward), quantize="nf4")
    assert live_numel(moe)[1] == quantized_params("tiny-moe")
    assert all(block.mlp.router.weight.dtype == torch.float32 for block in moe.blocks)


def _qlora(root, other):
    return train.main([*RUN, *LORA, "--quantize-base", "nf4", "--double-quant",
                       "--init-from", str(root / "base.pt"), "--data", other, "--steps", "12"])


def test_qlora_fine_tuning_lowers_the_loss(pretrained):    # noqa: F811
    root, other = pretrained
    history = run_ranks(_qlora, 1, root, other)[0]
    assert history["eval_loss"] < history["eval_loss_before"], history


# ---- QLoRA through training ---------------------------------------------------------------------

def test_qlora_trains_exactly_as_lora_on_the_dequantized_weights():
    """Five AdamW steps of a QLoRA GPT and of a LoRA GPT whose weights QLoRA stores in 4 bits
    (the targeted ones and every other linear of the blocks) are the dequantized ones: the same
    numbers, step by step (the same F.linear on the same W0, the same adapter gradients)."""
    torch.manual_seed(0)
    qlora = apply_lora(GPT(PRESETS["tiny"]), rank=4, alpha=8, quantize="nf4", double_quant=True)
    torch.manual_seed(0)
    lora = apply_lora(GPT(PRESETS["tiny"]), rank=4, alpha=8)
    quantized = {n: m for n, m in qlora.named_modules() if isinstance(m, QLoRALinear)}
    assert len(quantized) == 2 * PRESETS["tiny"].n_layer                # query and value per block
    four_bit = {n.rsplit(".", 1)[0]: m for n, m in qlora.named_modules() if isinstance(m, NF4Weight)}
    assert len(four_bit) == 6 * PRESETS["tiny"].n_layer                 # every linear of a block
    with torch.no_grad():
        for name, base in four_bit.items():
            lora.get_submodule(name).weight.copy_(base.dequantize())
    trainable = [[p for p in m.parameters() if p.requires_grad] for m in (qlora, lora)]
    for q, p in zip(*trainable):
        assert torch.equal(q, p)                                         # the same adapters to start
    optimizers = [torch.optim.AdamW(params, lr=1e-2) for params in trainable]
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        x = torch.randint(0, 256, (4, 33), generator=g)                  # (B, T+1)
        losses = []
        for model, optimizer in zip((qlora, lora), optimizers):
            _, loss = model(x[:, :-1], x[:, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        assert losses[0] == losses[1]
    for q, p in zip(*trainable):
        assert torch.equal(q, p)
    assert any(p.abs().sum() > 0 for n, p in qlora.named_parameters() if "lora_B" in n)   # it trained


def _qlora_run(root, other, strategy, extra=()):
    return train.main([*RUN, *LORA, "--quantize-base", "nf4", "--strategy", strategy,
                       "--init-from", str(root / "base.pt"), "--data", other,
                       "--export", str(root / f"qlora-{strategy}.pt"), *extra])


def test_qlora_under_zero2_fsdp_and_a_pipeline_equals_one_process(pretrained):    # noqa: F811
    """zero2 keeps the 4-bit base whole on every rank, fsdp shards it (its packed codes and
    scales, all-gathered as bytes: tests/test_fsdp_qlora.py); both shard and average the
    adapters' gradients only. A pipeline stage keeps its own blocks' 4-bit weights, and its
    export dequantizes them there. Each: one process's fine-tuning and its exported (folded)
    weights, to fp32 noise (test_snapshot's LOSS_RTOL and WEIGHT_ATOL, as LoRA under every strategy)."""
    from test_snapshot import LOSS_RTOL, WEIGHT_ATOL, _same_weights, _weights
    root, other = pretrained
    single = run_ranks(_qlora_run, 1, root, other, "single")[0]
    for strategy, extra in (("zero2", ()), ("fsdp", ()), ("pipeline", ("--pp", "2", "--microbatches", "4"))):
        out = run_ranks(_qlora_run, 2, root, other, strategy, extra)[0]
        assert out["losses"].keys() == single["losses"].keys()
        for step, loss in single["losses"].items():
            assert out["losses"][step] == pytest.approx(loss, rel=LOSS_RTOL), (strategy, step)
        _same_weights(_weights(root / f"qlora-{strategy}.pt"), _weights(root / "qlora-single.pt"),
                      atol=WEIGHT_ATOL)
