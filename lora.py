"""LoRA: fine-tune a frozen model through a low-rank update of chosen weight matrices.

A pretrained W0 (d x k) stays frozen. The layer learns B (d x r) and A (r x k), r much smaller
than d and k, and computes h = W0 x + (alpha / r) B A x (Hu et al. 2021, "LoRA", section 4.1).
The scale is alpha / r, the paper's: the lecture's "alpha = 1" (scale 1) is alpha = r here.
B starts at zero, so the model starts exactly as the base one.
Only A and B get gradients and optimizer state.
In mixed precision the lecture counts 2 + 2 + 12 = 16 bytes per trainable parameter (weight,
gradient, fp32 master and Adam's two moments) against 2 per frozen one (its 16-bit weight).
So training needs room for the frozen model plus 16 bytes per adapter parameter, not 16 bytes
per parameter of the whole model; napkin/memory.py counts it.
Merging adds (alpha / r) B A into W0: no extra latency at inference.
Subtracting it back restores the base, up to rounding (merge).
So adapters for several tasks share one base model.
QLoRA keeps W0 in 4 bits (quantization.py) under the same adapters (Dettmers et al. 2023),
and the blocks' other frozen linears in 4 bits too.
Left out: LoRA on embeddings.
Run alone: python lora.py (a layer's adapter trained, merged, and checked against plain torch);
in training: python train.py --init-from RUN --lora --data OTHER.txt;
test: python -m pytest tests/test_lora.py

Shapes: k in features, d out features, r rank; "..." for batch dimensions.
"""
import math
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from foundations.alone import start_alone
from quantization import FrozenNF4Linear, NF4Weight


class LoRALinear(nn.Module):
    """A frozen nn.Linear's weight and bias (same tensors, same names) plus lora_A, lora_B.

    alpha None means alpha = r, a scale of 1: the paper sets alpha to the first r it tries and
    does not tune it (with Adam, alpha acts as a learning rate). The lecture's alpha multiplies
    B A directly; here scale = alpha / r, so the lecture's alpha = 1 is alpha = r here (the
    default). Inside a tensor-parallel layer: split_alongside, the hook tensor_parallel.py's
    split layers call.
    """

    def __init__(self, base: nn.Linear, rank: int = 8, alpha: float | None = None,
                 dropout: float = 0.0):
        super().__init__()
        smaller = min(base.in_features, base.out_features)
        if rank < 1 or rank > smaller:
            raise ValueError(f"LoRA rank {rank} must be between 1 and min(in, out) = "
                             f"{smaller}: use a smaller --lora-rank")
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias            # W0 (d, k), b (d,): frozen
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.rank = rank
        self.scale = (alpha if alpha is not None else rank) / rank  # alpha / r
        self.dropout = dropout
        like = dict(device=base.weight.device, dtype=base.weight.dtype)
        # A random (as nn.Linear initialises a k -> r layer), B zero: B A = 0 at the start.
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, **like))  # (r, k)
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, **like))  # (d, r)
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.merged = False

    # The adapter's products go through self.linear, a swap point (why: after forward).
    linear = staticmethod(F.linear)

    def delta(self) -> torch.Tensor:
        """The update the adapter adds to W0: (alpha / r) B A, (d, k)."""
        return self.scale * self.lora_B @ self.lora_A

    def frozen_forward(self, x):
        return F.linear(x, self.weight, self.bias)

    def forward(self, x):                                       # x: (..., k) -> (..., d)
        h = self.frozen_forward(x)
        if self.merged:        # W0 + s B A is in weight already: A and B get no gradient
            return h
        x = F.dropout(x, self.dropout, self.training)
        # Two thin products, (..., k) -> (..., r) -> (..., d): the d x k update is never built.
        return h + self.scale * self.linear(self.linear(x, self.lora_A), self.lora_B)

    # self.linear rather than F.linear: a zero-bubble pipeline sets layer.linear to its own
    # function, which in backward returns the input's gradient now and defers A's and B's
    # (extensions/zero_bubble.py, WeightGradients). The frozen W0 needs no gradient, so its
    # product stays F.linear.

    # merge and unmerge each round their sum to the weight's dtype, so W0 comes back only up to
    # that rounding: a merge/unmerge cycle rounds twice, each time up to 2^-24 of a value in
    # fp32, 2^-8 in bf16, where the drift shows (load_lora unmerges a merged model first: swap
    # adapters on an unmerged one).
    @torch.no_grad()
    def merge(self):
        if not self.merged:
            self.weight += self.delta().to(self.weight.dtype)
            self.merged = True

    @torch.no_grad()
    def unmerge(self):
        if self.merged:
            self.weight -= self.delta().to(self.weight.dtype)
            self.merged = False

    def split_alongside(self, dim: int):
        """The hook tensor_parallel.py's split layers look for: how A and B split beside W0.

        dim is the dimension W0 (d, k) is split along: 0 (a column layer: d, its output
        features, split) or 1 (a row layer: k, its input features, split).
        Returns {name: (factor, its dim)}, dim None for a whole copy, and the term to add.
        The split is drawn below (LoRA inside a tensor-parallel layer).
        """
        if dim == 0:                                              # A (r, k) whole, B (d/N, r)
            pieces = {"lora_A": (self.lora_A, None), "lora_B": (self.lora_B, 0)}
        else:                                                     # A (r, k/N), B (d, r) whole
            pieces = {"lora_A": (self.lora_A, 1), "lora_B": (self.lora_B, None)}
        return pieces, partial(_split_term, scale=self.scale, dropout=self.dropout)

    def extra_repr(self):
        return (f"in={self.in_features}, out={self.out_features}, rank={self.rank}, "
                f"scale={self.scale:g}")


