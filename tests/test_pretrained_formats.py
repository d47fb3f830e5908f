"""The file formats of a Hugging Face model directory, against references written here: the
safetensors reader against a file built by hand from the format, and the byte-level BPE
tokenizer's words and ids against hand-written patterns and the textbook merge loop (with a
tokenizer.json trained here), its round trip exact on the standard library's text."""
import functools
import json
import os
import pathlib
import re
import struct
import sys
import sysconfig
import unicodedata
from collections import Counter

import pytest
import torch

from pretrained import PretrainedError
from pretrained.safetensors import DTYPES, Checkpoint, SafetensorsFile, save
from pretrained.tokenizer import Tokenizer

STDLIB = pathlib.Path(sysconfig.get_paths()["stdlib"])


# ---- safetensors ------------------------------------------------------------------------------

def hand_built(path, tensors: dict):
    """The format written out by hand: length, JSON header, bytes (torch's little-endian)."""
    header, data = {"__metadata__": {"format": "pt"}}, b""
    for name, t in tensors.items():
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        dtype = {v: k for k, v in DTYPES.items()}[t.dtype]
        header[name] = {"dtype": dtype, "shape": list(t.shape),
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    pathlib.Path(path).write_bytes(struct.pack("<Q", len(text)) + text + data)


def some_tensors():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(3, 5, generator=g), "b": torch.randn(7, generator=g).bfloat16(),
            "h": torch.randn(2, 2, 2, generator=g).half(), "i": torch.arange(-3, 4),
            "odd": torch.randn(1, generator=g).half(), "mask": torch.tensor([True, False]),
            "empty": torch.zeros(0, 4)}


def test_safetensors_reads_a_file_built_by_hand_and_writes_what_it_reads(tmp_path):
    tensors = some_tensors()
    hand_built(tmp_path / "a.safetensors", tensors)       # "odd" leaves the rest misaligned
    read = SafetensorsFile(str(tmp_path / "a.safetensors"))
    assert read.metadata == {"format": "pt"} and read.names() == list(tensors)
    for name, t in tensors.items():
        assert read.get(name).dtype == t.dtype and torch.equal(read.get(name), t), name
    save(str(tmp_path / "b.safetensors"), tensors)
    again = SafetensorsFile(str(tmp_path / "b.safetensors"))
    assert all(torch.equal(again.get(n), t) for n, t in tensors.items())
    assert again.start % 8 == 0                    # the tensors' bytes start 8-byte aligned


def test_safetensors_reads_shards_through_the_index(tmp_path):
    tensors = some_tensors()
    names = list(tensors)
    save(str(tmp_path / "model-1.safetensors"), {n: tensors[n] for n in names[:3]})
    save(str(tmp_path / "model-2.safetensors"), {n: tensors[n] for n in names[3:]})
    weight_map = {n: "model-1.safetensors" if i < 3 else "model-2.safetensors"
                  for i, n in enumerate(names)}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": weight_map}))
    checkpoint = Checkpoint(str(tmp_path))
    assert all(torch.equal(checkpoint.get(n), t) for n, t in tensors.items())
    os.remove(tmp_path / "model-2.safetensors")
    with pytest.raises(PretrainedError, match="model-2.safetensors: missing"):
        Checkpoint(str(tmp_path)).get(names[-1])


def header_edited(path, edit):
    data = pathlib.Path(path).read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    edit(header)
    text = json.dumps(header).encode()
    pathlib.Path(path).write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length:])


BAD_FILES = {
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:-4]), "outside the file"),
    "header past the end": (lambda p: p.write_bytes(struct.pack("<Q", 10**6) + b"{}"),
                            "runs past the end"),
    "shorter than its length": (lambda p: p.write_bytes(b"\x01\x02"), "fewer than the 8"),
    "offsets outside": (lambda p: header_edited(p, lambda h: h["w"].update(
        data_offsets=[10**6, 10**6 + 60])), "outside the file"),
    "unknown dtype": (lambda p: header_edited(p, lambda h: h["w"].update(dtype="F4")),
                      "dtype 'F4'"),
    "not json": (lambda p: p.write_bytes(struct.pack("<Q", 3) + b"{x}"), "not JSON"),
    "wrong length": (lambda p: header_edited(p, lambda h: h["w"].update(shape=[3, 4])),
                     "60 bytes for shape"),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_safetensors_a_bad_file_gets_one_line_naming_it(tmp_path, case):
    path = tmp_path / "model.safetensors"
    save(str(path), some_tensors())
    damage, words = BAD_FILES[case]
    damage(path)
    with pytest.raises(PretrainedError) as error:
        SafetensorsFile(str(path))
    assert str(path) in str(error.value) and words in str(error.value)
    assert "\n" not in str(error.value)


