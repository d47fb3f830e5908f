"""foundations/placements.py: the records, the one gradient norm, the data dimension's reduction, and the
rule that concept files read placements instead of each other's tags."""
import pathlib
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from composition.mesh_optimizer import on_mesh
from multiprocess import run_ranks
from test_imports import _project_files
from foundations.placements import by_reduction, data_reduction, norm_weight, place, placement, tensor_dim

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _group(n):
    return SimpleNamespace(world_size=n, rank=0)


def test_a_record_merges_its_dimensions_and_defaults_to_replicated():
    p = nn.Parameter(torch.zeros(4, 4))
    assert placement(p).shard == {} and placement(p).counted and tensor_dim(p) is None
    place(p, shard={"tp": 1})
    place(p, shard={"pp": None}, partial="tp")
    assert placement(p).shard == {"tp": 1, "pp": None}      # the second split kept the first's
    assert tensor_dim(p) == 1 and tensor_dim(p, "pp") is None and placement(p).partial == "tp"
    assert placement(nn.Parameter(torch.zeros(1))).shard == {}  # records are per parameter


def test_norm_weight_counts_each_value_once_over_the_groups():
    """A value k ranks of the summed groups hold counts 1/k on each: tp 2 x pp 3 x ep 4."""
    split = {"tp": _group(2), "pp": _group(3), "ep": _group(4)}
    every_dim = place(nn.Parameter(torch.zeros(1)), shard={"tp": 0, "pp": None, "ep": None})
    stage_only = place(nn.Parameter(torch.zeros(1)), shard={"pp": None})
    tied_copy = place(nn.Parameter(torch.zeros(1)), shard={"pp": None}, counted=False)
    assert norm_weight(every_dim, split) == 1.0
    assert norm_weight(stage_only, split) == pytest.approx(1 / (2 * 4))
    assert norm_weight(tied_copy, split) == 0.0
    assert norm_weight(nn.Parameter(torch.zeros(1)), split) == pytest.approx(1 / 24)
    assert norm_weight(stage_only, split, copies=2) == pytest.approx(1 / 16)   # HSDP's copies too


def test_data_reduction_averages_replicas_and_sums_an_experts_holders():
    data, holders = _group(8), _group(2)
    shared = nn.Parameter(torch.zeros(1))
    expert = place(nn.Parameter(torch.zeros(1)), shard={"ep": None}, holders=holders)
    assert data_reduction(shared, data) == (data, "avg", 1)
    # Its gradient sums the ep group's tokens already: summed over its 2 holders, / all 8 ranks.
    assert data_reduction(expert, data) == (holders, "sum", 8)
    assert data_reduction(expert, data, world=16) == (holders, "sum", 16)     # HSDP: copies too
    other = nn.Parameter(torch.zeros(1))
    groups = by_reduction([expert, shared, other], data)
    assert [part for _, part in groups] == [[shared, other], [expert]]       # replicated first


def _norm_on_a_mesh():
    """tp 2 x pp 2 on 4 ranks: this rank's pieces of five gradients, and the norm from them."""
    from foundations.comm import Comm
    from mixed_precision import MixedPrecisionOptimizer
    from foundations.process_groups import make_mesh
    tensor, stages = make_mesh(Comm(), 2)
    torch.manual_seed(0)                                    # the whole model's gradients, everywhere
    whole = {"w0": torch.randn(4, 6), "b0": torch.randn(6), "emb": torch.randn(5, 3),
             "w1": torch.randn(6, 4), "b1": torch.randn(4)}
    params = []

    def hold(name, grad, **record):
        p = place(nn.Parameter(torch.zeros_like(grad)), **record)
        p.grad = grad.clone()
        params.append(p)

    if stages.rank == 0:
        hold("w0", whole["w0"].chunk(2, 0)[tensor.rank], shard={"tp": 0, "pp": None})
        hold("b0", whole["b0"], shard={"pp": None})
        hold("emb", whole["emb"], shard={"pp": None})
    else:
        hold("w1", whole["w1"].chunk(2, 1)[tensor.rank], shard={"tp": 1, "pp": None})
        hold("b1", whole["b1"], shard={"pp": None})
        # The tied copy: its gradient is the first stage's, counted there (a different value
        # here shows it is not read).
        hold("emb", 100 * torch.ones(5, 3), shard={"pp": None}, counted=False)
    optimizer = MixedPrecisionOptimizer(params, torch.optim.SGD, lr=0.0)
    optimizer = on_mesh([optimizer], {"tp": tensor, "pp": stages})
    norm = optimizer.clip_grad_norm_(1e9).item()
    return norm, torch.cat([g.reshape(-1) for g in whole.values()]).norm().item()


def test_the_global_norm_counts_every_piece_once_on_a_tensor_by_pipeline_mesh():
    """Slices summed over tp, replicated weights once, stages added, a tied copy left out: every
    rank's norm equals the one-process norm of the whole model's gradient (fp32 sums of about 60
    squares in another order: 1e-6 relative)."""
    for norm, reference in run_ranks(_norm_on_a_mesh, 4):
        assert norm == pytest.approx(reference, rel=1e-6)


def test_no_concept_file_reads_another_strategys_tags():
    """The tags placements replaced (tp_dim, tp_partial, expert_parallel marks, expert_group,
    counted_elsewhere, stage_norm, rest_norm) appear in no project file, and the squares of a
    gradient are summed in one place only: placements.grad_norm."""
    gone = ["tp_dim", "tp_partial", ".expert_parallel =", "expert_group", "counted_elsewhere",
            "stage_norm", "rest_norm", "split_norm"]
    for path in _project_files().values():               # every module, its packages' too
        text = path.read_text()
        for word in gone:
            assert word not in text, f"{path.name} still says {word!r}"
        if path.name != "placements.py":
            assert ".pow(2).sum()" not in text, f"{path.name} sums squares: use placements.grad_norm"


def test_the_concept_optimizers_know_nothing_of_the_mesh():
    """Composition, not inheritance: mixed precision's, ZeRO's and FSDP's optimizers step the group
    they are given; the placements, the mesh's splits and the experts' groups are read by the
    composition (composition/mesh_optimizer.py) only, which hands them the global norm."""
    for name in ("mixed_precision", "zero", "mechanics/fsdp_optimizer"):
        text = (ROOT / f"{name}.py").read_text()
        for word in ("import placements", "from placements", "foundations.placements", "split_model", "by_reduction",
                     "norm_weight", "holders"):
            assert word not in text, f"{name}.py says {word!r}: the mesh is the composition's " \
                                     f"(mesh_optimizer.py)"
