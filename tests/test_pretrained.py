"""Hugging Face model directories written here (GPT-2, Llama 3, SmolLM2, Qwen2 shapes and names;
random weights; no download, no transformers): logits against forwards written from the Hugging
Face names with plain loops, export then load, sharded and bf16 files, and one line for each
bad directory. The file formats' own tests: tests/test_pretrained_formats.py."""
import functools
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from pretrained import PretrainedError
from pretrained.load import export_hf, load_pretrained
from pretrained.safetensors import SafetensorsFile, save
from test_pretrained_formats import stdlib_sample, tokenizer_spec

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Small directories in each family's shapes and tensor names: random weights, a trained tokenizer.


def write_directory(path, config: dict, tensors: dict, spec: dict, shards: int = 1):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer.json").write_text(json.dumps(spec))
    if shards == 1:
        save(str(path / "model.safetensors"), tensors)
        return
    names, weight_map = list(tensors), {}
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        mine = names[k::shards]
        save(str(path / file), {n: tensors[n] for n in mine})
        weight_map |= dict.fromkeys(mine, file)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def random_tensors(shapes: dict, seed: int) -> dict:
    """Norm weights near 1, biases near 0, matrices N(0, 1 / their smaller side): activations,
    attention scores and logits of order 1 (0.02 would leave the attention uniform)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        noise = torch.randn(shape, generator=g)
        if len(shape) == 2:
            tensors[name] = noise / math.sqrt(min(shape))
        else:
            norm = ("ln_" in name or "norm" in name) and name.endswith("weight")
            tensors[name] = (1.0 if norm else 0.0) + 0.1 * noise
    return tensors


def gpt2_files(V: int, prefix: str = "transformer.", n_layer=2, C=32, H=4, P=24):
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": n_layer,
              "n_head": H, "n_embd": C, "n_positions": P, "vocab_size": V, "n_inner": None,
              "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
              "bos_token_id": V - 1, "eos_token_id": V - 1}
    shapes = {"wte.weight": (V, C), "wpe.weight": (P, C), "ln_f.weight": (C,), "ln_f.bias": (C,)}
    for i in range(n_layer):
        shapes |= {f"h.{i}.{name}": shape for name, shape in {
            "ln_1.weight": (C,), "ln_1.bias": (C,), "attn.c_attn.weight": (C, 3 * C),
            "attn.c_attn.bias": (3 * C,), "attn.c_proj.weight": (C, C), "attn.c_proj.bias": (C,),
            "ln_2.weight": (C,), "ln_2.bias": (C,), "mlp.c_fc.weight": (C, 4 * C),
            "mlp.c_fc.bias": (4 * C,), "mlp.c_proj.weight": (4 * C, C),
            "mlp.c_proj.bias": (C,)}.items()}
    tensors = {prefix + name: t for name, t in random_tensors(shapes, 1).items()}
    for i in range(n_layer):                  # old files keep the causal mask, a buffer
        tensors[f"{prefix}h.{i}.attn.bias"] = torch.ones(1, 1, P, P).tril()
    return config, tensors


def llama_files(V: int, family: str):
    """Llama 3 (grouped-query, rope scaled, untied), SmolLM2 (tied, plain rope, MHA), Qwen2
    (q, k, v biases, tied, theta 1e6)."""
    C, H, G, F, L = {"llama3": (64, 4, 2, 80, 2), "smollm2": (32, 4, 4, 48, 2),
                     "qwen2": (48, 6, 2, 64, 2)}[family]
    config = {"architectures": ["Qwen2ForCausalLM" if family == "qwen2" else "LlamaForCausalLM"],
              "model_type": "qwen2" if family == "qwen2" else "llama", "hidden_size": C,
              "intermediate_size": F, "num_hidden_layers": L, "num_attention_heads": H,
              "num_key_value_heads": G, "vocab_size": V, "max_position_embeddings": 64,
              "rms_norm_eps": 1e-5 if family == "llama3" else 1e-6, "hidden_act": "silu",
              "rope_theta": {"llama3": 10000.0, "smollm2": 10000.0, "qwen2": 1e6}[family],
              "tie_word_embeddings": family != "llama3", "attention_bias": False}
    if family == "llama3":   # D = 16: wavelengths 6.3 (kept), 19.9 (blended), 63 and up (slowed)
        config["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    D = C // H
    shapes = {"model.embed_tokens.weight": (V, C), "model.norm.weight": (C,)}
    if family == "llama3":
        shapes["lm_head.weight"] = (V, C)
    for i in range(L):
        layer = f"model.layers.{i}."
        shapes |= {layer + "input_layernorm.weight": (C,),
                   layer + "post_attention_layernorm.weight": (C,),
                   layer + "self_attn.q_proj.weight": (H * D, C),
                   layer + "self_attn.k_proj.weight": (G * D, C),
                   layer + "self_attn.v_proj.weight": (G * D, C),
                   layer + "self_attn.o_proj.weight": (C, H * D),
                   layer + "mlp.gate_proj.weight": (F, C), layer + "mlp.up_proj.weight": (F, C),
                   layer + "mlp.down_proj.weight": (C, F)}
        if family == "qwen2":
            shapes |= {layer + f"self_attn.{p}_proj.bias": (n * D,)
                       for p, n in (("q", H), ("k", G), ("v", G))}
    return config, random_tensors(shapes, 2)


FAMILIES = ["gpt2", "gpt2-bare", "llama3", "smollm2", "qwen2"]


@functools.cache
def small_spec(style: str) -> dict:
    return tokenizer_spec(style, stdlib_sample()[:8000], 60)


def family_directory(path, family: str, shards: int = 1):
    """(config, tensors, tokenizer spec) written to path in the family's form."""
    spec = small_spec({"gpt2-bare": "gpt2", "smollm2": "gpt2"}.get(family, family))
    V = len(spec["model"]["vocab"]) + 1
    if family.startswith("gpt2"):
        config, tensors = gpt2_files(V, "" if family == "gpt2-bare" else "transformer.")
    else:
        config, tensors = llama_files(V, family)
    write_directory(path, config, tensors, spec, shards)
    return config, tensors, spec


