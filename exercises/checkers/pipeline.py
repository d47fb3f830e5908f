"""Checks exercises/pipeline.py: the schedules as lists, then the executor's parts one by one, then
whole training steps and an evaluation on 3 ranks (one stage each), against one process.

The schedules are compared exactly with lists written here: each micro-batch's messages around
its F or B, GPipe's forwards then backwards, and 1F1B as a stage that runs a forward whenever
fewer than P-s micro-batches are in flight, else a backward (the same order as warm-up, steady
state, cool-down). The executor runs a small fp64 GPT cut into 3 stages, against one process's
forward and backward on the whole batch: its activations at the stages' boundaries, their
gradients, the loss and every parameter's gradient. 3 ranks, because with 2 the next and the
previous stage are the same rank. The messages are checked on a ring (the last stage sends to
the first, as interleaving does), so that every rank both sends and receives.

Bounds: fp64 activations and gradients differ from one process's by the order of sums alone
(the micro-batches' gradients added one by one): 1e-12. The step's loss is summed in fp32 by the
executor (a metric): relative 1e-6.
"""
import copy

import torch

from foundations.comm import Comm
from mechanics.pipeline_mechanics import split_layers
from model import GPT, GPTConfig
from pipeline import Action, GPTStage, StepCache

WORLD = 3
PARTS = ["forward_actions", "backward_actions", "gpipe", "one_f_one_b", "Pipeline._forward",
         "Pipeline._backward", "Pipeline._post", "Pipeline._wait"]
BOUND, WHY = 1e-12, "fp64, sums in another order"
LOSS_RTOL, LOSS_WHY = 1e-6, "the executor sums the loss in fp32"
M, b, T = 4, 2, 8                                   # micro-batches, rows each, sequence
CONFIG = GPTConfig(n_layer=4, n_head=2, n_embd=16, block_size=T, vocab_size=32)
SIZES = [(1, 1), (1, 3), (2, 1), (2, 5), (3, 4), (4, 2), (4, 8)]     # (P, M) of the lists
# (s, P, m, chunk, V) of one micro-batch's actions: GPipe's and 1F1B's (V None), interleaving's
CALLS = [(s, P, m, chunk, P * v if v > 1 else None) for P in range(1, 5) for v in (1, 2)
         for s in range(P) for chunk in range(v) for m in (0, 3)]


# ---- the schedules, written another way ---------------------------------------------------

def messages(kind: str, s: int, P: int, m: int, chunk: int = 0, V: int | None = None) -> list:
    """F or B of micro-batch m on virtual stage chunk*P + s, with the messages around it."""
    vs, V = chunk * P + s, V or P
    if kind == "F":
        before = [("recv_act", m, chunk)] if vs != 0 else []
        after = [("send_act", m, chunk)] if vs != V - 1 else []
    else:
        before = [("recv_grad", m, chunk)] if vs != V - 1 else []
        after = [("send_grad", m, chunk)] if vs != 0 else []
    return [Action(*a) for a in before + [(kind, m, chunk)] + after]


def expand(order: list, s: int, P: int) -> list:
    """A stage's computations [(kind, m)] as its list of actions, messages included."""
    return [a for kind, m in order for a in messages(kind, s, P, m)]


def gpipe_order(s: int, P: int, M: int) -> list:
    return [("F", m) for m in range(M)] + [("B", m) for m in range(M)]


def one_f_one_b_order(s: int, P: int, M: int) -> list:
    """A forward while fewer than P-s micro-batches are in flight on stage s (and any is left),
    else the backward of the oldest: P-1-s forwards ahead, then one each, then the backwards."""
    order, forwards, backwards = [], 0, 0
    while backwards < M:
        if forwards < M and forwards - backwards < P - s:
            order.append(("F", forwards))
            forwards += 1
        else:
            order.append(("B", backwards))
            backwards += 1
    return order


def written(actions: list) -> str:
    """A list of actions as the student reads it: F0 send_act0 ... (a chunk after a dot)."""
    return " ".join(f"{a[0]}{a[1]}" + "".join(f".{c}" for c in a[2:] if c) for a in actions)


def same_list(grader, what: str, got: list, expected: list):
    if not isinstance(got, list):
        grader.fail(f"{what} is a {type(got).__name__}, expected a list of Actions")
    if got != expected:
        grader.fail(f"{what} is [{written(got)}], expected [{written(expected)}]")


def check_micro_batch(grader, kind: str, name: str, make):
    for call in CALLS:
        same_list(grader, f"{name}{call}", make(*call), messages(kind, *call))


def check_lists(grader, name: str, make, order):
    for P, micro in SIZES:
        got = make(P, micro)
        grader.same(f"len({name}({P}, {micro}))", len(got), P)
        for s in range(P):
            same_list(grader, f"{name}({P}, {micro})[{s}]", got[s],
                      expand(order(s, P, micro), s, P))


# ---- the one process: a small GPT on the whole batch --------------------------------------

