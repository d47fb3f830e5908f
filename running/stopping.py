"""running/stopping.py: how train.py stops on a signal, whatever its main thread is doing.

SIGINT is Ctrl-C (torchrun forwards it to every worker); SIGTERM is how torchrun stops every
worker once one failed (about 0.1 s after a kill -9), or stops the job (a batch system's end).
Either ends the run as the command line ends it: one line naming the last checkpoint
(run_log.finish says it). Torch-free: train.py installs it before importing torch, which takes
seconds on a loaded machine.
Test: python -m pytest tests/test_run_log.py -k "ctrl_c or torchrun"
"""
import os
import signal
import threading
import time

# Seconds the main thread has to take a signal before the watcher says it for it: a step's
# compute, or a save's write, ends well within them; torchrun's SIGKILL comes 30 s after SIGTERM.
GRACE = 5


class StopSignals:
    """SIGINT and SIGTERM as the command line handles them. Until run() (train.py's imports) a
    signal is only noted; from then the first raises KeyboardInterrupt where the run is, unless
    the run is already stopping (then it is only noted); a second while stopping ends the process
    at once. received: the first one's number (0: none).

    Python runs a handler between the main thread's bytecodes only: one blocked in a call (a
    rendezvous waiting for a rank that died, an NCCL collective waiting for one) would take it at
    --timeout, after torchrun's SIGKILL. So a thread woken by the signal itself (set_wakeup_fd)
    says the line for it GRACE s later (stuck(): the exit code, once the line is said) and ends
    the process, unless the main thread took it (taken) by then."""

    def __init__(self):
        self.received, self.stopping, self.taken, self.stuck = 0, True, False, None
        for signum in (signal.SIGINT, signal.SIGTERM):
            # A job started in the background (`cmd &`, nohup) ignores SIGINT: it stays so.
            if signal.getsignal(signum) is not signal.SIG_IGN:
                signal.signal(signum, self)
        read, write = os.pipe()
        os.set_blocking(write, False)
        signal.set_wakeup_fd(write)             # each signal's number, written as it arrives
        threading.Thread(target=self._watch, args=(read,), name="stop-signals", daemon=True).start()

    def run(self):
        """The run starts: a signal raises from here on, and one noted before raises now."""
        self.stopping = False
        if self.received:
            raise KeyboardInterrupt

    def __call__(self, signum, frame):
        if self.received and self.stopping:
            os._exit(128 + signum)                # a shell's exit status for a signal's
        self.received = self.received or signum
        if not self.stopping:
            raise KeyboardInterrupt

    def _watch(self, read: int):
        while (signum := os.read(read, 1)[0]) not in (signal.SIGINT, signal.SIGTERM):
            pass
        time.sleep(GRACE)
        while not self.taken:
            if self.stuck:                        # none yet: still importing, run() will take it
                self.received, self.stopping = self.received or signum, True
                os._exit(self.stuck())
            time.sleep(1)