def layer_norm(x, weight, bias, eps=1e-5):                      # x: (C,)
    mean = sum(x) / len(x)
    variance = sum((x - mean) ** 2) / len(x)
    return (x - mean) / math.sqrt(variance + eps) * weight + bias


def attend(q, k, v, D):       # lists over positions of (D,): causal softmax(q k / sqrt(D)) v
    out = []
    for t in range(len(q)):
        scores = [float(q[t] @ k[s]) / math.sqrt(D) for s in range(t + 1)]
        top = max(scores)
        weights = [math.exp(s - top) for s in scores]
        out.append(sum(w * v[s] for s, w in enumerate(weights)) / sum(weights))
    return out


def gpt2_reference(config: dict, tensors: dict, ids: list) -> torch.Tensor:
    """GPT2LMHeadModel's forward from its names, one position and one head at a time, fp64."""
    prefix = "transformer." if "transformer.wte.weight" in tensors else ""
    W = {name.removeprefix(prefix): t.double() for name, t in tensors.items()}
    C, H = config["n_embd"], config["n_head"]
    D = C // H
    x = [W["wte.weight"][i] + W["wpe.weight"][p] for p, i in enumerate(ids)]
    for layer in range(config["n_layer"]):
        w = {name.split(".", 2)[2]: t for name, t in W.items() if name.startswith(f"h.{layer}.")}
        qkv = [layer_norm(v, w["ln_1.weight"], w["ln_1.bias"]) @ w["attn.c_attn.weight"]
               + w["attn.c_attn.bias"] for v in x]                 # Conv1D: x @ W (in, out)
        heads = [attend([r[h * D:(h + 1) * D] for r in qkv],
                        [r[C + h * D:C + (h + 1) * D] for r in qkv],
                        [r[2 * C + h * D:2 * C + (h + 1) * D] for r in qkv], D)
                 for h in range(H)]
        for t in range(len(x)):
            y = torch.cat([heads[h][t] for h in range(H)])
            x[t] = x[t] + y @ w["attn.c_proj.weight"] + w["attn.c_proj.bias"]
            z = layer_norm(x[t], w["ln_2.weight"], w["ln_2.bias"]) @ w["mlp.c_fc.weight"] \
                + w["mlp.c_fc.bias"]
            gelu_new = 0.5 * z * (1 + torch.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3)))
            x[t] = x[t] + gelu_new @ w["mlp.c_proj.weight"] + w["mlp.c_proj.bias"]
    return torch.stack([layer_norm(v, W["ln_f.weight"], W["ln_f.bias"]) @ W["wte.weight"].T
                        for v in x])


