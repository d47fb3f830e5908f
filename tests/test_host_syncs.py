"""Host syncs: an unlogged training step makes the host wait for the device at most once.

On a GPU the host queues kernels and runs ahead; a call that needs a value the device computes
(.item(), .tolist(), a boolean mask's size), or a copy from pageable host memory, makes it wait,
and the GPU idles while the host catches up. Here on the CPU nothing waits, so the test counts
the calls that WOULD block on CUDA, made by this project's code (not torch's), in one unlogged
step: from the batch's copy to the end of train_step (backward and the optimizer step). The
one allowed: the inf/NaN-and-clip decision (torch.amp.GradScaler makes the same one).
"""
import collections
import os
import sys

import pytest
import torch

from multiprocess import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
STEPS = ["--steps", "3", "--log-every", "100", "--eval-every", "0", "--eval-batches", "1",
         "--seq-len", "16", "--batch-size", "8", "--warmup", "1"]
UNLOGGED = 1                 # step 0 and the last step log; step 1 does not


def _device(args, kwargs):
    """The device a .to(...) call names, or None (a dtype-only cast copies nothing across)."""
    for a in [*args, kwargs.get("device")]:
        if isinstance(a, (torch.device, str)) or (isinstance(a, int) and not isinstance(a, bool)):
            return a
    return None


def _blocks(name, args, kwargs):
    """Would this call, with these arguments, make the host wait for a CUDA device?"""
    if name == "to":            # a copy between host and device without non_blocking waits,
        target = _device(args[1:], kwargs)
        if target is None:
            return False
        if not kwargs.get("non_blocking", False):
            return True
        # and so does a non_blocking one from host memory that is strided (staged through a
        # contiguous pageable copy) or, towards a GPU, not pinned (pageable).
        source = args[0]
        return source.device.type == "cpu" and (not source.is_contiguous() or (
            torch.device(target).type == "cuda" and not source.is_pinned()))
    if name == "tensor":        # Python data copied to the device: a blocking host-to-device copy
        return kwargs.get("device") is not None
    if name == "__getitem__":   # a boolean mask: the result's size is counted on the device
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
    if name == "repeat_interleave":
        return "output_size" not in kwargs
    return True                 # .item(), .tolist(), nonzero, bincount (its max): a device read


TENSOR_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__",
                  "__format__", "nonzero", "unique", "masked_select", "__getitem__", "to",
                  "repeat_interleave")
TORCH_FUNCTIONS = ("tensor", "nonzero", "argwhere", "unique", "bincount", "masked_select",
                   "repeat_interleave")


# running/data.py builds each batch from a host tensor, in host memory (data.pinned_copy moves it): its
# reads never touch a device.
HOST_ONLY = (os.path.join(TESTS, ""), os.path.join(ROOT, "running", "data.py"))
# A virtual environment inside the clone (install.sh's .venv) holds torch's own files, not ours.
VENV = os.path.join(ROOT, ".venv", "")


class SyncCounter:
    """Patches the blocking calls; while `on`, records each made from the project's files.

    Offload's copy of the gradients to the host ends in a wait for the stream (on CUDA; on the
    CPU there is nothing to wait for): each call of offload.gradients_to_host counts one, and a
    read of the pinned host buffers it filled (offload.host_buffer's) waits for nothing more."""

    def __init__(self):
        self.on, self.calls, self.host = False, collections.Counter(), set()

    def _record(self, name, depth=2):
        frame = sys._getframe(depth)
        self.calls[f"{name} at {os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"] += 1

    def _wrap(self, name, original):
        def call(*args, **kwargs):
            if self.on:
                caller = sys._getframe(1).f_code.co_filename
                on_host = (isinstance(args[0], torch.Tensor) and name != "to"
                           and args[0].untyped_storage().data_ptr() in self.host) if args else False
                # The project's files: the concept files at the top level and the packages.
                ours = caller.startswith(os.path.join(ROOT, "")) and not caller.startswith(VENV)
                if (ours and not caller.startswith(HOST_ONLY) and not on_host
                        and _blocks(name, args, kwargs)):
                    self._record(name)
            return original(*args, **kwargs)
        return call

    def install(self):
        from mechanics import offload
        for name in TENSOR_METHODS:
            setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))
        for name in TORCH_FUNCTIONS:
            setattr(torch, name, self._wrap(name, getattr(torch, name)))
        to_host, host_buffer = offload.gradients_to_host, offload.host_buffer

        def gradients_to_host(grads, buffers):
            if self.on:
                self._record("gradients_to_host's wait")
            return to_host(grads, buffers)

        def counted_host_buffer(*args, **kwargs):
            buffer = host_buffer(*args, **kwargs)
            self.host.add(buffer.untyped_storage().data_ptr())
            return buffer
        offload.gradients_to_host, offload.host_buffer = gradients_to_host, counted_host_buffer


