"""Checks exercises/moe.py: the routing against a loop over tokens, then the all-to-all and the
experts split over 2 ranks against one process running every token through its experts.

The loop below routes token by token: a softmax written out, the k largest probabilities, the
gates divided by their sum, the assignments in priority order (every first choice, then every
second), each counted into its (routing group, expert) queue and kept while the count is under
K = ceil(capacity_factor * k * S / E). Routing is compared exactly (which expert, which place,
kept or not), the gates within 1e-12 (fp64, the softmax's sum in another order). A bf16 router's
gates are compared with the fp64 softmax of its bf16 logits: fp32's rounding, under 1e-6.
The all-to-all runs with unequal splits (so swapped splits show), its backward with a probe.
The MoE layer, its E = 4 experts split 2 a rank, routes each rank's own tokens and is compared
with the loop: each kept choice's expert on its token, times its gate, summed, and the input's
gradient; fp64, the experts' sums over a batch rather than a row: rounding alone, under 1e-12.
"""
import math

import torch
import torch.nn as nn

from foundations.comm import Comm

WORLD = 2
PARTS = ["MoE.route", "_queue_positions", "_AllToAll.forward", "_AllToAll.backward",
         "all_to_all", "MoE._exchange_static"]
BOUND, WHY = 1e-12, "fp64, the same sums in another order"
C, E, K_CHOICES, S, GROUPS, FACTOR = 6, 4, 2, 8, 2, 1.0     # K = ceil(1.0 * 2 * 8 / 4) = 4


