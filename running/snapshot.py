"""running/snapshot.py: a training run's checkpoints: saved atomically, resumed bit for bit, resharded.

Hours of GPU time must survive a crash. A checkpoint holds what an exact continuation needs:
the fp32 weights and optimizer state, the loss scale, the step (which fixes the learning rate
and the data position: batches are a function of the step), every rank's RNG state and the
configuration. Sharded strategies save each rank's shard with the map of which elements of
which parameter it holds (running/pieces.py), so the same files load on any world size and under any
strategy: every rank takes the elements it now owns; tensor parallelism's split matrices are
saved gathered whole, so they load at any --tp. Here: the run directory, and what train.py
saves, resumes and exports; load_weights reads any of them on one process. (PyTorch's elastic
training calls these snapshots; activation checkpointing, recomputing in backward, is
checkpointing.py.)
Left out: asynchronous saving, object stores, fsync of the directory entries.
Test: python -m pytest tests/test_snapshot.py tests/test_writes.py

Layout:  OUT/ckpt-0000100/{meta.json, rank00000.pt, ...}   written as ckpt-0000100.tmp first
         OUT/lock                     the run writing OUT: host, pid, start time
         OUT/abandoned-TIME/ckpt-...  a branch left behind by --resume of another checkpoint
"""
import contextlib
import dataclasses
import errno
import functools
import hashlib
import io
import json
import math
import os
import re
import shutil
import socket
import tempfile
import time
import zipfile
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

import lora
from composition.parallelize import weights_dtype
from foundations.comm import Comm
from model import GPT, GPTConfig
from moe import feed_forward
from pretrained.llama import Llama, LlamaConfig
from pretrained import PretrainedError
from pretrained.load import empty_model, export_hf, load_pretrained, read_config
from pretrained.load import model_config as model_config_of
from pretrained.streamed import hollow_model
from pretrained.tokenizer import Tokenizer
from foundations.placements import place, placement
from running.pieces import (CheckpointError, Pieces, TensorParallelReader, all_finite, frozen_pieces,
                    gather_pieces, join_shards, load_pieces, optimizer_pieces, whole_piece)
from foundations.process_groups import gather_objects
from running.errors import RunError

CHECKPOINT = re.compile(r"ckpt-(\d{7})$")


# ---- the run directory ----------------------------------------------------------------------

def checkpoints(out_dir: str) -> list[str]:
    """The complete checkpoints in out_dir, oldest first: a .tmp directory (a save that crashed)
    never counts."""
    if not os.path.isdir(out_dir):
        return []
    return [os.path.join(out_dir, entry) for entry in sorted(os.listdir(out_dir))
            if CHECKPOINT.match(entry) and os.path.exists(os.path.join(out_dir, entry, "meta.json"))]


def latest(out_dir: str) -> str | None:
    """The newest complete checkpoint in out_dir, or None."""
    saved = checkpoints(out_dir)
    return saved[-1] if saved else None


def losses(out_dir: str) -> list[tuple[str, float | None]]:
    """(checkpoint, the loss of the step it was saved after; None: none saved, or a damaged
    meta.json), oldest first: where to go back to when a run diverged."""
    out = []
    for path in checkpoints(out_dir):
        try:
            out.append((path, read_meta(path).get("loss")))     # a finite number, or None
        except CheckpointError:
            out.append((path, None))
    return out


def clear(out_dir: str):
    """Delete every checkpoint in out_dir, complete or not (train.py --overwrite). Rank 0 only."""
    for entry in os.listdir(out_dir) if os.path.isdir(out_dir) else []:
        if CHECKPOINT.match(entry.split(".")[0]):                 # .tmp, .replaced.tmp too
            shutil.rmtree(os.path.join(out_dir, entry))


def set_aside_other_lines(out_dir: str, resumed: str, step: int) -> str | None:
    """Move the checkpoints in out_dir that are not on the line of the run resumed from `resumed`
    (a checkpoint of `step`) into OUT/abandoned-TIME/: --resume picks the newest in out_dir and
    --keep prunes the oldest, so another line's would be taken for this run's, or deleted. On
    the line: out_dir's own checkpoints up to `step`, when `resumed` is one of them (out_dir then
    holds one line, as every resume leaves it). Resumed from anywhere else (another run's
    directory, an abandoned branch), none of out_dir's is: they go aside whatever their steps.
    A .tmp stays: a save that crashed, which the next save of that step replaces. Rank 0.
    Returns the log's line naming what moved where, or None."""
    own = os.path.dirname(os.path.realpath(resumed)) == os.path.realpath(out_dir)
    others = [entry for entry in sorted(os.listdir(out_dir)) if CHECKPOINT.match(entry)
              and not (own and int(CHECKPOINT.match(entry).group(1)) <= step)]
    if not others:
        return None
    aside = _new_directory(os.path.join(out_dir, "abandoned-" + time.strftime("%Y%m%d-%H%M%S")))
    for entry in others:
        os.rename(os.path.join(out_dir, entry), os.path.join(aside, entry))
    moved = f"({', '.join(others)}) are moved to {aside}; --resume and --keep see this run's only"
    if own:
        return (f"resumed from step {step}: this run is a new branch, so the checkpoints the old "
                f"one saved after it {moved}")
    return (f"resumed from {resumed}, not one of {out_dir}'s own checkpoints: this run is a new "
            f"branch, so the checkpoints {out_dir} held, another run's or branch's, {moved}")


def _new_directory(path: str) -> str:
    """A directory made now at path, or at path-2, path-3, ... where one exists: two set-asides
    in one second never mix their checkpoints (or move one onto another of the same step)."""
    candidate, n = path, 1
    while True:
        try:
            os.mkdir(candidate)
            return candidate
        except FileExistsError:
            n += 1
            candidate = f"{path}-{n}"


def unwritable_file(flag: str, path: str, example: str) -> str | None:
    """Why the file `flag` names cannot be written where it says, checked before any work (a
    program writes it after its runs), or None: a directory given as the file (example: a file
    name to suggest in it), a directory that does not exist, one this process cannot write."""
    directory = os.path.dirname(path) or "."
    if path.endswith(os.sep) or os.path.isdir(path):
        return f"{flag} {path} is a directory: name a file in it, e.g. {flag} {os.path.join(path, example)}"
    if not os.path.isdir(directory):
        return (f"{flag} {path}: there is no directory {directory}: create it, or name a file in a "
                f"directory that exists")
    try:                 # by writing, not by os.access: root passes that even on a read-only mount
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        return f"{flag} {path}: cannot write in {directory} ({e.strerror}): choose a directory you can write to"
    return None


def write_whole(path: str, data, replace: bool = True):
    """path holds data whole, or is left as it was: data is written beside it first (fsynced),
    then renamed over it (replace), or hard-linked to it (not replace: a link, unlike a rename,
    fails where path exists, FileExistsError). A write that fails, a full disk's halfway,
    removes its partial file and raises its OSError, naming path."""
    tmp = f"{path}.{socket.gethostname()}-{os.getpid()}.tmp"      # no other writer's, even on NFS
    try:
        write_file(tmp, data)
        (os.replace if replace else os.link)(tmp, path)
    except OSError as e:          # a failed write() names no file: this one names path (EEXIST:
        raise OSError(e.errno, e.strerror, path) from None       # still a FileExistsError)
    finally:
        with contextlib.suppress(FileNotFoundError):        # renamed, or never created
            os.remove(tmp)


