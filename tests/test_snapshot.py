"""Checkpoints, resume, faults and bad input: nothing lost, nothing hangs (running/snapshot.py, train.py).

train.main runs in spawned CPU ranks (fp32 unless said), each launch doing several runs of a
tiny GPT. Resuming at the same world size must be bit for bit; resuming on another world size
or strategy reorders sums, so it matches within fp32's noise. Faults are real: a rank is
SIGKILLed, a save is cut off between writing and renaming, torchrun restarts a killed job.
"""
import collections
import errno
import hashlib
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from running import divergence, snapshot
import train
from multiprocess import run_ranks, train_logged

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = ["--steps", "6", "--log-every", "1", "--eval-every", "0", "--seq-len", "32",
       "--batch-size", "8", "--warmup", "2", "--eval-batches", "1"]
SAVE_AT = 3                  # --save-every: the checkpoint the resumed runs start from
# Resharded runs: the same global batch, averaged over other ranks in another order; three
# Adam steps after loading. fp32 loss differences stay ~1e-6 relative (measured: 4e-7); the
# weights, moved by lr ~1e-3 per step, agree to ~1e-6 absolute where a mis-mapped shard or a
# lost moment is off by 1e-3 or more. Worst measured (2-core Xeon, test_resharded_resume_matches_
# within_fp32_noise; the weights with test_fsdp's resharded resume too): losses 1.1e-7 relative
# under default, avx2 and avx512 (88x below LOSS_RTOL); weights 1.7e-7 default (118x below
# WEIGHT_ATOL), 2.7e-7 avx2 (75x), 2.3e-7 avx512 (86x).
LOSS_RTOL = 1e-5
WEIGHT_ATOL = 2e-5


def _train(argv, **kwargs):
    return train.main([*RUN, *argv], **kwargs)


def _weights(path):
    return torch.load(path, weights_only=True)["state_dict"]


def _same_weights(a, b, atol=0.0):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def _resume_runs(root, strategy, extra):
    """Straight 6 steps twice (the second saving every 3); then resume a copy from step 3."""
    rank = torch.distributed.get_rank()
    straight, saved, resumed = (os.path.join(root, name) for name in ("straight", "saved", "resumed"))
    out = {"straight": _train(["--strategy", strategy, *extra, "--export", straight + ".pt"])}
    out["saved"] = _train(["--strategy", strategy, *extra, "--out", saved,
                           "--save-every", str(SAVE_AT), "--export", saved + ".pt"])
    if rank == 0:                                 # the run stopped after its first checkpoint
        shutil.copytree(saved, resumed, ignore=shutil.ignore_patterns("ckpt-0000006"))
    torch.distributed.barrier()
    out["resumed"] = _train(["--strategy", strategy, *extra, "--out", resumed,
                             "--save-every", str(SAVE_AT), "--export", resumed + ".pt", "--resume"])
    return out


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    cases = {"single": (1, []), "ddp": (2, []), "zero1": (2, []), "zero2": (2, []),
             # fp16 with dropout: the loss scaler and every rank's RNG stream must carry over
             "zero2-fp16-dropout": (2, ["--precision", "fp16", "--dropout", "0.1"])}
    results = {}
    for case, (world, extra) in cases.items():
        path = os.path.join(root, case)
        os.makedirs(path)
        results[case] = (path, run_ranks(_resume_runs, world, path, case.split("-")[0], extra)[0])
    return results


@pytest.mark.parametrize("case", ["single", "ddp", "zero1", "zero2", "zero2-fp16-dropout"])
def test_resume_is_bit_exact(resumed, case):
    path, out = resumed[case]
    straight, saved, again = out["straight"], out["saved"], out["resumed"]
    # Two identical runs give identical curves, and saving does not disturb a run.
    assert saved["losses"] == straight["losses"]
    # The resumed run logs steps 3..5 exactly as the uninterrupted one, and ends on its weights.
    assert list(again["losses"]) == [3, 4, 5]
    assert again["losses"] == {s: straight["losses"][s] for s in (3, 4, 5)}
    assert again["eval_loss"] == straight["eval_loss"]
    _same_weights(_weights(path + "/resumed.pt"), _weights(path + "/straight.pt"))


def test_checkpoint_round_trips_scaler_rng_and_shards(resumed):
    """The resumed run's final checkpoint equals the uninterrupted run's, file by file."""
    path, _ = resumed["zero2-fp16-dropout"]
    meta_a, parts_a = snapshot.load(os.path.join(path, "saved", "ckpt-0000006"))
    meta_b, parts_b = snapshot.load(os.path.join(path, "resumed", "ckpt-0000006"))
    assert meta_a["world_size"] == meta_b["world_size"] == 2 and meta_a["step"] == 6
    # The growth counter moved (a step may have overflowed at the initial scale and reset
    # it), so restoring it mattered: a fresh scaler would restart the count at 0.
    assert parts_a[0]["scaler"]["clean_steps"] > 0
    for rank, (a, b) in enumerate(zip(parts_a, parts_b)):
        assert a["scaler"] == b["scaler"], rank
        assert torch.equal(a["rng"]["cpu"], b["rng"]["cpu"]), rank
        assert len(a["pieces"]) == len(b["pieces"]) > 0       # zero2: every rank owns a shard
        for pa, pb in zip(a["pieces"], b["pieces"]):
            assert (pa["name"], pa["start"], pa["stop"]) == (pb["name"], pb["start"], pb["stop"])
            assert pa["tensors"].keys() == {"param", "exp_avg", "exp_avg_sq"}
            for key in pa["tensors"]:
                assert torch.equal(pa["tensors"][key], pb["tensors"][key]), (rank, pa["name"], key)
    # dropout drew random numbers: the state moved from the seed's, so restoring it mattered
    torch.manual_seed(0)
    assert not torch.equal(parts_a[0]["rng"]["cpu"], torch.get_rng_state())


def test_replicas_save_once_and_shards_cover_every_parameter(resumed):
    for case, owners in (("ddp", [True, False]), ("zero2", [True, True])):
        path, _ = resumed[case]
        _, parts = snapshot.load(os.path.join(path, "saved", "ckpt-0000006"))
        assert [bool(part["pieces"]) for part in parts] == owners, case
        model = train.load_weights(path + "/saved")          # every element found, on one process
        _same_weights({n: p.detach() for n, p in model.named_parameters()},
                      _weights(path + "/saved.pt"))


# ---- resharding: 4 ranks -> 2 (and 1), across strategies ------------------------------------

def _save_on_four(root):
    return {s: _train(["--strategy", s, "--out", os.path.join(root, s), "--save-every", str(SAVE_AT),
                       "--export", os.path.join(root, s + ".pt")]) for s in ("ddp", "zero2")}