def apply_lora(model: nn.Module, targets=("query", "value"), rank: int = 8,
               alpha: float | None = None, dropout: float = 0.0, quantize: str | None = None,
               double_quant: bool = False) -> nn.Module:
    """Freeze every parameter of model and wrap each nn.Linear named in targets, in place.

    targets are module names' last parts ("query" matches blocks.0.attn.query). A mixture of
    experts' experts (moe.py, under an "experts" list) are never adapted: a token reaches an
    expert only when routed there, so each adapter would learn from a few tokens, and the
    experts stay plain weights that expert parallelism can split. Parameter names of the base
    stay as they were, so base checkpoints still load. quantize="nf4" is QLoRA: the targeted
    weights and every other linear named in QUANTIZED stored in 4 bits; double_quant quantizes
    their scales too.
    """
    if quantize not in (None, "nf4"):
        raise ValueError(f"--quantize-base {quantize}: the one 4-bit format here is nf4")
    for p in model.parameters():
        p.requires_grad_(False)
    linears = [(name, module) for name, module in model.named_modules()
               if isinstance(module, nn.Linear) and "experts" not in name.split(".")]
    found = [(name, module) for name, module in linears if name.rsplit(".", 1)[-1] in targets]
    if not found:
        choices = sorted({name.rsplit(".", 1)[-1] for name, _ in linears})
        raise ValueError(f"--lora-targets {','.join(targets)} names no linear layer; choose "
                         f"among {','.join(choices)}")
    for name, module in found:
        _replace(model, name, QLoRALinear(module, rank, alpha, dropout, double_quant) if quantize
                 else LoRALinear(module, rank=rank, alpha=alpha, dropout=dropout))
    # The targeted layers are LoRALinear now (not nn.Linear): this loop reaches only the others.
    if quantize:
        for name, module in list(model.named_modules()):
            if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in QUANTIZED:
                _replace(model, name, FrozenNF4Linear(module, double_quant))
    return model


def _replace(model: nn.Module, name: str, module: nn.Module):
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, module)


def lora_layers(model: nn.Module) -> list[LoRALinear]:
    return [m for m in model.modules() if isinstance(m, LoRALinear)]


def merge_lora(model: nn.Module) -> nn.Module:
    for layer in lora_layers(model):
        layer.merge()
    return model


def unmerge_lora(model: nn.Module) -> nn.Module:
    for layer in lora_layers(model):
        layer.unmerge()
    return model


def lora_state_dict(model: nn.Module) -> dict:
    """Only the adapter: every lora_A and lora_B, by name (the base is saved elsewhere, once)."""
    return {name: p.detach().clone() for name, p in model.named_parameters() if ".lora_" in name}