# ---- the run directory's owner ----------------------------------------------------------------
# Two runs writing one --out replace each other's checkpoints and interleave one log. The run
# writing OUT holds OUT/lock, and removes it when it ends. The lock appears whole, with its
# owner in it (write_whole's link: of two runs, the second's link fails), so a run that finds
# one always finds whom it belongs to. A run killed outright leaves it behind: stale once its
# process is gone, which only its own host can see.

LOCK = "lock"


def lock(out_dir: str) -> str:
    """Make this process out_dir's owner (rank 0, before any work): "" or a line for the log
    when it takes over a stale lock. Another run's live lock: RunError naming it and the fix.

    A stale lock is taken over, not refused: torchrun --max-restarts restarts a killed job on
    the same --out, and its lock holds the pid of a worker that is gone.
    """
    path, note = os.path.join(out_dir, LOCK), ""
    for _ in range(3):       # each pass takes the lock, or finds it held (a stale one is removed)
        owner = {"host": socket.gethostname(), "pid": os.getpid(),
                 "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        try:
            write_whole(path, json.dumps(owner).encode(), replace=False)
            return note
        except FileExistsError:
            held = _read(path)
            if held is not None:                     # None: released since the link found it
                note = _stale_lock(out_dir, path, held)
                _remove_if_unchanged(path, held)
    raise RunError(f"--out {out_dir}: other runs keep taking and releasing {path}: run one at a time")


def unlock(out_dir: str):
    """Remove out_dir's lock if this process holds it (a run that took over holds it now)."""
    path = os.path.join(out_dir, LOCK)
    holder = _holder(_read(path))
    if holder and (holder["host"], holder["pid"]) == (socket.gethostname(), os.getpid()):
        os.remove(path)


def _stale_lock(out_dir: str, path: str, held: str) -> str:
    """The log's line for a lock whose process is gone; RunError if it may still be running."""
    holder = _holder(held)
    if holder is None:          # a lock appears whole (lock): this one was damaged since
        raise RunError(f"--out {out_dir}: {path} exists but names no run (a damaged file): if no "
                       f"run uses {out_dir}, delete {path}")
    who = f"pid {holder['pid']} on {holder['host']}, started {holder.get('started', '?')}"
    if holder["host"] != socket.gethostname():
        raise RunError(f"--out {out_dir} is in use by another run ({who}; {path}); a pid on "
                       f"another host cannot be checked from {socket.gethostname()}: if that run "
                       f"has ended, delete {path}, or give another --out")
    if _alive(holder["pid"]):
        raise RunError(f"--out {out_dir} is in use by another run ({who}; {path}): wait for it "
                       f"to end, or give another --out")
    return (f"--out {out_dir}: took over {path} from a run that is no longer running ({who}: "
            f"killed, or crashed before it could remove it)")


def _remove_if_unchanged(path: str, held: str):
    """Remove a stale lock, unless another run took it over between our read and now."""
    aside = f"{path}.stale-{os.getpid()}"
    try:
        os.rename(path, aside)                # atomic: of two runs taking over, one moves it
    except FileNotFoundError:
        return
    if _read(aside) == held:
        os.remove(aside)
    else:                                     # a live run's new lock: put it back
        os.rename(aside, path)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return None


def _holder(text: str | None) -> dict | None:
    try:
        holder = json.loads(text)
        pid = holder.get("pid")
        return holder if isinstance(pid, int) and pid > 0 and "host" in holder else None
    except (TypeError, ValueError, AttributeError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)                       # signal 0: only asks whether the process exists
    except (ProcessLookupError, OverflowError):   # too large for a pid: no process has it
        return False
    except PermissionError:                   # another user's process: it exists
        pass
    return True


# ---- saving and loading a checkpoint ---------------------------------------------------------

def _sha256(data) -> str:
    return hashlib.sha256(data).hexdigest()


def _file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(2**24):
            digest.update(chunk)
    return digest.hexdigest()


def save(out_dir: str, step: int, part: dict, meta: dict, keep: int) -> str:
    """Write this rank's part; the checkpoint appears, renamed from .tmp, once every rank's is on disk.

    Collective: every rank calls it. A crash at any point leaves the previous checkpoint whole;
    a write that fails on any rank (a full disk) stops every rank with one RunError, and the
    partial .tmp is removed.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    final = os.path.join(out_dir, f"ckpt-{step:07d}")
    tmp = final + ".tmp"
    # Serialized in memory first, so its checksum costs no second read of the file; load()
    # verifies it: flipped bits inside a tensor would otherwise load as silently wrong weights.
    data = io.BytesIO()
    torch.save(part, data)
    name = f"rank{rank:05d}.pt"

    def start():
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)          # left by a save that crashed
            os.makedirs(tmp)

    def write_part():
        write_file(os.path.join(tmp, name), data.getbuffer())
        with open(os.path.join(tmp, name + ".sha256"), "w") as f:
            f.write(_sha256(data.getbuffer()))

    def finish():                                  # every part is on disk ...
        if rank == 0:
            checksums = {}
            for r in range(world_size):
                with open(os.path.join(tmp, f"rank{r:05d}.pt.sha256")) as f:
                    checksums[f"rank{r:05d}.pt"] = f.read()
                os.remove(os.path.join(tmp, f"rank{r:05d}.pt.sha256"))
            with open(os.path.join(tmp, "meta.json"), "w") as f:
                json.dump({**meta, "step": step, "world_size": world_size, "sha256": checksums}, f,
                          indent=1)
            if os.path.exists(final):                  # the same step saved again after a resume:
                replaced = final + ".replaced.tmp"     # moved aside, not deleted before the rename
                shutil.rmtree(replaced, ignore_errors=True)
                os.rename(final, replaced)
            os.rename(tmp, final)                      # ... before the checkpoint exists at all
            shutil.rmtree(final + ".replaced.tmp", ignore_errors=True)

    for write in (start, write_part, finish):
        _written_by_every_rank(write, tmp, data.getbuffer().nbytes)
    if rank == 0:
        older = sorted(e for e in os.listdir(out_dir) if CHECKPOINT.match(e))[:-keep]
        for entry in older:        # renamed first: a kill inside the delete leaves a .tmp, never
            doomed = os.path.join(out_dir, entry + ".tmp")    # a half checkpoint that counts
            shutil.rmtree(doomed, ignore_errors=True)
            os.rename(os.path.join(out_dir, entry), doomed)
            shutil.rmtree(doomed)
    dist.barrier()
    return final


def write_file(path: str, data):
    """data on disk (fsync: in the file, not only in the page cache) before the checkpoint counts."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _written_by_every_rank(write, tmp: str, part_bytes: int):
    """write() on this rank, then every rank learns whether every rank's succeeded: a rank whose
    write failed still joins the exchange, so no rank waits for it in a barrier until --timeout.
    On a failure the partial .tmp goes (its bytes would keep the disk full) and every rank stops
    with the same line: the error, where, and the bytes the checkpoint needs (every rank's part)."""
    try:
        write()
        failure = 0
    except OSError as e:
        failure = e.errno or errno.EIO
    # NCCL moves only device tensors (init_distributed set this rank's device).
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    every = gather_objects((failure, part_bytes), Comm(), torch.device(device))
    failed = {rank: code for rank, (code, _) in enumerate(every) if code}
    if not failed:
        return
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    needed = sum(size for _, size in every)
    code = max(failed.values())              # ranks may differ: the same choice on every rank
    full = code in (errno.ENOSPC, errno.EDQUOT)
    out_dir, last = os.path.dirname(tmp), latest(os.path.dirname(tmp))
    raise RunError(f"saving {tmp.removesuffix('.tmp')} failed on rank{'s' if len(failed) > 1 else ''} "
                   f"{','.join(map(str, failed))}: {os.strerror(code)}"
                   + (f" (the disk or quota of {out_dir} is full)" if full else "")
                   + f"; the checkpoint needs {needed:,} bytes ({needed / 2**20:.1f} MiB; a save "
                   f"holds one more than --keep at once). Its partial write was removed; the last "
                   f"complete checkpoint is {last or 'none yet'}: "
                   + ("free space there" if full else "fix that") + " and rerun"
                   + (" with --resume" if last else ""))


def load(path: str) -> tuple[dict, list[dict]]:
    """(meta, [part of rank 0, ...]) of a complete checkpoint, or one CheckpointError naming the fix.

    Every rank checks every part's checksum and reads every part (memory-mapped: only the
    pieces it copies come into memory), so every rank finds the same damage and stops with
    the same message.
    """
    fix = f"delete {path} to resume from the checkpoint before it"
    meta = read_meta(path)
    parts = []
    for rank in range(meta["world_size"]):
        file = os.path.join(path, f"rank{rank:05d}.pt")
        expected = meta.get("sha256", {}).get(f"rank{rank:05d}.pt")    # older checkpoints: none
        if not os.path.isfile(file):            # a copy that left it out: nothing to call corrupt
            raise CheckpointError(f"{file} is missing: {path} was saved by {meta['world_size']} "
                                  f"ranks, one file each (rank00000.pt to rank"
                                  f"{meta['world_size'] - 1:05d}.pt); copy the checkpoint directory "
                                  f"whole, or {fix}")
        try:
            if expected is not None and _file_sha256(file) != expected:
                raise CheckpointError(f"{file} is corrupt or truncated (its bytes no longer match "
                                      f"the checksum saved with it); {fix}")
            damaged = _failed_crc(file) if expected is None else None
            if damaged:
                raise CheckpointError(f"{file} is corrupt or truncated (its record {damaged} no "
                                      f"longer matches its CRC-32); {fix}")
            part = torch.load(file, mmap=True, weights_only=True)
        except CheckpointError:
            raise
        except Exception as e:      # truncated or corrupt: in our words, not the unpickler's
            raise CheckpointError(f"{file} is corrupt or truncated (it does not read back as a "
                                  f"checkpoint part: {type(e).__name__}); {fix}") from None
        wrong = _wrong_in_part(part)
        if wrong:
            raise CheckpointError(f"{file} is damaged: it {wrong} (it was not written by a save of "
                                  f"this program, or was edited); {fix}")
        parts.append(part)
    return meta, parts


def _failed_crc(file: str) -> str | None:
    """The first record of a torch file (a zip archive) whose bytes fail the CRC-32 saved with
    them, or None: an older checkpoint's only check, saved before its parts had a sha256.
    A file that is no archive at all raises zipfile's BadZipFile."""
    with zipfile.ZipFile(file) as archive:
        return archive.testzip()


# ---- what a checkpoint holds: every value read back checked for what a save can have written --
# A value of the right type can still be nonsense: a NaN first loss would turn divergence
# stopping off, a piece one element short would fail deep inside a copy. So each value is
# checked for its type and for what it can be (finite, in range), and each part for its keys.

# What a checkpoint's meta.json must hold for load() and resume(); save() writes them all.
META_FIELDS = ("step", "world_size", "model", "args")
MODEL_FIELDS = {field.name for field in dataclasses.fields(GPTConfig)}
# A model loaded from a Hugging Face directory (meta.json's "hf") may be the Llama family's.
PRETRAINED_FIELDS = MODEL_FIELDS | {field.name for field in dataclasses.fields(LlamaConfig)}


def read_meta(path: str) -> dict:
    """A checkpoint's meta.json, or one CheckpointError naming the field missing, of the wrong
    type or out of range (_wrong_field), and the fix."""
    fix = f"delete {path} to fall back on the checkpoint before it"
    try:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not a complete checkpoint ({e}); {fix}") from None
    missing = [field for field in META_FIELDS if not isinstance(meta, dict) or field not in meta]
    if missing:
        raise CheckpointError(f"{path}/meta.json lacks {', '.join(missing)} (it was not written by a "
                              f"save of this program, or was cut short); {fix}")
    wrong = _wrong_field(meta)
    if wrong:
        field, value, what = wrong
        value = json.dumps(value)
        value = value if len(value) <= 40 else value[:37] + "..."
        raise CheckpointError(f"{path}/meta.json: {field} is {value}, not {what} (it was not written "
                              f"by a save of this program, or was edited); {fix}")
    return meta


def _count(value, least: int) -> bool:
    """A whole number from `least` (JSON's true is a Python int too, and is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _number(value, low: float = 0.0, below: float = math.inf) -> bool:
    """A finite number from low up to, not including, below (NaN fails every comparison)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value < below


def _checksum(value) -> bool:
    """A sha256, as _sha256 writes it: 64 hexadecimal digits."""
    return isinstance(value, str) and re.fullmatch("[0-9a-f]{64}", value) is not None


# GPTConfig's fields, as model.py reads them: (holds a right value, what it must be).
MODEL_RULES = {
    **{field: (lambda v: _count(v, 1), "a whole number from 1")
       for field in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "top_k")},
    "dropout": (lambda v: _number(v, 0, 1), "a probability from 0 up to, not including, 1"),
    "tie_embeddings": (lambda v: isinstance(v, bool), "true or false"),
    "gelu_approximate": (lambda v: v in ("none", "tanh"), "none or tanh"),
    "experts": (lambda v: _count(v, 0), "a whole number from 0 (dense)"),
    "capacity_factor": (lambda v: v is None or _number(v) and v > 0, "a positive number, or null"),
    "aux_loss_weight": (_number, "a number from 0"),
    "z_loss_weight": (_number, "a number from 0"),
    "routing_group": (lambda v: v is None or _count(v, 1), "a whole number from 1, or null"),
}
# lora.apply_lora's arguments, as a LoRA run's meta.json holds them (lora_config).
LORA_RULES = {
    "targets": (lambda v: isinstance(v, list) and v and all(isinstance(t, str) for t in v),
                "a list of module names"),
    "rank": (lambda v: _count(v, 1), "a whole number from 1"),
    "alpha": (lambda v: v is None or _number(v) and v > 0, "a positive number, or null"),
    "dropout": (lambda v: _number(v, 0, 1), "a probability from 0 up to, not including, 1"),
    "quantize": (lambda v: v in (None, "nf4"), "nf4, or null"),
    "double_quant": (lambda v: isinstance(v, bool), "true or false"),
}