def _resume_elsewhere(root, pairs):
    out = {}
    for saved_by, strategy in pairs:
        target = os.path.join(root, f"{saved_by}-to-{strategy}-{torch.distributed.get_world_size()}")
        if torch.distributed.get_rank() == 0:
            shutil.copytree(os.path.join(root, saved_by), target,
                            ignore=shutil.ignore_patterns("ckpt-0000006"))
        torch.distributed.barrier()
        out[saved_by, strategy] = _train(["--strategy", strategy, "--out", target, "--resume",
                                          "--export", target + ".pt"])
    return out


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("reshard"))
    four = run_ranks(_save_on_four, 4, root)[0]
    two = run_ranks(_resume_elsewhere, 2, root, [("zero2", "zero2"), ("ddp", "zero2"),
                                                 ("zero2", "ddp"), ("zero2", "zero1")])[0]
    one = run_ranks(_resume_elsewhere, 1, root, [("zero2", "single")])[0]
    return root, four, {**two, **one}


@pytest.mark.parametrize("pair", [("zero2", "zero2", 2), ("ddp", "zero2", 2), ("zero2", "ddp", 2),
                                  ("zero2", "zero1", 2), ("zero2", "single", 1)],
                         ids=lambda p: f"{p[0]}x4-to-{p[1]}x{p[2]}")
def test_resharded_resume_matches_within_fp32_noise(resharded, pair):
    root, four, resumed = resharded
    saved_by, strategy, world = pair
    straight, again = four[saved_by], resumed[saved_by, strategy]
    assert list(again["losses"]) == [3, 4, 5]
    for step, loss in again["losses"].items():
        assert loss == pytest.approx(straight["losses"][step], rel=LOSS_RTOL), step
    _same_weights(_weights(os.path.join(root, f"{saved_by}-to-{strategy}-{world}.pt")),
                  _weights(os.path.join(root, saved_by + ".pt")), atol=WEIGHT_ATOL)


# ---- tensor-parallel slices: gathered whole into the file, cut again on load -----------------

WHOLE = torch.arange(6 * 9, dtype=torch.float32).view(6, 9)     # a matrix 3 ranks split either way


def _tensor_parallel_pieces():
    """On 3 ranks: each holds its slice of WHOLE split along dim 0 (a column layer's) and dim 1
    (a row layer's: its flat range is no range of the whole), with a moment beside it; what
    gather_pieces writes, this rank's slice read back from that (TensorParallelReader), and a
    data group's shards of one 11-element slice (4, 4 and 3 elements) joined by join_shards."""
    from foundations.comm import Comm
    from running.pieces import Pieces, TensorParallelReader, gather_pieces, join_shards
    from foundations.placements import place
    comm = Comm()
    r, n = comm.rank, comm.world_size
    params, pieces = {}, []
    for dim in (0, 1):
        name = f"split{dim}.weight"
        params[name] = p = WHOLE.chunk(n, dim)[r].clone()       # (2, 9) or (6, 3)
        place(p, shard={"tp": dim})
        pieces.append({"name": name, "start": 0, "stop": p.numel(), "scalars": {"step": 3},
                       "tensors": {"param": p.reshape(-1).clone(), "exp_avg": -p.reshape(-1)}})
    whole = gather_pieces(pieces, params, comm)
    reader = TensorParallelReader(Pieces(whole), params, comm)
    back = {name: reader.read(name, 0, p.numel()) for name, p in params.items()}
    start, stop = 4 * r, min(4 * r + 4, 11)
    shard = {"name": "slice", "start": start, "stop": stop, "scalars": {"step": 3},
             "tensors": {"param": torch.arange(start, stop, dtype=torch.float32)}}
    return {"whole": whole, "back": back, "joined": join_shards([shard], comm, torch.device("cpu"))}


def test_tensor_parallel_slices_save_whole_and_load_as_each_rank_slice():
    """N = 3 (an odd group: a slice index off by one that 2 ranks hide shows): the pieces a
    checkpoint holds are WHOLE, values and moment, for either split; each rank reads back exactly
    its own slice; a data group's shards of a slice join into the whole slice on its first rank."""
    for rank, out in enumerate(run_ranks(_tensor_parallel_pieces, 3)):
        assert [piece["name"] for piece in out["whole"]] == ["split0.weight", "split1.weight"]
        for dim, piece in enumerate(out["whole"]):
            assert (piece["start"], piece["stop"]) == (0, WHOLE.numel()), (rank, dim)
            assert torch.equal(piece["tensors"]["param"], WHOLE.reshape(-1)), (rank, dim)
            assert torch.equal(piece["tensors"]["exp_avg"], -WHOLE.reshape(-1)), (rank, dim)
            mine = WHOLE.chunk(3, dim)[rank].reshape(-1)
            back = out["back"][f"split{dim}.weight"]
            assert torch.equal(back["param"], mine) and torch.equal(back["exp_avg"], -mine), (rank, dim)
        if rank == 0:
            [joined] = out["joined"]
            assert (joined["name"], joined["start"], joined["stop"]) == ("slice", 0, 11)
            assert torch.equal(joined["tensors"]["param"], torch.arange(11.0))
        else:
            assert out["joined"] == [], rank


# ---- a save cut off between writing and renaming --------------------------------------------

CRASH_IN_RENAME = """
import os, sys
sys.path.insert(0, {root!r})
import train
from running import snapshot
def rename(src, dst):
    if dst.endswith("ckpt-0000006"):
        os._exit(9)                                  # every part written, not yet renamed
    os.replace(src, dst)
snapshot.os.rename = rename
train.main({argv!r})
"""


def _resume_single(out, export):
    return _train(["--out", out, "--resume", "--export", export])


def test_crash_during_save_keeps_the_previous_checkpoint(resumed, tmp_path):
    out = str(tmp_path / "run")
    argv = [*RUN, "--out", out, "--save-every", str(SAVE_AT)]
    code = CRASH_IN_RENAME.format(root=ROOT, argv=argv)
    crashed = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)
    assert crashed.returncode == 9, crashed.stderr
    # The killed run's lock stays behind, stale: the resumed run below takes it over.
    assert sorted(os.listdir(out)) == ["ckpt-0000003", "ckpt-0000006.tmp", "config.json", "lock", "log.txt"]
    assert snapshot.latest(out).endswith("ckpt-0000003")     # the partial one never counts
    again = run_ranks(_resume_single, 1, out, str(tmp_path / "final.pt"))[0]
    path, straight = resumed["single"]
    assert again["losses"] == {s: straight["straight"]["losses"][s] for s in (3, 4, 5)}
    _same_weights(_weights(str(tmp_path / "final.pt")), _weights(path + "/straight.pt"))
    assert sorted(os.listdir(out)) == ["ckpt-0000003", "ckpt-0000006", "config.json", "log.txt"]


