"""The optimizer around the optimizer: what every optimizer of the project shares.

Each of our optimizers (mixed_precision.py's, zero.py's, FSDP's, a mesh's) is a
torch.optim.Optimizer that the training loop and an lr scheduler drive, around an inner torch
optimizer that only ever sees the fp32 master weights. Here is that plumbing, written once:
the shared param_groups (wrap_inner), the checks on what the loop passes, the step's one
device-to-host read, and the state_dict that saves the masters beside the inner state.
MasterWeightsOptimizer puts the state_dict and the checks together as the base class of an
optimizer that holds every master (mixed_precision.py's).
Test: python -m pytest tests/test_mixed_precision.py
"""
import torch


def wrap_inner(outer: torch.optim.Optimizer,
               inner: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make outer a torch.optim.Optimizer whose param_groups and state are inner's own (the
    inner optimizer only ever sees the masters): a scheduler that sets group["lr"] on outer sets
    it for the inner step (add_param_group keeps the dict it is given). Returns inner."""
    torch.optim.Optimizer.__init__(outer, inner.param_groups, inner.defaults)
    outer.state = inner.state
    return inner


def refuse_new_groups(optimizer, param_group: dict):
    """add_param_group: during construction (wrap_inner) as torch's; after it, refused."""
    if hasattr(optimizer, "optimizer"):          # built: the masters are laid out
        raise ValueError(f"{type(optimizer).__name__} lays out its fp32 masters once, when it is "
                         f"built: pass every parameter to the constructor")
    torch.optim.Optimizer.add_param_group(optimizer, param_group)


def run_closure(closure):
    with torch.enable_grad():
        return None if closure is None else closure()


def check_max_norm(max_norm: float):
    if max_norm <= 0:
        raise ValueError(f"clip_grad_norm_: max_norm must be > 0, got {max_norm}")


def read_decision(norm: torch.Tensor,
                  flags: torch.Tensor | None = None) -> tuple[float, list | None]:
    """The step's one device-to-host read (a host sync on a GPU): returns (the global norm as a
    float, whose finiteness is the decision, step or skip; any flags the step needs on the host,
    a sharded step's used-flags, read in the same copy, else None)."""
    if flags is None:
        return norm.item(), None
    norm, *flags = torch.cat([norm.reshape(1).float(), flags.float()]).tolist()
    return norm, flags


def optimizer_state(optimizer, shard: dict | None = None) -> dict:
    """An optimizer's state_dict: inner state, fp32 masters, loss scale (plus, sharded, which
    shard: {"rank", "world_size"}). train.py's checkpoints save by parameter name
    (running/snapshot.py)."""
    return {"optimizer": optimizer.optimizer.state_dict(), "scaler": optimizer.scaler.state_dict(),
            "masters": [m.detach().clone() for m in optimizer.masters], **(shard or {})}


@torch.no_grad()
def load_masters(optimizer, state: dict, shard: dict | None = None):
    """optimizer_state's inverse into optimizer's inner state, masters and loss scale, checked:
    the same shard, the same masters' shapes."""
    if shard and (state["rank"], state["world_size"]) != (shard["rank"], shard["world_size"]):
        raise ValueError(f"this state is rank {state['rank']} of {state['world_size']}'s shard; "
                         f"load it on rank {state['rank']} of a world of {state['world_size']}")
    masters = optimizer.masters
    if [m.shape for m in state["masters"]] != [m.shape for m in masters]:
        raise ValueError(f"the state holds {len(state['masters'])} master weights that do not "
                         f"match this optimizer's {len(masters)}: build the same model (and "
                         f"freeze the same parameters) before loading")
    inner = optimizer.optimizer
    # Keep the objects wrap_inner shared (a scheduler holds them too): torch's load_state_dict
    # makes new groups and state, whose values are copied into the old objects below.
    groups, inner_state = inner.param_groups, inner.state
    inner.load_state_dict(state["optimizer"])
    for group, loaded in zip(groups, inner.param_groups):
        group.update(loaded)
    inner_state.clear()
    inner_state.update(inner.state)
    inner.param_groups, inner.state = groups, inner_state      # the same objects, the loaded values
    optimizer.scaler.load_state_dict(state["scaler"])
    for master, saved in zip(masters, state["masters"]):
        master.copy_(saved)


def element_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """A torch optimizer's per-element state (Adam's moments), not its step counts."""
    return [v for s in optimizer.state.values() for v in s.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0]


class MasterWeightsOptimizer(torch.optim.Optimizer):
    """A torch.optim.Optimizer whose inner optimizer steps fp32 masters: what it answers beside
    its step (mixed_precision.py's optimizer is one).

    A subclass sets self.optimizer (the inner one, set last: add_param_group then refuses),
    self.masters and self.scaler, and defines refresh_params() (the model follows the masters)."""

    def add_param_group(self, param_group: dict):
        refuse_new_groups(self, param_group)

    def state_dict(self) -> dict:
        """Inner state, fp32 masters, loss scale."""
        return optimizer_state(self)

    @torch.no_grad()
    def load_state_dict(self, state: dict):
        """state_dict's inverse, checked (load_masters); then the model follows the masters."""
        load_masters(self, state)
        self.refresh_params()

    def state_tensors(self) -> list[torch.Tensor]:
        """The fp32 masters and the inner optimizer's state (memory_math.held_bytes counts them)."""
        return [*self.masters, *element_state(self.optimizer)]