def _wrong_field(meta: dict) -> tuple[str, object, str] | None:
    """The first value of meta.json that save() cannot have written: (its field, the value, what
    it must be), or None: every field load(), resume(), load_weights() and Divergence read."""
    model, args, sums = meta["model"], meta["args"], meta.get("sha256", {})
    rules = {
        "step": (_count(meta["step"], 0), "the steps done, a whole number"),
        "world_size": (_count(meta["world_size"], 1),
                       "the ranks that saved it, a whole number from 1"),
        "model": (isinstance(model, dict)
                  and model.keys() <= (PRETRAINED_FIELDS if meta.get("hf") else MODEL_FIELDS),
                  "the model's configuration (GPTConfig's fields; LlamaConfig's too with hf)"),
        "hf": (isinstance(meta.get("hf"), (str, type(None))),
               "the Hugging Face directory the run started from, or null"),
        "args": (isinstance(args, dict) and isinstance(args.get("strategy"), str),
                 "the run's options (with its --strategy)"),
        "sha256": (isinstance(sums, dict) and all(map(_checksum, sums.values())),
                   "{part file: its checksum, 64 hexadecimal digits}"),
        "lora": (meta.get("lora") is None or isinstance(meta["lora"], dict)
                 and meta["lora"].keys() <= LORA_RULES.keys(),
                 "the adapters' configuration (lora.apply_lora's arguments), or null"),
        "base": (isinstance(meta.get("base"), (str, type(None))), "the base model's path, or null"),
        "base_sha256": (meta.get("base_sha256") is None or _checksum(meta["base_sha256"]),
                        "the base's checksum, 64 hexadecimal digits, or null"),
        "data_position": (_count(meta.get("data_position"), 0),
                          "the steps of data read, a whole number"),
        "loss": (meta.get("loss") is None or _number(meta["loss"]),
                 "the loss it was saved at: a finite number from 0, or null"),
        "first_loss": (meta.get("first_loss") is None or _number(meta["first_loss"]),
                       "the run's first loss, which its divergence limit is measured from: a "
                       "finite number from 0, or null"),
    }
    wrong = next(((field, meta[field], what) for field, (right, what) in rules.items()
                  if not right and field in meta), None)
    return wrong or _wrong_entry("model", model, MODEL_RULES) or _wrong_entry(
        "lora", meta.get("lora") or {}, LORA_RULES)