def one_process():
    """The GPT, the batch (B, T+1), and one process's forward and backward on it: the stages'
    inputs and outputs (B, T, C) with their .grad, each micro-batch's loss, the mean loss."""
    torch.manual_seed(0)
    gpt = GPT(CONFIG).double()
    generator = torch.Generator().manual_seed(1)
    batch = torch.randint(0, CONFIG.vocab_size, (M * b, T + 1), generator=generator)
    whole, layers = copy.deepcopy(gpt), split_layers(CONFIG.n_layer, WORLD)
    h, boundaries = whole.embed(batch[:, :-1]), []
    for s, blocks in enumerate(layers):
        if s > 0:                                   # the activation stage s-1 sends to stage s
            h.retain_grad()
            boundaries.append(h)
        h = whole.run_blocks(h, blocks)
    logits = whole.logits(h)
    loss = whole.loss_fn(logits, batch[:, 1:])
    loss.backward()
    losses = [whole.loss_fn(lg, tg).detach() for lg, tg in
              zip(logits.chunk(M), batch[:, 1:].chunk(M))]
    return gpt, whole, batch, layers, boundaries, losses, loss.detach()


def by_micro_batch(activation: torch.Tensor) -> tuple:
    """A boundary's activation (B, T, C) and its gradient, each as M micro-batches (b, T, C)."""
    return activation.detach().chunk(M), activation.grad.chunk(M)


def stage_of(gpt, layers, s: int) -> GPTStage:
    return GPTStage(copy.deepcopy(gpt), layers[s], first=s == 0, last=s == WORLD - 1)


def check_gradients(grader, stage: GPTStage, whole):
    for name, p in stage.named_parameters():
        if p.grad is None:
            grader.fail(f"{name} has no gradient")
        expected = whole.get_parameter(name.removeprefix("gpt.")).grad
        grader.close(f"{name}.grad", p.grad, expected, BOUND, WHY)


def rank_tensor(seed: int, rank: int, m: int) -> torch.Tensor:
    """What rank sends for micro-batch m in the messages' steps: every rank can build any's."""
    generator = torch.Generator().manual_seed(seed + 10 * rank + m)
    return torch.randn(b, T, CONFIG.n_embd, generator=generator, dtype=torch.float64)