def load_lora(model: nn.Module, adapter: dict):
    """Put an adapter (lora_state_dict's output) into a model apply_lora has wrapped.

    Swapping adapters on one base: call again with another task's adapter. A merged model is
    unmerged first, so the base underneath stays the pretrained one.
    """
    unmerge_lora(model)
    mine = {name for name, _ in model.named_parameters() if ".lora_" in name}
    if set(adapter) != mine:
        raise ValueError(f"the adapter's {len(adapter)} tensors do not match this model's "
                         f"{len(mine)} LoRA tensors (e.g. {sorted(set(adapter) ^ mine)[:2]}): "
                         f"apply LoRA with the same --lora-targets as the run that trained it")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in adapter.items():
            params[name].copy_(value)


def adapter_bytes(model: nn.Module) -> int:
    # From shapes alone: under FSDP a parameter between uses has no storage to read.
    adapters = [p for name, p in model.named_parameters() if ".lora_" in name]
    return sum(p.numel() * p.element_size() for p in adapters)


def fold_adapters(state_dict: dict, model: nn.Module) -> dict:
    """A plain model's state dict from a LoRA one: W0 + (alpha / r) B A, the lora_ keys dropped.

    model is the LoRA-wrapped model the state dict came from (its layers give the scales);
    the result loads into the base architecture with no LoRA code at all.
    The state dict must come from an unmerged model: a merged weight already holds the update,
    which folding would add a second time. An adapted head tied to the token embedding gets a
    weight of its own (W0 the table, or its 4-bit copy): the result's head and embedding differ,
    so it loads into the base architecture untied (running/snapshot.py's export says so).
    """
    layers = {name: layer for name, layer in model.named_modules() if isinstance(layer, LoRALinear)}
    # A state dict gathered from pieces holds a tied weight once, under its first name (a tied
    # head's under the embedding's); model.state_dict() holds it under both.
    first_name = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first_name.setdefault(id(p), name)
    four_bit = {name: m for name, m in model.named_modules()
                if isinstance(m, (QLoRALinear, FrozenNF4Linear))}
    # The lora_ keys and the NF4 buffers (<layer>.base.codes, .scales, .scale_codes,
    # .scale_absmax) stay out.
    folded = {key: t for key, t in state_dict.items()
              if ".lora_" not in key and key.rsplit(".base.", 1)[0] not in four_bit}
    for name, m in four_bit.items():                 # a 4-bit W0 (d, k) as the run computed with it
        folded[name + ".weight"] = m.base.dequantize(torch.float32)
    for name, layer in layers.items():
        B, A = state_dict[name + ".lora_B"], state_dict[name + ".lora_A"]       # (d, r), (r, k)
        W0 = folded.get(name + ".weight")
        if W0 is None:                                # tied: held under the embedding's name
            W0 = folded[first_name[id(layer.weight)]]
        folded[name + ".weight"] = W0 + layer.scale * B @ A
    return folded


def dequantized_weights(model: nn.Module) -> dict:
    """{name.weight: W0 (d, k), fp32} of every 4-bit layer of model, as the run computed with it.
    An export of a model split over ranks calls it on each rank that holds codes (a pipeline
    stage, a tensor-parallel rank), gathers the weights, then folds the adapters in as
    fold_adapters does for a whole model. A tensor-parallel layer gives this rank's slice W0_r
    (the export joins the slices along the layer's dim)."""
    return {name + ".weight": m.base.dequantize(torch.float32) for name, m in model.named_modules()
            if isinstance(getattr(m, "base", None), NF4Weight)}


# ---- QLoRA: the same adapters over a 4-bit base (quantization.py) ------------------------------
#
# Dettmers et al. 2023: W0 kept as NF4 codes and scales (4.5 bits a value), dequantized in each
# forward and backward and dropped again; the adapters train as above, in the compute dtype.
# The paper stores the whole pretrained model so, adapted or not: here every block's attention
# query, key, value and output and MLP up and down (a Llama's SwiGLU gate too; each expert's).
# The embeddings, norms and biases stay in the compute dtype (its code quantizes linear layers
# only), and so do a mixture's routers (small, and a rounded score flips a token's expert) and
# the head, unless adapted (then QLoRALinear): Hugging Face's 4-bit loading, which the paper's
# code uses, keeps the output layer in 16 bits, and a tied head is the embedding's table.
QUANTIZED = ("query", "key", "value", "output", "gate", "up", "down")

