"""Training text and batches: embedded, byte-level, and the same at any world size.

The default corpus is the Python standard library's own source (the top-level .py files,
found through sysconfig, sorted): real text on every machine with Python, no download.
Tokens are bytes (vocabulary 256), or a pretrained model's own (--init-from hf:DIR: its
byte-level BPE, pretrained/tokenizer.py). A batch is a pure function of (seed, step): the global
batch is drawn the same way whatever the world size, and rank r takes its contiguous slice,
so a run on N ranks can be compared line by line with a run on one.
pinned_copy moves a batch to the device without the host waiting.
Left out: streaming from disk, shuffling epochs (we sample windows at random).
Test: python -m pytest tests/test_data.py

Shapes: B global batch, T sequence length, N ranks, r rank; each rank gets B/N rows.
"""
import pathlib
import sysconfig

import torch


def stdlib_text() -> bytes:
    """The standard library's top-level .py files, concatenated in sorted order (~5 MB)."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    return b"\n".join(path.read_bytes() for path in sorted(root.glob("*.py")))


class TextData:
    """A byte stream split into a training part and a held-out tail for the eval loss."""

    def __init__(self, text: bytes, eval_fraction: float = 0.05, tokenizer=None):
        if tokenizer is None:
            tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8)  # (L,) one per byte
        else:      # its ids (L,); bytes that are not UTF-8 are read as U+FFFD
            ids = tokenizer.encode(text.decode("utf-8", errors="replace"))
            tokens = torch.tensor(ids, dtype=torch.int32)
        split = int(len(tokens) * (1 - eval_fraction))
        self.splits = {"train": tokens[:split], "eval": tokens[split:]}

    @classmethod
    def from_file(cls, path: str | None = None, tokenizer=None) -> "TextData":
        """--data FILE, or the embedded standard-library corpus when no file is given; tokenizer:
        a pretrained model's (pretrained.tokenizer.Tokenizer), None for bytes."""
        return cls(pathlib.Path(path).read_bytes() if path else stdlib_text(),
                   tokenizer=tokenizer)

    def check_length(self, seq_len: int):
        """A ValueError naming the fix unless both parts hold a window of seq_len + 1 tokens."""
        for split, tokens in self.splits.items():
            if len(tokens) <= seq_len:
                raise ValueError(f"the {split} text has {len(tokens)} tokens, fewer than "
                                 f"--seq-len {seq_len} + 1: use a larger --data file or a "
                                 f"shorter --seq-len")

    def batch(self, step: int, batch_size: int, seq_len: int, seed: int = 0,
              split: str = "train", rank: int = 0, world_size: int = 1):
        """This rank's slice of the global batch for `step`: inputs and next-token targets.

        Returns x, y of shape (B/N, T), int64; y is x shifted one token to the left.
        """
        self.check_length(seq_len)
        tokens = self.splits[split]
        # One generator per (seed, split, step): the global batch depends on nothing else.
        # (Not Python's hash(): it is salted per process, and every rank must agree.)
        split_id = 0 if split == "train" else 1
        generator = torch.Generator().manual_seed((2 * seed + split_id) * 1_000_000_007 + step)
        starts = torch.randint(len(tokens) - seq_len, (batch_size,), generator=generator)  # (B,)
        rows = batch_size // world_size
        mine = starts[rank * rows:(rank + 1) * rows]                                   # (B/N,)
        windows = torch.stack([tokens[s: s + seq_len + 1] for s in mine.tolist()])     # (B/N, T+1)
        windows = windows.long()
        return windows[:, :-1], windows[:, 1:]


def pinned_copy(host: torch.Tensor, device) -> torch.Tensor:
    """A host tensor onto `device` without the host waiting for the copy.

    From pageable memory a host-to-device copy blocks the host until it is done; from pinned
    (page-locked) memory it is queued on the stream behind the step's kernels and the host runs
    on (the caching host allocator keeps the pinned block until the copy is done). The source
    must also be contiguous: pin_memory keeps a view's strides, and a non_blocking copy of a
    strided source stages through a contiguous copy in pageable memory, which may wait.
    Pinned memory exists only beside a GPU: on the CPU this is the tensor itself."""
    host = host.contiguous()
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
