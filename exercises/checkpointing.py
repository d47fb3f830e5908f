"""Exercise: recompute a block in backward, with the RNG restored (the solution: checkpointing.py's
CheckpointFunction).

A checkpointed block keeps only its input for backward. Write the autograd Function's two halves:
- forward: run the block without recording a graph; keep what backward needs to run it again,
  and save only the inputs. The block draws dropout masks: what must backward find to draw the
  same ones?
- backward: run the block again, this time recording, on fresh leaves of the saved inputs (each
  requiring grad as its original did), and backpropagate grad_output through that copy. Return
  one gradient per argument of forward, the parameters' included: autograd accumulates them
  into .grad as without checkpointing (so gradient hooks, DDP's and ZeRO's, fire), and
  torch.autograd.grad(loss, params) gets them. The rest of training draws random numbers too:
  what must backward leave as it found it?
Given: the Function's arguments are the block (run_function), its call's layout (each tensor
argument replaced by a placeholder; _rebuild(layout, tensors) returns the call's positional
arguments as a list, the tensors given back in place: pass it the inputs only, for
run_function(*that)), n_inputs (how many of the tensors are inputs), then the input tensors,
then the parameters (run_function uses them itself: they are no argument of its call;
checkpointing.py's checkpoint() builds all this). The RNG:
torch.get_rng_state() and torch.set_rng_state(state) (the CPU's; torch.cuda.get_rng_state(d)
and torch.cuda.set_rng_state(state, d) for each CUDA device d the inputs are on), and
torch.random.fork_rng(devices=[...]) (a context that puts the states back on leaving).
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
        # TODO: keep on ctx what backward needs (the RNG among it); save the inputs, and only
        # them; return the block's output, recording nothing.
        raise NotImplementedError

    @staticmethod
    def backward(ctx, grad_output):
        # TODO: the block again, recording, with forward's random numbers; the gradients of its
        # output to the inputs that need one and to the parameters, returned (not written into
        # .grad here). One per forward argument: None where there is none.
        raise NotImplementedError