class QLoRALinear(LoRALinear):
    """LoRA over a 4-bit NormalFloat W0: the full-precision weight is replaced by its NF4 copy."""

    def __init__(self, base: nn.Linear, rank: int = 8, alpha: float | None = None,
                 dropout: float = 0.0, double_quant: bool = False):
        super().__init__(base, rank, alpha, dropout)
        self.base = NF4Weight(base.weight, double_quant)        # codes and scales: 4.5 bits/value
        del self.weight                                         # only the 4-bit copy stays

    def frozen_forward(self, x):
        return self.base(x, self.bias)                          # W0 dequantized, used, dropped

    def merge(self):
        raise ValueError("a 4-bit base cannot absorb the update without losing it to rounding: "
                         "use fold_adapters (train.py --export) for a merged full-precision model")


def as_4_bit(layer: nn.Module, name: str, double_quant: bool = False) -> nn.Module | None:
    """A whole layer (name: its name in the model) as apply_lora(quantize="nf4") stores it, made
    after its adapters were drawn: an adapted one as QLoRALinear with the same A, B and scale,
    another linear QUANTIZED names as FrozenNF4Linear, any other None. QLoRALinear reads W0, the
    bias and the sizes from an adapted layer as from an nn.Linear, and draws an A of its own,
    drawn aside (fork_rng) and replaced: the generator is left as it was, so every draw after
    this one is the draw apply_lora(quantize=...) would have made."""
    if isinstance(layer, LoRALinear):
        W0 = layer.weight
        with torch.random.fork_rng(devices=[W0.device] if W0.is_cuda else []):
            stored = QLoRALinear(layer, layer.rank, None, layer.dropout, double_quant)
        stored.scale, stored.lora_A, stored.lora_B = layer.scale, layer.lora_A, layer.lora_B
        return stored
    if isinstance(layer, nn.Linear) and name.rsplit(".", 1)[-1] in QUANTIZED:
        return FrozenNF4Linear(layer, double_quant)
    return None


# ---- LoRA inside a tensor-parallel layer (tensor_parallel.py) -----------------------------------
#
# A layer split over tensor-parallel ranks adds s B A x (s = alpha / r) too. Split A and B the way
# W0 is split, so the low-rank path needs no collective of its own:
#   column (W0 rows split):  B's rows split with W0's, A whole:    y_r = W0_r x + s B_r (A x)
#   row (W0 columns split):  A's columns split with W0's, B whole: z_r = W0_r y_r + s B (A_r y_r),
#                            and the all-reduce that sums W0_r y_r over the ranks
#                            (tensor_parallel.py's g) sums B (A_r y_r) into B A y as well.
# The whole factor (A of a column layer, B of a row layer) gets only this rank's part of its
# gradient, a partial sum: tensor_parallel.py records it so (foundations/placements.py), and
# composition/tensor_parallel_gpt.py sums those over the group after backward.

def _split_term(layer: nn.Module, x: torch.Tensor, scale: float, dropout: float) -> torch.Tensor:
    """A split layer's local low-rank term (alpha/r) B A x, through the layer's own products.
    layer.linear is the swap point: a zero-bubble pipeline's swap reaches these too."""
    x = F.dropout(x, dropout, layer.training)
    return scale * layer.linear(layer.linear(x, layer.lora_A), layer.lora_B)


# ---- QLoRA inside a tensor-parallel layer ------------------------------------------------------
#
# An NF4 block is 64 consecutive values of W0 (d, k) read row by row (quantization.py). A slice
# of a 4-bit W0 would cut through blocks: a row layer's slice takes k/N values of each row, and
# a column layer's d/N rows end inside a block unless (d/N) k divides by 64. So under tensor
# parallelism apply_lora runs without quantize, tensor_parallel.py splits the full-precision
# W0, and then each rank quantizes its own slice W0_r, in blocks of its own. Where the slice is
# whole blocks (a column layer's when (d/N) k divides by 64, a row layer's when k/N does), those
# are one process's blocks, and so its codes and scales, cut; where not, each rank rounds its
# slice a little differently from one process. Double quantization's mean and blocks of 256
# scales are the slice's own: never one process's. Rank r of a split layer then holds
#   W0_r as NF4 codes and scales (layer.base, which its local product dequantizes),
#   the bias: its d/N in a column layer, whole in a row layer (full precision, frozen),
#   the adapters as above: A whole and B_r (column), or A_r and B whole (row).