CRASH_IN_PRUNE = """
import os, shutil, sys
sys.path.insert(0, {root!r})
import train
from running import snapshot
delete = shutil.rmtree
def rmtree(path, *args, **kwargs):
    if "ckpt-0000003" in path and os.path.isdir(path) and "rank00000.pt" in os.listdir(path):
        os.remove(os.path.join(path, "rank00000.pt"))  # half deleted: meta.json still there
        os._exit(9)
    delete(path, *args, **kwargs)
snapshot.shutil.rmtree = rmtree
train.main({argv!r})
"""


def test_a_kill_while_pruning_leaves_no_half_checkpoint_that_counts(tmp_path):
    """--keep 1 deletes step 3's checkpoint once step 6's exists; killed halfway through that
    delete (a part gone, meta.json not yet), what remains must not count as a checkpoint: every
    one checkpoints() lists still holds every part its meta.json names."""
    out = str(tmp_path / "run")
    argv = [*RUN, "--out", out, "--save-every", str(SAVE_AT), "--keep", "1"]
    crashed = subprocess.run([sys.executable, "-c", CRASH_IN_PRUNE.format(root=ROOT, argv=argv)],
                             cwd=ROOT, capture_output=True, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)
    assert crashed.returncode == 9, crashed.stderr
    for path in snapshot.checkpoints(out):
        with open(os.path.join(path, "meta.json")) as f:
            parts = json.load(f)["sha256"]
        assert all(os.path.exists(os.path.join(path, name)) for name in parts), path
    assert snapshot.latest(out).endswith("ckpt-0000006")


# ---- the run directory: one owner, one branch, outputs checked first, a full disk -------------

def _listing(directory):
    """{name: bytes} of the files directly in directory (its subdirectories by name only)."""
    return {e: open(os.path.join(directory, e), "rb").read() if os.path.isfile(os.path.join(directory, e))
            else None for e in os.listdir(directory)}


def _write_lock(out, host, pid):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "lock"), "w") as f:
        json.dump({"host": host, "pid": pid, "started": "2025-01-01 00:00:00"}, f)


def _refusals(runs):
    """train.main for each argv on this rank: its RunError's message (None: it ran)."""
    messages = []
    for argv in runs:
        try:
            _train(argv)
            messages.append(None)
        except train.RunError as e:
            messages.append(str(e))
    return messages


def test_a_run_directory_in_use_is_refused_on_every_rank_and_left_as_it_was(tmp_path):
    here, there = str(tmp_path / "here"), str(tmp_path / "there")
    _write_lock(here, socket.gethostname(), os.getpid())        # this test's process: alive
    _write_lock(there, "another-node", 1)                        # a pid this host cannot check
    os.makedirs(os.path.join(there, "ckpt-0000001"))             # what --overwrite would delete
    open(os.path.join(there, "ckpt-0000001", "meta.json"), "w").write("{}")
    before = {d: _listing(d) for d in (here, there)}
    ranks = run_ranks(_refusals, 2, [["--strategy", "ddp", "--out", here],
                                     ["--strategy", "ddp", "--out", there, "--overwrite"]])
    assert ranks[0] == ranks[1], ranks                         # every rank, the same words
    live, elsewhere = ranks[0]
    assert live.startswith(f"--out {here} is in use by another run (pid {os.getpid()} on "
                           f"{socket.gethostname()}, started 2025-01-01 00:00:00; {here}/lock)"), live
    assert "another --out" in live and "\n" not in live
    assert f"pid 1 on another-node" in elsewhere and "cannot be checked" in elsewhere, elsewhere
    assert f"delete {there}/lock" in elsewhere and "\n" not in elsewhere
    # Nothing started: no log, no config, --overwrite deleted nothing, the lock is the owner's.
    assert {d: _listing(d) for d in (here, there)} == before


def test_a_stale_lock_is_named_and_taken_over(tmp_path):
    out = str(tmp_path / "run")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()                                       # its pid names no running process now
    _write_lock(out, socket.gethostname(), gone.pid)
    _, printed = run_ranks(train_logged, 1, [*RUN, "--steps", "1", "--out", out])[0]
    assert (f"--out {out}: took over {out}/lock from a run that is no longer running (pid "
            f"{gone.pid} on {socket.gethostname()}") in printed, printed
    assert "took over" in open(os.path.join(out, "log.txt")).read()
    assert not os.path.exists(os.path.join(out, "lock"))        # released when the run ended


@pytest.mark.parametrize("pid, says", [
    (2**40, "took over {lock} from a run that is no longer running (pid 1099511627776 on {host}"),
    (0, "--out {out}: {lock} exists but names no run"),
    (-1, "--out {out}: {lock} exists but names no run"),
])
def test_a_lock_naming_a_pid_no_process_can_have_is_stale_or_damaged(pid, says, tmp_path):
    """A pid too large for the OS (os.kill raised OverflowError) is no running process: stale,
    taken over. 0 and -1 are no pid at all (os.kill would ask about a process group, or every
    process): the lock names no run."""
    out = str(tmp_path / "run")
    _write_lock(out, socket.gethostname(), pid)
    says = says.format(out=out, lock=os.path.join(out, "lock"), host=socket.gethostname())
    try:
        said = snapshot.lock(out)
        snapshot.unlock(out)
    except snapshot.RunError as e:
        said = str(e)
    assert says in said and "\n" not in said, said


def _branching_runs(out):
    """The issue's case: a run saves 8, 10, 12; resumed from 8 at another --lr, it saves 9, 10,
    11 (--keep 3); then a plain --resume. Returns what each run printed."""
    first = train_logged([*RUN, "--out", out, "--steps", "12", "--save-every", "2"])[1]
    branch = train_logged([*RUN, "--out", out, "--steps", "11", "--save-every", "1", "--lr", "1e-3",
                           "--resume", os.path.join(out, "ckpt-0000008")])[1]
    latest = train_logged([*RUN, "--out", out, "--steps", "12", "--save-every", "1", "--lr", "1e-3",
                           "--resume"])[1]
    return first, branch, latest