def _wrong_entry(section: str, values: dict, rules: dict) -> tuple[str, object, str] | None:
    """The first of a configuration's values (the model's: meta.json's or an export's; LoRA's)
    outside its rule: ("SECTION.FIELD", its value, what it must be), or None. values: a dict
    whose keys the caller checked are the rules'."""
    return next(((f"{section}.{field}", values[field], what)
                 for field, (right, what) in rules.items()
                 if field in values and not right(values[field])), None)


def _wrong_in_part(part) -> str | None:
    """What in a checkpoint part (a rank's file) save() cannot have written, in words, or None:
    its keys, the RNG state, the loss scaler's state, and every piece: its range, its tensors
    (flat fp32 or fp64, one value per element of the range, finite; Adam's second moment from
    0), its optimizer scalars (finite, from 0)."""
    if not isinstance(part, dict) or not {"pieces", "rng", "scaler"} <= part.keys():
        keys = sorted(part) if isinstance(part, dict) else type(part).__name__
        return f"holds {keys}, not the pieces, rng and scaler every part has"
    rng, scaler = part["rng"], part["scaler"]
    cpu_state = torch.get_rng_state()
    if not (isinstance(rng, dict) and torch.is_tensor(rng.get("cpu"))
            and rng["cpu"].dtype == torch.uint8 and rng["cpu"].shape == cpu_state.shape):
        return f"has an rng that is not a CPU generator's state ({cpu_state.numel()} bytes)"
    if not (isinstance(scaler, dict) and _number(scaler.get("scale")) and scaler["scale"] > 0
            and _count(scaler.get("clean_steps"), 0)):
        return (f"has a loss scaler state {scaler!r}, not a positive finite scale and a count "
                f"of steps")
    if not isinstance(part["pieces"], list):
        return "has pieces that are not a list"
    return next((f"has a piece {wrong}" for wrong in map(_wrong_in_piece, part["pieces"]) if wrong),
                None)


def _bounds(t: torch.Tensor) -> tuple[float, float]:
    """(min, max) of t's elements in one pass, no copy (10x isfinite().all()'s speed): a NaN
    makes both NaN, an inf one of them inf, so both are finite exactly when every element is."""
    if t.numel() == 0:
        return 0.0, 0.0
    low, high = torch.aminmax(t.float())
    return float(low), float(high)


def _wrong_in_piece(piece) -> str | None:
    if not (isinstance(piece, dict) and isinstance(piece.get("name"), str)
            and _count(piece.get("start"), 0) and _count(piece.get("stop"), piece["start"] + 1)
            and isinstance(piece.get("tensors"), dict) and "param" in piece["tensors"]
            and isinstance(piece.get("scalars"), dict)):
        return "without a name, an element range start < stop, its tensors (param first), scalars"
    name = f"{piece['name']}[{piece['start']}:{piece['stop']}]"
    size = piece["stop"] - piece["start"]
    for key, t in piece["tensors"].items():
        # fp32, or an fp64 run's own (pieces.optimizer_pieces: the masters' dtype)
        if not (torch.is_tensor(t) and t.dtype in (torch.float32, torch.float64)
                and t.shape == (size,)):
            shape = tuple(t.shape) if torch.is_tensor(t) else type(t).__name__
            return f"{name} whose {key} is {shape}, not {size} fp32 values"
        low, high = _bounds(t)
        if not (math.isfinite(low) and math.isfinite(high)):
            return f"{name} whose {key} holds inf or NaN"
        if key == "exp_avg_sq" and low < 0:
            return f"{name} whose exp_avg_sq (a mean of squares) is negative"
    for key, value in piece["scalars"].items():
        value = value.item() if torch.is_tensor(value) and value.numel() == 1 else value
        if not _number(value):
            return f"{name} whose {key} is {value!r}, not a finite number from 0"
    return None


def check_source(path: str):
    """One CheckpointError, in words naming the fix, unless load_weights can read `path`: an
    --export file, a checkpoint directory, or a run directory holding one. It reads a file
    memory-mapped (its tensors are read once, to check them: check_weights) and of a directory
    only meta.json (load() checks the parts), so every rank can check it before any work."""
    kinds = "give a run directory, a checkpoint directory (RUN/ckpt-NNNNNNN) or an --export file"
    if path.startswith(HF):
        check_pretrained(path)
        return
    if os.path.isfile(path):
        try:
            saved = torch.load(path, mmap=True, weights_only=True)
        except Exception as e:            # not torch's format at all: our words, not the unpickler's
            raise CheckpointError(f"{path} is not a model file torch can read ({type(e).__name__}); "
                                  f"{kinds}") from None
        if not (isinstance(saved, dict) and {"model", "state_dict"} <= saved.keys()):
            raise CheckpointError(f"{path} is a torch file, but not one --export wrote (it has no "
                                  f"'model' and 'state_dict'); {kinds}")
        config, weights = saved["model"], saved["state_dict"]
        wrong = (_wrong_entry("model", config, MODEL_RULES)
                 if isinstance(config, dict) and config.keys() <= MODEL_FIELDS
                 else ("model", config, "the model's configuration (GPTConfig's fields)"))
        if wrong or not isinstance(weights, dict):
            field, value, what = wrong or ("state_dict", type(weights).__name__, "{name: tensor}")
            raise CheckpointError(f"{path}: its {field} is {value!r}, not {what}: it was not "
                                  f"written by --export, or was edited; export the model again")
        try:
            with torch.device("meta"):             # the shapes it describes, no memory
                described = GPT(GPTConfig(**config), feed_forward)
        except ValueError as e:                    # model.py's refusal of its configuration
            raise CheckpointError(f"{path}: its model is not one model.py builds ({e}): it was "
                                  f"not written by --export, or was edited; export the model "
                                  f"again") from None
        check_weights(weights, described, path)
        return
    checkpoint = latest(path) or path
    if not os.path.isfile(os.path.join(checkpoint, "meta.json")):
        raise CheckpointError(f"{path} holds no checkpoint (no ckpt-NNNNNNN directory with a "
                              f"meta.json in it, and no meta.json of its own); {kinds}")
    meta = read_meta(checkpoint)
    if meta.get("lora") and meta.get("base"):
        check_adapter_base(meta, checkpoint)


