"""The Llama family: model.py's decoder with Llama's four changes, to load Llama, SmolLM, Qwen2.

RMSNorm in place of LayerNorm (Zhang & Sennrich 2019); rotary position embeddings in place of
learned ones, each query and key rotated by its position (Su et al. 2021, "RoFormer", section
3.4), with Llama 3's rescaled long wavelengths (Llama 3 paper, section 3.3.4 / its reference
code); a SwiGLU MLP (Shazeer 2020); grouped-query attention, several query heads sharing one
key/value head (Ainslie et al. 2023). Qwen2 adds biases to q, k and v. Module and method names
are model.py's (blocks, attn.query/key/value/output, embed, run_blocks, logits, loss_fn), so the
strategies see the same parts. Left out: KV caching, sliding windows, rope types but Llama 3's.
Test: python -m pytest tests/test_pretrained.py

Shapes: B batch, T sequence, C channels, H query heads, G key/value heads, D per head, V vocab.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from model import GPT, Block, at_least_fp32, cross_entropy, whole_sequence


@dataclass
class LlamaConfig:
    n_layer: int = 2
    n_head: int = 4                # H
    n_kv_head: int = 2             # G: H/G query heads share each key/value head
    n_embd: int = 64               # C
    head_dim: int | None = None    # D; None: C / H
    hidden: int = 172              # the MLP's width (intermediate_size)
    vocab_size: int = 256
    block_size: int = 2048         # max_position_embeddings: generate's window
    rope_theta: float = 10000.0
    # Llama 3's: {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}; None: plain rotary embeddings
    rope_scaling: dict | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False   # the head is the token embedding (SmolLM2, Llama 3.2 1B)
    qkv_bias: bool = False         # Qwen2
    output_bias: bool = False      # Llama's attention_bias: q, k, v and output all have one
    mlp_bias: bool = False
    dropout: float = 0.0           # on the attention weights only (attention_dropout)
    experts: int = 0               # dense: the strategies ask a model for its experts

    @property
    def D(self) -> int:
        return self.head_dim or self.n_embd // self.n_head


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps), scaled: no mean subtracted, no bias. Computed in at least fp32
    and cast back before the scale, as Llama's reference does, so bf16 weights give its numbers."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):                                        # (B, T, C)
        wide = at_least_fp32(x)
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rope_frequencies(cfg: LlamaConfig, device=None) -> torch.Tensor:        # (D/2,)
    """The rotation speed of each pair of channels, theta^(-2i/D): fast pairs see nearby tokens,
    slow ones far. Llama 3 slows the slowest pairs (wavelength over original context /
    low_freq_factor) by factor, keeps the fastest (under original / high_freq_factor), and
    blends in between, so a model trained on 8K positions reads 128K."""
    D = cfg.D
    frequencies = 1.0 / cfg.rope_theta ** (torch.arange(0, D, 2, device=device).float() / D)
    scaling = cfg.rope_scaling
    if not scaling:
        return frequencies
    factor, context = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelength = 2 * math.pi / frequencies
    # 0 for a slow pair (long wavelength), 1 for a fast one, linear in context / wavelength
    blend = ((context / wavelength - low) / (high - low)).clamp(0, 1)
    return blend * frequencies + (1 - blend) * frequencies / factor


def rotate(x, cos, sin):                          # x (B, H, T, D); cos, sin (T, D/2)
    """Turn each pair (x[i], x[i + D/2]) by its angle (Llama's half-split pairing, not the
    paper's adjacent pairs: Hugging Face's weights are permuted to it)."""
    x1, x2 = x.chunk(2, dim=-1)                                  # (B, H, T, D/2) each
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def grouped_causal_attention(q, k, v, dropout_p: float = 0.0):  # q (B, H, T, D), k, v (B, G, T, D)
    """model.py's causal attention, each of the G key/value heads serving H/G query heads."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p,
                                          enable_gqa=True)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        if cfg.n_head % cfg.n_kv_head:
            raise ValueError(f"n_head={cfg.n_head} must be a multiple of n_kv_head="
                             f"{cfg.n_kv_head}: each key/value head serves a whole group")
        C, D, bias = cfg.n_embd, cfg.D, cfg.qkv_bias or cfg.output_bias
        self.cfg, self.head_dim = cfg, D
        self.query = nn.Linear(C, cfg.n_head * D, bias=bias)
        self.key = nn.Linear(C, cfg.n_kv_head * D, bias=bias)
        self.value = nn.Linear(C, cfg.n_kv_head * D, bias=bias)
        self.output = nn.Linear(cfg.n_head * D, C, bias=cfg.output_bias)
        # The two parts a parallelism swaps, as in model.py: attention over the sequence, and the
        # positions of the T tokens this attention sees (context parallelism: its chunks').
        self.attend = grouped_causal_attention
        self.positions_of = whole_sequence

    def forward(self, x):                                        # x: (B, T, C)
        B, T, _ = x.shape
        def split_heads(t):                                      # (B, T, n*D) -> (B, n, T, D)
            return t.view(B, T, -1, self.head_dim).transpose(1, 2)
        q, k, v = split_heads(self.query(x)), split_heads(self.key(x)), split_heads(self.value(x))
        # Angles from the positions each forward (D/2 x T numbers): a buffer would be cast to
        # the model's bf16 with it, and bf16 angles are off by whole turns at long positions.
        angles = torch.outer(self.positions_of(T, x.device).float(),
                             rope_frequencies(self.cfg, x.device))           # (T, D/2)
        cos, sin = angles.cos(), angles.sin()
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)          # (B, H, T, D), (B, G, T, D)
        # Grouped-query: the attention lines each key/value head up with the H/G query heads it
        # serves (context parallelism sends the G heads, not H copies).
        y = self.attend(q, k, v, self.cfg.dropout if self.training else 0.0)   # (B, H, T, D)
        return self.output(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, H*D) -> (B, T, C)