def test_resuming_an_earlier_checkpoint_sets_the_later_ones_aside(tmp_path):
    out = str(tmp_path / "run")
    first, branch, latest = run_ranks(_branching_runs, 1, out)[0]
    assert "saved " + os.path.join(out, "ckpt-0000012") in first
    aside = [e for e in os.listdir(out) if e.startswith("abandoned-")]
    assert len(aside) == 1, os.listdir(out)
    aside = os.path.join(out, aside[0])
    # The old branch's checkpoints after 8 went aside whole, named in the log; --keep 3 kept
    # the new branch's 9, 10, 11 (then 10, 11, 12 after the last run's save at 12).
    assert f"(ckpt-0000010, ckpt-0000012) are moved to {aside}" in branch, branch
    assert sorted(os.listdir(aside)) == ["ckpt-0000010", "ckpt-0000012"]
    for name, step in (("ckpt-0000010", 10), ("ckpt-0000012", 12)):
        meta, _ = snapshot.load(os.path.join(aside, name))           # complete, checksums intact
        assert meta["step"] == step and meta["args"]["lr"] == 2e-3   # the old branch's rate
    assert re.findall(r"saved \S+/(ckpt-\d+)", branch) == ["ckpt-0000009", "ckpt-0000010", "ckpt-0000011"]
    # "latest" is the new branch's: 11, not the abandoned 12.
    assert f"resumed from {os.path.join(out, 'ckpt-0000011')} at step 11" in latest, latest
    kept = [os.path.basename(p) for p in snapshot.checkpoints(out)]
    assert kept == ["ckpt-0000010", "ckpt-0000011", "ckpt-0000012"]
    for name in kept:
        meta, _ = snapshot.load(os.path.join(out, name))
        assert meta["args"]["lr"] == 1e-3, name                       # every one the new branch's


SMALL = ["--seq-len", "16", "--batch-size", "4", "--save-every", "1", "--log-every", "100"]


def _checkpoint_files(directory):
    """(checkpoint, file, bytes) of every checkpoint file under directory, wherever it sits."""
    return collections.Counter((os.path.basename(d), f, open(os.path.join(d, f), "rb").read())
                               for d, _, files in os.walk(directory) for f in files
                               if snapshot.CHECKPOINT.match(os.path.basename(d)))


def _other_lines_runs(root):
    """The issue's cases: A holds a branch (3, 4, 5) beside an abandoned one (4, 6), and is resumed
    from the abandoned 6; Y, another run (another seed), is resumed from A's 9. For each of those
    two resumes: what it printed, and every checkpoint file in its --out before it."""
    a, y = os.path.join(root, "A"), os.path.join(root, "Y")
    train_logged([*RUN, *SMALL, "--out", a, "--steps", "6", "--save-every", "2"])
    train_logged([*RUN, *SMALL, "--out", a, "--steps", "5", "--resume", os.path.join(a, "ckpt-0000002")])
    abandoned = next(e for e in os.listdir(a) if e.startswith("abandoned-"))
    before_a = _checkpoint_files(a)
    from_abandoned = train_logged([*RUN, *SMALL, "--out", a, "--steps", "9", "--resume",
                                   os.path.join(a, abandoned, "ckpt-0000006")])[1]
    train_logged([*RUN, *SMALL, "--out", y, "--steps", "2", "--seed", "1"])
    before_y = _checkpoint_files(y)
    from_a = train_logged([*RUN, *SMALL, "--out", y, "--steps", "10", "--resume",
                           os.path.join(a, "ckpt-0000009")])[1]
    return {"A": (from_abandoned, before_a), "Y": (from_a, before_y)}


def test_resuming_a_checkpoint_of_another_line_sets_all_of_out_aside(tmp_path):
    runs = run_ranks(_other_lines_runs, 1, str(tmp_path))[0]
    for out, held, kept in (("A", "ckpt-0000003, ckpt-0000004, ckpt-0000005",
                             ["ckpt-0000007", "ckpt-0000008", "ckpt-0000009"]),
                            ("Y", "ckpt-0000001, ckpt-0000002", ["ckpt-0000010"])):
        printed, before = runs[out]
        out = str(tmp_path / out)
        # Every checkpoint --out held went aside, named in one line, in a directory of its own.
        moved = [line for line in printed.splitlines() if "are moved to" in line]
        assert len(moved) == 1 and f"not one of {out}'s own checkpoints" in moved[0], printed
        aside = re.search(r"\(([^)]*)\) are moved to (\S+);", moved[0])
        assert aside.group(1) == held and os.path.dirname(aside.group(2)) == out, moved[0]
        assert sorted(os.listdir(aside.group(2))) == held.split(", ")
        # Nothing deleted: every checkpoint file from before is on disk, byte for byte; --keep
        # pruned only this run's own.
        lost = before - _checkpoint_files(out)
        assert not lost, sorted(f"{checkpoint}/{name}" for checkpoint, name, _ in lost)
        assert [os.path.basename(p) for p in snapshot.checkpoints(out)] == kept


def test_export_path_is_checked_before_any_work(tmp_path):
    missing, directory = str(tmp_path / "no" / "model.pt"), str(tmp_path / "exports")
    os.makedirs(directory)
    outs = [str(tmp_path / "a"), str(tmp_path / "b")]
    ranks = run_ranks(_refusals, 2, [["--strategy", "ddp", "--out", outs[0], "--export", missing],
                                     ["--strategy", "ddp", "--out", outs[1], "--export", directory]])
    assert ranks[0] == ranks[1], ranks
    no_dir, is_dir = ranks[0]
    assert no_dir == f"--export {missing}: no directory {tmp_path / 'no'}: create it, or export elsewhere"
    assert is_dir.startswith(f"--export {directory} is a directory: give the file to write, e.g. "
                             f"{directory}/model.pt"), is_dir
    for out in outs:                        # refused before any work: no log, no checkpoint
        assert os.listdir(out) == [], os.listdir(out)
    assert os.listdir(directory) == [] and not os.path.exists(missing + ".tmp")


def _disk_full_at_step_6(out):
    """Rank 1's fsync of its part of the checkpoint after step 6 finds the disk full (the
    bytes were written, the file system could not keep them). Returns (the RunError's
    message, the bytes of this rank's part of that checkpoint)."""
    rank, fsync, part_bytes = torch.distributed.get_rank(), os.fsync, []

    def full(fd):
        # the parts of checkpoints 3 and 6: megabytes (the lock and config.json: a few hundred bytes)
        if os.fstat(fd).st_size > 2**16 and len(part_bytes) < 2:
            part_bytes.append(os.fstat(fd).st_size)
            if rank == 1 and len(part_bytes) == 2:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        fsync(fd)
    snapshot.os.fsync = full                # this rank's process only (a fresh one per rank)
    try:
        _train(["--strategy", "zero2", "--out", out, "--save-every", str(SAVE_AT)])
        return None, part_bytes[-1]
    except train.RunError as e:
        return str(e), part_bytes[-1]


