"""What a student meets on the command line: the log says what each number is, a refused command
line is one line once (under torchrun too), Ctrl-C is one line and exit 130, the CPU threads are
a share of the cores (running/run_log.py, running/cli.py, threads.cpu_threads)."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from multiprocess import run_ranks, train_logged

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK = ["--steps", "6", "--log-every", "1", "--eval-every", "0", "--eval-batches", "1",
         "--seq-len", "32", "--batch-size", "8", "--warmup", "2"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py"]


# ---- the log: each number says what it is, a line that does not change is said once ----------

@pytest.mark.parametrize("world, flags, why", [
    (1, ["--grad-accum", "2"], "step_time.py prices one micro-batch a step, not --grad-accum 2"),
    (2, ["--strategy", "fsdp", "--shard-group", "1"], "step_time.py has no hybrid sharding (--shard-group)"),
])
def test_a_run_the_napkin_does_not_price_says_why_in_place_of_its_time(world, flags, why):
    """Issue 55: under --grad-accum (as --strategy auto chooses) and --shard-group the napkin's
    time left the step line without a word; it says why there, and a run it prices keeps it."""
    out = run_ranks(train_logged, world, [*QUICK, "--steps", "1", *flags])[0][1]
    step = next(line for line in out.splitlines() if re.match(r"step +0 \| loss", line))
    assert re.search(r"k tok/s \(\d+ ms/step; no napkin: " + re.escape(why) + r"\) \|", step), step
    out = run_ranks(train_logged, 1, [*QUICK, "--steps", "1"])[0][1]
    assert re.search(r"k tok/s \(\d+ ms/step, napkin \d+\) \|", out), out


def test_memory_is_said_once_measured_beside_predicted_with_activations():
    history, out = run_ranks(train_logged, 1, [*QUICK, "--strategy", "single"])[0]
    steps = re.findall(r"^step +\d+ \| loss", out, re.M)
    measured = re.findall(r"^step +(\d+) \| memory per rank, measured: (.*)$", out, re.M)
    # The state held between steps does not change from step to step: said once, at step 0.
    assert len(steps) == 6 and [step for step, _ in measured] == ["0"], out
    predicted = re.search(r"^memory per rank, predicted \(memory.py's napkin math\): (.*)$", out, re.M).group(1)
    state = r"params ([\d.]+) MiB, grads ([\d.]+), optim ([\d.]+) = ([\d.]+) on the device"
    assert re.match(state, predicted).groups() == re.match(state, measured[0][1]).groups(), out
    # tiny, 8 x 32 tokens on one rank, fp32: L = 4 blocks of C = 128.
    kept = float(re.search(r"activations ([\d.]+) MiB kept for backward \(autograd", out).group(1)) * 2**20
    formula = float(re.search(r"activations ([\d.]+) MiB kept for backward \(Korth", out).group(1)) * 2**20
    tokens, C, L, V = 8 * 32, 128, 4, 256
    # Korthikanti et al.'s sbh(34 + 5as/h) per block in 16-bit values (x2 in fp32), the fp32
    # log-probabilities 4 sbV: without dropout an upper bound (no masks, no s x s scores kept).
    by_hand = L * tokens * C * (34 + 5 * 4 * 32 / C) * 2 + 4 * tokens * V
    assert abs(formula - by_hand) <= 0.05 * 2**20, (formula, by_hand)       # the log's 0.1 MiB
    # At least each block's linear layers' inputs (q/k/v and the projection: C each, the MLP's
    # C and 4C) in fp32, which backward needs for the weights' gradients.
    assert L * tokens * 7 * C * 4 <= kept <= formula, (kept, formula)


def _train_on_a_fake_clock(argv, first: float, later: float):
    """train_logged with time.perf_counter running `first` seconds fast across the first step
    (its warm-up) and `later` across each one after."""
    import train
    real_step, real_clock, ahead = train.train_step, time.perf_counter, [0.0]

    def slow_step(*args, **kwargs):
        done = real_step(*args, **kwargs)
        ahead[0] += later if ahead[0] else first
        return done
    train.train_step, time.perf_counter = slow_step, lambda: real_clock() + ahead[0]
    return train_logged(argv)


def test_time_left_is_paced_by_the_steps_after_the_first():
    """A first step of 1000 s (warm-up) and 100 s each after it: after step 1 of 3 the step
    left takes 100 s (and a real step's own time, well under 5 s), not the first two steps'
    mean pace (550 s); the first line has no pace to go by."""
    out = run_ranks(_train_on_a_fake_clock, 1, ["--steps", "3", "--log-every", "1", "--eval-every", "0",
                                                "--seq-len", "32", "--batch-size", "8"], 1000.0, 100.0)[0][1]
    ends = re.findall(r"^step +(\d+) \| loss .* \| \d/3 in [\d:]+, (.*)$", out, re.M)
    assert [step for step, _ in ends] == ["0", "1", "2"], out
    assert ends[0][1] == "time left from the next logged step (the first warms up)", out
    minutes, seconds = re.fullmatch(r"about (\d+):(\d\d) left", ends[1][1]).groups()
    assert 100 <= 60 * int(minutes) + int(seconds) <= 100 + 5, out
    assert ends[2][1] == "about 0:00 left", out


def test_interrupted_line_says_where_to_continue_from(tmp_path):
    from running.run_log import interrupted_line
    log = type("Log", (), {"step": 7, "out": str(tmp_path)})()
    assert interrupted_line(log) == (f"train.py: interrupted at step 7; no checkpoint in {tmp_path} yet "
                                     f"(--save-every K writes one every K steps)")
    (tmp_path / "ckpt-0000004").mkdir()                     # not complete: no metadata yet
    assert "no checkpoint in" in interrupted_line(log)
    assert interrupted_line(None).startswith("train.py: interrupted before the first step; nothing was saved")


# ---- Ctrl-C: one line, exit 130, every rank -----------------------------------------------------

def _interrupt(argv, when: str, timeout=240):
    """Run argv, send SIGINT (what Ctrl-C sends the terminal's foreground process) once a stdout
    line starts with `when`: (exit code, stdout, stderr, seconds from SIGINT to exit)."""
    # A test run in the background inherits SIGINT ignored (train.py keeps it so): not here.
    job = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"},
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines, sent = [], None
    try:
        for line in job.stdout:
            lines.append(line)
            if line.startswith(when):
                job.send_signal(signal.SIGINT)
                sent = time.monotonic()
                break
        out, err = job.communicate(timeout=timeout)
    finally:
        job.kill()
    assert sent is not None, ("".join(lines), err)            # the run reached `when`
    return job.returncode, "".join(lines) + out, err, time.monotonic() - sent


def test_ctrl_c_says_one_line_naming_the_checkpoint_and_exits_130(tmp_path):
    from running.snapshot import latest
    out_dir = tmp_path / "run"
    code, out, err, _ = _interrupt([sys.executable, "train.py", *QUICK, "--steps", "100000", "--out",
                                    str(out_dir), "--save-every", "2", "--threads", "1"], "step     2 | loss")
    said = [line for line in (out + err).splitlines() if "interrupted" in line]
    assert code == 130 and len(said) == 1 and "Traceback" not in out + err, (code, out, err)
    step, saved = re.match(r"train.py: interrupted at step (\d+); the last checkpoint is (\S+): rerun "
                           r"the same command with --resume to continue from it$", said[0]).groups()
    # the newest complete checkpoint on disk (--resume's), saved every 2 steps, at least ckpt-2
    assert int(step) >= 2 and saved == latest(str(out_dir)) and int(saved[-7:]) >= 2, said
    assert "| 1 CPU thread per rank: --threads |" in out.splitlines()[0], out


def test_ctrl_c_under_torchrun_is_one_line_from_rank_0():
    """torchrun forwards SIGINT to its workers: each stops, rank 0 alone says so; torchrun then
    raises its own SignalException (its traceback, not a worker's) and exits 1."""
    code, out, err, waited = _interrupt([*TORCHRUN, *QUICK, "--steps", "100000", "--strategy", "zero2"],
                                        "step     1 | loss")
    said = [line for line in (out + err).splitlines() if "interrupted" in line]
    assert said == [said[0]] and said[0].startswith("train.py: interrupted at step "), (out, err)
    assert "nothing was saved" in said[0], said
    assert "KeyboardInterrupt" not in err and 'train.py", line' not in err, err      # no worker's traceback
    assert code != 0 and waited < 60, (code, waited)      # the workers left at once (torchrun waits 30 s)


# ---- a rank killed or stopped under torchrun: every other rank says so in one line --------------

# A disk whose fsync of a checkpoint's part takes a second: a save is long enough to stop a rank in.
SLOW_DISK = '''import os, time
fsync = os.fsync
def slow_fsync(fd):
    if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith("rank"):
        time.sleep(1.0)
    fsync(fd)
os.fsync = slow_fsync
'''


def _workers(job) -> dict:
    """torchrun's workers: {local rank: pid}."""
    from test_snapshot import _children
    workers = {}
    for pid in _children(job.pid):
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        workers[int(env[b"LOCAL_RANK"])] = pid
    return workers


def _sigterm_pending(pid: int) -> bool:
    """Whether SIGTERM waits to be delivered to the (stopped) process pid."""
    with open(f"/proc/{pid}/status") as f:
        pending = int(re.search(r"^ShdPnd:\s*([0-9a-f]+)$", f.read(), re.M).group(1), 16)
    return bool(pending & 1 << (signal.SIGTERM - 1))


def _killed_while_stopped(victim: int, survivor: int):
    """kill -9 of local rank `victim` while `survivor` is busy: torchrun's SIGTERM reaches the
    survivor before its next collective finds the peer gone (the issue's trial). The survivor is
    held stopped until that SIGTERM waits for it, so the order is the same on every run."""
    def act(job):
        workers = _workers(job)
        os.kill(workers[survivor], signal.SIGSTOP)
        os.kill(workers[victim], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not _sigterm_pending(workers[survivor]) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(workers[survivor], signal.SIGCONT)
        return [victim]
    return act


def _sigterm_while_waiting(job):
    """SIGTERM to rank 0 while it waits in a collective (torch's, in C++) for rank 1, stalled
    (alive, its connections open): Python runs no handler until that call returns, at --timeout
    (60 s), as when a peer died under NCCL. Rank 0 must say its line and leave within
    stopping.GRACE (5 s) and a margin; rank 1 then goes on, to torchrun's SIGTERM."""
    workers = _workers(job)
    os.kill(workers[1], signal.SIGSTOP)
    time.sleep(2)                                 # rank 0's next collective waits for rank 1
    os.kill(workers[0], signal.SIGTERM)
    sent = time.monotonic()
    while os.path.exists(f"/proc/{workers[0]}") and time.monotonic() < sent + 30:
        time.sleep(0.1)
    left = time.monotonic() - sent
    os.kill(workers[1], signal.SIGCONT)
    assert left < 5 + 10, left
    return []


def _sigterm_rank(rank: int):
    def act(job):
        os.kill(_workers(job)[rank], signal.SIGTERM)
        return []
    return act


def _sigterm_torchrun(job):
    job.send_signal(signal.SIGTERM)               # the job's end (a batch system's): every worker's
    return []


def _torchrun_stopped(tmp_path, ready, act, flags=(), slow_disk=False):
    """torchrun, 2 CPU ranks of zero2 saving every step (and flags), until ready(out, stdout)
    holds; then act(job) (returns the local ranks it killed outright). Returns (exit code,
    stderr, the run directory, the ranks killed)."""
    out, log = tmp_path / "run", tmp_path / "out.txt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if slow_disk:
        (tmp_path / "sitecustomize.py").write_text(SLOW_DISK)      # every worker imports it
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), *filter(None, [env.get("PYTHONPATH")])])
    argv = [*TORCHRUN, *QUICK, "--steps", "100000", "--strategy", "zero2", "--timeout", "60",
            "--out", str(out), "--save-every", "1", "--keep", "2", *flags]
    with open(log, "w") as stdout, open(tmp_path / "err.txt", "w+") as stderr:
        job = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=stdout, stderr=stderr, text=True)
        try:
            deadline = time.monotonic() + 180
            while not ready(out, log.read_text()) and job.poll() is None:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.02)
            assert job.poll() is None, log.read_text()
            killed = act(job)
            code = job.wait(timeout=60)            # torchrun SIGKILLs a worker after 30 s
        finally:
            job.kill()
            job.wait()
        stderr.seek(0)
        return code, stderr.read(), str(out), killed