def quantize_split(module: nn.Module, double_quant: bool = False):
    """apply_lora's 4-bit replacements in module (a block, or the head), made after
    tensor_parallel.py split it, in place: each split layer (one with a local_product)
    apply_lora would quantize keeps its slice W0_r as NF4 codes and scales in layer.base, its
    full-precision weight deleted; a linear left whole (a mixture's experts, and its router
    when adapted: --lora-targets router) is replaced as apply_lora replaces it."""
    for name, layer in list(module.named_modules()):
        W0, kind = getattr(layer, "weight", None), name.rsplit(".", 1)[-1]
        # no weight (a container), 4-bit already, or meta: another stage's, dropped after
        if not isinstance(W0, nn.Parameter) or W0.is_meta:
            continue
        if hasattr(layer, "local_product"):                  # a split layer: its slice, in place
            if hasattr(layer, "lora_A") or kind in QUANTIZED:
                layer.base = NF4Weight(W0, double_quant)
                del layer.weight
        elif (stored := as_4_bit(layer, name, double_quant)) is not None:
            _replace(module, name, stored)


# ---- run alone: one adapted layer against plain torch's W0 + (alpha/r) B A ----------------------

def _demonstrate(steps: int = 10) -> float:
    """Train a rank-8 adapter on a frozen 512 x 512 layer toward a low-rank change of its weight,
    beside one process's plain torch: the same A and B, in h = x (W0 + (alpha/r) B A)^T + b.
    Then merge and check the merged layer computes what the adapted one did. fp64 throughout.
    Returns the largest difference from plain torch."""
    torch.manual_seed(0)
    base = nn.Linear(512, 512, dtype=torch.float64)                       # W0 (d, k), d = k = 512
    W0, b = base.weight.detach().clone(), base.bias.detach().clone()
    # scale alpha / r = 2, not the lecture's 1: the target change is learned in fewer steps
    layer = LoRALinear(base, rank=8, alpha=16)
    trained = [p for p in layer.parameters() if p.requires_grad]
    total = sum(p.numel() for p in layer.parameters())
    print(f"trainable: {sum(p.numel() for p in trained):,} of {total:,} parameters "
          f"({100 * sum(p.numel() for p in trained) / total:.1f}%: A and B; W0 and b frozen)")
    A, B = (p.detach().clone().requires_grad_() for p in (layer.lora_A, layer.lora_B))
    x = torch.randn(64, 512, dtype=torch.float64)                         # (batch, k)
    target = x @ (W0 + 0.01 * torch.randn(512, 8, dtype=W0.dtype)         # (batch, d): W0 plus
                  @ torch.randn(8, 512, dtype=W0.dtype)).T + b            # a rank-8 change
    ours, theirs = torch.optim.Adam(trained, lr=1e-3), torch.optim.Adam([A, B], lr=1e-3)
    for step in range(steps):
        plain = x @ (W0 + layer.scale * B @ A).T + b                      # one process, plain torch
        for optimizer, h in ((theirs, plain), (ours, layer(x))):
            loss = (h - target).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        if step in (0, steps - 1):
            print(f"step {step:2d}: loss {loss.item():.3e}")
    with torch.no_grad():
        adapted, plain = layer(x), x @ (W0 + layer.scale * B @ A).T + b
        layer.merge()                                                     # W0 += (alpha/r) B A
        merged = layer(x)
    differences = {"adapted output": (adapted - plain).abs().max().item(),
                   "merged output": (merged - plain).abs().max().item(),
                   "A and B": max((layer.lora_A - A).abs().max(),
                                  (layer.lora_B - B).abs().max()).item()}
    print(f"merged into W0: one matmul now, the same output ({(merged - adapted).abs().max():.1e} "
          f"from the adapted layer's)")
    print("max |difference| from one process (plain torch, W0 + (alpha/r) B A): "
          + ", ".join(f"{name} {d:.1e}" for name, d in differences.items())
          + " (bound 1e-12: fp64, the same sums grouped another way, W0 x + s B (A x))")
    return max(differences.values())


if __name__ == "__main__":
    start_alone()
    raise SystemExit(0 if _demonstrate() <= 1e-12 else 1)
