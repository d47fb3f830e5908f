"""safetensors: Hugging Face's weight file, read memory-mapped one tensor at a time, and written.

The format is three parts: 8 bytes, the header's length N (unsigned, little-endian); N bytes of
JSON, {name: {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, "__metadata__":
{str: str}}; then the tensors' raw little-endian bytes, offsets counted from the end of the
header. A large model comes in shards named by model.safetensors.index.json's "weight_map".
The file is mapped, not read: a tensor's bytes come off the disk when it is used, so a loader
holds one tensor (one layer) at a time. Left out: big-endian machines.
Test: python -m pytest tests/test_pretrained.py -k safetensors
"""
import json
import math
import mmap
import os
import struct

import torch

from pretrained import PretrainedError

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
          "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
          "U8": torch.uint8, "BOOL": torch.bool}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class SafetensorsFile:
    """One .safetensors file, mapped: names(), shape(name), dtype(name), get(name)."""

    def __init__(self, path: str):
        self.path = path
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                # Copy-on-write: torch wants a writable buffer, and nothing is ever written back.
                self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else b""
        except OSError as e:
            raise PretrainedError(f"{path}: cannot read it ({e.strerror}): check the path") \
                from None
        self.header, self.start = self._read_header(size)
        self.metadata = self.header.pop("__metadata__", None) or {}
        for name, entry in self.header.items():
            self._check(name, entry, size)

    def _bad(self, what: str) -> PretrainedError:
        return PretrainedError(f"{self.path}: {what}: the file is truncated or not safetensors; "
                               f"download it again")

    def _read_header(self, size: int) -> tuple[dict, int]:
        """The JSON header and where the tensors' bytes start."""
        if size < 8:
            raise self._bad(f"{size} bytes, fewer than the 8 of the header's length")
        (length,) = struct.unpack("<Q", self.map[:8])
        if 8 + length > size:
            raise self._bad(f"the header's length {length} runs past the end ({size} bytes)")
        try:
            header = json.loads(bytes(self.map[8:8 + length]).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self._bad(f"the header is not JSON ({e})") from None
        if not isinstance(header, dict):
            raise self._bad("the header is not a JSON object")
        return header, 8 + length

    def _check(self, name: str, entry, size: int):
        """dtype known, shape a list of sizes, offsets inside the file and as long as the shape."""
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
            raise self._bad(f"tensor {name!r} lacks dtype, shape or data_offsets")
        if entry["dtype"] not in DTYPES:
            raise PretrainedError(f"{self.path}: tensor {name!r} has dtype {entry['dtype']!r}, "
                                  f"which this reader does not know: use one of "
                                  f"{', '.join(DTYPES)}")
        shape, offsets = entry["shape"], entry["data_offsets"]
        if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)
                and isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) for o in offsets)):
            raise self._bad(f"tensor {name!r}'s shape or data_offsets are not lists of sizes")
        (begin, end), numel = offsets, math.prod(shape)
        if not 0 <= begin <= end or self.start + end > size:
            raise self._bad(f"tensor {name!r}'s bytes [{begin}, {end}) lie outside the file")
        if end - begin != numel * DTYPES[entry["dtype"]].itemsize:
            raise self._bad(f"tensor {name!r} has {end - begin} bytes for shape {entry['shape']}")

    def names(self) -> list[str]:
        return list(self.header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return DTYPES[self.header[name]["dtype"]]

    def get(self, name: str) -> torch.Tensor:
        """The tensor, a view of the mapped file (copy it to keep it past this object)."""
        entry = self.header[name]
        begin, end = (self.start + offset for offset in entry["data_offsets"])
        dtype = DTYPES[entry["dtype"]]
        if begin == end:
            return torch.empty(entry["shape"], dtype=dtype)
        raw = torch.frombuffer(self.map, dtype=torch.uint8, count=end - begin, offset=begin)
        if begin % dtype.itemsize:                   # a view as wider elements needs alignment
            raw = raw.clone()
        return raw.view(dtype).view(entry["shape"])

    def release(self, name: str):
        """Let go of the tensor's pages once it is copied (the kernel rereads them from the file
        if it is read again), so that a whole loaded model is not resident twice."""
        begin, end = (self.start + offset for offset in self.header[name]["data_offsets"])
        page = mmap.PAGESIZE
        first, last = -(-begin // page) * page, end // page * page   # whole pages inside it
        if last > first and hasattr(mmap, "MADV_DONTNEED"):
            self.map.madvise(mmap.MADV_DONTNEED, first, last - first)


class Checkpoint:
    """A directory's weights: model.safetensors, or the shards its index names, opened as read."""

    def __init__(self, directory: str):
        index, single = os.path.join(directory, INDEX), os.path.join(directory, SINGLE)
        self.path = index if os.path.exists(index) else single     # for the error lines
        self.files: dict[str, SafetensorsFile] = {}                 # opened as first read
        if os.path.exists(index):
            self.where = self._weight_map(index, directory)          # {tensor name: its file}
        elif os.path.exists(single):
            self.files[single] = SafetensorsFile(single)
            self.where = dict.fromkeys(self.files[single].names(), single)
        else:
            raise PretrainedError(f"{directory}: holds no {SINGLE} nor {INDEX}: download the "
                                  f"model's weights in safetensors form into it")

    @staticmethod
    def _weight_map(index: str, directory: str) -> dict:
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise PretrainedError(f"{index}: unreadable or without a weight_map ({e}): download "
                                  f"it again") from None
        return {name: os.path.join(directory, file) for name, file in weight_map.items()}

    def names(self) -> list[str]:
        return list(self.where)

    def file(self, name: str) -> SafetensorsFile:
        path = self.where[name]
        if path not in self.files:
            if not os.path.exists(path):
                raise PretrainedError(f"{path}: missing, though {INDEX} names it for {name!r}: "
                                      f"download every shard")
            self.files[path] = SafetensorsFile(path)
        if name not in self.files[path].header:
            raise PretrainedError(f"{path}: holds no {name!r}, though {INDEX} says it does: "
                                  f"download the shard again")
        return self.files[path]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.file(name).shape(name)

    def get(self, name: str) -> torch.Tensor:
        return self.file(name).get(name)

    def release(self, name: str):
        self.file(name).release(name)


def save(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None):
    """Write tensors to path as safetensors, one tensor's bytes at a time; the file appears whole
    (written beside it, then renamed) or not at all."""
    header, offset = {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)                  # the tensors start 8-byte aligned
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text)
            for t in tensors.values():
                f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
