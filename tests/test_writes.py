"""Every path a run writes, when it cannot be written: one line, nothing partial left, nothing lost.

The lock, config.json and log.txt (snapshot.own_outputs, run_log.RunLog), --export, --profile's
traces, napkin/machines.py's cache and pictures/draw.py's -o. A full disk is simulated without privileges:
a module's `open` is replaced (FullDisk) so that its files take the bytes there is room for and
then raise ENOSPC, the bytes that fit written, as a full disk's write() does. A directory that
cannot be written is one under a regular file (ENOTDIR), or a directory where a file should be:
both fail for root too, where chmod 0o555 stops nothing.
"""
import builtins
import errno
import io
import json
import os
import socket
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist

from napkin import machines
from pictures import draw as pictures
from composition.parallelize import build_gpt
from running import snapshot
import train
from model import PRESETS as MODELS
from multiprocess import run_ranks, train_logged

RUN = ["--steps", "4", "--log-every", "1", "--eval-every", "0", "--seq-len", "32", "--batch-size", "8",
       "--warmup", "2", "--eval-batches", "1"]


class FullDisk:
    """A disk with `room` bytes free for the files a module opens to write (FullDisk(room).on(module)),
    or only for those whose path starts with `under`: a write takes what fits and then raises
    ENOSPC, the bytes that fit written."""

    def __init__(self, room: int, under: str = ""):
        self.room, self.under = room, under

    def on(self, module):
        module.open = self.open                    # the module's name shadows the builtin

    def open(self, path, mode="r", *args, **kwargs):
        file = builtins.open(path, mode, *args, **kwargs)
        writes = any(m in mode for m in "wax+")
        return _Filling(file, self) if writes and str(path).startswith(self.under) else file


class _Filling:
    """A file on a FullDisk."""

    def __init__(self, file, disk: FullDisk):
        self.file, self.disk = file, disk

    def write(self, data):
        fits = min(len(data), self.disk.room)
        self.file.write(data[:fits])
        self.file.flush()
        self.disk.room -= fits
        if fits < len(data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return fits

    def __getattr__(self, name):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()


def _listing(directory) -> list[str]:
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


# ---- the lock: it appears whole ----------------------------------------------------------------

def test_the_lock_never_exists_without_its_owner(tmp_path):
    # What a second run starting at any instant of lock() finds: checked after every line that
    # running/snapshot.py runs meanwhile. An empty lock (created, not yet written) is the race's "names
    # no run": the loser is told to delete a live run's lock.
    out, seen = str(tmp_path), []
    path = os.path.join(out, "lock")

    def holder():
        try:
            with builtins.open(path) as f:
                return json.loads(f.read())
        except FileNotFoundError:
            return "absent"
        except ValueError:
            return "names no run"

    def trace(frame, event, arg):
        if frame.f_code.co_filename != snapshot.__file__:
            return None
        if event == "line":
            seen.append(holder())
        return trace
    sys.settrace(trace)
    try:
        snapshot.lock(out)
    finally:
        sys.settrace(None)
    mine = {"host": socket.gethostname(), "pid": os.getpid()}
    assert "absent" in seen and seen[-1] != "absent", seen             # it was taken meanwhile
    found = [s for s in seen if s != "absent"]
    assert all(isinstance(s, dict) and {k: s.get(k) for k in mine} == mine for s in found), found
    snapshot.unlock(out)
    assert _listing(out) == []                       # no file beside it left behind


def test_a_lock_that_cannot_be_written_is_not_left(tmp_path, monkeypatch):
    out = str(tmp_path)
    monkeypatch.setattr(snapshot, "open", FullDisk(10).open, raising=False)   # 10 bytes fit
    with pytest.raises(OSError) as e:
        snapshot.lock(out)
    monkeypatch.undo()
    assert (e.value.errno, e.value.filename) == (errno.ENOSPC, os.path.join(out, "lock"))
    assert _listing(out) == []                      # neither an empty lock nor its partial file
    snapshot.lock(out)                              # the next run is not blocked
    snapshot.unlock(out)


# ---- the run directory at the start: the lock, config.json, log.txt -----------------------------

def _start_on_a_full_disk(root):
    """Runs whose --out cannot take its first files, rank 0's writes on a FullDisk (every rank
    gets the verdict): {case: the RunError's line}, and on rank 0 {case: what --out holds after}."""
    rank, lines, left = dist.get_rank(), {}, {}
    config_room = len(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                  "started": "2025-01-01 00:00:00"})) + 100
    for case, disk in (("lock", FullDisk(10)), ("config", FullDisk(config_room)), ("log", None)):
        out = os.path.join(root, case)
        if rank == 0 and disk:
            disk.on(snapshot)
        if rank == 0 and case == "log":
            os.makedirs(os.path.join(out, "log.txt"))            # log.txt cannot be opened
        try:
            train_logged([*RUN, "--strategy", "ddp", "--out", out])
        except train.RunError as e:
            lines[case], left[case] = str(e), _listing(out) if rank == 0 else None
        if rank == 0 and disk:
            del snapshot.open
    return lines, left


