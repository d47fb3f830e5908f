"""Exercise: pipeline schedules as lists of actions, and the executor that runs one stage's list
over point-to-point messages (the solution: pipeline.py).

The model is cut into P stages, one per rank; a batch is split into M micro-batches. A schedule
is, for every stage, the list of what it does in order: "F" and "B" compute a micro-batch's
forward or backward, "recv_act"/"send_act" move activations to the next stage, "recv_grad"/
"send_grad" move their gradients back to the previous one.
- forward_actions, backward_actions: one micro-batch's forward (receive, compute, send on) and
  backward (receive the gradient, compute, send it back), minus the messages the ends skip.
- gpipe: every forward, then every backward. one_f_one_b: a warm-up of forwards, deep enough to
  keep the later stages busy until the first backward returns; then a forward and a backward in
  turn; then the backwards left over. Every micro-batch's F comes before its B.
- The executor (Pipeline._run, given) groups the messages between two computations into one
  batch: _post sends and receives a group together, _wait waits for it and files what arrived by
  (micro-batch, chunk); _forward runs F and keeps its output for B; _backward runs B from the
  loss (the last stage) or from the gradient that arrived. The step's loss is the mean over the
  micro-batches: each one's loss counts 1/M.
Check: python -m exercises check pipeline (on 3 ranks: with 2, the next and the previous stage
are the same rank).

Shapes: P stages, M micro-batches, s stage, m micro-batch, B batch rows, b = B / M rows per
micro-batch, T sequence, C channels. chunk and V: interleaving's (extensions/schedules.py); here
chunk 0 and V = P, except that the ring wraps round: the last stage's next stage is stage 0.
"""
import torch

import pipeline
from pipeline import Action, StepCache


def forward_actions(s: int, P: int, m: int, chunk: int = 0, V: int | None = None) -> list[Action]:
    """Forward of micro-batch m by chunk `chunk` of stage s: receive, compute, send on.

    The chunk is virtual stage vs = chunk*P + s of V (P*v). The defaults, V = P and chunk 0,
    are GPipe's and 1F1B's."""
    # TODO: vs and V as the docstring says; an activation arrives unless vs is the first virtual
    # stage, then F, then the output goes on unless vs is the last. Each Action(kind, m, chunk).
    raise NotImplementedError


def backward_actions(s: int, P: int, m: int, chunk: int = 0, V: int | None = None) -> list[Action]:
    """Backward of micro-batch m by chunk `chunk` of stage s: receive, compute, send back."""
    # TODO: the mirror image: a gradient arrives unless vs is the last virtual stage (it has the
    # loss), then B, then the input's gradient goes back unless vs is the first.
    raise NotImplementedError


def gpipe(P: int, M: int) -> list[list[Action]]:
    """GPipe in two phases: fill, all M forwards; drain, all M backwards. Holds M activations."""
    # TODO: for each stage s, the forward actions of micro-batches 0..M-1, then their backward
    # actions in the same order.
    raise NotImplementedError


def one_f_one_b(P: int, M: int) -> list[list[Action]]:
    """1F1B in three phases. Warm-up: P-1-s forwards, so that the stages after it stay busy
    until the first backward comes back. Steady state: one forward and one backward in turn.
    Cool-down: the remaining backwards. Stage s holds at most P-s micro-batches, GPipe M."""
    # TODO: for each stage s: the warm-up's forwards (never more than M); then, while forwards
    # remain, the forward of the newest micro-batch followed by the backward of the oldest one
    # not yet done; then the backwards of the micro-batches the warm-up left in flight.
    raise NotImplementedError


class Pipeline(pipeline.Pipeline):
    """pipeline.Pipeline with its executor's core to write: F, B and the messages."""

    def _forward(self, a: Action, x, y, cache: StepCache):
        """F: chunk a.chunk on micro-batch a.m, from its tokens x (b, T) or the activation
        received. The last chunk's loss joins the step's, 1/M each."""
        # TODO: key (a.m, a.chunk). The input: the tokens on the first stage's chunk 0, else the
        # activation filed in cache.inputs. The model's last chunk (last stage, chunk v-1) also
        # gets the targets and returns the loss. Call self.module(inputs, [targets,] chunk=...),
        # pass what it returns through self._keep_aux_loss. A loss joins cache.loss (a detached
        # float, 1/M of it). Keep the output in cache.outputs for B (evaluating, under no_grad,
        # only an activation still to be sent needs keeping).
        raise NotImplementedError

    def _backward(self, a: Action, cache: StepCache, scale_loss):
        """B: chunk a.chunk's backward on micro-batch a.m, from the loss or a received gradient."""
        # TODO: the model's last chunk: backward from scale_loss of its loss, 1/M of it (the
        # step's loss is the mean over micro-batches). A chunk with routers' losses (key in
        # cache.aux_losses): self._backward_with_aux_loss. Else: backward from the output kept
        # by F, with the gradient that arrived for it. Pop what you use: nothing outlives its B.
        raise NotImplementedError

    def _post(self, group: tuple, cache: StepCache, shape, device):
        """Post a group's sends and receives as one batch_isend_irecv (Comm.exchange: one work)."""
        # TODO: the next and the previous stage, wrapping round modulo P. For each action: a
        # send_act sends F's output, detached (popped when evaluating: nothing will need it);
        # a send_grad sends the gradient B left on the received input (pop it); a receive gets
        # a fresh buffer (shape, self.dtype), from the previous stage for an activation, the
        # next for a gradient. self.comm.exchange(ops) posts them all; keep its work and the
        # buffers in cache.recvs[group] if it receives, else in cache.sends_to_wait.
        raise NotImplementedError

    def _wait(self, group: tuple, cache: StepCache):
        """Wait for a posted group; file what it received: activations for F, gradients for B."""
        # TODO: take the group's work and buffers out of cache.recvs, wait, then file each buffer
        # by (m, chunk): an activation in cache.inputs, requiring grad when training (B sends its
        # gradient back), a gradient in cache.output_grads.
        raise NotImplementedError