def base_identity(path: str) -> dict:
    """The weights `path` names now, pinned for a LoRA run's checkpoints to record as their base:
    {"path": the concrete weights (an --export file, or the checkpoint a run directory's newest
    is), "sha256": their checksum}. A run directory that trains on names other weights later;
    its checkpoint does not. A checkpoint's checksum is one of its parts' (meta.json's, which
    load() verifies) and, an adapter itself, of its own base's: no second read of its files.
    hf:DIR's is its config.json's and weight files' (read once a process)."""
    directory = pretrained_directory(path) if path.startswith(HF) else None
    if directory:                    # its config.json and weights, in the order their names sort
        files = sorted(f for f in os.listdir(directory)
                       if f == "config.json" or f.endswith(".safetensors"))
        sums = [_export_sha256(os.path.join(directory, f), *_version(os.path.join(directory, f)))
                for f in files]
        return {"path": HF + directory, "sha256": _sha256(json.dumps(sums).encode())}
    path = os.path.abspath(path)
    if os.path.isfile(path):
        return {"path": path, "sha256": _export_sha256(path, *_version(path))}
    checkpoint = latest(path) or path
    meta = read_meta(checkpoint)
    files = [f"rank{r:05d}.pt" for r in range(meta["world_size"])]
    parts = meta.get("sha256") or {f: _file_sha256(os.path.join(checkpoint, f)) for f in files}  # older
    return {"path": checkpoint, "sha256": _sha256(json.dumps([parts, meta.get("base_sha256")],
                                                             sort_keys=True).encode())}


def _version(path: str) -> tuple[int, int]:
    """A file's modification time (ns) and size: a new version of it has another."""
    stat = os.stat(path)
    return stat.st_mtime_ns, stat.st_size


@functools.lru_cache(maxsize=8)
def _export_sha256(path: str, modified_ns: int, size: int) -> str:
    """An --export file's checksum, read once a process for each version of the file: a LoRA
    run checks its base before any work and records it in every checkpoint."""
    return _file_sha256(path)


def check_adapter_base(meta: dict, path: str):
    """A LoRA checkpoint's recorded base (meta["base"]) is there and holds the weights its adapter
    was trained on (meta["base_sha256"]; older checkpoints record none): one CheckpointError
    naming the fix otherwise, for the adapter over any other base is another model."""
    base = meta["base"]
    if not os.path.exists(base.removeprefix(HF)):
        raise CheckpointError(f"{path} holds a LoRA adapter over the base {base}, which is missing "
                              f"(moved or deleted; a run's --keep prunes its old checkpoints): put "
                              f"those weights back at {base}")
    if meta.get("base_sha256") and base_identity(base)["sha256"] != meta["base_sha256"]:
        raise CheckpointError(f"{path} holds a LoRA adapter trained over the base {base}, whose "
                              f"weights have changed since (another checksum; an --export over it?): "
                              f"put the weights it was trained on back at {base}")


def check_same_model(saved: dict, current: dict, path: str, ignore: tuple = ()):
    """The saved model configuration must equal this run's: name the first field that differs.
    A field the checkpoint predates (GPTConfig grew it later) reads as its default."""
    defaults = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
    saved = {**{f: defaults[f] for f in current if f in defaults and f not in saved}, **saved}
    for field in sorted(set(saved) | set(current)):
        if field not in ignore and saved.get(field) != current.get(field):
            raise CheckpointError(f"{path} holds a model with {field}={saved.get(field)!r}, this run "
                                  f"builds {field}={current.get(field)!r}: use the checkpoint's "
                                  f"--model (and overrides), or another --out")


# ---- a run's checkpoints: what train.py saves, resumes and exports -----------------------------

class Layout(NamedTuple):
    """Where this rank's weights sit, as checkpoints need it: its rank in the data-parallel
    group (replica 0 writes replicated weights), and the group that splits one model (tp's
    tensor group or a pipeline, else None). `tensor` says the split is by matrix (parameters
    sharded along "tp", foundations/placements.py): whole pieces are gathered over `split`, and its first
    rank writes them; a pipeline stage writes its own parameters."""
    data_rank: int
    split: Comm | None
    tensor: bool
    experts: Comm | None = None     # expert parallelism: the ranks holding this rank's experts
    data: Comm | None = None        # the data-parallel group (a sharded optimizer's shards)


def layout_of(gpt, data_comm, split) -> Layout:
    """gpt's layout from its parameters' placements (the experts' holders, the tensor split)."""
    where = [placement(p) for p in gpt.parameters()]
    experts = next((w.holders for w in where if w.holders is not None), None)
    return Layout(data_comm.rank, split, any("tp" in w.shard for w in where), experts, data_comm)


def rank_pieces(gpt, optimizer, layout: Layout, frozen=True) -> list[dict]:
    """This rank's part of the weights and optimizer state: its shard (a sharded optimizer:
    zero, fsdp), or the first replica's whole parameters (tp gathers each split one whole
    first; a pipeline stage's first replica writes that stage's).
    frozen: with the frozen weights (a LoRA checkpoint leaves them to its base)."""
    replicas = layout.data_rank == 0
    experts = layout.experts is not None and layout.experts.rank == 0     # first holder of these
    if not (optimizer.sharded or replicas or experts):
        return []
    pieces = optimizer_pieces(optimizer, names(gpt))
    held = {name for name, p in gpt.named_parameters() if placement(p).holders is not None}
    # HSDP's copies hold the same shards: the first copy's ranks write them, every rank its
    # experts' (sharded over the ranks holding them, not copied).
    if getattr(optimizer, "replica_rank", 0) != 0:
        pieces = [piece for piece in pieces if piece["name"] in held]
    if layout.experts is not None and not optimizer.sharded:   # each rank its own experts
        pieces = [piece for piece in pieces if (experts if piece["name"] in held else replicas)]
    if frozen:
        with frozen_whole(optimizer):                  # collective where FSDP shards them
            pieces += frozen_pieces(gpt) if layout.data_rank == 0 else []
    if layout.tensor:                                  # collective: the whole tensor group
        params = dict(gpt.named_parameters())
        if optimizer.sharded:          # each slice's shards joined on the data group's first rank
            pieces = join_shards(pieces, layout.data, next(gpt.parameters()).device)
        pieces = gather_pieces(pieces, params, layout.split)
        pieces = pieces if layout.split.rank == 0 else []
    return pieces


