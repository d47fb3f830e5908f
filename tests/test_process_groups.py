"""Process groups (process_groups.py): picklable objects gathered over the ranks arrive whole.

Joining the job runs in every spawned test; the groups every rank creates and the meshes are
checked in tests/test_pipeline.py and tests/test_tensor_parallel.py, and the same-model check
at start-up in tests/test_snapshot.py.
"""
import pytest
import torch

from collectives import Comm
from multiprocess import run_ranks
from process_groups import gather_objects


def _gathered_objects():
    comm = Comm()
    r = comm.rank
    mine = {"rank": r, "text": "x" * (1000 * r + 1), "tensor": torch.arange(3 * r + 1.0)}  # sizes differ
    return gather_objects(mine, comm, torch.device("cpu")), gather_objects(mine, comm, torch.device("cpu"), dst=1)


@pytest.mark.parametrize("world_size", [3])
def test_gather_objects_without_numpy(world_size):
    """Python objects of different sizes (tensors inside) arrive whole and in rank order, on
    every rank or on one; pickled into a uint8 tensor, so no numpy is needed (CI has none)."""
    for rank, (everywhere, at_one) in enumerate(run_ranks(_gathered_objects, world_size)):
        for objects in [everywhere] + ([at_one] if rank == 1 else []):
            assert [o["rank"] for o in objects] == list(range(world_size))
            assert [len(o["text"]) for o in objects] == [1000 * i + 1 for i in range(world_size)]
            for i, o in enumerate(objects):
                assert torch.equal(o["tensor"], torch.arange(3 * i + 1.0))
        if rank != 1:
            assert at_one is None
