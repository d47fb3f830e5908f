"""Exercise: recompute a block in backward, with the RNG restored (the solution: checkpointing.py's
CheckpointFunction).

A checkpointed block keeps only its input for backward. Write the autograd Function's two halves:
- forward: remember what backward needs to run the block again (the function, the layout of
  its arguments, the parameters, and the random number generator's state as forward found it,
  so that the recomputation draws the same dropout masks), save the inputs (nothing else), and
  run the block without recording a graph.
- backward: take fresh leaves of the saved inputs (needing a gradient as the originals did),
  put the RNG back as forward found it, without disturbing the stream the rest of training
  draws from (torch.random.fork_rng), run the block again with grad enabled, this time
  recording, then backpropagate grad_output through the fresh copy to the inputs that need a
  gradient and to the parameters. Return one gradient per argument of forward.
The Function's arguments are the block (run_function), its call's layout (each tensor argument
replaced by a placeholder; _rebuild(layout, tensors) puts them back), n_inputs, then the input
tensors and the parameters (checkpointing.py's checkpoint() builds them).
Check: python -m exercises check checkpointing (one process: against the same block run by plain
autograd, dropout included).

Shapes: B batch, T sequence, C channels; the block's input (B, T, C) is all that is kept.
"""
import torch

import checkpointing
from checkpointing import _rebuild


class CheckpointFunction(checkpointing.CheckpointFunction):
    """checkpointing.py's CheckpointFunction, with your forward and backward."""

    @staticmethod
    def forward(ctx, run_function, layout, n_inputs, *tensors):
        # TODO: split tensors into the inputs and the parameters; keep on ctx what backward
        # needs to run the block again, the RNG state as forward finds it among it (the CPU's,
        # and each CUDA device's the inputs are on); save the inputs, and only them; return the
        # block's output, recording nothing.
        raise NotImplementedError

    @staticmethod
    def backward(ctx, grad_output):
        # TODO: fresh leaves from the saved inputs; the block run again, recording, from the
        # RNG state forward kept, inside fork_rng so the outer stream is left as it was; the
        # gradients of its output (given grad_output) to the inputs that need one and to the
        # parameters. One gradient per forward argument: None where there is none.
        raise NotImplementedError
