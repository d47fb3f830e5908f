"""snapshot.py: a training run's checkpoints: saved atomically, resumed bit for bit, resharded.

Hours of GPU time must survive a crash. A checkpoint holds what an exact continuation needs:
the fp32 weights and optimizer state, the loss scale, the step (which fixes the learning rate
and the data position: batches are a function of the step), every rank's RNG state and the
configuration. Sharded strategies save each rank's shard with the map of which elements of
which parameter it holds ("pieces"), so the same files load on any world size and under any
strategy: every rank takes the elements it now owns; tensor parallelism's split matrices are
saved gathered whole, so they load at any --tp. (PyTorch's elastic training calls these
snapshots; activation checkpointing, recomputing in backward, is checkpointing.py.)
Left out: asynchronous saving, object stores, fsync of the directory entries.
Test: python -m pytest tests/test_snapshot.py

Layout:  OUT/ckpt-0000100/{meta.json, rank00000.pt, ...}   written as ckpt-0000100.tmp first
"""
import hashlib
import io
import json
import os
import re
import shutil

import torch
import torch.distributed as dist

CHECKPOINT = re.compile(r"ckpt-(\d{7})$")


class CheckpointError(Exception):
    """A checkpoint that cannot be used, with the fix in the message; train.py prints it plainly."""


# ---- pieces: which elements of which parameter this rank holds ------------------------------
#
# A piece is {"name", "start", "stop", "tensors", "scalars"}: elements start:stop of the named
# parameter (flattened), their fp32 values ("param") and optimizer state of the same shape
# ("exp_avg", "exp_avg_sq", "momentum_buffer"...), and the optimizer's scalars ("step").
# DDP's replicas save one full-range piece per parameter (rank 0 only); ZeRO's ranks save
# the ranges their shards cover, which may cut a parameter in two.

def optimizer_pieces(optimizer, names: dict) -> list[dict]:
    """This rank's pieces, from an optimizer with master_ranges() (mixed_precision.py, zero.py)."""
    pieces = []
    for param, start, stop, master, offset in optimizer.master_ranges():
        ranged = {"param": master}
        scalars = {}
        for key, value in optimizer.optimizer.state.get(master, {}).items():
            if torch.is_tensor(value) and value.dim() > 0:
                ranged[key] = value
            else:
                scalars[key] = value.clone() if torch.is_tensor(value) else value
        # Cloned: saving a view would write the whole flat buffer it points into.
        tensors = {key: t.detach().reshape(-1)[offset: offset + stop - start].float().cpu().clone()
                   for key, t in ranged.items()}
        pieces.append({"name": names[param], "start": start, "stop": stop,
                       "tensors": tensors, "scalars": scalars})
    return pieces


def frozen_pieces(model: torch.nn.Module) -> list[dict]:
    """Parameters no optimizer owns (requires_grad=False), whole: saved by rank 0."""
    return [{"name": name, "start": 0, "stop": p.numel(), "scalars": {},
             "tensors": {"param": p.detach().reshape(-1).float().cpu().clone()}}
            for name, p in model.named_parameters() if not p.requires_grad]


class Pieces:
    """Every rank's pieces, joined by parameter name: read any element range back."""

    def __init__(self, pieces: list[dict]):
        self.by_name = {}
        for piece in pieces:
            self.by_name.setdefault(piece["name"], []).append(piece)

    def read(self, name: str, start: int, stop: int) -> dict:
        """{key: (stop - start,) tensor} for elements start:stop of `name`, from whichever pieces hold them."""
        if name not in self.by_name:
            raise CheckpointError(f"the checkpoint has no parameter {name!r}: it was saved from "
                                  f"another model; start from scratch or pick its own --model")
        out, covered = {}, torch.zeros(stop - start, dtype=torch.bool)
        for piece in self.by_name[name]:
            first, last = max(start, piece["start"]), min(stop, piece["stop"])
            if first >= last:
                continue
            for key, t in piece["tensors"].items():
                if key not in out:
                    out[key] = torch.zeros(stop - start, dtype=t.dtype)
                out[key][first - start: last - start] = t[first - piece["start"]: last - piece["start"]]
            covered[first - start: last - start] = True
        if not covered.all():
            raise CheckpointError(f"the checkpoint lacks elements of {name!r}: a rank's file is "
                                  f"missing; resume from an earlier checkpoint")
        return out

    def scalars(self, name: str) -> dict:
        return {key: value.clone() if torch.is_tensor(value) else value
                for key, value in self.by_name[name][0]["scalars"].items()}

    def full_state_dict(self, model: torch.nn.Module, missing_from_model: bool = False) -> dict:
        """{name: fp32 tensor shaped like the model's}: the weights alone, on one process.

        missing_from_model: parameters the checkpoint does not hold (a LoRA run's frozen base,
        saved elsewhere) are taken from model as it is.
        """
        return {name: self.read(name, 0, p.numel())["param"].view(p.shape)
                if name in self.by_name or not missing_from_model else p.detach().float()
                for name, p in model.named_parameters()}


