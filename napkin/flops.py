"""napkin/flops.py: napkin math, compute: a model's shape, and the FLOPs a token costs it in a step.

2 per matrix element forward (a multiply and an add), twice that backward: 6 per parameter per
token, 8 with activation checkpointing, 4 for a frozen weight, plus attention's (Kaplan et al.
2020 section 2.1, PaLM appendix B). napkin/step_time.py divides them by a machine's FLOP/s;
napkin/machines.py's `this` measures that rate on the model's block, counting its FLOPs here.
Test: python -m pytest tests/test_step_time.py

Shapes: L layers, C width, F the MLP's hidden width, T sequence, V vocabulary.
"""
from dataclasses import dataclass

from napkin.memory_math import model_params
from model import GPTConfig


@dataclass(frozen=True)
class Shape:
    """What a step's FLOPs need of a model: its layer shapes. gated: a SwiGLU MLP (3 C x F
    matrices, Llama's) instead of GELU's 2; kv_heads < heads: grouped-query attention (K and V
    C x kv_heads D); head_dim D (0: C / heads); experts: an MoE MLP, top_k of them per token.
    other_params: every parameter outside the matrices (biases, norms, positions), counted for
    bytes, not FLOPs."""
    layers: int
    width: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    gated: bool = False
    head_dim: int = 0
    tied: bool = False
    experts: int = 0
    top_k: int = 0
    capacity_factor: float | None = None
    routing_group: int | None = None
    other_params: int = 0

    @classmethod
    def of(cls, cfg: GPTConfig) -> "Shape":
        """model.py's GPT, or a Llama's (pretrained/llama.py: SwiGLU, G key/value heads of D)."""
        if hasattr(cfg, "n_kv_head"):
            shape = cls(cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.hidden,
                        cfg.vocab_size, gated=True, head_dim=cfg.D, tied=cfg.tie_embeddings)
            return cls(**{**shape.__dict__, "other_params": model_params(cfg) - shape.params()})
        shape = cls(cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_head, 4 * cfg.n_embd, cfg.vocab_size,
                    tied=cfg.tie_embeddings, experts=cfg.experts, top_k=cfg.top_k if cfg.experts else 0,
                    capacity_factor=cfg.capacity_factor, routing_group=cfg.routing_group)
        return cls(**{**shape.__dict__, "other_params": model_params(cfg) - shape.params()})

    def block_params(self, active: bool = True) -> int:
        """A block's matrix elements: Q and O C x heads D, K and V C x kv_heads D, the MLP's 2
        or 3 C x F (an MoE: top_k of them per token if active, else all E, plus the router's
        E x C)."""
        C = self.width
        attention = 2 * C * self.heads * self.D + 2 * C * self.kv_heads * self.D
        mlp = (3 if self.gated else 2) * C * self.ffn
        if self.experts:
            mlp = mlp * (self.top_k if active else self.experts) + self.experts * C
        return attention + mlp

    @property
    def D(self) -> int:
        return self.head_dim or self.width // self.heads

    def params(self) -> int:
        """Every parameter: the blocks' matrices, token embedding, head (once if tied), the rest."""
        embeddings = self.vocab * self.width * (1 if self.tied else 2)
        return self.layers * self.block_params(active=False) + embeddings + self.other_params

    def expert_matrices(self, experts: int | None = None) -> int:
        """The experts' C x F matrices over all blocks: every one of each MoE layer's E, or
        `experts` of them (a rank's E/ep). Their biases (F + C each) stay in other_params."""
        per_expert = (3 if self.gated else 2) * self.width * self.ffn
        return self.layers * (self.experts if experts is None else experts) * per_expert

    def held_params(self, ep: int = 1) -> int:
        """The parameters a rank holds with each MoE layer's experts split over ep ranks."""
        if ep == 1:
            return self.params()
        return self.params() - self.expert_matrices() + self.expert_matrices(self.experts // ep)


LLAMA_3_1_8B = Shape(layers=32, width=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, gated=True)


# ---- FLOPs per token ----------------------------------------------------------------------------

def block_flops(shape: Shape, seq_len: int) -> int:
    """Forward FLOPs per token of one block: 2 per matrix element (a multiply and an add), and
    attention's scores q k^T and weighted sum over the T positions, 2 T H D each (H D = C but
    in a Llama whose head_dim says otherwise). Over the whole T, causal or not (PaLM's and
    torchtitan's count: MFU compares across papers so)."""
    return 2 * shape.block_params() + 4 * seq_len * shape.heads * shape.D


def step_flops(shape: Shape, seq_len: int, checkpointing: float = 0.0, frozen: int = 0,
               adapters: int = 0) -> dict:
    """Training FLOPs per token, forward and backward. Backward is twice forward: each matmul
    computes its input's gradient and its weight's, each as costly as forward (attention's two
    products have no weight: their two gradients are both inputs'). frozen: matrix elements
    that train not (LoRA's base): no weight gradient, so 4 per element instead of 6. adapters:
    LoRA's trainable matrices beside them (6 each). checkpointing: the share of blocks whose forward
    runs once more in backward (1: every block, 8 per element; train.py --checkpoint-activations K: 1/K)."""
    forward = shape.layers * block_flops(shape, seq_len) + 2 * shape.vocab * shape.width + 2 * adapters
    backward = 2 * forward - 2 * frozen
    if checkpointing:
        backward += round(checkpointing * shape.layers * block_flops(shape, seq_len))   # not the head
    return {"forward": forward, "backward": backward}


def model_flops_per_token(shape: Shape, seq_len: int) -> int:
    """MFU's numerator per token: 6 N + 12 L C T (N: the matrices a token computes with), no
    recomputation, every weight trained: what the model needs, not what a strategy spends."""
    return sum(step_flops(shape, seq_len).values())