def _says_each_rank_stopped(err: str, out: str, killed: list) -> str:
    """Every rank not killed outright says in one line of ours why it stopped, naming the newest
    complete checkpoint, which loads whole; no traceback of ours. Returns that checkpoint."""
    from running import snapshot
    ours = [line for line in err.splitlines() if line.startswith("train.py: ")]
    saved = snapshot.latest(out)
    for rank in {0, 1} - set(killed):
        said = [line for line in ours if re.match(rf"train.py: (error: )?rank {rank} ", line)]
        assert len(said) == 1, (rank, err)
        named = re.search(r"the last checkpoint is (\S+): rerun the same command with --resume "
                          r"to continue from it$|--resume to continue from the last checkpoint, "
                          r"(\S+)$", said[0])
        assert named and saved in named.groups(), (said[0], saved)
    assert len(ours) == 2 - len(killed), err
    frames = re.findall(r'File "([^"]+)", line', err)       # torchrun's own summary: its traceback
    assert all("site-packages" in frame or frame.startswith("<frozen") for frame in frames), err
    assert "KeyboardInterrupt" not in err, err
    snapshot.load(saved)                                        # every part, its checksum matching
    return saved


def _logged(step: int):
    return lambda out, log: f"\nstep {step:5d} | loss" in log


def _saving(step: int, rank: int):
    """rank is writing checkpoint `step`'s part (slow_disk: for a second)."""
    return lambda out, log: os.path.exists(out / f"ckpt-{step:07d}.tmp" / f"rank{rank:05d}.pt")


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds torchrun's workers through /proc")
@pytest.mark.parametrize("moment", ["rank 1 killed in a step", "rank 0 killed in a save",
                                    "rank 1 SIGTERMed", "rank 0 SIGTERMed in a collective",
                                    "torchrun SIGTERMed"])
