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
- The executor (Pipeline._run, given) plays a stage's list; you write its core: _forward (F,
  keeps its output for B), _backward (B, from the loss or the gradient that arrived), _post
  (posts a group of messages between two computations as one batch) and _wait (waits for a
  group; files what arrived by (micro-batch, chunk)). The step's loss is the mean over the
  micro-batches: each one's loss counts 1/M. train_step runs the whole list with grad enabled;
  evaluate() only the forwards and their messages, under torch.no_grad(): a part tells which
  by torch.is_grad_enabled(). Evaluating keeps no graph, and nothing for a B.
Given by Pipeline.__init__: self.stage (s), self.P, self.M; self.first, self.last (s is the
first, the last stage); self.v, this rank's chunks of layers (1 here); self.dtype, what an
activation or gradient is sent in, the model's own (a received buffer is used as it is, no
cast); self.comm, a Comm whose exchange(ops) posts ops [("send" | "recv", tensor, peer)]
together and returns one work (.wait()); a peer is a rank of self.comm, and stage s is rank s.
scale_loss, given to B, is a function: loss -> the loss to backward (fp16's loss scale; the
identity otherwise). self.module(inputs, chunk=c)
runs chunk c of this stage on inputs: the tokens (b, T) on stage 0's chunk 0, else the
activation (b, T, C), and returns the activation (b, T, C). The model's last chunk (the last
stage's chunk v-1) is called self.module(inputs, targets, chunk=c), targets (b, T), and
returns the loss (0-dim). With experts either returns (that, the routers' losses):
self._keep_aux_loss(output, key, cache) takes them in and returns the first; a chunk whose key
is then in cache.aux_losses needs self._backward_with_aux_loss(key, cache, scale_loss) for B
(the whole B: it pops the key's output, output_grad and aux_loss itself).
StepCache, all by key (m, chunk): inputs (received activations: B leaves their .grad),
outputs (what F returned, until B, or evaluating, until sent), output_grads (received
gradients, until B), aux_losses; recvs {group: (work, {action: buffer})}, every posted group
that receives (sends too or not: _wait's wait covers its sends); sends_to_wait [work], the
groups that only send (waited for at the step's end); loss (this stage's part of the step's
loss: starts as a 0-dim fp32 zero, on the batch's device).
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
        # TODO: which input does this chunk read, and is it the model's last chunk (the loss)?
        # A loss joins the step's as a number, not a graph. What must stay in cache.outputs,
        # training, and what evaluating, where no B comes?
        raise NotImplementedError

    def _backward(self, a: Action, cache: StepCache, scale_loss):
        """B: chunk a.chunk's backward on micro-batch a.m, from the loss or a received gradient."""
        # TODO: from the loss (scaled by scale_loss, its share of the mean), from the routers'
        # losses too, or from the output F kept with the gradient that arrived for it. Pop
        # what you use: nothing outlives its B.
        raise NotImplementedError

    def _post(self, group: tuple, cache: StepCache, shape, device):
        """Post a group's sends and receives as one batch_isend_irecv (Comm.exchange: one work)."""
        # TODO: one exchange for the whole group. Who is the peer of each kind of message (the
        # ring wraps round modulo P)? What does each send, and what may it drop from the cache
        # (training, evaluating)? A receive needs a fresh buffer of (shape, self.dtype). Keep
        # the work where _wait, or the step's end, will find it.
        raise NotImplementedError

    def _wait(self, group: tuple, cache: StepCache):
        """Wait for a posted group; file what it received: activations for F, gradients for B."""
        # TODO: once it has arrived, file each buffer where F or B looks for it. Which received
        # activations need autograd to leave a gradient on them, and which not?
        raise NotImplementedError