def check(exercise, grader):
    P, s = grader.world, grader.rank
    first, last = s == 0, s == P - 1

    with grader.step("a forward's actions", "receive the activation unless this is the first "
                     "(virtual) stage, F, send it on unless this is the last"):
        check_micro_batch(grader, "F", "forward_actions", exercise.forward_actions)

    with grader.step("a backward's actions", "receive the output's gradient unless this is the "
                     "last (virtual) stage, B, send the input's gradient back unless the first"):
        check_micro_batch(grader, "B", "backward_actions", exercise.backward_actions)

    with grader.step("GPipe's lists", "GPipe: fill (every micro-batch's forward, in order), "
                     "then drain (every backward, in the same order)"):
        check_lists(grader, "gpipe", exercise.gpipe, gpipe_order)

    with grader.step("1F1B's lists", "1F1B: a warm-up of min(P-1-s, M) forwards, then the next "
                     "forward and the oldest backward in turn, then the backwards left"):
        check_lists(grader, "one_f_one_b", exercise.one_f_one_b, one_f_one_b_order)

    gpt, whole, batch, layers, boundaries, losses, loss = one_process()
    x, y = batch[:, :-1].chunk(M), batch[:, 1:].chunk(M)               # M micro-batches (b, T)
    # What stage s receives and sends on (B, T, C), and their gradients, by micro-batch
    inputs, input_grads = by_micro_batch(boundaries[s - 1]) if not first else (None, None)
    outputs, output_grads = by_micro_batch(boundaries[s]) if not last else (None, None)
    stage = stage_of(gpt, layers, s)

    with grader.step("F: a micro-batch's forward", "F runs the stage on the tokens (first stage) "
                     "or the activation received, keeps the output for B; the last stage's loss "
                     "joins the step's, 1/M each"):
        runner = exercise.Pipeline(stage, Comm(grader.group), "gpipe", M, CONFIG.n_embd,
                                   torch.float64)
        cache = StepCache(torch.device("cpu"), None)
        for m in range(M):
            if not first:
                cache.inputs[m, 0] = inputs[m].clone().requires_grad_()
            runner._forward(Action("F", m), x[m], y[m], cache)
            if (m, 0) not in cache.outputs:
                grader.fail(f"F kept no cache.outputs[{m}, 0]: its B needs it")
            expected = losses[m] if last else outputs[m]
            grader.close(f"cache.outputs[{m}, 0]", cache.outputs[m, 0], expected, BOUND, WHY)
        grader.close("cache.loss", cache.loss, loss if last else torch.zeros(()), 0.0, LOSS_WHY,
                     LOSS_RTOL)

    with grader.step("B: a micro-batch's backward", "B runs backward from the loss / M (last "
                     "stage) or from F's output with the gradient received, leaving the input's "
                     "gradient on it"):
        for m in range(M):
            if not last:
                cache.output_grads[m, 0] = output_grads[m].clone()
            runner._backward(Action("B", m), cache, lambda loss: loss)
        for m in range(M):
            if not first:
                grader.close(f"cache.inputs[{m}, 0].grad", cache.inputs[m, 0].grad,
                             input_grads[m], BOUND, WHY)
        check_gradients(grader, stage, whole)

    m, shape = 1, (b, T, CONFIG.n_embd)
    wrapped = 1 if first else 0           # stage 0 receives the last stage's chunk 0 as chunk 1
    with grader.step("messages: activations to the next stage", "_post sends F's output to "
                     "stage s+1 and receives from s-1 (modulo P) in one exchange; _wait files "
                     "the activation by (m, chunk), requiring grad"):
        cache = StepCache(torch.device("cpu"), None)
        for k in range(M):
            cache.outputs[k, 0] = rank_tensor(200, s, k).requires_grad_()
        group = (Action("send_act", m, 0), Action("recv_act", m, wrapped))
        runner._post(group, cache, shape, torch.device("cpu"))
        runner._wait(group, cache)
        if (m, wrapped) not in cache.inputs:
            grader.fail(f"_wait filed no cache.inputs[{m}, {wrapped}]")
        received = cache.inputs[m, wrapped]
        grader.close(f"cache.inputs[{m}, {wrapped}]", received, rank_tensor(200, (s - 1) % P, m),
                     0.0, "a message copies")
        grader.same(f"cache.inputs[{m}, {wrapped}].requires_grad", received.requires_grad, True)

    with grader.step("messages: gradients to the previous stage", "_post sends the input's "
                     ".grad to stage s-1 and receives from s+1 (modulo P); _wait files the "
                     "gradient in cache.output_grads by (m, chunk)"):
        cache = StepCache(torch.device("cpu"), None)
        for k in range(M):
            cache.inputs[k, wrapped] = torch.zeros(shape, dtype=torch.float64,
                                                   requires_grad=True)
            cache.inputs[k, wrapped].grad = rank_tensor(300, s, k)
        group = (Action("send_grad", m, wrapped), Action("recv_grad", m, 0))
        runner._post(group, cache, shape, torch.device("cpu"))
        runner._wait(group, cache)
        if (m, 0) not in cache.output_grads:
            grader.fail(f"_wait filed no cache.output_grads[{m}, 0]")
        grader.close(f"cache.output_grads[{m}, 0]", cache.output_grads[m, 0],
                     rank_tensor(300, (s + 1) % P, m), 0.0, "a message copies")

    for name, make in [("GPipe", exercise.gpipe), ("1F1B", exercise.one_f_one_b)]:
        with grader.step(f"a training step under {name}", f"the executor plays your {name} "
                         "lists: every stage's loss and gradients equal one process's"):
            stage = stage_of(gpt, layers, s)
            runner = exercise.Pipeline(stage, Comm(grader.group), make(P, M), M, CONFIG.n_embd,
                                       torch.float64)
            got = runner.train_step(batch[:, :-1], batch[:, 1:])
            grader.close("the loss", got, loss, 0.0, LOSS_WHY, LOSS_RTOL)
            check_gradients(grader, stage, whole)

    with grader.step("evaluation: what F keeps", "evaluating (no grad), no B comes: what "
                     "must F keep, and what not?"):
        with torch.no_grad():
            cache = StepCache(torch.device("cpu"), None)
            for k in range(M):
                if not first:
                    cache.inputs[k, 0] = inputs[k].clone()
                runner._forward(Action("F", k), x[k], y[k], cache)
        grader.same("cache.outputs kept by the evaluating F's (only what is still to send)",
                    sorted(cache.outputs), [] if last else [(k, 0) for k in range(M)])

    with grader.step("evaluation: the forwards alone", "evaluating (no grad), no B comes: how "
                     "long must an output stay, and what does a received activation need?"):
        with torch.no_grad():
            for k in range(M):
                cache.outputs[k, 0] = rank_tensor(400, s, k)
            group = (Action("send_act", m, 0), Action("recv_act", m, wrapped))
            runner._post(group, cache, shape, torch.device("cpu"))
            runner._wait(group, cache)
            grader.same(f"cache.outputs once the evaluating send_act{m} has sent",
                        sorted(cache.outputs), [(k, 0) for k in range(M) if k != m])
            received = cache.inputs[m, wrapped]
            grader.close(f"cache.inputs[{m}, {wrapped}]", received,
                         rank_tensor(400, (s - 1) % P, m), 0.0, "a message copies")
            grader.same(f"cache.inputs[{m}, {wrapped}].requires_grad (evaluating)",
                        received.requires_grad, False)
        grader.close("the loss", runner.evaluate(batch[:, :-1], batch[:, 1:]), loss, 0.0,
                     LOSS_WHY, LOSS_RTOL)
