"""A byte-level BPE tokenizer (GPT-2's, Llama 3's, Qwen2's), read from a tokenizer.json.

Text becomes UTF-8 bytes, each byte one of 256 printable characters (so no text is ever out of
the vocabulary); a regular expression first splits the text into words (pre-tokenization), and
in each word the adjacent pair ranked first among the learned merges is merged, again and
again, until no pair is a merge (Sennrich et al. 2016, section 3.1; Radford et al. 2019,
section 2.2). Decoding concatenates the tokens' bytes: encode then decode gives the text back.
The pre-tokenizers' patterns use \\p{L} (a letter) and \\p{N} (a number), which Python's re
lacks: they become explicit character classes built from unicodedata, and \\s Unicode's
White_Space list (Python's \\s also matches \\x1c-\\x1f), so the words are the Rust library's.
Left out: added tokens' lstrip/rstrip/single_word, normalizers other than NFC, templates that
add BOS/EOS (encode adds no special token). Test: python -m pytest tests/test_pretrained.py
"""
import functools
import json
import re
import sys
import unicodedata

from pretrained import PretrainedError

# GPT-2's pre-tokenizer (the ByteLevel one's use_regex): contractions, letters, numbers, other
# symbols, each run with the space before it, and whitespace.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
WHITE_SPACE = "\\t\\n\\x0b\\x0c\\r \\x85\\xa0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f" \
              "\\u205f\\u3000"