def test_a_run_directory_that_cannot_be_written_stops_every_rank_before_any_work(tmp_path):
    ranks = run_ranks(_start_on_a_full_disk, 2, str(tmp_path))
    assert ranks[0][0] == ranks[1][0], ranks                          # every rank, the same line
    lines, left = ranks[0]
    for case, name in (("lock", "lock"), ("config", "config.json")):
        assert lines[case] == (f"--out {tmp_path / case}: cannot write {tmp_path / case / name} (No space "
                               f"left on device): free space there, and rerun"), lines[case]
        assert left[case] == [], (case, left)     # no lock to block the next run, nothing half-written
    assert lines["log"] == (f"--out {tmp_path / 'log'}: cannot write {tmp_path / 'log' / 'log.txt'} (Is a "
                            f"directory): give a directory rank 0 can write to, and rerun"), lines["log"]
    assert left["log"] == ["config.json", "log.txt"]     # its lock released; config.json whole
    json.load(open(tmp_path / "log" / "config.json"))


def _log_fills_up(out):
    """A run whose log.txt has room for about 1 KiB: its history and what it printed."""
    if dist.get_rank() == 0:
        FullDisk(1000, under=os.path.join(out, "log.txt")).on(snapshot)
    return train_logged([*RUN, "--strategy", "ddp", "--out", out])


def test_a_log_that_fills_up_ends_at_a_whole_line_and_the_run_goes_on(tmp_path):
    out = str(tmp_path / "run")
    (history, printed), _ = run_ranks(_log_fills_up, 2, out)
    log = open(os.path.join(out, "log.txt")).read()
    assert 0 < len(log) <= 1000 and log.endswith("\n"), log
    lines = printed.splitlines()
    assert log.splitlines() == lines[:len(log.splitlines())]          # whole lines, as printed
    note = (f"train.py: {out}/log.txt cannot take more lines (No space left on device): from here the "
            f"log is on stdout only")
    assert lines.count(note) == 1, printed
    assert "step     3 | loss" in printed and history["eval_loss"] > 0     # the run went on
    assert "ckpt-0000004" in os.listdir(out)


# ---- --export: checked first, and the weights kept where it fails at the end ---------------------

def _export_on_a_full_disk(root, checked_free):
    """zero2 runs exporting m.pt: refused before any work where the directory lacks the room
    (checked_free bytes free), then one whose export's write finds the disk full (into a
    temporary directory that has room; m.pt's own 1000 bytes fit), with and without --out; then
    the same run exporting normally, the reference. Returns {case: (the RunError's line, what
    m.pt's directory holds after)}."""
    rank, export = dist.get_rank(), os.path.join(root, "small", "m.pt")
    tempfile.tempdir = os.path.join(root, "tmp")
    os.makedirs(os.path.join(root, "small"), exist_ok=True)
    os.makedirs(tempfile.tempdir, exist_ok=True)
    usage = snapshot.shutil.disk_usage
    snapshot.shutil.disk_usage = lambda path: usage(path)._replace(free=checked_free)
    lines = {}
    try:
        train_logged([*RUN, "--strategy", "zero2", "--export", export])
    except train.RunError as e:
        lines["checked"] = (str(e), _listing(os.path.join(root, "small")))
    snapshot.shutil.disk_usage = usage
    for case, out in (("no out", []), ("out", ["--out", os.path.join(root, "run")])):
        if rank == 0:
            FullDisk(1000, under=os.path.join(root, "small")).on(snapshot)
        try:
            train_logged([*RUN, "--strategy", "zero2", "--export", export, *out])
        except train.RunError as e:
            lines[case] = (str(e), _listing(os.path.join(root, "small")))
        if rank == 0:
            del snapshot.open
    train_logged([*RUN, "--strategy", "zero2", "--export", export])
    return lines


