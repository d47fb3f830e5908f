"""A small GPT: the decoder-only transformer every strategy in this project trains.

Token and position embeddings, n_layer pre-norm blocks (causal self-attention, then an
MLP, each added to the residual stream), a final norm and a linear head over the vocabulary
(Radford et al. 2019, GPT-2, section 2.3). Attention's query, key, value and output
projections are separate named nn.Linear modules so that LoRA can target query and value,
and tensor parallelism can split them. Left out: KV caching, rotary embeddings, fused kernels.
Run: python train.py --model tiny; test: python -m pytest tests/test_model.py

Shapes: B batch, T sequence, C channels (n_embd), H heads, D = C / H per head, V vocabulary.
"""
import contextlib
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 128          # longest sequence the position embedding covers
    vocab_size: int = 256          # bytes
    dropout: float = 0.0
    tie_embeddings: bool = False   # head shares the token embedding's weight (GPT-2 does)
    gelu_approximate: str = "none"  # "tanh": GPT-2's GELU, which its pretrained weights need
    # Mixture of experts (moe.py): every block's MLP becomes `experts` MLPs behind a router, each
    # token sent to top_k of them; 0 experts: the dense model. moe.py builds those blocks (its
    # feed_forward, which GPT and build_model take): the model knows no router itself.
    experts: int = 0
    top_k: int = 2
    capacity_factor: float | None = 1.25       # None: dropless
    aux_loss_weight: float = 0.01              # Switch's load-balancing loss
    z_loss_weight: float = 0.0                 # ST-MoE's router z-loss
    routing_group: int | None = None           # tokens per routing group; None: a forward's


PRESETS = {
    # trains a few hundred steps in about a minute on 2 CPU cores with 2 ranks
    "tiny": GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=128),
    # about 11M parameters: a laptop can still train it, a GPU shows the strategies' costs
    "medium": GPTConfig(n_layer=6, n_head=6, n_embd=384, block_size=256),
    # tiny with every MLP a mixture of 8 experts, top-2 (GShard): 4x the parameters, each token
    # computing 2 experts' worth
    "tiny-moe": GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=128, experts=8, top_k=2),
    # GPT-2 small's shape, vocabulary included (50257 padded to a multiple of 64), so that its
    # memory and FLOPs are GPT-2's 124M: our byte-level data uses only the first 256 rows.
    "gpt2-small": GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024,
                            vocab_size=50304, tie_embeddings=True),
    # gpt2-small with every MLP a mixture of 8 experts, top-2: 521M parameters, of which a token
    # computes with 181M (GPT-2 small's 124M plus one more MLP per block and the routers)
    "gpt2-small-moe": GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024,
                                vocab_size=50304, tie_embeddings=True, experts=8, top_k=2),
    # The lecture's "does a 7B model fit?", for napkin/memory.py's napkin math: Llama 2 7B's 32
    # layers of width 4096, 32 heads, 32000 tokens and 4096 positions in our blocks: 6.72B
    # parameters.
    "7b": GPTConfig(n_layer=32, n_head=32, n_embd=4096, block_size=4096, vocab_size=32000),
    # The talk's QLoRA + FSDP case, for napkin/memory.py's napkin math (not to train on a laptop):
    # Llama 2 70B's depth, width, heads and vocabulary in our blocks (a 4x GeLU MLP where
    # Llama's SwiGLU is 3.5x, full multi-head attention): 65B parameters, the 70B class.
    "70b": GPTConfig(n_layer=80, n_head=64, n_embd=8192, block_size=4096, vocab_size=32000),
}