def byte_symbols() -> list[str]:
    """The character standing for each byte 0..255: itself where it is printable and not a space
    (so that tokens read as text), else a character from 256 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(others)) for b in range(256)]


@functools.cache
def unicode_classes() -> dict[str, str]:
    """{"L": letters, "N": numbers} as the inside of a character class: ranges of code points."""
    ranges = {"L": [], "N": []}
    for code in range(sys.maxunicode + 1):
        kind = unicodedata.category(chr(code))[0]
        if kind in ranges:
            spans = ranges[kind]
            if spans and spans[-1][1] == code - 1:
                spans[-1][1] = code
            else:
                spans.append([code, code])
    return {kind: "".join(f"\\U{a:08x}" + (f"-\\U{b:08x}" if b > a else "") for a, b in spans)
            for kind, spans in ranges.items()}


def python_pattern(pattern: str) -> str:
    """A pattern in the Rust regex syntax tokenizer.json uses, written for Python's re: \\p{L},
    \\p{N} and \\s as explicit classes (inside a [...] class too), \\S outside one."""
    classes = {**unicode_classes(), "s": WHITE_SPACE}
    out, i, in_class = [], 0, False
    while i < len(pattern):
        token = pattern[i:i + 5] if pattern.startswith(("\\p{", "\\P{"), i) else pattern[i:i + 2]
        if token in ("\\p{L}", "\\p{N}", "\\s"):
            body = classes[token[-2] if token != "\\s" else "s"]
            out.append(body if in_class else f"[{body}]")
        elif token == "\\S" and not in_class:
            out.append(f"[^{WHITE_SPACE}]")
        elif token.startswith(("\\p", "\\P")) or token == "\\S":
            raise ValueError(f"the pattern's {token} has no Python translation here")
        elif token[0] == "\\":
            out.append(token)
        else:
            token = token[0]
            in_class = (token == "[") or (in_class and token != "]")
            out.append(token)
        i += len(token)
    return "".join(out)


class Tokenizer:
    """encode(text) -> ids and decode(ids) -> text, from tokenizer.json's dictionary (read())."""

    def __init__(self, spec: dict, path: str = "tokenizer.json"):
        self.spec, self.path = spec, path
        model = spec.get("model") or {}
        if model.get("type", "BPE") != "BPE" or model.get("continuing_subword_prefix") or \
                model.get("end_of_word_suffix") or model.get("byte_fallback"):
            self._refuse("model: not a byte-level BPE (no prefix, suffix or byte fallback)")
        self.vocab: dict[str, int] = model.get("vocab") or {}
        merges = [m.split(" ") if isinstance(m, str) else m for m in model.get("merges", [])]
        if any(len(m) != 2 for m in merges):
            self._refuse("model.merges: each merge must be two tokens, 'a b' or [a, b]")
        self.ranks = {tuple(pair): rank for rank, pair in enumerate(merges)}
        self.ignore_merges = model.get("ignore_merges", False)     # Llama 3: a known word whole
        self.symbols = byte_symbols()
        if missing := [s for s in self.symbols if s not in self.vocab]:
            self._refuse(f"model.vocab lacks byte symbols such as {missing[0]!r}")
        self.byte_of = {symbol: byte for byte, symbol in enumerate(self.symbols)}
        self.added = {t["content"]: t["id"] for t in spec.get("added_tokens") or []}
        self.added_ids = set(self.added.values())
        self.token_of = {i: t for t, i in [*self.vocab.items(), *self.added.items()]}
        longest_first = sorted(self.added, key=len, reverse=True)
        self.added_pattern = re.compile("(" + "|".join(map(re.escape, longest_first)) + ")") \
            if self.added else None
        normalizer = spec.get("normalizer")
        if normalizer not in (None, {"type": "NFC"}):
            self._refuse(f"normalizer {normalizer}: only none or NFC is read here")
        self.nfc = normalizer is not None
        self.steps = self._pre_tokenizer(spec.get("pre_tokenizer"))
        self.cache: dict[str, list[int]] = {}

    @classmethod
    def read(cls, path: str) -> "Tokenizer":
        try:
            with open(path, encoding="utf-8") as f:
                return cls(json.load(f), path)
        except (OSError, ValueError) as e:
            if isinstance(e, PretrainedError):
                raise
            raise PretrainedError(f"{path}: unreadable ({e}): download the model's "
                                  f"tokenizer.json again") from None

    def _refuse(self, what: str):
        raise PretrainedError(f"{self.path}: {what}: a GPT-2, Llama 3 or Qwen2 tokenizer.json "
                              f"is what this tokenizer reads")

    def _pre_tokenizer(self, spec) -> list:
        """The pre-tokenizer as a list of patterns, each splitting every piece further."""
        steps = spec.get("pretokenizers", []) if spec and spec["type"] == "Sequence" else [spec]
        patterns, byte_level = [], False
        for step in steps:
            kind = (step or {}).get("type")
            if kind == "ByteLevel" and not step.get("add_prefix_space", False):
                byte_level = True
                if step.get("use_regex", True):
                    patterns.append(GPT2_PATTERN)
            elif kind == "Split" and step.get("behavior") == "Isolated" and \
                    not step.get("invert") and "Regex" in step.get("pattern", {}):
                patterns.append(step["pattern"]["Regex"])
            elif kind == "Digits":
                patterns.append(r"\p{N}" if step.get("individual_digits") else r"\p{N}+")
            else:
                self._refuse(f"pre_tokenizer step {step}: not one read here (ByteLevel without a "
                             f"prefix space, Split by a regex isolated, Digits)")
        if not byte_level:
            self._refuse("pre_tokenizer: no ByteLevel step")
        try:
            return [re.compile(python_pattern(pattern)) for pattern in patterns]
        except (ValueError, re.error) as e:
            self._refuse(f"pre_tokenizer pattern: {e}")

    def words(self, text: str) -> list[str]:
        """The pre-tokenizer's pieces: each pattern's matches, and the text between them."""
        pieces = [unicodedata.normalize("NFC", text) if self.nfc else text]
        for pattern in self.steps:
            split = []
            for piece in pieces:
                end = 0
                for match in pattern.finditer(piece):
                    split += [piece[end:match.start()], match.group()]
                    end = match.end()
                split.append(piece[end:])
            pieces = [p for p in split if p]
        return pieces

    def bpe(self, word: str) -> list[int]:
        """A word's ids: its bytes' symbols, then the best-ranked merge applied everywhere it
        occurs, until none applies."""
        if word in self.cache:
            return self.cache[word]
        parts = [self.symbols[b] for b in word.encode("utf-8")]
        if self.ignore_merges and "".join(parts) in self.vocab:
            parts = ["".join(parts)]
        while len(parts) > 1:
            pair = min(zip(parts, parts[1:]), key=lambda p: self.ranks.get(p, float("inf")))
            if pair not in self.ranks:
                break
            merged, i = [], 0
            while i < len(parts):
                if tuple(parts[i:i + 2]) == pair:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        if len(self.cache) > 100_000:
            self.cache.clear()
        self.cache[word] = ids = [self.vocab[p] for p in parts]
        return ids

    def encode(self, text: str) -> list[int]:
        """Added tokens (special ones included) where their text appears, BPE between them."""
        ids = []
        for i, chunk in enumerate(self.added_pattern.split(text) if self.added else [text]):
            if i % 2:                               # split() puts the matches at odd places
                ids.append(self.added[chunk])
            else:
                for word in self.words(chunk):
                    ids += self.bpe(word)
        return ids

    def decode(self, ids) -> str:
        """The tokens' bytes as UTF-8 (a cut multi-byte character becomes U+FFFD). An id with no
        token is skipped, as Hugging Face's decoder skips it: a model's embedding may have rows
        past its tokenizer's last id (Qwen2.5: 151,936 rows for 151,665 tokens), which a sample
        can draw."""
        data = bytearray()
        for i in ids:
            token = self.token_of.get(int(i))
            if token is None:
                continue
            if int(i) in self.added_ids:
                data += token.encode("utf-8")
            else:
                data += bytes(self.byte_of[symbol] for symbol in token)
        return data.decode("utf-8", errors="replace")

    def save(self, path: str):
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.spec, f, ensure_ascii=False)