@torch.no_grad()
def load_pieces(optimizer, names: dict, model: torch.nn.Module, pieces: Pieces, frozen: bool = True):
    """Write the saved values and optimizer state into what this rank owns now, at any world size.

    frozen=False: the frozen parameters are not in the checkpoint (a LoRA run's base, loaded
    from its own file) and stay as they are.
    """
    for param, start, stop, master, offset in optimizer.master_ranges():
        values = pieces.read(names[param], start, stop)
        window = slice(offset, offset + stop - start)
        master.view(-1)[window].copy_(values.pop("param"))
        if values:                       # torch optimizers create their state at the first step
            state = optimizer.optimizer.state[master]
            for key, value in values.items():
                if key not in state:
                    state[key] = torch.zeros_like(master)
                state[key].view(-1)[window].copy_(value)
            state.update(pieces.scalars(names[param]))
    for name, p in model.named_parameters():
        if frozen and not p.requires_grad:
            p.copy_(pieces.read(name, 0, p.numel())["param"].view(p.shape))
    optimizer.refresh_params()


# ---- tensor parallelism's slices: whole parameters in, whole parameters out -------------------
#
# snapshot.py's pieces are flat element ranges; a rank's slice of a column- or row-split
# matrix is not one range. So a save gathers each split parameter (and its optimizer state)
# over the tensor group into one whole piece, and a load reads the whole piece and keeps this
# rank's slice: tp checkpoints are plain full-model checkpoints, loadable at any --tp.

def gather_pieces(pieces: list[dict], params: dict, comm) -> list[dict]:
    """Whole-parameter pieces from this rank's pieces of tensor_parallel.py's split parameters
    (those with a tp_dim); params: {name: parameter}; comm: the tensor group. Collective."""
    whole = []
    for piece in pieces:
        p = params[piece["name"]]
        if not hasattr(p, "tp_dim"):
            whole.append(piece)
            continue
        tensors = {}
        for key, t in piece["tensors"].items():
            # The pieces were copied to the host for the file; the gather runs on the
            # parameter's device (NCCL moves device memory only), the whole piece goes back.
            local = t.to(p.device)
            parts = [torch.empty_like(local) for _ in range(comm.world_size)]
            dist.all_gather(parts, local, group=comm.group)      # a checkpoint, not a training step
            tensors[key] = torch.cat([x.view(p.shape) for x in parts], p.tp_dim).reshape(-1).cpu()
        whole.append({**piece, "start": 0, "stop": p.numel() * comm.world_size, "tensors": tensors})
    return whole


class TensorParallelReader:
    """snapshot.Pieces' read() and scalars(), answering with this rank's slice of whole pieces."""

    def __init__(self, pieces, params: dict, comm):
        self.pieces, self.params, self.comm = pieces, params, comm

    def read(self, name: str, start: int, stop: int) -> dict:
        p = self.params[name]
        if not hasattr(p, "tp_dim"):
            return self.pieces.read(name, start, stop)
        full_shape = list(p.shape)
        full_shape[p.tp_dim] *= self.comm.world_size
        whole = self.pieces.read(name, 0, p.numel() * self.comm.world_size)
        return {key: t.view(full_shape).chunk(self.comm.world_size, p.tp_dim)[self.comm.rank]
                .reshape(-1)[start:stop] for key, t in whole.items()}

    def scalars(self, name: str) -> dict:
        return self.pieces.scalars(name)


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
    """(checkpoint, the loss of the step it was saved after), oldest first: where to go back to
    when a run diverged."""
    out = []
    for path in checkpoints(out_dir):
        with open(os.path.join(path, "meta.json")) as f:
            out.append((path, json.load(f).get("loss")))
    return out


