"""running/pieces.py: training state by parameter name and element range, the format that reshards.

A rank's share of the weights and optimizer state is a list of pieces, each naming one
parameter and the element range start:stop of it (flattened) that this rank holds: DDP's rank
0 a whole parameter, ZeRO's and FSDP's ranks the ranges their shards cover (a parameter may be
cut in two). Joined by name, every rank's pieces read back any other range: so a checkpoint
saved at one world size and strategy loads at another. Tensor parallelism's split matrices are
gathered whole first. The files and the run directory: running/snapshot.py.
Test: python -m pytest tests/test_snapshot.py
"""
import torch
import torch.distributed as dist

from foundations.dtypes import master_dtype
from foundations.placements import tensor_dim
from foundations.process_groups import gather_objects


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
    """This rank's pieces, from an optimizer with master_ranges() (mixed_precision.py, foundations/flat.py)."""
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
        tensors = {key: _wide(t.detach().reshape(-1)[offset: offset + stop - start]).cpu().clone()
                   for key, t in ranged.items()}
        pieces.append({"name": names[param], "start": start, "stop": stop,
                       "tensors": tensors, "scalars": scalars})
    return pieces


def _wide(t: torch.Tensor) -> torch.Tensor:
    """t in fp32, what a checkpoint holds (an fp64 run's in fp64: dtypes.master_dtype)."""
    return t.to(master_dtype(t.dtype))


def whole_piece(name: str, t: torch.Tensor) -> dict:
    """A whole tensor as one piece: its fp32 values (fp64's own), flat, on the host."""
    return {"name": name, "start": 0, "stop": t.numel(), "scalars": {},
            "tensors": {"param": _wide(t.detach().reshape(-1)).cpu().clone()}}


def frozen_pieces(model: torch.nn.Module) -> list[dict]:
    """Parameters no optimizer owns (requires_grad=False), whole: saved by rank 0."""
    return [whole_piece(name, p) for name, p in model.named_parameters() if not p.requires_grad]


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
                if name in self.by_name or not missing_from_model else _wide(p.detach())
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
# running/snapshot.py's pieces are flat element ranges; a rank's slice of a column- or row-split
# matrix is not one range. So a save gathers each split parameter (and its optimizer state)
# over the tensor group into one whole piece, and a load reads the whole piece and keeps this
# rank's slice: tp checkpoints are plain full-model checkpoints, loadable at any --tp.

def join_shards(pieces: list[dict], comm, device) -> list[dict]:
    """A sharded optimizer's pieces of a tensor-parallel rank's slices (ZeRO's, FSDP's), joined
    into one whole-slice piece per parameter on comm's first rank (the data group's; the others
    get []): a row-split slice's flat range is not one range of the whole matrix, so the tensor
    group gathers whole slices only. A slice's shards end where it does (their last stop is its
    size), also for the experts other ranks hold (expert parallelism). Collective over comm."""
    every = gather_objects(pieces, comm, device, dst=0)
    if every is None:
        return []
    joined = Pieces([piece for part in every for piece in part])
    sizes = {name: max(piece["stop"] for piece in parts) for name, parts in joined.by_name.items()}
    return [{"name": name, "start": 0, "stop": size, "scalars": joined.scalars(name),
             "tensors": joined.read(name, 0, size)} for name, size in sizes.items()]


def gather_pieces(pieces: list[dict], params: dict, comm) -> list[dict]:
    """Whole-parameter pieces from this rank's pieces of tensor_parallel.py's split parameters
    (those sharded along "tp"); params: {name: parameter}; comm: the tensor group. Collective."""
    whole = []
    for piece in pieces:
        p = params.get(piece["name"])              # None: experts another rank holds (whole)
        if tensor_dim(p) is None:
            whole.append(piece)
            continue
        tensors = {}
        for key, t in piece["tensors"].items():
            # The pieces were copied to the host for the file; the gather runs on the
            # parameter's device (NCCL moves device memory only), the whole piece goes back.
            local = t.to(p.device)
            parts = [torch.empty_like(local) for _ in range(comm.world_size)]
            dist.all_gather(parts, local, group=comm.group)      # a checkpoint, not a training step
            tensors[key] = torch.cat([x.view(p.shape) for x in parts], tensor_dim(p)).reshape(-1).cpu()
        whole.append({**piece, "start": 0, "stop": p.numel() * comm.world_size, "tensors": tensors})
    return whole


class TensorParallelReader:
    """snapshot.Pieces' read() and scalars(), answering with this rank's slice of whole pieces."""

    def __init__(self, pieces, params: dict, comm):
        self.pieces, self.params, self.comm = pieces, params, comm

    def read(self, name: str, start: int, stop: int) -> dict:
        p = self.params[name]
        dim = tensor_dim(p)
        if dim is None:
            return self.pieces.read(name, start, stop)
        full_shape = list(p.shape)
        full_shape[dim] *= self.comm.world_size
        whole = self.pieces.read(name, 0, p.numel() * self.comm.world_size)
        return {key: t.view(full_shape).chunk(self.comm.world_size, dim)[self.comm.rank]
                .reshape(-1)[start:stop] for key, t in whole.items()}

    def scalars(self, name: str) -> dict:
        return self.pieces.scalars(name)


def all_finite(pieces: list[dict], device: torch.device) -> bool:
    """Whether every rank's weights are finite: a checkpoint with NaNs is never written."""
    finite = all(bool(torch.isfinite(piece["tensors"]["param"]).all()) for piece in pieces)
    flag = torch.tensor([0.0 if finite else 1.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)        # one rank's NaN stops every rank's save
    return flag.item() == 0.0