def randn(seed: int, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


def layer(exercise):
    """The student's MoE of E small experts, fp64, the same weights on every rank; the router's
    weights spread so that some (group, expert) queues overflow the capacity."""
    torch.manual_seed(0)
    model = exercise.MoE(C, lambda: nn.Sequential(nn.Linear(C, 2 * C), nn.Tanh(),
                                                  nn.Linear(2 * C, C)),
                         experts=E, top_k=K_CHOICES, capacity_factor=FACTOR, group_size=S)
    model = model.double()
    with torch.no_grad():
        model.router.weight.copy_(2 * randn(10, E, C))
    return model


def route_by_loop(x, weight):
    """Token by token: [(token, expert, gate, group, position, kept)], choice-major."""
    choices = []
    for n in range(x.shape[0]):
        logits = weight @ x[n]
        exp = (logits - logits.max()).exp()
        probs = exp / exp.sum()
        top = sorted(range(E), key=lambda e: -probs[e])[:K_CHOICES]
        choices.append([(e, probs[e] / sum(probs[f] for f in top)) for e in top])
    capacity = math.ceil(FACTOR * K_CHOICES * S / E)
    seen, routed = {}, []
    for j in range(K_CHOICES):
        for n in range(x.shape[0]):
            e, gate = choices[n][j]
            place = seen.get((n // S, e), 0)
            seen[(n // S, e)] = place + 1
            routed.append((n, e, gate, n // S, place, place < capacity))
    return routed, capacity


def positions_by_loop(queue: list, queues: int):
    """Order, positions and counts of the queues, one assignment at a time."""
    order = sorted(range(len(queue)), key=lambda i: queue[i])           # Python's sort: stable
    counts, position = [0] * queues, []
    for q in queue:
        position.append(counts[q])
        counts[q] += 1
    return order, position, counts


def check(exercise, grader):
    model = layer(exercise)
    x = randn(11, GROUPS * S, C)
    routed, capacity = route_by_loop(x, model.router.weight.detach())

    def column(i):
        return torch.tensor([float(a[i]) for a in routed], dtype=torch.float64)

    def exact(what, got, expected):
        grader.close(what, got, expected, 0.0, "a count or an index: exact")

    with grader.step("the router's top-k", "softmax over the experts, the k largest, the gates "
                     "renormalised to sum to 1; assignments choice-major: every token's first "
                     "choice, then every second"):
        routing = model.route(x)
        exact("routing.token", routing.token, column(0))
        exact("routing.expert", routing.expert, column(1))
        grader.close("routing.gate", routing.gate, column(2), BOUND,
                     "fp64, the softmax's sum in another order")
        exact("routing.group", routing.group, column(3))

    with grader.step("a bf16 router", "the router's matmul runs in the model's dtype, bf16 here; "
                     "a softmax and gates computed in bf16 keep 8 significant bits of each "
                     "probability: what dtype should the softmax see?"):
        low = layer(exercise).to(torch.bfloat16)
        x_low = x.to(torch.bfloat16)
        with torch.no_grad():
            logits = low.router(x_low).double()                  # the matmul in bf16, as route's
            top, _ = logits.softmax(dim=-1).topk(K_CHOICES, dim=-1)
        gates = (top / top.sum(dim=-1, keepdim=True)).t().reshape(-1)
        routing_low = low.route(x_low)
        grader.same("a bf16 router's routing.gate dtype", routing_low.gate.dtype, torch.float32)
        grader.close("a bf16 router's routing.gate", routing_low.gate, gates, 1e-6,
                     "the softmax of the same bf16 logits in fp32: fp32 rounding")

    with grader.step("each assignment's place in its queue", "a queue per (routing group, "
                     "expert); the position counts the assignments of the same queue before it, "
                     "in priority order: a stable sort by queue, minus the queue's start"):
        queue = [3, 0, 3, 1, 3, 0, 4, 1, 3]                               # queue 2 empty
        order, position, per_queue = exercise._queue_positions(torch.tensor(queue), 5)
        expected = positions_by_loop(queue, 5)
        grader.same("_queue_positions' order", order.tolist(), expected[0])
        grader.same("_queue_positions' positions", position.tolist(), expected[1])
        grader.same("_queue_positions' counts", per_queue.tolist(), expected[2])
        exact("routing.position", routing.position, column(4))

    with grader.step("capacity", "an assignment is kept while its position is under K = "
                     "ceil(capacity_factor * k * S / E): positions 0 .. K-1"):
        grader.same("routing.capacity", routing.capacity, capacity)
        exact("routing.keep", routing.keep, column(5))
        kept = [sum(1 for a in routed if a[1] == e and a[5]) for e in range(E)]
        grader.same("routing.per_expert", routing.per_expert.tolist(), kept)

    n, r = grader.world, grader.rank
    comm = Comm(grader.group)
    sends = [[1 + (p + q) % 3 + p for q in range(n)] for p in range(n)]   # rows p sends to q
    pieces = [randn(20 + p, sum(sends[p]), C).split(sends[p]) for p in range(n)]
    probe = [randn(30 + q, sum(sends[p][q] for p in range(n)), C) for q in range(n)]

    with grader.step("the all-to-all", "rank r sends its i-th block of rows to rank i and "
                     "receives rank i's r-th block; backward sends each gradient back the "
                     "mirror way, its splits exchanged"):
        mine = torch.cat(pieces[r]).requires_grad_()
        receive = [sends[p][r] for p in range(n)]
        out = exercise.all_to_all(mine, comm, receive, sends[r])
        grader.close("received rows", out, torch.cat([pieces[p][r] for p in range(n)]), 0.0,
                     "rows moved, not computed: exact")
        (out * probe[r]).sum().backward()
        # Rank q's probe rows from p..: the gradient of what rank r sent to q.
        back = [probe[q].split([sends[p][q] for p in range(n)])[r] for q in range(n)]
        grader.close("the rows' gradient", mine.grad, torch.cat(back), 0.0,
                     "rows moved, not computed: exact")

    with grader.step("the experts on their ranks", "the slots go to the rank of their expert, "
                     "arrive as [source rank][expert][slot], run expert by expert, and return "
                     "in the order they came"):
        whole = layer(exercise)                          # the same weights, every expert here
        model.shard_experts(comm)
        tokens = randn(40 + r, S, C).requires_grad_()
        y = model(tokens)
        alone = tokens.detach().clone().requires_grad_()     # the gates' gradient reaches it
        routed, _ = route_by_loop(alone, whole.router.weight.detach())
        expected = [torch.zeros(C, dtype=torch.float64) for _ in range(S)]
        for token, e, gate, _, _, kept in routed:
            if kept:
                expected[token] = expected[token] + gate * whole.experts[e](alone[token])
        expected = torch.stack(expected)
        grader.close("the layer's output", y, expected, BOUND, WHY)
        readout = randn(50 + r, S, C)
        (y * readout).sum().backward()
        (expected * readout).sum().backward()
        grader.close("the input's gradient", tokens.grad, alone.grad, BOUND, WHY)