def frozen_whole(optimizer):
    """A context in which the frozen weights are whole on every rank: FSDP shards them
    (fsdp_optimizer.FSDPOptimizer.frozen_gathered), the other strategies keep them whole already."""
    return getattr(optimizer, "frozen_gathered", contextlib.nullcontext)()


def save_checkpoint(args, step, gpt, optimizer, layout: Layout, loss=None, lora_config=None,
                    first_loss=None, base: dict | None = None):
    """Every rank's shard (or the first replica's copy), RNG, loss scale; returns its path.
    Weights with inf or NaN are not saved: RunError. lora_config: apply_lora's arguments.
    first_loss: the run's first (Divergence's), which a resumed run's divergence limit keeps.

    A LoRA run on an --init-from base saves only what trains, the adapter, and names the base:
    base, its base_identity as the run loaded it.
    """
    pieces = rank_pieces(gpt, optimizer, layout, frozen=not base)
    if not all_finite(pieces, next(gpt.parameters()).device):
        raise RunError(f"step {step}: the weights hold inf or NaN; no checkpoint written (the "
                       f"last good one is {latest(args.out)})")
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    part = {"pieces": pieces, "rng": rng, "scaler": optimizer.scaler.state_dict()}
    meta = {"model": model_config(gpt), "args": vars(args), "data_position": step,
            "lora": lora_config, "base": base and base["path"], "base_sha256": base and base["sha256"],
            "loss": loss, "first_loss": first_loss, "hf": args.hf}
    return save(args.out, step, part, meta, keep=args.keep)


def resume(args, gpt, optimizer, layout: Layout, world_size, rank, say) -> tuple[int, float | None]:
    """Load the newest checkpoint in --out (or the one --resume names) into this run: the step
    to continue from, and the run's first loss (Divergence's; None: no checkpoint, a fresh
    start). Checkpoints in --out not on its line (saved after that step, or another run's) are
    another branch's: once the load succeeded, they are set aside (set_aside_other_lines)."""
    path = args.resume if args.resume not in ("must", "auto") else latest(args.out)
    if path is None:
        if args.resume == "auto":
            say(f"--resume auto: no checkpoint in {args.out} yet, starting from step 0")
            return 0, None
        raise RunError(f"--resume: no complete checkpoint in {args.out}; start without --resume, "
                       f"or use --resume auto to start fresh when there is none")
    meta, parts = load(path)
    check_same_model(meta["model"], model_config(gpt), path)
    bookkeeping = ("out", "save_every", "keep", "resume", "overwrite", "export", "timeout", "log_every",
                   "init_from", "hf", "export_hf")
    changed = [(k, v, vars(args).get(k)) for k, v in meta["args"].items()
               if k not in bookkeeping and vars(args).get(k) != v]
    pieces = Pieces([p for part in parts for p in part["pieces"]])
    if layout.tensor:                                    # whole pieces in, this rank's slices out
        pieces = TensorParallelReader(pieces, dict(gpt.named_parameters()), layout.split)
    with frozen_whole(optimizer):
        load_pieces(optimizer, names(gpt), gpt, pieces, frozen=not meta.get("base"))
    optimizer.scaler.load_state_dict(parts[0]["scaler"])     # the same on every rank
    if meta["world_size"] == world_size:
        torch.set_rng_state(parts[rank]["rng"]["cpu"])
        if torch.cuda.is_available() and "cuda" in parts[rank]["rng"]:
            torch.cuda.set_rng_state(parts[rank]["rng"]["cuda"])
        resharded = ""
    else:
        # Another world size: no rank's RNG stream carries over (dropout masks differ from an
        # uninterrupted run; without dropout nothing random is drawn after initialisation).
        torch.manual_seed(args.seed + meta["step"] * 1000 + rank)
        resharded = f", resharded from {meta['world_size']} to {world_size} ranks"
    say(f"resumed from {path} at step {meta['step']} ({meta['args']['strategy']}{resharded})")
    moved = set_aside_other_lines(args.out, path, meta["step"]) if rank == 0 else None  # as it prunes
    if moved:
        say(moved)
    for name, before, now in changed:
        say(f"resumed with --{name.replace('_', '-')} {now} (the run was started with {before})"
            + ("; the learning-rate schedule (warmup, then cosine decay to --min-lr at the last "
               "step) is rebuilt for the new length, so the rate from here on differs from the "
               "first run's" if name == "steps" else ""))
    if meta["step"] == args.steps:            # cli.check_resume refused a --steps below it
        say(f"the run is complete: {path} is step {meta['step']} of --steps {args.steps}, so nothing "
            f"is left to train (the final eval and --export still run); give a larger --steps to "
            f"train on")
    first_loss = meta.get("first_loss")      # None: saved before it was; ln V, a fresh run's start
    return meta["step"], math.log(gpt.cfg.vocab_size) if first_loss is None else first_loss