def test_a_rank_killed_or_stopped_under_torchrun_says_so_naming_a_checkpoint(tmp_path, moment):
    """The issue's trial, made deterministic: torchrun SIGTERMs the survivors of a kill -9 (also
    its way of stopping a job), which must end each of them as Ctrl-C does, whichever rank died,
    whatever it was doing: one line naming the last complete checkpoint, which resumes."""
    native = ["--collectives", "native"]          # a wait in C++, not in our ring's Python thread
    ready, act, flags = {
        "rank 1 killed in a step": (_logged(3), _killed_while_stopped(victim=1, survivor=0), []),
        "rank 0 killed in a save": (_saving(4, 1), _killed_while_stopped(victim=0, survivor=1), []),
        "rank 1 SIGTERMed": (_logged(3), _sigterm_rank(1), []),
        "rank 0 SIGTERMed in a collective": (_logged(3), _sigterm_while_waiting, native),
        "torchrun SIGTERMed": (_logged(3), _sigterm_torchrun, [])}[moment]
    code, err, out, killed = _torchrun_stopped(tmp_path, ready, act, flags, "save" in moment)
    assert code != 0, err
    saved = _says_each_rank_stopped(err, out, killed)
    if moment == "rank 0 killed in a save":     # cut off in its save of step 4: step 3's stands
        assert saved.endswith("ckpt-0000003") and os.path.isdir(out + "/ckpt-0000004.tmp"), saved
        argv = [sys.executable, "train.py", *QUICK, "--strategy", "zero2", "--out", out, "--steps",
                "5", "--resume"]
        resumed = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=240,
                                 env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        assert f"resumed from {saved} at step 3" in resumed.stdout, resumed.stdout


