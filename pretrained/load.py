"""Load a Hugging Face model directory into this project's models, and export one back to it.

A directory holds config.json (the architecture and its sizes), model.safetensors (or the
shards model.safetensors.index.json names) and tokenizer.json. GPT-2 is model.py's GPT: its
Conv1D weights are stored (in, out), nn.Linear's transpose, and its c_attn holds q, k and v
side by side. Its key bias is dropped: q . (k + b) adds q . b to every score of a row, which
softmax ignores, so model.py's attention has none (exported as zeros). The Llama family (Llama,
SmolLM2, Qwen2) is pretrained/llama.py's. The model is built empty, then filled one tensor at
a time from the mapped files: loading holds the model once and one tensor besides (--sample,
export, tests; a training run holds its share and one unit: pretrained/streamed.py).
Left out: other architectures, quantized checkpoints, dropout (a loaded model has none).
Test: python -m pytest tests/test_pretrained.py

Shapes: C channels, V vocabulary.
"""
import json
import os

import torch
import torch.nn as nn

from model import GPT, GPTConfig
from pretrained import PretrainedError
from pretrained.llama import Llama, LlamaConfig
from pretrained.safetensors import SINGLE, Checkpoint, save
from pretrained.tokenizer import Tokenizer

ARCHITECTURES = ("GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM")
# Our parameters' names, part by part, in each architecture's files (GPT-2's under
# "transformer.", its c_attn holding query, key and value).
GPT2_PARTS = {"token_emb": "wte", "pos_emb": "wpe", "blocks": "h", "norm1": "ln_1",
              "norm2": "ln_2", "norm": "ln_f", "query": "c_attn", "key": "c_attn",
              "value": "c_attn", "output": "c_proj", "up": "c_fc", "down": "c_proj",
              "head": "lm_head"}
LLAMA_PARTS = {"token_emb": "model.embed_tokens", "blocks": "model.layers", "norm": "model.norm",
               "norm1": "input_layernorm", "norm2": "post_attention_layernorm",
               "attn": "self_attn", "query": "q_proj", "key": "k_proj", "value": "v_proj",
               "output": "o_proj", "gate": "gate_proj", "up": "up_proj", "down": "down_proj",
               "head": "lm_head"}
# Tensors some files carry that are no weight: GPT-2's causal masks, old Llamas' frequencies.
NOT_WEIGHTS = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


def load_pretrained(directory: str, dtype: torch.dtype = torch.float32):
    """(model, tokenizer, config.json's dictionary) from a Hugging Face model directory."""
    config = read_config(directory)
    tokenizer_path = os.path.join(directory, "tokenizer.json")
    if not os.path.exists(tokenizer_path):
        raise PretrainedError(f"{tokenizer_path}: missing: download the model's tokenizer.json "
                              f"beside its config.json")
    tokenizer = Tokenizer.read(tokenizer_path)
    checkpoint = Checkpoint(directory)
    model = empty_model(config, os.path.join(directory, "config.json"), dtype)
    fill(model, checkpoint, gpt2_source if isinstance(model, GPT) else llama_source)
    return model, tokenizer, config