def test_a_full_disk_stops_every_rank_with_one_line_and_frees_the_partial_save(tmp_path):
    out = str(tmp_path / "run")
    ranks = run_ranks(_disk_full_at_step_6, 2, out)
    messages, parts = [m for m, _ in ranks], [b for _, b in ranks]
    assert messages[0] == messages[1] and messages[0] is not None, messages
    needed = sum(parts)                               # both ranks' shards: what the save needs
    assert messages[0].startswith(f"saving {out}/ckpt-0000006 failed on rank 1: No space left on "
                                  f"device (the disk or quota of {out} is full); the checkpoint "
                                  f"needs {needed:,} bytes"), messages[0]
    assert f"the last complete checkpoint is {out}/ckpt-0000003" in messages[0]
    assert "\n" not in messages[0]
    assert sorted(os.listdir(out)) == ["ckpt-0000003", "config.json", "log.txt"]   # no .tmp, no lock
    meta, parts = snapshot.load(os.path.join(out, "ckpt-0000003"))    # every checksum still matches
    assert meta["step"] == 3 and len(parts) == 2


# ---- a rank dies ----------------------------------------------------------------------------

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_killed_rank_stops_the_other_with_a_clear_message():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    argv = [sys.executable, "train.py", "--strategy", "ddp", *RUN, "--steps", "100000", "--timeout", "10"]
    ranks = [subprocess.Popen(argv, cwd=ROOT, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    try:
        for line in ranks[0].stdout:                        # training is under way ...
            if line.startswith("step     3 |"):
                break
        ranks[1].send_signal(signal.SIGKILL)                # ... when rank 1 dies
        killed_at = time.monotonic()
        code = ranks[0].wait(timeout=30)
        waited = time.monotonic() - killed_at
        stderr = ranks[0].stderr.read()
    finally:
        for p in ranks:
            p.kill()
            p.wait()
    assert code == 1 and waited < 10 + 5, (code, waited, stderr)   # within --timeout, never a hang
    assert "rank 0 lost contact with the other ranks" in stderr and "--resume" in stderr, stderr
    assert "Traceback" not in stderr, stderr


def _children(pid):
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(entry))
            except OSError:
                pass
    return kids


def _straight_zero2(export):
    return _train(["--strategy", "zero2", "--steps", "30", "--export", export])


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds torchrun's workers through /proc")
def test_torchrun_restart_resumes_and_finishes_like_an_uninterrupted_run(tmp_path):
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            "--max-restarts=1", "train.py", *RUN, "--strategy", "zero2", "--steps", "30",
            "--save-every", "10", "--out", str(tmp_path / "run"), "--resume", "auto",
            "--export", str(tmp_path / "restarted.pt")]
    job = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, killed = [], False
    for line in job.stdout:
        lines.append(line)
        if not killed and line.startswith("step    15 |"):    # after the checkpoint at 10
            os.kill(max(_children(job.pid)), signal.SIGKILL)
            killed = True
    assert job.wait(timeout=120) == 0, "".join(lines)
    log = "".join(lines)
    # Whether rank 0 logs "lost contact" first or torchrun's agent SIGTERMs it first is a race
    # (seen both ways); the message itself is test_killed_rank_stops_the_other_with_a_clear_message's.
    assert killed and "resumed from" in log and "ckpt-0000010" in log, log
    final = float(re.findall(r"done \| eval loss ([\d.]+)", log)[-1])
    straight = run_ranks(_straight_zero2, 2, str(tmp_path / "straight.pt"))[0]
    assert final == round(straight["eval_loss"], 4)                   # the log's 4 decimals
    # Resume is bit-exact: the restarted job's final weights are the uninterrupted run's.
    _same_weights(_weights(tmp_path / "restarted.pt"), _weights(tmp_path / "straight.pt"))


# ---- numerics -------------------------------------------------------------------------------

def _nan_at_step_4(out):
    """The loss turns NaN at the fifth forward pass: the run stops, the last checkpoint stays."""
    from model import GPT
    forward, calls = GPT.forward, [0]

    def poisoned(self, idx, targets=None):
        logits, loss = forward(self, idx, targets)
        calls[0] += 1
        return logits, loss * float("nan") if calls[0] == 5 else loss
    GPT.forward = poisoned
    try:
        _train(["--strategy", "zero2", "--precision", "bf16", "--out", out, "--save-every", str(SAVE_AT)])
    except train.RunError as e:
        return str(e)


def test_nan_loss_stops_every_rank_and_writes_no_checkpoint(tmp_path):
    messages = run_ranks(_nan_at_step_4, 2, str(tmp_path / "run"))
    for message in messages:                       # NaN on each rank's batch, the same decision
        assert message is not None and message.startswith("step 4:") and "inf/NaN in bf16" in message
    assert snapshot.latest(str(tmp_path / "run")).endswith("ckpt-0000003")
    assert not [e for e in os.listdir(tmp_path / "run") if e.startswith("ckpt-0000006")]


def _nan_weights_refused():
    piece = {"name": "w", "start": 0, "stop": 2, "scalars": {},
             "tensors": {"param": torch.tensor([1.0, float("nan")] if torch.distributed.get_rank() else [1.0, 2.0])}}
    return snapshot.all_finite([piece], torch.device("cpu"))


def test_nan_weights_on_one_rank_refuse_the_save_everywhere():
    assert run_ranks(_nan_weights_refused, 2) == [False, False]


# ---- no leak ---------------------------------------------------------------------------------

def _live_bytes(strategies):
    split = {"tp": ["--tp", "2"], "pipeline": ["--pp", "2", "--microbatches", "2"]}
    return {s: _train(["--strategy", s, *split.get(s, []), "--steps", "60", "--log-every", "10",
                       "--eval-every", "20", "--batch-size", "4", "--seq-len", "16"],
                      live_bytes=True)["live_bytes"]
            for s in strategies}


def test_memory_is_flat_from_step_10_to_60():
    runs = {**run_ranks(_live_bytes, 1, ["single"])[0],
            **run_ranks(_live_bytes, 2, ["ddp", "zero1", "zero2", "tp", "pipeline"])[0]}
    for strategy, live in runs.items():
        assert set(live) >= {10, 30, 59}
        # Every CPU tensor alive in the process, counted after the step: the same bytes at
        # step 59 as at step 10, two evals later (logged losses are floats; gradients and
        # buckets are reused). A leak of any size per step, or per eval, shows as a difference.
        assert live[59] == live[10], (strategy, live)


# ---- bad input: one clear message on every rank, before any work ----------------------------