def clear(out_dir: str):
    """Delete every checkpoint in out_dir, complete or not (train.py --overwrite). Rank 0 only."""
    for entry in os.listdir(out_dir) if os.path.isdir(out_dir) else []:
        if CHECKPOINT.match(entry.removesuffix(".tmp")):
            shutil.rmtree(os.path.join(out_dir, entry))


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

    Collective: every rank calls it. A crash at any point leaves the previous checkpoint whole.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    final = os.path.join(out_dir, f"ckpt-{step:07d}")
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)          # left by a save that crashed
        os.makedirs(tmp)
    dist.barrier()
    # Serialized in memory first, so its checksum costs no second read of the file; load()
    # verifies it: flipped bits inside a tensor would otherwise load as silently wrong weights.
    data = io.BytesIO()
    torch.save(part, data)
    name = f"rank{rank:05d}.pt"
    with open(os.path.join(tmp, name), "wb") as f:
        f.write(data.getbuffer())
        f.flush()
        os.fsync(f.fileno())
    with open(os.path.join(tmp, name + ".sha256"), "w") as f:
        f.write(_sha256(data.getbuffer()))
    dist.barrier()                                     # every part is on disk ...
    if rank == 0:
        checksums = {}
        for r in range(world_size):
            with open(os.path.join(tmp, f"rank{r:05d}.pt.sha256")) as f:
                checksums[f"rank{r:05d}.pt"] = f.read()
            os.remove(os.path.join(tmp, f"rank{r:05d}.pt.sha256"))
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump({**meta, "step": step, "world_size": world_size, "sha256": checksums}, f, indent=1)
        shutil.rmtree(final, ignore_errors=True)       # the same step saved again after a resume
        os.rename(tmp, final)                          # ... before the checkpoint exists at all
        older = sorted(e for e in os.listdir(out_dir) if CHECKPOINT.match(e))[:-keep]
        for entry in older:
            shutil.rmtree(os.path.join(out_dir, entry))
    dist.barrier()
    return final


def load(path: str) -> tuple[dict, list[dict]]:
    """(meta, [part of rank 0, ...]) of a complete checkpoint, or one CheckpointError naming the fix.

    Every rank checks every part's checksum and reads every part (memory-mapped: only the
    pieces it copies come into memory), so every rank finds the same damage and stops with
    the same message.
    """
    fix = f"delete {path} to resume from the checkpoint before it"
    try:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not a complete checkpoint ({e}); {fix}") from None
    parts = []
    for rank in range(meta["world_size"]):
        file = os.path.join(path, f"rank{rank:05d}.pt")
        expected = meta.get("sha256", {}).get(f"rank{rank:05d}.pt")    # older checkpoints: none
        try:
            if expected is not None and _file_sha256(file) != expected:
                raise CheckpointError(f"{file} is corrupt or truncated (its bytes no longer match "
                                      f"the checksum saved with it); {fix}")
            parts.append(torch.load(file, mmap=True, weights_only=True))
        except CheckpointError:
            raise
        except Exception as e:      # truncated or corrupt: in our words, not the unpickler's
            raise CheckpointError(f"{file} is corrupt or truncated (it does not read back as a "
                                  f"checkpoint part: {type(e).__name__}); {fix}") from None
    return meta, parts


def check_same_model(saved: dict, current: dict, path: str, ignore: tuple = ()):
    """The saved model configuration must equal this run's: name the first field that differs."""
    for field in sorted(set(saved) | set(current)):
        if field not in ignore and saved.get(field) != current.get(field):
            raise CheckpointError(f"{path} holds a model with {field}={saved.get(field)!r}, this run "
                                  f"builds {field}={current.get(field)!r}: use the checkpoint's "
                                  f"--model (and overrides), or another --out")


def all_finite(pieces: list[dict], device: torch.device) -> bool:
    """Whether every rank's weights are finite: a checkpoint with NaNs is never written."""
    finite = all(bool(torch.isfinite(piece["tensors"]["param"]).all()) for piece in pieces)
    flag = torch.tensor([0.0 if finite else 1.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)        # one rank's NaN stops every rank's save
    return flag.item() == 0.0