def empty_model(config: dict, path: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model config.json (at path) describes, its weights allocated but not set."""
    cfg = model_config(config, path)
    with torch.device("meta"):                   # no memory, no random init
        model = GPT(cfg) if isinstance(cfg, GPTConfig) else Llama(cfg)
    model = model.to(dtype).to_empty(device="cpu")
    if cfg.tie_embeddings:                # to_empty gave each module its own tensor: tie again
        model.head.weight = model.token_emb.weight
    return model


def read_config(directory: str) -> dict:
    path = os.path.join(directory, "config.json")
    if not os.path.isdir(directory) or not os.path.exists(path):
        raise PretrainedError(f"{path}: missing: give the directory of a Hugging Face model "
                              f"(config.json, model.safetensors, tokenizer.json)")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise PretrainedError(f"{path}: unreadable ({e}): download it again") from None
    architectures = config.get("architectures") if isinstance(config, dict) else None
    if not architectures or architectures[0] not in ARCHITECTURES:
        raise PretrainedError(f"{path}: architecture {architectures} is not one read here: use "
                              f"a model of {', '.join(ARCHITECTURES)}")
    return config


def model_config(config: dict, path: str) -> GPTConfig | LlamaConfig:
    """Our model's configuration from config.json's; one line naming a field we cannot follow."""
    try:
        if config["architectures"][0] == "GPT2LMHeadModel":
            return gpt2_config(config, path)
        return llama_config(config, path)
    except KeyError as e:
        raise PretrainedError(f"{path}: lacks {e}: download it again") from None


def _refuse(path: str, field: str, value, why: str):
    raise PretrainedError(f"{path}: {field}={value!r}: {why}: use a model whose config.json "
                          f"does without it")


def gpt2_config(c: dict, path: str) -> GPTConfig:
    approximate = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}
    activation = c.get("activation_function", "gelu_new")
    if activation not in approximate:
        _refuse(path, "activation_function", activation,
                f"the GELUs read here are {', '.join(approximate)}")
    if c.get("n_inner") not in (None, 4 * c["n_embd"]):
        _refuse(path, "n_inner", c["n_inner"], "model.py's MLP is 4 x n_embd wide")
    if c.get("layer_norm_epsilon", 1e-5) != 1e-5:
        _refuse(path, "layer_norm_epsilon", c["layer_norm_epsilon"], "model.py's is 1e-5")
    for field in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if c.get(field):
            _refuse(path, field, c[field], "model.py's attention has no such option")
    return GPTConfig(n_layer=c["n_layer"], n_head=c["n_head"], n_embd=c["n_embd"],
                     block_size=c["n_positions"], vocab_size=c["vocab_size"], dropout=0.0,
                     tie_embeddings=c.get("tie_word_embeddings", True),
                     gelu_approximate=approximate[activation])


def llama_config(c: dict, path: str) -> LlamaConfig:
    qwen2 = c["architectures"][0] == "Qwen2ForCausalLM"
    scaling = c.get("rope_scaling")
    kind = scaling and scaling.get("rope_type", scaling.get("type"))
    if kind not in (None, "default", "llama3"):
        _refuse(path, "rope_scaling", scaling, "only Llama 3's rope scaling is read here")
    if c.get("hidden_act", "silu") != "silu":
        _refuse(path, "hidden_act", c["hidden_act"], "the Llama family's MLP is SwiGLU (silu)")
    if qwen2 and c.get("use_sliding_window"):
        _refuse(path, "use_sliding_window", True, "sliding-window attention is not built here")
    return LlamaConfig(
        n_layer=c["num_hidden_layers"], n_head=c["num_attention_heads"],
        n_kv_head=c.get("num_key_value_heads") or c["num_attention_heads"],
        n_embd=c["hidden_size"], head_dim=c.get("head_dim"), hidden=c["intermediate_size"],
        vocab_size=c["vocab_size"], block_size=c.get("max_position_embeddings", 2048),
        rope_theta=c.get("rope_theta", 10000.0),
        rope_scaling=scaling if kind == "llama3" else None,
        norm_eps=c.get("rms_norm_eps", 1e-6), tie_embeddings=c.get("tie_word_embeddings", False),
        qkv_bias=qwen2 or c.get("attention_bias", False),
        output_bias=not qwen2 and c.get("attention_bias", False),
        mlp_bias=c.get("mlp_bias", False))


def hf_name(ours: str, parts: dict) -> str:
    return ".".join(parts.get(part, part) for part in ours.split("."))


def llama_source(name: str, param: torch.Tensor):
    """(the file's tensor name, its shape, how our parameter is taken from it): as it is."""
    return hf_name(name, LLAMA_PARTS), tuple(param.shape), lambda t: t


def gpt2_source(name: str, param: torch.Tensor):
    """GPT-2's tensor for our parameter: transposed from Conv1D's (in, out), and query, key and
    value each a third of c_attn's columns."""
    kind, weight = name.split(".")[-2], name.endswith("weight")
    hf = hf_name(name, GPT2_PARTS)
    if kind in ("query", "key", "value"):
        C = param.shape[-1] if weight else param.shape[0]
        i = ("query", "key", "value").index(kind)
        if weight:                                    # (C, 3C) -> our (C_out, C_in)
            return hf, (C, 3 * C), lambda t: t[:, i * C:(i + 1) * C].T
        return hf, (3 * C,), lambda t: t[i * C:(i + 1) * C]
    if weight and kind in ("output", "up", "down"):
        return hf, tuple(param.shape[::-1]), lambda t: t.T
    return hf, tuple(param.shape), lambda t: t


def fill(model: nn.Module, checkpoint: Checkpoint, source):
    """Copy each parameter from its tensor in the files, one at a time; one line for a tensor
    that is missing, has another shape, or has no place in the model."""
    used = set()
    with torch.no_grad():
        for name, param in model.named_parameters():
            value, hf = read(checkpoint, source, name, param, used)
            param.copy_(value)
            checkpoint.release(hf)
    check_all_used(model, checkpoint, used)


def read(checkpoint: Checkpoint, source, name: str, param: torch.Tensor, used: set):
    """(our parameter `name`'s value as the files hold it: a view of the mapped file, copy it
    before release; its tensor's name, added to used)."""
    hf, take = locate(checkpoint, source, name, param)
    used.add(hf)
    return take(checkpoint.get(hf)), hf


def locate(checkpoint: Checkpoint, source, name: str, param: torch.Tensor):
    """(the files' tensor our parameter `name` comes from, how to take it from that tensor);
    one line for a tensor that is missing or has another shape. Reads the header only."""
    hf, shape, take = source(name, param)
    # GPT-2's files are saved with or without the "transformer." in front
    hf = next((n for n in (hf, f"transformer.{hf}") if n in checkpoint.where), hf)
    if hf not in checkpoint.where:
        raise PretrainedError(f"{checkpoint.path}: no tensor {hf}, which the model "
                              f"config.json describes needs: download both again")
    if checkpoint.shape(hf) != shape:
        raise PretrainedError(f"{checkpoint.where[hf]}: tensor {hf} has shape "
                              f"{list(checkpoint.shape(hf))} where config.json's model "
                              f"needs {list(shape)}: download both again")
    return hf, take


def check_all_used(model: nn.Module, checkpoint: Checkpoint, used: set):
    """One line for a tensor of the files that no parameter took."""
    tied = ("lm_head.weight",) if model.cfg.tie_embeddings else ()
    extra = [n for n in checkpoint.where if n not in used and n not in tied
             and not n.endswith(NOT_WEIGHTS)]
    if extra:
        raise PretrainedError(f"{checkpoint.where[extra[0]]}: tensor {extra[0]} has no place in "
                              f"the model config.json describes: download both again")


def export_hf(model: nn.Module, tokenizer: Tokenizer, directory: str,
              config: dict | None = None):
    """Write config.json, model.safetensors and tokenizer.json; config: the loaded config.json,
    whose other fields (token ids, dtype notes) are kept beside the sizes written here."""
    os.makedirs(directory, exist_ok=True)
    cfg = model.cfg
    sizes, tensors = (gpt2_export(model) if isinstance(model, GPT) else llama_export(model))
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    config = {**(config or {}), **sizes, "torch_dtype": dtype,
              "tie_word_embeddings": cfg.tie_embeddings}
    save(os.path.join(directory, SINGLE), tensors, {"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))


def gpt2_export(gpt: GPT) -> tuple[dict, dict]:
    """GPT-2's sizes and tensors: Linear weights transposed to Conv1D's, q, k, v into c_attn."""
    cfg, tensors = gpt.cfg, {}
    for name, param in gpt.named_parameters():
        kind, hf = name.split(".")[-2], hf_name(name, GPT2_PARTS)
        if kind not in ("query", "key", "value"):
            transposed = name.endswith("weight") and kind in ("output", "up", "down")
            tensors[hf if kind == "head" else f"transformer.{hf}"] = \
                param.T if transposed else param
    for i, block in enumerate(gpt.blocks):
        q, k, v = block.attn.query, block.attn.key, block.attn.value
        prefix = f"transformer.h.{i}.attn.c_attn"
        tensors[f"{prefix}.weight"] = torch.cat([q.weight, k.weight, v.weight]).T  # (C, 3C)
        tensors[f"{prefix}.bias"] = torch.cat([q.bias, torch.zeros_like(q.bias), v.bias])
    sizes = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
             "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_embd": cfg.n_embd,
             "n_positions": cfg.block_size, "vocab_size": cfg.vocab_size, "n_inner": None,
             "activation_function": "gelu_new" if cfg.gelu_approximate == "tanh" else "gelu",
             "layer_norm_epsilon": 1e-5}
    return sizes, tensors


def llama_export(llama: Llama) -> tuple[dict, dict]:
    """The Llama family's sizes and tensors, named as in its files."""
    cfg = llama.cfg
    tensors = {hf_name(name, LLAMA_PARTS): p for name, p in llama.named_parameters()}
    qwen2 = cfg.qkv_bias and not cfg.output_bias
    sizes = {"architectures": ["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"],
             "model_type": "qwen2" if qwen2 else "llama", "num_hidden_layers": cfg.n_layer,
             "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head,
             "hidden_size": cfg.n_embd, "head_dim": cfg.D, "intermediate_size": cfg.hidden,
             "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.block_size,
             "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling,
             "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu", "mlp_bias": cfg.mlp_bias}
    if not qwen2:
        sizes["attention_bias"] = cfg.output_bias
    return sizes, tensors