def rope_inverse_frequencies(config: dict, D: int) -> list[float]:
    """theta^(-2i/D), and Llama 3's scaling as its paper states it, band by band."""
    theta, scaling = config["rope_theta"], config.get("rope_scaling")
    frequencies = [theta ** (-2 * i / D) for i in range(D // 2)]
    if not scaling:
        return frequencies
    old = scaling["original_max_position_embeddings"]
    low, high, factor = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["factor"]
    scaled = []
    for f in frequencies:
        wavelength = 2 * math.pi / f
        if wavelength < old / high:
            scaled.append(f)
        elif wavelength > old / low:
            scaled.append(f / factor)
        else:
            smooth = (old / wavelength - low) / (high - low)
            scaled.append((1 - smooth) * f / factor + smooth * f)
    return scaled


def llama_reference(config: dict, tensors: dict, ids: list) -> torch.Tensor:
    """LlamaForCausalLM's (and Qwen2's) forward from its names, a position, head and channel
    pair at a time, fp64."""
    W = {name: t.double() for name, t in tensors.items()}
    C, H, G = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    D, eps = C // H, config["rms_norm_eps"]
    frequencies = rope_inverse_frequencies(config, D)

    def rms_norm(x, weight):
        return x / math.sqrt(float(sum(x * x)) / len(x) + eps) * weight

    def rotate(x, p):                     # (D,): pairs (i, i + D/2) turned by p * frequency i
        out = x.clone()
        for i, f in enumerate(frequencies):
            c, s = math.cos(p * f), math.sin(p * f)
            out[i], out[i + D // 2] = x[i] * c - x[i + D // 2] * s, x[i + D // 2] * c + x[i] * s
        return out

    x = [W["model.embed_tokens.weight"][i] for i in ids]
    for layer in range(config["num_hidden_layers"]):
        w = {name.split(".", 3)[3]: t for name, t in W.items()
             if name.startswith(f"model.layers.{layer}.")}
        a = [rms_norm(v, w["input_layernorm.weight"]) for v in x]
        proj = {p: [v @ w[f"self_attn.{p}_proj.weight"].T
                    + w.get(f"self_attn.{p}_proj.bias", torch.zeros(1, dtype=torch.float64))
                    for v in a] for p in "qkv"}
        heads = []
        for h in range(H):
            g = h // (H // G)                     # the key/value head this query head shares
            q = [rotate(r[h * D:(h + 1) * D], p) for p, r in enumerate(proj["q"])]
            k = [rotate(r[g * D:(g + 1) * D], p) for p, r in enumerate(proj["k"])]
            heads.append(attend(q, k, [r[g * D:(g + 1) * D] for r in proj["v"]], D))
        for t in range(len(x)):
            y = torch.cat([heads[h][t] for h in range(H)])
            x[t] = x[t] + y @ w["self_attn.o_proj.weight"].T
            m = rms_norm(x[t], w["post_attention_layernorm.weight"])
            gate, up = m @ w["mlp.gate_proj.weight"].T, m @ w["mlp.up_proj.weight"].T
            x[t] = x[t] + (gate / (1 + torch.exp(-gate)) * up) @ w["mlp.down_proj.weight"].T
    head = W.get("lm_head.weight", W["model.embed_tokens.weight"])
    return torch.stack([rms_norm(v, W["model.norm.weight"]) @ head.T for v in x])


def reference_logits(family, config, tensors, ids):
    return (gpt2_reference if family.startswith("gpt2") else llama_reference)(config, tensors, ids)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_a_forward_written_from_the_hugging_face_names(tmp_path, family):
    config, tensors, _ = family_directory(tmp_path, family)
    model, tokenizer, loaded = load_pretrained(str(tmp_path))
    assert loaded == config
    ids = tokenizer.encode("def f(x):\n    return x + 1  # 12345")[:20]
    assert len(ids) >= 12
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0]                     # (T, V), fp32
    expected = reference_logits(family, config, tensors, ids)      # fp64
    difference = (logits.double() - expected).abs().max().item()
    # fp32's rounding through two narrow blocks, against fp64: well under 1e-5
    assert difference < 1e-5, f"{family}: logits differ by {difference:.3g}"
    assert model.num_parameters() == sum(t.numel() for n, t in tensors.items()
                                         if not n.endswith(".attn.bias")) \
        - (config["n_layer"] * config["n_embd"] if family.startswith("gpt2") else 0)  # key bias


@pytest.mark.parametrize("family", FAMILIES)
def test_export_then_load_gives_identical_logits(tmp_path, family):
    config, tensors, spec = family_directory(tmp_path / "hf", family)
    model, tokenizer, loaded = load_pretrained(str(tmp_path / "hf"))
    export_hf(model, tokenizer, str(tmp_path / "out"), loaded)
    again, tokenizer_again, config_again = load_pretrained(str(tmp_path / "out"))
    ids = torch.tensor([tokenizer.encode("import os\nprint(os.sep * 3)")])
    with torch.no_grad():
        assert torch.equal(model(ids), again(ids))
    assert torch.equal(model.generate(ids, 4, temperature=0), again.generate(ids, 4, 0))
    assert json.loads((tmp_path / "out" / "tokenizer.json").read_text()) == spec
    assert config_again["bos_token_id" if family.startswith("gpt2") else "vocab_size"] == \
        config["bos_token_id" if family.startswith("gpt2") else "vocab_size"]
    written = set(SafetensorsFile(str(tmp_path / "out" / "model.safetensors")).names())
    prefix = "transformer." if family == "gpt2-bare" else ""      # written as GPT2LMHeadModel's
    assert written == {prefix + n for n in tensors if not n.endswith(".attn.bias")}


def test_a_sharded_bf16_checkpoint_loads_as_its_values_in_one_fp32_file(tmp_path):
    config, tensors, spec = family_directory(tmp_path / "fp32", "llama3")
    rounded = {name: t.bfloat16() for name, t in tensors.items()}
    write_directory(tmp_path / "fp32", config, {n: t.float() for n, t in rounded.items()}, spec)
    write_directory(tmp_path / "bf16", config, rounded, spec, shards=3)
    one, _, _ = load_pretrained(str(tmp_path / "fp32"))
    sharded, _, _ = load_pretrained(str(tmp_path / "bf16"))
    in_bf16, _, _ = load_pretrained(str(tmp_path / "bf16"), dtype=torch.bfloat16)
    ids = torch.arange(10)[None]
    with torch.no_grad():
        assert torch.equal(one(ids), sharded(ids))
    assert in_bf16.head.weight.dtype == torch.bfloat16
    assert torch.equal(in_bf16.blocks[1].mlp.down.weight,
                       rounded["model.layers.1.mlp.down_proj.weight"])


def truncate(path, n_bytes: int):
    path.write_bytes(path.read_bytes()[:-n_bytes])


def edit_json(path, edit):
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def without_tensor(directory, name, replace=None):
    file = SafetensorsFile(str(directory / "model.safetensors"))
    tensors = {n: file.get(n).clone() for n in file.names() if n != name}
    save(str(directory / "model.safetensors"), {**tensors, **(replace or {})})


LAYER = "model.layers.1."
BAD_DIRECTORIES = {   # the damage, the file the line names, words it says
    "no config.json": (lambda d: os.remove(d / "config.json"), "config.json", "missing"),
    "an unknown architecture": (lambda d: edit_json(d / "config.json", lambda c: c.update(
        architectures=["BertForMaskedLM"])), "config.json", "'BertForMaskedLM'] is not one"),
    "a config without a size": (lambda d: edit_json(d / "config.json", lambda c: c.pop(
        "num_hidden_layers")), "config.json", "lacks 'num_hidden_layers'"),
    "a rope this code lacks": (lambda d: edit_json(d / "config.json", lambda c: c.update(
        rope_scaling={"rope_type": "yarn", "factor": 4.0})), "config.json", "rope_scaling="),
    "no weights": (lambda d: os.remove(d / "model.safetensors"), "", "holds no model.safetensors"),
    "a missing tensor": (lambda d: without_tensor(d, LAYER + "mlp.down_proj.weight"),
                         "model.safetensors", f"no tensor {LAYER}mlp.down_proj.weight"),
    "a wrong shape": (lambda d: without_tensor(d, LAYER + "mlp.up_proj.weight", {
        LAYER + "mlp.up_proj.weight": torch.zeros(3, 64)}), "model.safetensors", "[3, 64] where"),
    "a tensor with no place": (lambda d: without_tensor(d, "", {"model.extra.weight":
                               torch.zeros(2)}), "model.safetensors", "model.extra.weight has no"),
    "a truncated file": (lambda d: truncate(d / "model.safetensors", 100), "model.safetensors",
                         "outside the file"),
    "no tokenizer.json": (lambda d: os.remove(d / "tokenizer.json"), "tokenizer.json", "missing"),
    "a tokenizer.json cut short": (lambda d: truncate(d / "tokenizer.json", 100), "tokenizer.json",
                                   "unreadable"),
}


@pytest.mark.parametrize("case", BAD_DIRECTORIES)
def test_a_bad_directory_gets_one_line_naming_the_file_and_the_fix(tmp_path, case):
    family_directory(tmp_path, "llama3")
    damage, file, words = BAD_DIRECTORIES[case]
    damage(tmp_path)
    with pytest.raises(PretrainedError) as error:
        load_pretrained(str(tmp_path))
    line = str(error.value)
    assert line.startswith(str(tmp_path / file)) and words in line, line
    assert "\n" not in line and any(fix in line for fix in ("download", "use ", "give ")), line


PEAK = """
import sys
from pretrained.load import load_pretrained
def status(field):           # bytes; VmHWM: the peak (getrusage's may be the parent's at fork)
    line = next(l for l in open("/proc/self/status") if l.startswith(field + ":"))
    return int(line.split()[1]) * 1024
load_pretrained(sys.argv[2])          # torch's first operations map in tens of MB of code
before = status("VmRSS")
model, _, _ = load_pretrained(sys.argv[1])
peak = status("VmHWM")
print(max(0, peak - before), sum(p.numel() * p.element_size() for p in model.parameters()))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads Linux's /proc")
def test_loading_holds_the_model_once_and_not_the_file_beside_it(tmp_path):
    """The file is mapped and each tensor's pages let go once copied: the load's peak is the
    model plus about one tensor, where reading the file (or keeping its pages) would be twice."""
    C, F, L = 512, 1536, 4                                       # 14M parameters, 57 MB
    shapes = {"model.embed_tokens.weight": (256, C), "model.norm.weight": (C,)}
    for i in range(L):
        layer = f"model.layers.{i}."
        shapes |= {layer + "input_layernorm.weight": (C,), **{
            layer + f"self_attn.{p}_proj.weight": (C, C) for p in "qkvo"},
            layer + "post_attention_layernorm.weight": (C,), **{
            layer + f"mlp.{p}_proj.weight": (F, C) if p != "down" else (C, F)
            for p in ("gate", "up", "down")}}
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": C, "intermediate_size": F,
              "num_hidden_layers": L, "num_attention_heads": 8, "vocab_size": 256,
              "tie_word_embeddings": True}
    tensors = {name: torch.zeros(shape) + 1 for name, shape in shapes.items()}
    write_directory(tmp_path / "large", config, tensors, small_spec("gpt2"))
    family_directory(tmp_path / "small", "smollm2")
    result = subprocess.run([sys.executable, "-c", PEAK, *(str(tmp_path / d) for d in
                            ("large", "small"))], capture_output=True, text=True, cwd=ROOT,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    grew, model_bytes = map(int, result.stdout.split())
    largest = max(t.numel() * 4 for t in tensors.values())
    # the model, one tensor, and 8 MB for the allocator's and Python's own
    assert grew < model_bytes + largest + 8 * 2**20, (grew / 2**20, model_bytes / 2**20)