# ---- no warning: only torchrun's own process's, the README's note --------------------------------

def _python_warnings(stderr: str) -> list[str]:
    """The warnings Python printed ('...py:368: UserWarning: text'), from 'UserWarning' on."""
    return [m.group(1) for m in re.finditer(r"^\S+:\d+: (\w*Warning: [^:(]*)", stderr, re.M)]


def test_the_commands_print_no_warning():
    """python train.py, torchrun (its launcher and 2 workers), python mixed_precision.py and
    pytest print no warning: numpy is installed (requirements.txt), so torch has none to give
    as it is imported."""
    quick = ["--steps", "2", "--eval-every", "0", "--eval-batches", "1", "--seq-len", "32", "--batch-size", "8"]
    commands = ([sys.executable, "train.py", *quick], [*TORCHRUN, *quick], [sys.executable, "mixed_precision.py"],
                [sys.executable, "-m", "pytest", "--collect-only", "-q", "tests/test_data.py"])
    jobs = [subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for argv in commands]
    (alone, alone_err), (ranks, ranks_err), (_, mixed_err), (collected, _) = [job.communicate(timeout=240)
                                                                              for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0, 0, 0], alone_err + ranks_err + mixed_err
    assert "done | eval loss" in alone and "done | eval loss" in ranks, (alone, ranks)
    assert alone_err == "" and mixed_err == "", alone_err + mixed_err
    assert _python_warnings(ranks_err) == [], ranks_err
    assert "warning" not in collected.lower(), collected