class SwiGLU(nn.Module):
    """down(silu(gate x) * up x): a gated MLP, hidden about 8/3 C wide for 4C's parameters."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.n_embd, cfg.hidden, bias=cfg.mlp_bias)
        self.up = nn.Linear(cfg.n_embd, cfg.hidden, bias=cfg.mlp_bias)
        self.down = nn.Linear(cfg.hidden, cfg.n_embd, bias=cfg.mlp_bias)

    def forward(self, x):                            # (B, T, C) -> (B, T, hidden) -> (B, T, C)
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(Block):
    """model.py's pre-norm block, its forward inherited, with RMSNorm, Llama's attention and
    SwiGLU: a Block, so what treats a GPT's blocks as units (FSDP's wrap) treats these alike."""

    def __init__(self, cfg: LlamaConfig):
        nn.Module.__init__(self)                 # Block's own parts are built here, not there
        self.norm1 = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.attn = LlamaAttention(cfg)
        self.norm2 = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)


class Llama(nn.Module):
    """Token embedding, blocks, final norm, head: model.py's GPT without position embeddings
    (the positions are in the attention's rotations). Its forward's parts are GPT's own."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        if cfg.experts:
            raise ValueError(f"the Llama family here is dense: it has no mixture of experts to "
                             f"give {cfg.experts} experts; drop --experts")
        self.cfg = cfg
        self.token_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.token_emb.weight
        self.loss_fn = cross_entropy
        self.apply(GPT._init_weights)                # N(0, 0.02), Llama's initializer_range

    def embed(self, idx):                                        # (B, T) -> (B, T, C)
        return self.token_emb(idx)

    # The same blocks loop, final norm and head, generation and count as model.py's GPT.
    run_blocks, logits, generate, num_parameters = \
        GPT.run_blocks, GPT.logits, GPT.generate, GPT.num_parameters

    def forward(self, idx, targets=None):                        # idx: (B, T) token ids
        """The logits (B, T, V); with targets, (logits, loss), as model.py's GPT returns them."""
        logits = self.logits(self.run_blocks(self.embed(idx)))   # (B, T, V)
        return logits if targets is None else (logits, self.loss_fn(logits, targets))