def test_an_export_the_disk_cannot_take_keeps_the_trained_weights(tmp_path):
    needed = sum(4 * p.numel() + 2**10 for p in build_gpt("tiny").parameters())   # headers: 1 KiB
    ranks = run_ranks(_export_on_a_full_disk, 2, str(tmp_path), 16 * 2**10)
    assert ranks[0] == ranks[1], ranks                          # every rank, the same line
    lines, export, small = ranks[0], tmp_path / "small" / "m.pt", tmp_path / "small"
    line, left = lines["checked"]                               # before any work: nothing trained
    assert line == (f"--export {export}: {small} has 16,384 bytes free, the model's fp32 weights need "
                    f"{needed:,} ({needed / 2**20:.1f} MiB): free space there, or export elsewhere"), line
    assert left == []
    reference = snapshot.load_weights(str(export)).state_dict()
    line, left = lines["no out"]
    assert line.startswith(f"--export {export}: writing its "), line
    assert ("bytes failed: No space left on device (the disk or quota is full); nothing partial was "
            "left. The trained weights are kept in ") in line, line
    assert left == [] and "\n" not in line                      # no partial m.pt nor its .tmp
    [kept] = os.listdir(tmp_path / "tmp")
    assert line.endswith(f"kept in {tmp_path / 'tmp' / kept} (train.load_weights reads it): move it to {export}")
    for name, weights in ((kept, snapshot.load_weights(str(tmp_path / "tmp" / kept)).state_dict()),
                          ("ckpt-0000004", snapshot.load_weights(str(tmp_path / "run")).state_dict())):
        assert weights.keys() == reference.keys(), name
        for key in reference:                                   # the very weights it trained
            assert torch.equal(weights[key], reference[key]), (name, key)
    line, left = lines["out"]
    assert line.endswith(f"The trained weights are in {tmp_path / 'run' / 'ckpt-0000004'}: free space and "
                         f"rerun the same command with --resume to export them"), line
    assert left == []


def test_weights_kept_nowhere_say_so(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "file" / "tmp"))   # under a file: ENOTDIR
    line = snapshot.kept_weights(str(tmp_path / "m.pt"), io.BytesIO(b"weights"), None)
    assert line == (f"The trained weights are lost: {tmp_path / 'file' / 'tmp'} could not take them "
                    f"either (Not a directory); --out DIR keeps a checkpoint of them"), line


# ---- --profile: a trace cut short stops the run -----------------------------------------------

def _profile_cut_short(directory):
    """A ddp run under --profile where rank 1's trace is cut short, as torch's C++ writer leaves
    it on a full disk: no error (a line in its own log), the blocks that fit in path.tmp, which
    it renames to path only once written whole."""
    if dist.get_rank() == 1:
        export = torch.profiler.profile.export_chrome_trace

        def cut_short(self, path):
            export(self, path)
            os.rename(path, path + ".tmp")
            os.truncate(path + ".tmp", 4096)
        torch.profiler.profile.export_chrome_trace = cut_short
    try:
        train_logged([*RUN, "--steps", "6", "--strategy", "ddp", "--profile", directory])
    except train.RunError as e:
        return str(e)


def test_a_profile_trace_cut_short_stops_every_rank_with_one_line(tmp_path):
    lines = run_ranks(_profile_cut_short, 2, str(tmp_path))
    assert lines[0] == lines[1] and lines[0] is not None, lines
    assert lines[0].startswith(f"--profile {tmp_path}: {tmp_path / 'trace-rank1.json'} was cut short as it "
                               f"was written ("), lines[0]
    assert lines[0].endswith("bytes free there: a full disk?) and is removed: free space there, or give "
                             "another --profile directory, and rerun")
    assert os.listdir(tmp_path) == ["trace-rank0.json"]          # rank 0's whole, rank 1's removed
    json.load(open(tmp_path / "trace-rank0.json"))