# ---- a refused command line: one line, once, every rank refusing ---------------------------------

@pytest.mark.parametrize("argv, says", [
    (["--bogus"], "train.py: error: unrecognized arguments: --bogus (see --help)"),
    (["--strategy", "ddp", "--batch-size", "10", "--grad-accum", "2"],     # cli.check_args
     "train.py: error: --batch-size 10 does not divide into 2 "),
])
def test_a_refused_command_line_under_torchrun_is_one_line_once(argv, says):
    began = time.monotonic()
    result = subprocess.run([*TORCHRUN, *argv], cwd=ROOT, capture_output=True, text=True, timeout=240,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    output = result.stdout + result.stderr
    said = [line for line in output.splitlines() if line.startswith("train.py: error:")]
    assert len(said) == 1 and said[0].startswith(says) and said[0].endswith(" (see --help)"), output
    assert "usage:" not in output and result.returncode != 0, output
    # local rank 0 refused with exit 2, rank 1 refused too, quietly, and was stopped by torchrun,
    # whose summary names our line (the error file cli.record_for_torchrun wrote) as the root cause
    root = output.split("Root Cause (first observed failure):")[1]
    assert "exitcode  : 2" in root and "rank      : 0 (local_rank: 0)" in root, output
    assert f"traceback : {said[0]}" in root, output
    assert _python_warnings(result.stderr) == [], result.stderr
    assert time.monotonic() - began < 200                 # bounded: no rank waits in a collective


def test_a_quiet_rank_still_refuses_and_speaks_if_left_running(monkeypatch, capsys):
    """Under torchrun a rank other than local rank 0 waits (cli.QUIET_WAIT) for torchrun to stop
    it, then says its line itself: a refusal local rank 0 did not share is never lost."""
    from running import cli
    waits = []
    monkeypatch.setattr(cli.time, "sleep", waits.append)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(SystemExit) as stop:
        cli.parse_args(["--bogus"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and waits == [cli.QUIET_WAIT], waits
    assert err == "train.py: error: unrecognized arguments: --bogus (see --help)\n", err
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(SystemExit):
        cli.parse_args(["--steps", "0"])
    assert capsys.readouterr().err == "train.py: error: --steps must be at least 1, got 0 (see --help)\n"
    assert waits == [cli.QUIET_WAIT]                      # local rank 0 speaks at once


# ---- CPU threads: a share of the cores ------------------------------------------------------------

def test_cpu_threads_share_the_cores_among_the_ranks(monkeypatch):
    from running.threads import cpu_threads
    cores = len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    cpu = torch.device("cpu")
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        share = max(1, cores // 2)
        assert cpu_threads(None, cpu) == f"{share} CPU thread{'s' * (share > 1)} per rank: {cores} core" \
            f"{'s' * (cores > 1)} / 2 ranks on this node" and torch.get_num_threads() == share
        # torchrun's own OMP_NUM_THREADS=1 (set when the user set none) is not a choice ...
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
        assert cpu_threads(None, cpu).endswith("2 ranks on this node")
        # ... the user's is, and --threads is
        monkeypatch.delenv("TORCHELASTIC_RUN_ID")
        assert cpu_threads(None, cpu).endswith(": OMP_NUM_THREADS")
        assert cpu_threads(3, cpu) == "3 CPU threads per rank: --threads" and torch.get_num_threads() == 3
        assert cpu_threads(None, torch.device("cuda", 0)) == ""         # the host only launches kernels
    finally:
        torch.set_num_threads(before)
