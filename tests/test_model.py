"""The GPT: shapes, causality, presets, named projections, tying and the loss at init."""
import dataclasses
import math

import pytest
import torch

from model import PRESETS, build_model
from moe import feed_forward


def test_shapes_and_initial_loss_is_uniform_guess():
    torch.manual_seed(0)
    model = build_model("tiny")
    idx = torch.randint(0, 256, (3, 40))                        # (B, T)
    logits, loss = model(idx, idx)
    assert logits.shape == (3, 40, 256)                         # (B, T, V)
    # Small init makes the first prediction nearly uniform over 256 bytes: loss ~ ln 256.
    assert abs(loss.item() - math.log(256)) < 0.1


def test_attention_is_causal():
    torch.manual_seed(0)
    model = build_model("tiny")
    idx = torch.randint(0, 256, (1, 32))
    changed = idx.clone()
    changed[0, 20:] = (changed[0, 20:] + 1) % 256                # change only the future
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :20], b[:, :20], rtol=0, atol=0)   # exact: same arithmetic
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_presets():
    assert set(PRESETS) == {"tiny", "tiny-moe", "medium", "gpt2-small", "gpt2-small-moe", "7b", "70b"}
    assert build_model("tiny").num_parameters() < 2_000_000
    # GPT-2 small's 124M parameters, with its 50257-token vocabulary padded to 50304.
    assert round(build_model("gpt2-small").num_parameters() / 1e6) == 124


def test_moe_presets_are_their_dense_model_with_8_experts_top_2():
    from napkin.memory_math import active_params
    for moe, dense in (("tiny-moe", "tiny"), ("gpt2-small-moe", "gpt2-small")):
        cfg = PRESETS[moe]
        assert (cfg.experts, cfg.top_k) == (8, 2)
        assert dataclasses.replace(cfg, experts=0) == PRESETS[dense], moe     # the same shape
    with torch.device("meta"):                      # the real modules, no memory or init time
        model = build_model("gpt2-small-moe", feed_forward=feed_forward)
    assert len(model.blocks[0].mlp.experts) == 8
    assert round(model.num_parameters() / 1e6) == 521
    # A token computes with GPT-2 small plus one more MLP (4.7M) per block and the routers.
    C = 768
    assert active_params("gpt2-small-moe") == 124_466_688 + 12 * (8 * C * C + 5 * C + 8 * C)


def test_projections_are_separate_named_linears_and_tying_shares_storage():
    model = build_model("tiny")
    attn = model.blocks[0].attn
    for name in ("query", "key", "value", "output"):
        assert isinstance(getattr(attn, name), torch.nn.Linear)
    assert model.head.weight is not model.token_emb.weight
    tied = build_model("tiny", tie_embeddings=True)
    assert tied.head.weight is tied.token_emb.weight
    assert tied.num_parameters() == model.num_parameters() - 256 * 128


def test_dropout_is_off_by_default_and_optional():
    torch.manual_seed(0)
    idx = torch.randint(0, 256, (2, 16))
    plain = build_model("tiny").train()
    torch.testing.assert_close(plain(idx), plain(idx), rtol=0, atol=0)   # deterministic in train mode
    noisy = build_model("tiny", dropout=0.5).train()
    assert not torch.equal(noisy(idx), noisy(idx))
    noisy.eval()
    torch.testing.assert_close(noisy(idx), noisy(idx), rtol=0, atol=0)


def test_bad_configs_name_the_fix():
    with pytest.raises(ValueError, match="block_size"):
        build_model("tiny")(torch.zeros(1, 129, dtype=torch.long))
    with pytest.raises(ValueError, match="choose one of tiny, medium, tiny-moe, gpt2-small, gpt2-small-moe"):
        build_model("huge")
    with pytest.raises(ValueError, match="divisible by n_head"):
        build_model("tiny", n_head=5)


def test_a_fixed_batch_can_be_memorised():
    torch.manual_seed(0)
    model = build_model("tiny", n_layer=2)
    idx = torch.randint(0, 256, (4, 32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(60):
        _, loss = model(idx[:, :-1], idx[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 1.0                                    # from ln 256 = 5.5