def causal_attention(q, k, v, dropout_p: float = 0.0):        # (B, H, T, D) each -> (B, H, T, D)
    """softmax(q k^T / sqrt(D) + causal mask) v, in PyTorch's fused form."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd={cfg.n_embd} must be divisible by n_head={cfg.n_head}")
        self.n_head = cfg.n_head
        self.query = nn.Linear(cfg.n_embd, cfg.n_embd)
        # No key bias: q . (k + b) = q . k + q . b adds the same number to every score in a
        # row, which softmax ignores, so its gradient is exactly zero (Adam would turn the
        # rounding noise in that zero into full-size steps).
        self.key = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.value = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.output = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout
        # softmax(q k^T / sqrt(D) + causal mask) v over the whole sequence; context_parallel.py
        # swaps in attention over a sequence split across ranks (ring or all-gather K/V).
        self.attend = causal_attention

    def forward(self, x):                                        # x: (B, T, C)
        B, T, C = x.shape
        def split_heads(t):                                      # (B, T, H*D) -> (B, H, T, D)
            return t.view(B, T, self.n_head, -1).transpose(1, 2)
        q, k, v = split_heads(self.query(x)), split_heads(self.key(x)), split_heads(self.value(x))
        y = self.attend(q, k, v, self.dropout if self.training else 0.0)   # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, -1)                  # (B, T, H*D)
        return F.dropout(self.output(y), self.dropout, self.training)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.up = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.down = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.dropout, self.approximate = cfg.dropout, cfg.gelu_approximate

    def forward(self, x):                              # (B, T, C) -> (B, T, 4C) -> (B, T, C)
        hidden = F.gelu(self.up(x), approximate=self.approximate)
        return F.dropout(self.down(hidden), self.dropout, self.training)


class Block(nn.Module):
    """Pre-norm: each sublayer sees a normalised input and adds its result to the residual.
    feed_forward(cfg) builds the second sublayer: the MLP, or moe.py's mixture of experts."""

    def __init__(self, cfg: GPTConfig, feed_forward: Callable[[GPTConfig], nn.Module] = MLP):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.norm2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = feed_forward(cfg)

    def forward(self, x):                                        # (B, T, C)
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """feed_forward(cfg): each block's MLP; a config with experts needs moe.feed_forward."""

    def __init__(self, cfg: GPTConfig, feed_forward: Callable[[GPTConfig], nn.Module] = MLP):
        super().__init__()
        if cfg.experts and feed_forward is MLP:
            raise ValueError(f"a model of {cfg.experts} experts needs moe.py's feed-forward: pass "
                             f"feed_forward=moe.feed_forward (or build it with "
                             f"composition/parallelize.py's build_gpt)")
        self.cfg = cfg
        self.token_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, feed_forward) for _ in range(cfg.n_layer))
        self.norm = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.token_emb.weight
        # Two parts the parallelisms swap in place, so that every one of them runs this same
        # forward: the positions of the tokens this rank embeds (context parallelism keeps its
        # chunks of each sequence, sequence parallelism 1/tp of it), and the loss of the logits
        # this rank holds (tensor parallelism holds V/tp of them).
        self.positions_of = whole_sequence
        self.loss_fn = cross_entropy
        self.apply(self._init_weights)
        # GPT-2's scaling: each block adds two projections to the residual stream, so their
        # init shrinks with depth to keep the stream's variance from growing.
        for block in self.blocks:
            mlps = [m for m in block.mlp.modules() if isinstance(m, MLP)]   # a mixture's experts
            for proj in (block.attn.output, *(mlp.down for mlp in mlps)):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    # The forward in parts (embed, run_blocks, logits, then loss_fn): pipeline stages
    # (pipeline.py) run these same parts on their share of the model.

    def embed(self, idx):                                        # idx: (B, T) token ids
        """Token plus position embeddings, dropped out: (B, T, C) (sequence parallelism: its
        rank's T/tp of them). The positions: positions_of(T), 0..T-1 unless a parallelism
        swapped it."""
        T = idx.shape[1]
        # A split sequence's T is a part: the parallelism that split it checks the whole.
        if T > self.cfg.block_size and self.positions_of is whole_sequence:
            raise ValueError(f"sequence length {T} exceeds block_size {self.cfg.block_size}: "
                             f"use a shorter --seq-len or a larger model preset")
        positions = self.positions_of(T, idx.device)
        return self.drop(self.token_emb(idx) + self.pos_emb(positions))   # (B, T, C)

    def run_blocks(self, x, layers=None):                        # (B, T, C) -> (B, T, C)
        """The blocks in order: all of them, or those numbered in layers (a pipeline stage's)."""
        for i in (range(len(self.blocks)) if layers is None else layers):
            x = self.blocks[i](x)
        return x

    def logits(self, x):                                         # (B, T, C) -> (B, T, V)
        return self.head(self.norm(x))

    def forward(self, idx, targets=None):                        # idx: (B, T) token ids
        logits = self.logits(self.run_blocks(self.embed(idx)))
        if targets is None:
            return logits
        loss = self.loss_fn(logits, targets)
        return logits, loss + self.aux_loss() if self.cfg.experts else loss

    def aux_loss(self) -> torch.Tensor:
        """The routers' losses of the last forward (moe.py), summed over the blocks."""
        return sum(block.mlp.aux_loss for block in self.blocks)

    @torch.no_grad()
    def generate(self, idx, new_tokens: int, temperature: float = 0.8, top_k: int | None = 50):
        """Append new_tokens sampled one at a time to idx (B, T); the window slides past block_size.
        temperature 0: greedy, the most likely token every time. A feed-forward may act otherwise
        when generating (its generating() context: a mixture of experts routes each window's
        tokens as one group, whatever routing group it trained with)."""
        with contextlib.ExitStack() as generating:
            for block in self.blocks:
                if hasattr(block.mlp, "generating"):
                    generating.enter_context(block.mlp.generating())
            for _ in range(new_tokens):
                logits = self(idx[:, -self.cfg.block_size:])[:, -1, :].float()           # (B, V)
                if temperature == 0:
                    idx = torch.cat([idx, logits.argmax(dim=-1, keepdim=True)], dim=1)
                    continue
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]  # (B, 1)
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                next_token = torch.multinomial(torch.softmax(logits, dim=-1), 1)           # (B, 1)
                idx = torch.cat([idx, next_token], dim=1)
        return idx

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())         # shared weights counted once


def whole_sequence(n_tokens: int, device) -> torch.Tensor:
    """Positions 0..T-1: a rank that holds whole sequences."""
    return torch.arange(n_tokens, device=device)


def at_least_fp32(logits: torch.Tensor) -> torch.Tensor:
    """Logits as the loss computes them: fp32, or wider (an fp64 model's, for tests), whatever
    the model's dtype: log-softmax over V classes is where low precision hurts most."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def cross_entropy(logits, targets):                              # (B, T, V), (B, T) -> scalar
    """The mean loss over all B x T tokens, in at least fp32."""
    return F.cross_entropy(at_least_fp32(logits).flatten(0, 1), targets.flatten())


def build_model(name: str = "tiny", feed_forward: Callable[[GPTConfig], nn.Module] = MLP,
                **overrides) -> GPT:
    """A GPT from a preset name, with any config field overridden (e.g. dropout=0.1); a preset
    with experts takes moe.py's feed_forward."""
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}: choose one of {', '.join(PRESETS)}")
    cfg = GPTConfig(**{**PRESETS[name].__dict__, **overrides})
    return GPT(cfg, feed_forward)