def _bad_inputs(root):
    """Each case's error on this rank: (kind, message)."""
    os.environ["WORLD_SIZE"] = str(torch.distributed.get_world_size())
    rank = torch.distributed.get_rank()
    empty, short = os.path.join(root, "empty.txt"), os.path.join(root, "short.txt")
    corrupt, other = os.path.join(root, "corrupt"), os.path.join(root, "other")
    cases = {
        "seq_len": ["--seq-len", "1000"],
        "no_file": ["--data", os.path.join(root, "missing.txt")],
        "empty_file": ["--data", empty],
        "short_file": ["--data", short],
        "no_checkpoint": ["--out", os.path.join(root, "none"), "--resume"],
        "corrupt": ["--out", corrupt, "--resume"],
        "other_model": ["--out", other, "--resume", "--model", "medium"],
        "different_ranks": ["--model", "tiny" if rank == 0 else "medium"],
    }
    results = {}
    for name, argv in cases.items():
        try:
            train.main(["--strategy", "ddp", *RUN, *argv])
            results[name] = ("no error", "")
        except SystemExit as e:                    # argparse: usage + message on stderr, exit 2
            results[name] = ("usage", str(e.code))
        except (train.RunError, snapshot.CheckpointError) as e:
            results[name] = (type(e).__name__, str(e))
    return results


@pytest.fixture(scope="module")
def bad(tmp_path_factory, resumed):
    root = tmp_path_factory.mktemp("bad")
    (root / "empty.txt").write_bytes(b"")
    (root / "short.txt").write_bytes(b"x" * 500)
    source = os.path.join(resumed["ddp"][0], "saved")
    shutil.copytree(source, root / "other")
    shutil.copytree(source, root / "corrupt")
    part = root / "corrupt" / "ckpt-0000006" / "rank00000.pt"
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])        # truncated
    return run_ranks(_bad_inputs, 2, str(root))


def _stderr_of_parse(argv, capsys):
    with pytest.raises(SystemExit):
        train.parse_args(argv)
    return capsys.readouterr().err


@pytest.mark.parametrize("argv, fix", [
    (["--seq-len", "1000"], "use --seq-len 128 or less"),
    (["--data", "/no/such/file"], "no such file"),
    (["--resume"], "--resume and --save-every need a run directory: add --out DIR"),
    (["--model", "huge"], "invalid choice: 'huge'"),
    (["--precision", "fp8"], "invalid choice: 'fp8'"),
    (["--sample"], "add --init-from RUN_DIR"),
    (["--out", "run", "--resume", "--init-from", "other"], "use one"),
])
def test_bad_command_line_names_the_fix(argv, fix, capsys):
    assert fix in _stderr_of_parse(argv, capsys)


def test_data_file_checks(bad, tmp_path, capsys):
    for rank_results in bad:
        assert rank_results["no_file"][0] == rank_results["empty_file"][0] == "usage"
    err = _stderr_of_parse(["--data", str(tmp_path / "nope.txt")], capsys)
    assert "no such file" in err and "leave --data out" in err
    (tmp_path / "short.txt").write_bytes(b"x" * 500)
    err = _stderr_of_parse(["--data", str(tmp_path / "short.txt"), "--seq-len", "64"], capsys)
    assert "has 500 bytes, but --seq-len 64 needs at least 1300" in err and "smaller --seq-len" in err
    (tmp_path / "empty.txt").write_bytes(b"")
    assert "has 0 bytes" in _stderr_of_parse(["--data", str(tmp_path / "empty.txt")], capsys)


@pytest.mark.parametrize("case, kind, fix", [
    ("no_checkpoint", "RunError", "no complete checkpoint in"),
    ("corrupt", "CheckpointError", "rank00000.pt is corrupt or truncated"),
    ("other_model", "CheckpointError", "holds a model with block_size=128, this run builds block_size=256"),
    ("different_ranks", "RunError", "ranks were started with different models: rank 0 has"),
])
def test_bad_run_stops_every_rank_with_the_same_message(bad, case, kind, fix):
    messages = [rank_results[case] for rank_results in bad]
    assert messages[0] == messages[1], messages                # every rank, the same words
    assert messages[0][0] == kind and fix in messages[0][1], messages[0]


def test_corrupt_checkpoint_message_names_the_fix(bad):
    assert "delete" in bad[0]["corrupt"][1] and "ckpt-0000006" in bad[0]["corrupt"][1]