def check_export(path: str, nbytes: int = 0):
    """--export's file can be written: no directory, in a directory that exists, takes a file
    there and has room for its nbytes. Checked before any work, so trained weights are never
    lost to a bad path at the end: RunError naming the fix otherwise."""
    if os.path.isdir(path):
        raise RunError(f"--export {path} is a directory: give the file to write, e.g. "
                       f"{os.path.join(path, 'model.pt')}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise RunError(f"--export {path}: no directory {parent}: create it, or export elsewhere")
    try:                 # by writing, not by os.access: root passes that even on a read-only mount
        with open(path + ".tmp", "wb"):
            pass
        os.remove(path + ".tmp")
    except OSError as e:
        raise RunError(f"--export {path}: cannot write there ({e.strerror}): choose a directory "
                       f"rank 0 can write to") from None
    free = shutil.disk_usage(parent).free
    if free < nbytes:
        raise RunError(f"--export {path}: {parent} has {free:,} bytes free, the model's fp32 weights "
                       f"need {nbytes:,} ({nbytes / 2**20:.1f} MiB): free space there, or export elsewhere")


def export(path, gpt, optimizer, layout: Layout, rank, lora_config=None, out: str | None = None):
    """One consolidated fp32 file: {"model": config, "state_dict": weights}, written whole by
    rank 0 (write_whole). Collective. The frozen weights are whole throughout (folding reads a
    4-bit base). A file the disk does not take stops every rank with rank 0's line, which says
    where the trained weights are kept instead (kept_weights; out: the run's --out)."""
    device = next(gpt.parameters()).device
    with frozen_whole(optimizer):
        saved = _export(gpt, optimizer, layout, rank, lora_config, device)
    problem = None
    if rank == 0:
        # Serialized in memory: torch's own file writer turns a full disk's OSError into an
        # opaque RuntimeError, and a failed write must say why and keep the bytes.
        data = io.BytesIO()
        torch.save(saved, data)
        try:
            write_whole(path, data.getbuffer())
        except OSError as e:
            full = " (the disk or quota is full)" if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
            problem = (f"--export {path}: writing its {data.getbuffer().nbytes:,} bytes failed: "
                       f"{e.strerror}{full}; nothing partial was left. {kept_weights(path, data, out)}")
    verdict = gather_objects(problem, Comm(), device)[0]          # rank 0's, on every rank
    if verdict:
        raise RunError(verdict)


def kept_weights(path: str, data: io.BytesIO, out: str | None) -> str:
    """Where the weights --export could not write are: the run's last checkpoint (saved after
    the last step), or else a file written now in the temporary directory."""
    checkpoint = latest(out) if out else None
    if checkpoint:
        return (f"The trained weights are in {checkpoint}: free space and rerun the same command "
                f"with --resume to export them")
    stem, ext = os.path.splitext(os.path.basename(path))
    kept = os.path.join(tempfile.gettempdir(), f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}{ext}")
    try:
        write_whole(kept, data.getbuffer())
    except OSError as e:
        return (f"The trained weights are lost: {os.path.dirname(kept)} could not take them either "
                f"({e.strerror}); --out DIR keeps a checkpoint of them")
    return f"The trained weights are kept in {kept} (train.load_weights reads it): move it to {path}"


def _export(gpt, optimizer, layout: Layout, rank, lora_config, device) -> dict | None:
    """export's dict of the whole model on rank 0 (None on the others)."""
    pieces = [{**p, "tensors": {"param": p["tensors"]["param"]}, "scalars": {}}
              for p in rank_pieces(gpt, optimizer, layout)]
    split = layout.split is not None or layout.experts is not None
    four_bit = bool(lora_config and lora_config["quantize"])
    if split and four_bit and layout.data_rank == 0:
        # A 4-bit W0 is buffers, not a parameter: dequantized here, where its codes live, and
        # gathered as the plain weight it stands for (the whole shapes below are meta); a
        # tensor-parallel slice joined with the others' first (collective: the tensor group).
        dequantized, layers = lora.dequantized_weights(gpt), dict(gpt.named_modules())
        for name, w in dequantized.items():     # a slice: cut along its layer's dim, over "tp"
            dim = getattr(layers[name.removesuffix(".weight")], "dim", None)
            if dim is not None:
                place(w, shard={"tp": dim})
        mine = [whole_piece(name, w) for name, w in dequantized.items()]
        if layout.tensor:
            mine = gather_pieces(mine, dequantized, layout.split)
            mine = mine if layout.split.rank == 0 else []
        pieces += mine
    gathered = gather_objects(pieces, Comm(), device, dst=0)
    if rank != 0:
        return None
    shapes = gpt
    if split:
        with torch.device("meta"):     # whole shapes (a rank holds slices or a stage), no memory
            shapes = (Llama(gpt.cfg) if isinstance(gpt.cfg, LlamaConfig)
                      else GPT(gpt.cfg, feed_forward))
            if lora_config:            # a 4-bit W0 as the plain weight the pieces above hold
                lora.apply_lora(shapes, **{**lora_config, "quantize": None, "double_quant": False})
    gathered = Pieces([p for part in gathered for p in part])
    weights = gathered.full_state_dict(shapes)
    for name, p in shapes.named_parameters(remove_duplicate=False):
        if name not in weights and name in gathered.by_name:    # a tied head's 4-bit W0
            weights[name] = gathered.read(name, 0, p.numel())["param"].view(p.shape)
    weights = lora.fold_adapters(weights, shapes)         # LoRA: merged into W0; else as is
    return {"model": model_config(gpt, weights), "state_dict": weights}


def load_weights(path: str, gpt: nn.Module | None = None) -> nn.Module:
    """fp32 weights from a run directory, a checkpoint, an --export file or hf:DIR (a Hugging Face
    directory), on one process.

    Into `gpt` (its configuration must match, dropout aside) or into a new model of the saved
    configuration: `load_weights("model.pt")` is all a user of an exported model needs. A run
    that started from hf:DIR recorded it (meta.json's "hf"): its model is that directory's.
    """
    if path.startswith(HF):
        loaded = load_pretrained(pretrained_directory(path))[0]
        if gpt is None:
            return loaded
        config, weights = model_config(loaded), loaded.state_dict()
    elif os.path.isfile(path):
        saved = torch.load(path, weights_only=True)
        config, weights = saved["model"], saved["state_dict"]
    else:
        path = latest(path) or path
        meta, parts = load(path)
        config, hf = meta["model"], meta.get("hf")
        pieces = Pieces([p for part in parts for p in part["pieces"]])
        saved_from = new_model(config, hf)
        if meta.get("lora"):        # a LoRA run saved its adapter; the base is meta["base"]
            if meta["base"]:
                check_adapter_base(meta, path)
                load_weights(meta["base"], saved_from)
            lora.apply_lora(saved_from, **meta["lora"])
        weights = pieces.full_state_dict(saved_from, missing_from_model=bool(meta.get("base")))
        if meta.get("lora"):
            weights = lora.fold_adapters(weights, saved_from)
            config = model_config(saved_from, weights)      # an adapted tied head: its own now
        if gpt is None and hf:
            gpt = untie(new_model(config, hf), config)
    if gpt is None:
        gpt = GPT(GPTConfig(**config), feed_forward)
    else:
        check_same_model(config, model_config(gpt), path, ignore=("dropout",))
    check_weights(weights, gpt, path)
    if gpt.cfg.tie_embeddings:      # one tensor under two names: files hold the first name only
        weights.setdefault("head.weight", weights["token_emb.weight"])
    gpt.load_state_dict(weights)
    return gpt


def new_model(config: dict, hf: str | None) -> nn.Module:
    """The model a checkpoint's configuration describes: hf's architecture (its config.json) for
    a run that started from a Hugging Face directory, else model.py's GPT. Weights not set."""
    if hf:
        return empty_model(read_config(hf), os.path.join(hf, "config.json"))
    return GPT(GPTConfig(**config), feed_forward)


# ---- a run from a Hugging Face directory: --init-from hf:DIR, --export-hf DIR ------------------

HF = "hf:"          # --init-from hf:DIR names a Hugging Face model directory


def pretrained_directory(path: str | None) -> str | None:
    """The Hugging Face directory a model comes from (absolute): hf:DIR's, or the one a run
    directory's or checkpoint's meta.json records; None for this project's own GPT."""
    if not path:
        return None
    if path.startswith(HF):
        return os.path.abspath(path.removeprefix(HF))
    checkpoint = latest(path) or path
    if not os.path.isfile(os.path.join(checkpoint, "meta.json")):
        return None
    try:
        return read_meta(checkpoint).get("hf")
    except CheckpointError:
        return None                           # check_source and load() say what is wrong


def pretrained_model(args) -> nn.Module | None:
    """The run's model where it comes from a Hugging Face directory (args.hf): hf:DIR's, built
    hollow in the dtype the run stores its weights in, each unit read as the strategy comes to
    it (pretrained/streamed.py); or, for a run that continues or starts from one that did, its
    shape (weights loaded after); None otherwise. Seeded as new_gpt is: LoRA's adapters are
    drawn after it, alike on all ranks."""
    if not args.hf:
        return None
    torch.manual_seed(args.seed)
    if streamed(args):
        return hollow_model(args.hf, weights_dtype(args))
    return new_model({}, args.hf)


def streamed(args) -> bool:
    """Does the run read hf:DIR unit by unit into its share (pretrained/streamed.py)?"""
    return bool(args.init_from and args.init_from.startswith(HF))


def pretrained_tokenizer(hf: str | None) -> Tokenizer | None:
    """The tokenizer of the Hugging Face directory hf; None (bytes) without one."""
    return Tokenizer.read(os.path.join(hf, "tokenizer.json")) if hf else None


def check_pretrained(path: str):
    """One CheckpointError unless hf:DIR (path) is a model load_pretrained reads: a directory with
    a config.json of an architecture read here and a tokenizer.json (the tensors are checked as
    they load)."""
    directory = path.removeprefix(HF)
    if not os.path.exists(directory):
        raise CheckpointError(f"{path}: no such directory; give the local directory of a Hugging "
                              f"Face model (config.json, model.safetensors, tokenizer.json)")
    if not os.path.isdir(directory):
        raise CheckpointError(f"{path}: a file, not a directory; give the directory holding the "
                              f"model's config.json, model.safetensors and tokenizer.json")
    try:
        config = read_config(directory)
        model_config_of(config, os.path.join(directory, "config.json"))
        Tokenizer.read(os.path.join(directory, "tokenizer.json"))
    except PretrainedError as e:
        raise CheckpointError(str(e)) from None


def export_pretrained(path: str, gpt, optimizer, layout: Layout, rank, lora_config, hf: str,
                      out: str | None = None):
    """--export-hf: the trained model as a Hugging Face directory (config.json, model.safetensors,
    tokenizer.json: pretrained.load.export_hf) that load_pretrained reads back, fp32, LoRA
    merged and a 4-bit base dequantized (as --export folds them). Collective; rank 0 writes, and
    a write that fails stops every rank with its line (out: the run's --out, whose last
    checkpoint it names)."""
    device = next(gpt.parameters()).device
    with frozen_whole(optimizer):
        saved = _export(gpt, optimizer, layout, rank, lora_config, device)
    problem = None
    if rank == 0:
        model = untie(new_model(saved["model"], hf), saved["model"])
        weights = saved["state_dict"]
        if model.cfg.tie_embeddings:
            weights.setdefault("head.weight", weights["token_emb.weight"])
        model.load_state_dict(weights)
        try:
            export_hf(model, Tokenizer.read(os.path.join(hf, "tokenizer.json")), path,
                      read_config(hf))
        except OSError as e:
            full = " (the disk or quota is full)" if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
            problem = (f"--export-hf {path}: writing {e.filename} failed: {e.strerror}{full}"
                       + (f"; the trained weights are in {latest(out)}: free space and rerun "
                          f"with --resume to export them" if out and latest(out) else ""))
    verdict = gather_objects(problem, Comm(), device)[0]          # rank 0's, on every rank
    if verdict:
        raise RunError(verdict)


def check_weights(weights: dict, gpt: GPT, path: str):
    """One CheckpointError naming the tensor and the fix, unless `weights` (path's, read into
    gpt) are gpt's: every tensor of its state_dict there, of its shape, floating point and
    finite. Weights holding inf or NaN would make the first step's loss NaN: a run that seems
    to diverge, with nothing wrong in its flags."""
    expected = gpt.state_dict()
    if gpt.cfg.tie_embeddings and "head.weight" not in weights:     # files hold the first name
        expected.pop("head.weight")
    fix = "export the model again, or give other weights"
    for name, t in expected.items():
        if name not in weights:
            raise CheckpointError(f"{path} lacks the tensor {name}, of shape {tuple(t.shape)} in "
                                  f"the model it describes (cut short, or edited); {fix}")
        got = weights[name]
        if not (torch.is_tensor(got) and got.is_floating_point() and got.shape == t.shape):
            what = f"{tuple(got.shape)} {got.dtype}" if torch.is_tensor(got) else type(got).__name__
            raise CheckpointError(f"{path}: its tensor {name} is {what}, where the model it "
                                  f"describes has {tuple(t.shape)} floats (edited, or saved from "
                                  f"another model); {fix}")
        if not all(map(math.isfinite, _bounds(got))):
            raise CheckpointError(f"{path}: its tensor {name} holds inf or NaN (a run that "
                                  f"diverged, or damage): training or sampling from it gives NaN; "
                                  f"give weights saved before the run diverged")
    extra = sorted(weights.keys() - expected.keys())
    if extra:
        raise CheckpointError(f"{path} holds a tensor {extra[0]} that the model it describes has "
                              f"no place for (saved from another model, or edited); {fix}")


def model_config(gpt: GPT, weights: dict | None = None) -> dict:
    """gpt's configuration; that of the model weights make (an export's), if given: a head tied
    to the token embedding that LoRA adapted has a weight of its own there (fold_adapters)."""
    config = dataclasses.asdict(gpt.cfg)
    if weights is not None and "head.weight" in weights:
        config["tie_embeddings"] = False
    return config


def untie(model: nn.Module, config: dict) -> nn.Module:
    """model (built tied, from its Hugging Face directory) untied as config says (an exported
    adapted head's): the head given a weight of its own to load."""
    if model.cfg.tie_embeddings and not config["tie_embeddings"]:
        model.cfg = dataclasses.replace(model.cfg, tie_embeddings=False)
        model.head.weight = nn.Parameter(torch.empty_like(model.head.weight))
    return model


def names(gpt: GPT) -> dict:
    return {p: name for name, p in gpt.named_parameters()}


# ---- a run's guards: one run per directory, refusals as usage errors, divergence stops ------

def open_run(args, world_size: int):
    """Rank 0's run directory (--out): cleared first under --overwrite, its config.json written
    (whole: write_whole) unless a resume finds one, its log.txt opened for appending (returned)."""
    if args.overwrite:
        clear(args.out)                          # asked for: the old run's checkpoints go
    os.makedirs(args.out, exist_ok=True)
    config = os.path.join(args.out, "config.json")
    if not (args.resume and os.path.exists(config)):        # the run's own, not a resume's
        write_whole(config, json.dumps({**vars(args), "world_size": world_size}, indent=1).encode())
    return open(os.path.join(args.out, "log.txt"), "a")


@contextlib.contextmanager
def own_outputs(args, rank, device, export_bytes: int = 0):
    """Rank 0 checks --export's path and room for its export_bytes, takes --out's lock
    (snapshot.lock) and opens the run directory (open_run) before any work; every rank stops
    with rank 0's verdict (those files are rank 0's: another node may not even see their paths).
    Yields (the log's line on a stale lock taken over, "" if none; log.txt on rank 0, else None);
    the lock goes when the run ends: done, failed or interrupted (a killed run's stays, stale)."""
    problem, took_over, log = None, "", None
    try:
        if rank == 0:
            try:
                if args.export:
                    check_export(args.export, export_bytes)
                if args.out:
                    took_over = lock(args.out)
                    log = open_run(args, dist.get_world_size())
            except RunError as e:
                problem = str(e)
            except OSError as e:             # the lock, config.json, log.txt cannot be written
                problem = (f"--out {args.out}: cannot write {e.filename} ({e.strerror}): "
                           + ("free space there" if e.errno in (errno.ENOSPC, errno.EDQUOT) else
                              "give a directory rank 0 can write to") + ", and rerun")
        verdict = gather_objects(problem, Comm(), device)[0]       # rank 0's, on every rank
        if verdict:
            raise RunError(verdict)
        yield took_over, log
    finally:
        if log:
            log.close()
        if rank == 0 and args.out:
            unlock(args.out)          # only if this process holds it
