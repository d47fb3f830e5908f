"""A Hugging Face model read unit by unit into the rank's share: the talk's 70B on two GPUs.

load.load_pretrained holds the whole fp32 model before any strategy cuts it, which a 70B (280
GB in fp32) never fits. Here the model is built hollow (every tensor shaped, in the dtype the
run stores it in, its storage 0 bytes), LoRA's adapters are added to it (their A drawn from the
seeded generator in apply_lora's order, as on the whole model), and each unit (a block, or the
rest: embeddings, final norm, head) is read from the mapped files just before the first step
that needs its values, each frozen linear quantized to NF4 as it is read (QLoRA):
  - FSDP makes its units one at a time (StreamedFSDP): a unit keeps this rank's shard only;
  - tensor parallelism splits each block just after reading it (TensorParallelGPT's
    before_split), and each rank quantizes its own slices after that (after_split,
    lora.quantize_split: a 4-bit weight cannot be cut), so the reader leaves them unquantized;
  - a pipeline stage never reads what it will drop: another stage's blocks, embedding or head
    turn meta first (skip), so that a split before the drop costs nothing;
  - whatever the rank still holds hollow is read before the data-parallel wrap (fill_rest).
So a rank holds its share of the units read before and one unit more, as read, then cut,
quantized or sharded: napkin/memory_math.load_peak_bytes. The same weights, NF4 codes, scales,
adapters and generator state as the whole-model path, bit for bit (on the CPU: on a GPU the
whole-model path draws LoRA's A from the GPU's generator, this one from the CPU's).
Left out: reading GPT-2's c_attn once: query, key and value each read it (one tensor at a time
either way).
Test: python -m pytest tests/test_streamed_load.py
"""
import torch
import torch.nn as nn

from lora import as_4_bit
from model import GPT, Block
from pretrained.load import check_all_used, gpt2_source, llama_source, locate, model_config
from pretrained.load import read_config
from pretrained.llama import Llama
from pretrained.safetensors import Checkpoint


def hollow(t: torch.Tensor) -> torch.Tensor:
    """t's shape and dtype on the CPU, its storage 0 bytes (allocated, then given back)."""
    empty = torch.empty_like(t, device="cpu")
    empty.untyped_storage().resize_(0)
    return empty


def hollow_model(directory: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model config.json describes, every tensor hollow in dtype: no memory, no random init."""
    config = read_config(directory)
    cfg = model_config(config, f"{directory}/config.json")
    with torch.device("meta"):
        model = GPT(cfg) if not hasattr(cfg, "n_kv_head") else Llama(cfg)
    model._apply(lambda t: hollow(t.to(dtype)))   # to_empty's walk, each tensor freed at once
    if cfg.tie_embeddings:                   # each module got its own tensor: tie again
        model.head.weight = model.token_emb.weight
    return model


def is_hollow(model: nn.Module) -> bool:
    """Is model hollow_model's, its weights still to be read?"""
    return any(needs_reading(p) for p in model.parameters())


def needs_reading(t: torch.Tensor) -> bool:
    """Is t hollow: shaped, no storage (not meta: skipped, never to be read)?"""
    return bool(t.numel()) and not t.is_meta and not t.untyped_storage().nbytes()


def own_modules(unit: nn.Module):
    """unit and the modules inside it, but the blocks inside it (units of their own)."""
    yield unit
    for child in unit.children():
        if not isinstance(child, Block):
            yield from own_modules(child)


class StreamedLoad:
    """Fills a hollow model's units from the directory's files (fill), and quantizes the frozen
    linears as apply_lora(quantize=...) would. lora: apply_lora's settings or None
    (parallelize.lora_config); device: where the values go (None: the CPU, where FSDP takes
    them from). Every tensor is checked against the files first (names, shapes, none left
    over), so a bad directory gets its one line before anything is read, on every rank."""

    def __init__(self, model: nn.Module, directory: str, lora: dict | None, device=None):
        self.model, self.checkpoint, self.device = model, Checkpoint(directory), device
        self.source = gpt2_source if isinstance(model, GPT) else llama_source
        self.lora = lora or {"quantize": None}
        used = {locate(self.checkpoint, self.source, name, p)[0]
                for name, p in model.named_parameters() if ".lora_" not in f".{name}"}
        check_all_used(model, self.checkpoint, used)

    @torch.no_grad()
    def fill(self, unit: nn.Module):
        """Read unit's tensors (not those of the blocks inside it: units of their own), each
        linear quantized as soon as its weight is read; its adapters moved to the device."""
        names = {module: name for name, module in self.model.named_modules()}
        for module in list(own_modules(unit)):
            name = names.get(module)
            if name is None:              # a wrapper around the model (a stage's, tp's, cp's)
                continue
            for pname, param in module.named_parameters(prefix=name, recurse=False):
                if not needs_reading(param):    # read (a tied weight), drawn (an adapter), meta
                    if self.device is not None and not param.is_meta:
                        param.data = param.data.to(self.device)
                    continue
                hf, take = locate(self.checkpoint, self.source, pname, param)
                param.data = torch.empty(param.shape, dtype=param.dtype,
                                         device=self.device).copy_(take(self.checkpoint.get(hf)))
                self.checkpoint.release(hf)       # the view of the mapped file, released
            self._quantize(name, module)

    def fill_rest(self, module: nn.Module):
        """Read what module still holds hollow: each block, then the rest."""
        for block in [m for m in module.modules() if isinstance(m, Block)]:
            self.fill(block)
        self.fill(module)

    def skip(self, modules):
        """Modules this rank will drop (another pipeline stage's): never read, made meta, so
        that a split before the drop costs nothing."""
        for module in modules:
            module._apply(lambda t: torch.empty_like(t, device="meta"))

    def _quantize(self, name: str, module: nn.Module):
        """apply_lora's 4-bit replacements, of one module: an adapted linear's W0 to NF4 (its
        adapters kept), another linear QUANTIZED names to a FrozenNF4Linear."""
        if not self.lora["quantize"]:
            return
        stored = as_4_bit(module, name, self.lora["double_quant"])
        if stored is None:
            return
        parent, _, child = name.rpartition(".")
        setattr(self.model.get_submodule(parent), child, stored)
        # Its weight goes now, unless another module holds it too (a head tied to the token
        # embedding): FSDP's wrap still lists the old tensor, the unit takes the new ones.
        if all(p is not module.weight for p in self.model.parameters()):
            module.weight.data = hollow(module.weight)


class StreamedFSDP:
    """Mixed in before FrozenBaseFSDP (composition/parallelize.fsdp_with): FSDP(module,
    load=StreamedLoad, **options), each unit's module filled just before its unit is made."""

    def __init__(self, module: nn.Module, load: StreamedLoad, **options):
        object.__setattr__(self, "load", load)      # before nn.Module's __init__: a plain one
        super().__init__(module, **options)

    def _make_unit(self, index, module, listed):
        """The unit of module, filled now: its tensors listed again as FSDP's wrap lists them
        (each module's in order, nested units' left out), for the 4-bit replacements made
        while filling it change them (listed: FSDP's list, from before)."""
        self.load.fill(module)
        tensors, seen = [], set()

        def visit(m):
            for t in self._tensors_of(m):
                if id(t) not in seen:
                    seen.add(id(t))
                    tensors.append(t)
            for child in m.children():
                if not isinstance(child, Block):
                    visit(child)
        visit(module)
        return super()._make_unit(index, module, tensors)