def test_bf16_on_a_gpu_without_it(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert "use --precision fp16" in _stderr_of_parse(["--precision", "bf16"], capsys)


def test_command_line_error_prints_no_traceback(tmp_path):
    result = subprocess.run([sys.executable, "train.py", "--out", str(tmp_path), "--resume"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.startswith("train.py: error: --resume: no complete checkpoint"), result.stderr
    assert "Traceback" not in result.stderr


def test_sample_generates_text_from_a_run(resumed):
    path, _ = resumed["single"]
    result = subprocess.run([sys.executable, "train.py", "--sample", "--init-from", path + "/saved",
                             "--prompt", "import ", "--sample-tokens", "40"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("import ") and len(result.stdout.encode()) >= 40


# ---- what a checkpoint holds: every value read back is checked, not only its type ------------

def _save_and_export(root):
    _train(["--out", os.path.join(root, "run"), "--save-every", str(SAVE_AT),
            "--export", os.path.join(root, "model.pt")])


@pytest.fixture(scope="module")
def held(tmp_path_factory):
    """One process's run directory (checkpoints after steps 3 and 6) and its export."""
    root = tmp_path_factory.mktemp("held")
    run_ranks(_save_and_export, 1, str(root))
    return root


def _copy_checkpoint(held, tmp_path):
    shutil.copytree(held / "run", tmp_path / "run")
    return tmp_path / "run" / "ckpt-0000006"


def _edit_meta(checkpoint, **fields):
    meta = json.loads((checkpoint / "meta.json").read_text())
    (checkpoint / "meta.json").write_text(json.dumps({**meta, **fields}))


def _files(root):
    return {os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
            for d, _, files in os.walk(root) for f in files}


def _train_py(*argv):
    """python train.py ARGV in a process of its own: (exit code, stderr)."""
    result = subprocess.run([sys.executable, "train.py", *argv], cwd=ROOT, capture_output=True,
                            text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return result.returncode, result.stderr


def test_a_nan_first_loss_in_meta_json_is_refused_not_a_run_without_divergence_stops(held, tmp_path):
    """The issue's case: first_loss NaN passed the type checks, and every loss compared with a
    NaN limit is "not over" it: a run at --lr 10 trained on at losses in the hundreds, exit 0."""
    checkpoint = _copy_checkpoint(held, tmp_path)
    _edit_meta(checkpoint, first_loss=float("nan"))
    before = _files(tmp_path)
    code, stderr = _train_py("--steps", "10", "--lr", "10", "--warmup", "0", "--out",
                             str(tmp_path / "run"), "--resume")
    assert code == 2 and "Traceback" not in stderr and len(stderr.splitlines()) == 1, stderr
    assert (f"{checkpoint}/meta.json: first_loss is NaN, not the run's first loss" in stderr
            and f"delete {checkpoint}" in stderr), stderr
    assert _files(tmp_path) == before                                   # nothing written


@pytest.mark.parametrize("field, value", [
    ("first_loss", float("inf")), ("first_loss", -1.0), ("loss", float("nan")), ("step", 2.5),
    ("data_position", -3), ("sha256", {"rank00000.pt": "not a checksum"}),
])
def test_a_meta_json_number_out_of_range_is_named(field, value, held, tmp_path):
    checkpoint = _copy_checkpoint(held, tmp_path)
    _edit_meta(checkpoint, **{field: value})
    with pytest.raises(snapshot.CheckpointError) as error:
        snapshot.load(str(checkpoint))
    assert f"meta.json: {field} is {json.dumps(value)}, not " in str(error.value), error.value
    assert f"delete {checkpoint}" in str(error.value)


LORA = dict(targets=["query", "value"], rank=8, alpha=16.0, dropout=0.0, quantize=None,
            double_quant=False)                           # lora_config's, as a LoRA run saves it


@pytest.mark.parametrize("section, field, value", [
    ("model", "dropout", float("nan")), ("model", "n_layer", 0), ("model", "capacity_factor", -1.25),
    ("model", "routing_group", 0), ("lora", "rank", 0), ("lora", "alpha", float("inf")),
    ("lora", "quantize", "nf8"), ("lora", "targets", []),
])
def test_a_configuration_value_out_of_range_is_named(section, field, value, held, tmp_path):
    """The model's and the adapters' settings build the model a checkpoint loads into."""
    checkpoint = _copy_checkpoint(held, tmp_path)
    meta = json.loads((checkpoint / "meta.json").read_text())
    _edit_meta(checkpoint, **{section: {**(meta[section] or LORA), field: value}})
    with pytest.raises(snapshot.CheckpointError) as error:
        snapshot.read_meta(str(checkpoint))
    assert f"meta.json: {section}.{field} is {json.dumps(value)}, not " in str(error.value), error.value


def test_a_checkpoint_older_than_a_model_field_reads_it_as_its_default(held, tmp_path):
    """GPTConfig grew gelu_approximate (GPT-2's tanh GELU, pretrained/): a checkpoint saved before
    it holds no such field, and resumes into the default model; a model that differs is named."""
    checkpoint = _copy_checkpoint(held, tmp_path)
    meta = json.loads((checkpoint / "meta.json").read_text())
    older = {k: v for k, v in meta["model"].items() if k != "gelu_approximate"}
    _edit_meta(checkpoint, model=older)
    saved = snapshot.read_meta(str(checkpoint))["model"]
    current = {**older, "gelu_approximate": "none"}
    snapshot.check_same_model(saved, current, str(checkpoint))           # the default: no error
    with pytest.raises(snapshot.CheckpointError, match="gelu_approximate='none', this run builds "
                                                       "gelu_approximate='tanh'"):
        snapshot.check_same_model(saved, {**current, "gelu_approximate": "tanh"}, str(checkpoint))
    _edit_meta(checkpoint, model={**older, "gelu_approximate": "exact"})
    with pytest.raises(snapshot.CheckpointError, match="gelu_approximate is \"exact\", not none or tanh"):
        snapshot.read_meta(str(checkpoint))


def _rewrite_part(checkpoint, change):
    """Change rank 0's part and save it with its new checksum: bytes that read back whole, with
    a content no save writes (edited, or a program of another version)."""
    file = checkpoint / "rank00000.pt"
    part = torch.load(file, weights_only=True)
    change(part)
    data = io.BytesIO()
    torch.save(part, data)
    file.write_bytes(data.getvalue())
    _edit_meta(checkpoint, sha256={"rank00000.pt": hashlib.sha256(data.getvalue()).hexdigest()})


def _first(part, key):
    return part["pieces"][0]["tensors"][key]


@pytest.mark.parametrize("change, says", [
    (lambda part: part.pop("rng"), "holds ['pieces', 'scaler'], not the pieces, rng and scaler"),
    (lambda part: part.pop("scaler"), "holds ['pieces', 'rng'], not the pieces, rng and scaler"),
    (lambda part: part["pieces"][0]["tensors"].update(param=_first(part, "param")[:-1]),
     "a piece token_emb.weight[0:32768] whose param is (32767,), not 32768 fp32 values"),
    (lambda part: _first(part, "exp_avg")[7:9].fill_(float("nan")),
     "a piece token_emb.weight[0:32768] whose exp_avg holds inf or NaN"),
    (lambda part: _first(part, "exp_avg_sq")[5].fill_(-1.0), "whose exp_avg_sq (a mean of squares) is negative"),
    (lambda part: part["pieces"][0]["scalars"].update(step=torch.tensor(float("nan"))),
     "whose step is nan, not a finite number from 0"),
    (lambda part: part["scaler"].update(scale=float("inf")), "a loss scaler state"),
    (lambda part: part["rng"].update(cpu=part["rng"]["cpu"][:-1]), "an rng that is not a CPU generator's"),
])
def test_a_part_whose_checksum_matches_but_whose_content_is_wrong_is_named(change, says, held,
                                                                           tmp_path):
    """Before: KeyError: 'rng', KeyError: 'scaler', a RuntimeError of expanded sizes, or NaN
    moments resumed into a run that then "diverged"."""
    checkpoint = _copy_checkpoint(held, tmp_path)
    _rewrite_part(checkpoint, change)
    with pytest.raises(snapshot.CheckpointError) as error:
        snapshot.load(str(checkpoint))
    message = str(error.value)
    assert message.startswith(f"{checkpoint}/rank00000.pt is damaged: it ") and says in message, message
    assert message.endswith(f"delete {checkpoint} to resume from the checkpoint before it"), message


def test_a_part_without_its_rng_stops_the_resume_with_one_line(held, tmp_path):
    checkpoint = _copy_checkpoint(held, tmp_path)
    _rewrite_part(checkpoint, lambda part: part.pop("rng"))
    before = _files(tmp_path)
    code, stderr = _train_py(*RUN, "--steps", "8", "--out", str(tmp_path / "run"), "--resume")
    assert code == 2 and "Traceback" not in stderr and len(stderr.splitlines()) == 1, stderr
    assert stderr.startswith(f"train.py: error: {checkpoint}/rank00000.pt is damaged"), stderr
    assert _files(tmp_path) == before


def test_flipped_bytes_in_an_older_checkpoint_without_checksums_are_found(held, tmp_path):
    """A checkpoint saved before parts had a sha256 loaded its flipped bytes as weights; torch's
    file is a zip archive whose records each carry a CRC-32, which finds them."""
    checkpoint = _copy_checkpoint(held, tmp_path)
    meta = json.loads((checkpoint / "meta.json").read_text())
    del meta["sha256"]
    (checkpoint / "meta.json").write_text(json.dumps(meta))
    part = checkpoint / "rank00000.pt"
    data = bytearray(part.read_bytes())
    middle = len(data) // 2
    data[middle: middle + 64] = bytes(b ^ 0xFF for b in data[middle: middle + 64])
    part.write_bytes(bytes(data))
    with pytest.raises(snapshot.CheckpointError) as error:
        snapshot.load(str(checkpoint))
    assert re.fullmatch(rf"{part} is corrupt or truncated \(its record \S+ no longer matches its "
                        rf"CRC-32\); delete {checkpoint} to resume .*", str(error.value)), error.value


def _export_with(held, tmp_path, change):
    saved = torch.load(held / "model.pt", weights_only=True)
    change(saved["state_dict"])
    path = tmp_path / "model.pt"
    torch.save(saved, path)
    return path


@pytest.mark.parametrize("change, says", [
    (lambda weights: weights.pop("head.weight"), " lacks the tensor head.weight, of shape (256, 128)"),
    (lambda weights: weights.update({"head.weight": weights["head.weight"][:-1]}),
     ": its tensor head.weight is (255, 128) torch.float32, where the model it describes has (256, 128)"),
    (lambda weights: weights["blocks.1.mlp.up.weight"][3, 4].fill_(float("nan")),
     ": its tensor blocks.1.mlp.up.weight holds inf or NaN"),
])
@pytest.mark.parametrize("flags", [[], ["--sample"], ["--lora"]])
def test_an_export_with_a_missing_wrong_or_nan_tensor_is_named_before_any_work(change, says, flags, held,
                                                                              tmp_path, capsys):
    """Before: load_state_dict's Missing key(s) and size mismatch tracebacks, and NaN weights
    trained into a run that "diverged: lower --lr"."""
    path = _export_with(held, tmp_path, change)
    out = tmp_path / "tuned"
    with pytest.raises(SystemExit) as stop:
        train.parse_args([*flags, "--init-from", str(path), *([] if flags else ["--out", str(out)])])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.splitlines()) == 1, err
    assert f"error: --init-from: {path}{says}" in err, err
    assert not out.exists()                                             # nothing written
    with pytest.raises(snapshot.CheckpointError, match=re.escape(says)):
        train.load_weights(str(path))              # a user's own call: the same words


def test_a_weight_decay_that_flips_the_weights_sign_is_refused(capsys):
    """Before: --weight-decay 1e30 trained, and its NaN was blamed on --lr."""
    err = _stderr_of_parse(["--weight-decay", "1e30"], capsys)
    assert ("--weight-decay 1e+30 at --lr 0.002: AdamW multiplies every weight by 1 - lr x decay = "
            "-2e+27 each step, which zeroes the weights or flips their sign; give --weight-decay "
            "below 1/lr = 500") in err, err
    assert "below 1/lr = 1e+04" in _stderr_of_parse(["--weight-decay", "1e4", "--lr", "1e-4"], capsys)
    train.parse_args(["--weight-decay", "1", "--lr", "0.5"])       # 1 - 0.5: shrinks, stays positive


# ---- every rank's own RNG stream, where the ranks' streams differ ----------------------------

def _resumed_twice(root):
    """One process saves after step 3; two ranks resume it (resharded: each rank seeds its own
    stream) and save after steps 4 and 6 (straight); a copy resumes from step 4 (again)."""
    flags = ["--dropout", "0.1", "--save-every", "1", "--keep", "10"]
    straight, again = os.path.join(root, "straight"), os.path.join(root, "again")
    if torch.distributed.get_world_size() == 1:
        return _train([*flags, "--steps", "3", "--out", straight])
    out = {"straight": _train([*flags, "--strategy", "ddp", "--out", straight, "--resume",
                               "--export", straight + ".pt"])}
    if torch.distributed.get_rank() == 0:
        shutil.copytree(straight, again, ignore=shutil.ignore_patterns("ckpt-0000005", "ckpt-0000006"))
    torch.distributed.barrier()
    out["again"] = _train([*flags, "--strategy", "ddp", "--out", again, "--resume",
                           "--export", again + ".pt"])
    return out


def test_each_rank_resumes_its_own_rng_stream_where_the_streams_differ(tmp_path):
    """A resharded resume seeds each rank's stream apart (seed + step x 1000 + rank), so from then
    on the ranks' CPU states differ, and each rank's dropout masks are its own: a resume at the
    same world size must give rank r parts[r]'s state. Every rank taking parts[0]'s would
    replay rank 0's masks on rank 1's rows: another loss from step 4 on."""
    run_ranks(_resumed_twice, 1, str(tmp_path))
    ranks = run_ranks(_resumed_twice, 2, str(tmp_path))
    straight, again = ranks[0]["straight"], ranks[0]["again"]
    _, parts = snapshot.load(str(tmp_path / "straight" / "ckpt-0000004"))
    assert not torch.equal(parts[0]["rng"]["cpu"], parts[1]["rng"]["cpu"])   # the streams differ
    assert list(again["losses"]) == [4, 5]
    assert again["losses"] == {s: straight["losses"][s] for s in (4, 5)}
    assert again["eval_loss"] == straight["eval_loss"]
    _same_weights(_weights(tmp_path / "again.pt"), _weights(tmp_path / "straight.pt"))


def test_a_diverged_run_lists_a_damaged_checkpoints_loss_as_unknown(held, tmp_path):
    """Divergence's line lists every checkpoint's saved loss: one that is not a number (an edited
    meta.json) is '?', as one saved without a loss, not a ValueError in the middle of the stop."""
    _copy_checkpoint(held, tmp_path)
    _edit_meta(tmp_path / "run" / "ckpt-0000003", loss="low")
    args = train.parse_args([*RUN, "--out", str(tmp_path / "run"), "--resume"])
    with pytest.raises(snapshot.RunError) as error:
        divergence.Divergence(args, 256).stop(7, "the loss is nan in fp32")
    assert re.search(r"ckpt-0000003 \(\?\), ckpt-0000006 \([\d.]+\)", str(error.value)), error.value