# ---- napkin/machines.py's cache: optional --------------------------------------------------------------

def _this_with(cache):
    """machines.this on one rank, its measurements stubbed (counted): (Machine, measurements)."""
    calls = []
    machines.block_flops_per_second = lambda *args: calls.append("flops") or 1e9
    machines.optimizer_bandwidth = lambda device: calls.append("memory") or 2e9
    machines.host_copy_bandwidth = lambda device: calls.append("host") or 3e9
    return machines.this(MODELS["tiny"], 2, 16, cache=cache), calls


def _caches(root):
    """this() with each kind of cache that cannot be used; then with one the disk fills up
    as it is written over. Returns {case: (flops, the measurements made)}."""
    results = {}
    os.makedirs(os.path.join(root, "directory.json"))               # unreadable: a directory
    open(os.path.join(root, "file"), "w").close()
    with open(os.path.join(root, "truncated.json"), "w") as f:
        f.write('{"this machine": {"memory_ban')
    for case in ("truncated.json", "directory.json", "file/this.json"):    # the last: unwritable
        machine, calls = _this_with(os.path.join(root, case))
        results[case] = (machine.flops["fp32"], calls)
    full = os.path.join(root, "full.json")
    with open(full, "w") as f:
        f.write('{"an older entry": {}}')
    FullDisk(20).on(machines)
    machine, calls = _this_with(full)
    results["full"] = (machine.flops["fp32"], calls)
    return results


def test_a_cache_that_cannot_be_read_or_written_is_measured_again(tmp_path):
    [results] = run_ranks(_caches, 1, str(tmp_path))
    for case, (flops, calls) in results.items():           # measured, and the run goes on
        assert flops == 1e9 and sorted(calls) == ["flops", "host", "memory"], (case, calls)
    rewritten = json.load(open(tmp_path / "truncated.json"))     # whole again, as measured
    assert all(entry.get("flops") == 1e9 or entry.get("host_copy") == 3e9 for entry in rewritten.values())
    assert open(tmp_path / "full.json").read() == '{"an older entry": {}}'   # not cut short
    assert sorted(os.listdir(tmp_path)) == ["directory.json", "file", "full.json", "truncated.json"]


# ---- pictures/draw.py -o ---------------------------------------------------------------------------

def test_a_picture_path_that_cannot_be_written_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(pictures, "picture", lambda args: pytest.fail("worked before checking -o"))
    out = tmp_path / "no" / "x.svg"
    with pytest.raises(SystemExit):
        pictures.main(["loss", str(tmp_path), "-o", str(out)])
    assert f"error: -o {out}: there is no directory {tmp_path / 'no'}: create it" in capsys.readouterr().err

    def read_only(**where):                   # what a read-only mount answers, to root as well
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), where["dir"])
    monkeypatch.setattr(snapshot.tempfile, "TemporaryFile", read_only)
    with pytest.raises(SystemExit):
        pictures.main(["loss", str(tmp_path), "-o", str(tmp_path / "x.svg")])
    assert (f"error: -o {tmp_path / 'x.svg'}: cannot write in {tmp_path} (Read-only file "
            f"system): choose a directory you can write to") in capsys.readouterr().err


def test_a_picture_the_disk_cannot_take_leaves_the_old_file(tmp_path, monkeypatch):
    (tmp_path / "log.txt").write_text("step     0 | loss 5.0000 |\nstep     1 | loss 4.0000 |\n")
    out = tmp_path / "loss.svg"
    out.write_text("the old picture")
    monkeypatch.setattr(snapshot, "open", FullDisk(100).open, raising=False)
    with pytest.raises(SystemExit) as e:
        pictures.main(["loss", str(tmp_path), "-o", str(out)])
    assert e.value.code == (f"pictures.py: error: -o {out}: writing it failed (No space left on device); "
                            f"nothing partial was left: free space there, or write the picture elsewhere, "
                            f"and rerun")
    assert out.read_text() == "the old picture" and sorted(os.listdir(tmp_path)) == ["log.txt", "loss.svg"]