# ---- the tokenizer ---------------------------------------------------------------------------

def gpt2_byte_symbols() -> dict[int, str]:
    """GPT-2's table, written from its description: printable Latin-1 stands for itself, the
    other bytes (controls, space, 127-160, soft hyphen) take 256, 257, ... in byte order."""
    itself = set(range(33, 127)) | set(range(161, 173)) | set(range(174, 256))
    others = [b for b in range(256) if b not in itself]
    return {b: chr(b) if b in itself else chr(256 + others.index(b)) for b in range(256)}


SYMBOL = gpt2_byte_symbols()
# Hand-written Python forms of the three pre-tokenizers' patterns (tokenizer.json holds the Rust
# syntax): letters are str.isalpha's, numbers Unicode's N, white space Unicode's White_Space.
S = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"


def ranges(is_in) -> str:
    """The code points is_in accepts, as a character class's inside: runs written first-last."""
    runs, code = [], 0
    while code <= sys.maxunicode:
        if not is_in(chr(code)):
            code += 1
            continue
        first = code
        while code + 1 <= sys.maxunicode and is_in(chr(code + 1)):
            code += 1
        runs.append(re.escape(chr(first)) + ("-" + re.escape(chr(code)) if code > first else ""))
        code += 1
    return "".join(runs)


@functools.cache
def reference_pattern(style: str) -> re.Pattern:
    L = ranges(str.isalpha)
    N = ranges(lambda c: unicodedata.category(c).startswith("N"))
    other = f"[^{S}{L}{N}]"
    patterns = {
        "gpt2": rf"'s|'t|'re|'ve|'m|'ll|'d| ?[{L}]+| ?[{N}]+| ?{other}+|[{S}]+(?![^{S}])|[{S}]+",
        "llama3": rf"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n{L}{N}]?[{L}]+|[{N}]{{1,3}}|"
                  rf" ?{other}+[\r\n]*|[{S}]*[\r\n]+|[{S}]+(?![^{S}])|[{S}]+",
        "qwen2": rf"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n{L}{N}]?[{L}]+|[{N}]|"
                 rf" ?{other}+[\r\n]*|[{S}]*[\r\n]+|[{S}]+(?![^{S}])|[{S}]+"}
    return re.compile(patterns[style])


RUST_PATTERNS = {   # as Llama 3's and Qwen2's tokenizer.json write them
    "llama3": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?"
              r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
             r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
SAMPLE = ("Héllo wörld's 12345 naïve ²½ ١٢٣ 中文字 Ωmega  \t\n\n  x=1;\r\n y \u2003z "
          "I'LL don't <|endoftext|> end")


def stdlib_sample() -> str:
    """Every 40th of the standard library's top-level files (running/data.py's corpus): 120 KB."""
    paths = sorted(STDLIB.glob("*.py"))[::40]
    return "\n".join(p.read_text(encoding="utf-8") for p in paths)


def reference_words(text: str, style: str) -> list[str]:
    return reference_pattern(style).findall(text)


def merge_all(symbols: list, pair: tuple) -> list:
    out, i = [], 0
    while i < len(symbols):
        if tuple(symbols[i:i + 2]) == pair:
            out, i = out + [symbols[i] + symbols[i + 1]], i + 2
        else:
            out, i = out + [symbols[i]], i + 1
    return out


def train_merges(words: list[str], n: int) -> list[tuple[str, str]]:
    """BPE training: merge the most frequent adjacent pair n times (ties: the larger pair)."""
    counts = Counter("".join(SYMBOL[b] for b in w.encode()) for w in words)
    split, merges = {w: list(w) for w in counts}, []
    for _ in range(n):
        pairs = Counter()
        for w, c in counts.items():
            for pair in zip(split[w], split[w][1:]):
                pairs[pair] += c
        if not pairs:
            break
        best = max(pairs, key=lambda p: (pairs[p], p))
        merges.append(best)
        split = {w: merge_all(s, best) for w, s in split.items()}
    return merges


def tokenizer_spec(style: str, text: str, n_merges: int = 150, list_merges=False) -> dict:
    """A tokenizer.json as the three families write it (every field the Rust library wants),
    trained on text."""
    merges = train_merges(reference_words(text, style), n_merges)
    vocab = {SYMBOL[b]: b for b in range(256)}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": style == "gpt2"}
    pre = byte_level if style == "gpt2" else {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": RUST_PATTERNS[style]}, "behavior": "Isolated",
         "invert": False}, byte_level]}
    special = {"id": len(vocab), "content": "<|begin_of_text|>" if style == "llama3" else
               "<|endoftext|>", "single_word": False, "lstrip": False, "rstrip": False,
               "normalized": False, "special": True}
    model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
             "ignore_merges": style == "llama3", "vocab": vocab,
             "merges": [list(m) if list_merges else " ".join(m) for m in merges]}
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [special],
            "normalizer": {"type": "NFC"} if style == "qwen2" else None, "pre_tokenizer": pre,
            "post_processor": None, "decoder": {**byte_level, "use_regex": True}, "model": model}


