"""QLoRA + FSDP from a Hugging Face directory, loaded unit by unit: the talk's 70B on two GPUs.

load.load_pretrained holds the whole fp32 model on every rank before FSDP shards it, which a
70B (280 GB in fp32) never fits. Here the model is built hollow (every tensor shaped, its
storage 0 bytes), LoRA's adapters are added to it (their A drawn from the seeded generator in
apply_lora's order, as on the whole model), and FSDP's wrap (extensions/fsdp_frozen.py) makes
its units one at a time: just before a unit is made, its module is filled from the mapped
files, each frozen linear quantized to NF4 as it is read (its fp32 weight dropped then), and
the unit keeps this rank's shard only. So a rank holds the shards of the units made before,
LoRA's adapters (whole until their unit is made), and one unit: as read in fp32, then the
temporaries of the matrix being quantized, or that unit once more as stored (FrozenBytes lays
its frozen bytes out whole, as the broadcast of rank 0's unit needs them, before it cuts this
rank's shard): napkin/memory_math.load_peak_bytes. The same codes, scales, adapters and
generator state as the whole-model path, bit for bit.
Left out: tensor, context and pipeline splits (they cut the whole model), GPT-2's c_attn read
once for its three parts (each part reads it: one tensor at a time either way).
Test: python -m pytest tests/test_streamed_load.py
"""
import torch
import torch.nn as nn

from lora import QUANTIZED, LoRALinear, QLoRALinear
from model import GPT, Block
from pretrained.load import check_all_used, gpt2_source, llama_source, model_config, read
from pretrained.load import read_config
from pretrained.llama import Llama
from pretrained.safetensors import Checkpoint
from quantization import FrozenNF4Linear


def streams(args) -> bool:
    """Does this run load its hf:DIR unit by unit? LoRA (QLoRA too) under FSDP without a split."""
    return (bool(args.lora) and args.strategy in ("fsdp", "zero3")
            and args.tp == args.cp == args.pp == 1)


def hollow(t: torch.Tensor) -> torch.Tensor:
    """t's shape and dtype on the CPU, its storage 0 bytes (allocated, then given back)."""
    empty = torch.empty_like(t, device="cpu")
    empty.untyped_storage().resize_(0)
    return empty


def hollow_model(directory: str) -> nn.Module:
    """The fp32 model config.json describes, every tensor hollow: no memory, no random init."""
    config = read_config(directory)
    cfg = model_config(config, f"{directory}/config.json")
    with torch.device("meta"):
        model = GPT(cfg) if not hasattr(cfg, "n_kv_head") else Llama(cfg)
    model._apply(hollow)                     # nn.Module.to_empty's walk, each tensor freed at once
    if cfg.tie_embeddings:                   # each module got its own tensor: tie again
        model.head.weight = model.token_emb.weight
    return model


def is_hollow(model: nn.Module) -> bool:
    """Is model hollow_model's, its weights still to be read (before FSDP wraps it)?"""
    return any(p.numel() and not p.untyped_storage().nbytes() for p in model.parameters())


class StreamedLoad:
    """Fills a hollow model's modules from the directory's files, unit by unit (fill), and
    quantizes the frozen linears as apply_lora(quantize=...) would. lora: apply_lora's settings
    (parallelize.lora_config)."""

    def __init__(self, model: nn.Module, directory: str, lora: dict):
        self.model, self.checkpoint, self.used = model, Checkpoint(directory), set()
        self.source = gpt2_source if isinstance(model, GPT) else llama_source
        self.quantize, self.double_quant = lora["quantize"], lora["double_quant"]
        self.lora = lora

    @torch.no_grad()
    def fill(self, unit: nn.Module):
        """Read unit's tensors (not those of the blocks inside it: units of their own), each
        linear quantized as soon as its weight is read."""
        prefix = next(name for name, m in self.model.named_modules() if m is unit)
        blocks = [f"{name}." for name, m in unit.named_modules(prefix=prefix)
                  if m is not unit and isinstance(m, Block)]
        for name, module in list(unit.named_modules(prefix=prefix)):
            if any(f"{name}.".startswith(b) for b in blocks):
                continue
            for pname, param in module.named_parameters(prefix=name, recurse=False):
                if ".lora_" in f".{pname}" or param.untyped_storage().nbytes():
                    continue                      # an adapter (drawn), or a tied weight (read)
                value, hf = read(self.checkpoint, self.source, pname, param, self.used)
                param.data = torch.empty(param.shape, dtype=param.dtype).copy_(value)
                del value                         # the view of the mapped file, released next
                self.checkpoint.release(hf)
            self._quantize(name, module)

    def _quantize(self, name: str, module: nn.Module):
        """apply_lora's 4-bit replacements, of one module: an adapted linear's W0 to NF4 (its
        adapters kept), another linear QUANTIZED names to a FrozenNF4Linear."""
        last = name.rsplit(".", 1)[-1]
        if not self.quantize or not (isinstance(module, LoRALinear)
                                     or isinstance(module, nn.Linear) and last in QUANTIZED):
            return
        if isinstance(module, LoRALinear):
            with torch.random.fork_rng(devices=[]):     # its A is drawn already: keep that one
                stored = QLoRALinear(module, self.lora["rank"], self.lora["alpha"],
                                     self.lora["dropout"], self.double_quant)
            stored.lora_A, stored.lora_B = module.lora_A, module.lora_B
        else:
            stored = FrozenNF4Linear(module, self.double_quant)
        parent, _, child = name.rpartition(".")
        setattr(self.model.get_submodule(parent), child, stored)
        # Its fp32 weight goes now, unless another module holds it too (a head tied to the token
        # embedding): FSDP's wrap still lists the old tensor, the unit takes the new ones.
        if all(p is not module.weight for p in self.model.parameters()):
            module.weight.data = hollow(module.weight)

    def finish(self):
        """One line for a tensor of the files that no parameter took."""
        check_all_used(self.model, self.checkpoint, self.used)


class StreamedFSDP:
    """Mixed in before FrozenBaseFSDP (composition/parallelize.fsdp_with): FSDP(module,
    load=StreamedLoad, **options), each unit's module filled just before its unit is made."""

    def __init__(self, module: nn.Module, load: StreamedLoad, **options):
        object.__setattr__(self, "load", load)      # before nn.Module's __init__: a plain one
        super().__init__(module, **options)
        load.finish()

    def _make_unit(self, index, module, tensors):
        """The unit of module, filled now: its tensors as FSDP's wrap lists them (each module's
        in order, nested units' left out), those the 4-bit replacements made included."""
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