def _count_step(argv):
    """train.main(argv) on this rank with the blocking calls of step UNLOGGED counted: from its
    batch (data.batch) to the end of train_step. Returns {call at file:line: times}."""
    import train
    from running.data import TextData
    counter = SyncCounter()
    counter.install()
    batch, train_step = TextData.batch, train.train_step

    def counted_batch(self, step, *args, **kwargs):
        counter.on = step == UNLOGGED and kwargs.get("rank") is not None     # training's, not eval's
        return batch(self, step, *args, **kwargs)

    def counted_train_step(*args, **kwargs):
        try:
            return train_step(*args, **kwargs)
        finally:
            counter.on = False

    TextData.batch, train.train_step = counted_batch, counted_train_step
    os.environ["WORLD_SIZE"] = str(torch.distributed.get_world_size())
    import contextlib
    import io
    with contextlib.redirect_stdout(io.StringIO()):
        train.main(argv)
    return dict(counter.calls)


# run: (ranks, flags, host syncs allowed in the unlogged step). tiny-moe has 4 MoE layers.
RUNS = {
    "ddp": (2, ["--strategy", "ddp"], 1),
    "zero1": (2, ["--strategy", "zero1"], 1),
    "zero2": (2, ["--strategy", "zero2"], 1),
    "fsdp": (2, ["--strategy", "fsdp"], 1),
    "tp": (2, ["--tp", "2"], 1),
    "pipeline": (2, ["--pp", "2", "--microbatches", "2"], 1),
    "zero2 offload": (2, ["--strategy", "zero2", "--offload", "optimizer"], 1),
    "fsdp offload params": (2, ["--strategy", "fsdp", "--offload", "params"], 1),
    "hsdp": (4, ["--strategy", "fsdp", "--shard-group", "2"], 1),
    "moe capacity": (2, ["--model", "tiny-moe", "--capacity-factor", "1.25", "--grad-accum", "2"], 1),
    "moe capacity, ep 2": (2, ["--model", "tiny-moe", "--ep", "2", "--capacity-factor", "1.25"], 1),
    # Dropless, the rows each expert gets follow the routing, and the host must know them: to
    # cut the rows (one process), and to size the all-to-alls (NCCL takes host integers) and
    # their receiving buffer: one read per MoE layer and micro-batch, the counts and the splits
    # together. 4 layers x 2 micro-batches, and 4 layers x 1, plus the step's one.
    "moe dropless": (2, ["--model", "tiny-moe", "--capacity-factor", "0", "--grad-accum", "2"], 1 + 4 * 2),
    "moe dropless, ep 2": (2, ["--model", "tiny-moe", "--ep", "2", "--capacity-factor", "0"], 1 + 4),
}


@pytest.mark.parametrize("run", RUNS)
def test_an_unlogged_step_waits_for_the_device_at_most_once(run):
    """ddp, zero1, zero2, fsdp, tp, a pipeline, offload, HSDP and MoE layers in capacity mode: at
    most the step's one decision (measured before issue 36: 4 to 36, see the report). Dropless
    MoE: one more per layer and micro-batch, and exactly that."""
    ranks, flags, allowed = RUNS[run]
    counts = run_ranks(_count_step, ranks, [*STEPS, "--precision", "bf16", *flags])
    for rank, calls in enumerate(counts):
        if allowed == 1:
            assert sum(calls.values()) <= 1, (run, rank, calls)
        else:
            assert sum(calls.values()) == allowed, (run, rank, calls)


def test_a_batch_goes_to_the_gpu_from_contiguous_pinned_memory(monkeypatch):
    """data.batch's inputs and targets are views of one (B/N, T+1) tensor, strided (T+1, 1): the
    copy to a GPU must read a contiguous pinned tensor, or it stages through pageable memory and
    may wait. Here on the CPU pin_memory is played by a strided copy marked pinned (as
    pin_memory keeps strides) and the device copy only records its source."""
    from running.data import TextData
    from running.data import pinned_copy
    pinned, sources = set(), []

    def pin_memory(self):
        copy = torch.empty_strided(self.size(), self.stride(), dtype=self.dtype).copy_(self)
        pinned.add(copy.data_ptr())
        return copy

    def to(self, *args, **kwargs):
        sources.append((self, kwargs.get("non_blocking")))
        return self
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    x, y = TextData.from_file().batch(0, 4, 16, 0, rank=0, world_size=1)         # (4, 16) each
    assert not x.is_contiguous()                        # what the copy must not read as it is
    for batch in (x, y):
        pinned_copy(batch, torch.device("cuda", 0))
    for source, non_blocking in sources:
        assert non_blocking and source.is_contiguous() and source.data_ptr() in pinned