def reference_encode(spec: dict, text: str, style: str) -> list[int]:
    """Special tokens where they appear; in each word, the textbook loop: merge the lowest-ranked
    adjacent pair (one occurrence, the leftmost), until no adjacent pair is a merge."""
    model, ids = spec["model"], []
    ranks = {tuple(m.split(" ") if isinstance(m, str) else m): r
             for r, m in enumerate(model["merges"])}
    special = spec["added_tokens"][0]
    for k, part in enumerate(text.split(special["content"])):
        ids += [special["id"]] if k else []
        for word in reference_words(unicodedata.normalize("NFC", part), style):
            symbols = [SYMBOL[b] for b in word.encode()]
            if model["ignore_merges"] and "".join(symbols) in model["vocab"]:
                symbols = ["".join(symbols)]
            while True:
                found = [(ranks[p], i) for i, p in enumerate(zip(symbols, symbols[1:]))
                         if p in ranks]
                if not found:
                    break
                _, i = min(found)
                symbols = symbols[:i] + [symbols[i] + symbols[i + 1]] + symbols[i + 2:]
            ids += [model["vocab"][s] for s in symbols]
    return ids


def test_tokenizer_splits_words_as_each_family_does():
    text = "Hello world's 12345  x\n\n"
    expected = {"gpt2": ["Hello", " world", "'s", " 12345", " ", " x", "\n\n"],
                "llama3": ["Hello", " world", "'s", " ", "123", "45", " ", " x", "\n\n"],
                "qwen2": ["Hello", " world", "'s", " ", *"12345", " ", " x", "\n\n"]}
    for style, words in expected.items():
        assert Tokenizer(tokenizer_spec(style, text, 5)).words(text) == words, style
    smollm2 = tokenizer_spec("gpt2", text, 5)        # SmolLM2's: digits alone, then GPT-2's
    smollm2["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True}, smollm2["pre_tokenizer"]]}
    assert Tokenizer(smollm2).words(text) == expected["qwen2"]
    assert SYMBOL[ord(" ")] == "Ġ" and SYMBOL[ord("\n")] == "Ċ"      # GPT-2's own table


@pytest.mark.parametrize("style", ["gpt2", "llama3", "qwen2"])
def test_tokenizer_ids_equal_a_textbook_bpe_and_the_round_trip_is_exact(style):
    text = stdlib_sample()
    spec = tokenizer_spec(style, text[:20000], list_merges=style == "qwen2")
    tokenizer, special = Tokenizer(spec), spec["added_tokens"][0]
    for sample in (text, SAMPLE.replace("<|endoftext|>", special["content"])):
        assert tokenizer.words(sample) == reference_words(sample, style)
        ids = tokenizer.encode(sample)
        assert ids == reference_encode(spec, sample, style)
        assert tokenizer.decode(ids) == sample
    assert len(ids) < len(sample.encode()) and special["id"] in ids


def test_decode_skips_ids_past_the_tokenizers_last_as_hugging_face_does():
    """A model's embedding may have rows past its tokenizer's last id (Qwen2.5's 151,936 for
    151,665 tokens), and a sample can draw one: decode skips it rather than failing."""
    spec = tokenizer_spec("gpt2", "some text here, some more text", 5)
    tokenizer = Tokenizer(spec)
    ids = tokenizer.encode("some text")
    past = 1 + max(i for i in [*spec["model"]["vocab"].values(),
                               *(t["id"] for t in spec["added_tokens"])])
    assert tokenizer.decode([ids[0], past, past + 7, *ids[1:]]) == "some text"


def test_tokenizer_refuses_what_it_cannot_read_in_one_line(tmp_path):
    spec = tokenizer_spec("gpt2", "some text here", 3)
    spec["pre_tokenizer"] = {"type": "Whitespace"}
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec))
    with pytest.raises(PretrainedError, match=f"^{path}: pre_tokenizer step") as error:
        Tokenizer.read(str(path))
    assert "\n" not in str(error.value)
