"""The exercises: each blank is cut from its concept file, the concept file's own code passes its
checker, the blank gets "not implemented yet", and typical mistakes, written into the reference,
are each caught at the step they concern.

A mistake is (what it is, text of the concept file's code, what the student wrote instead, the
checker's step that must name it): fill() puts the concept file's functions into the blank, then
the mistake replaces its text, which must occur exactly once in the filled parts.
"""
import ast
import os
import re
import subprocess
import sys

import pytest

from exercises import EXERCISES
from exercises.grading import checker, combine, grade, grade_on_rank
from multiprocess import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MISTAKES = {
    # ---- collectives ----
    "collectives": [
        ("the reduce-scatter adds the chunk it sends, not the one arriving (off by one)",
         "sent, received = (r - 1 - step) % n, (r - 2 - step) % n",
         "sent, received = (r - 1 - step) % n, (r - 1 - step) % n", "reduce-scatter"),
        ("the all-gather starts by sending chunk r + 1, which this rank does not have whole",
         "sent, received = (r - step) % n, (r - 1 - step) % n",
         "sent, received = (r + 1 - step) % n, (r - step) % n", "all-gather"),
        ("one ring step too few: N-2 steps leave chunk r missing one rank's copy",
         "    for step in range(n - 1):\n        # The arriving",
         "    for step in range(n - 2):\n        # The arriving", "reduce-scatter"),
        ("one ring step too many: the N-th step adds a copy into chunk r-1, which nothing reads",
         "    for step in range(n - 1):\n        # The arriving",
         "    for step in range(n):\n        # The arriving", "reduce-scatter"),
        ("the all-reduce forgets the all-gather: each rank holds only its own chunk's sum",
         "    ring_reduce_scatter(chunks, group, log)\n    ring_all_gather(chunks, group, log)",
         "    ring_reduce_scatter(chunks, group, log)", "all-reduce"),
    ],

    # ---- mixed_precision ----
    "mixed_precision": [
        ("the loss is scaled even when the scaler is disabled (bf16, fp32 need no scale)",
         "return loss * self._scale if self.enabled else loss",
         "return loss * self._scale", "scale the loss"),
        ("the gradient is divided by the scale in fp16, before the cast to fp32: it underflows",
         "            master.grad = grad.to(master.dtype)\n        if scale != 1.0:\n"
         "            master.grad.div_(scale)",
         "            master.grad = (grad / scale).to(master.dtype)", "unscale the gradients"),
        ("a skipped unscale: the masters' gradients keep the loss scale",
         "        if scale != 1.0:\n            master.grad.div_(scale)\n", "",
         "unscale the gradients"),
        ("only inf counts as an overflow: a NaN gradient is stepped with",
         "self.last_step_skipped = not math.isfinite(norm)",
         "self.last_step_skipped = norm == math.inf", "skip the step on inf/NaN"),
        ("the skip flag is set on an overflow but never cleared: a clean step reads as skipped",
         "self.last_step_skipped = not math.isfinite(norm)\n"
         "        if not self.last_step_skipped:",
         "if not math.isfinite(norm):\n            self.last_step_skipped = True\n        else:",
         "skip the step on inf/NaN"),
        ("the masters step but are never rounded into the fp16 parameters",
         "p.copy_(m)", "pass", "skip the step on inf/NaN"),
        ("an overflow grows the scale instead of backing off",
         "self._scale *= self.backoff_factor", "self._scale *= self.growth_factor",
         "back off on overflow"),
        ("an overflow does not end the run of clean steps: the scale grows too early",
         "self._scale *= self.backoff_factor\n            self._clean_steps = 0",
         "self._scale *= self.backoff_factor", "grow after a run of clean steps"),
        ("the count is not restarted after growing: the scale grows once, then never again",
         "self._scale *= self.growth_factor\n                self._clean_steps = 0",
         "self._scale *= self.growth_factor", "grow after a run of clean steps"),
    ],

    # ---- ddp ----
    "ddp": [
        ("a gradient launches its bucket at once, before the bucket is full",
         "        if self.pending[b] == 0:\n"
         "            # launches b, and any full buckets after it, once every earlier bucket has "
         "launched\n            self._launch_full_buckets()",
         "        self._all_reduce(self.buckets[b])", "bucket launches"),
        ("a full bucket launches before an earlier one: ranks would pair different buckets",
         "            self._launch_full_buckets()",
         "            self._all_reduce(self.buckets[b])", "bucket launches"),
        ("the gradient is counted but never moved into its bucket slot",
         "        self._grad_into_slot(i)\n", "", "bucket launches"),
        ("a missing division by the world size: the buckets are summed, not averaged",
         "op=bucket.op", 'op="sum"', "bucket all-reduce"),
        ("the all-reduce blocks: backward waits for the network, nothing overlaps",
         "work = bucket.comm.all_reduce(wire, op=bucket.op, async_op=True)",
         "work = bucket.comm.all_reduce(wire, op=bucket.op, async_op=True)\n"
         "        work.wait()", "bucket all-reduce"),
        ("a forgotten wait: the finish reads the buckets before their all-reduce has come",
         "            work.wait()\n", "", "finish"),
        ("the finish forgets the buckets backward never filled (an unused parameter's)",
         "        self._launch_unused()", "        pass", "finish"),
        ("the upcast mean is never copied back into the bucket",
         "                bucket.grad_flat.copy_(wire)", "                pass", "finish"),
        ("syncing inside no_sync: the flag is never turned off",
         "outer, self.require_backward_grad_sync = self.require_backward_grad_sync, False",
         "outer = self.require_backward_grad_sync", "no_sync"),
        ("no_sync never gives the flag back: the last micro-batch's backward does not overlap",
         "            self.require_backward_grad_sync = outer", "            pass", "no_sync"),
        ("no_sync sets the flag to True at its end: a nested one ends the outer one's too",
         "            self.require_backward_grad_sync = outer",
         "            self.require_backward_grad_sync = True", "no_sync"),
        ("no_sync without try/finally: a body that raises leaves the sync off for good",
         "        try:\n            yield\n        finally:\n"
         "            self.require_backward_grad_sync = outer",
         "        yield\n        self.require_backward_grad_sync = outer", "no_sync"),
    ],

    # ---- zero ----
    "zero": [
        ("the norm left squared: the sum of squares without its root",
         "self._norm, self._used = squares.sqrt()[0], used",
         "self._norm, self._used = squares[0], used", "the global norm"),
        ("the norm of this rank's shards only: the squares never summed over the ranks",
         'self.comm.all_reduce(squares, op="sum")', "pass", "the global norm"),
        ("the ranks' norms summed, not their squares",
         'self.comm.all_reduce(squares, op="sum")',
         'self.comm.all_reduce(squares.sqrt_(), op="sum")\n                squares.pow_(2)',
         "the global norm"),
        ("the squares averaged over the ranks: divided by N where the shards add up",
         'self.comm.all_reduce(squares, op="sum")', 'self.comm.all_reduce(squares, op="avg")',
         "the global norm"),
        ("the model's whole gradients clipped, not the masters' shards the optimizer steps",
         "[b.master for b, g in zip(self.buckets, grads) if g is not None]",
         "[p for b in self.buckets for p in b.params]", "clip"),
        ("the gradient tensors passed to clip_grads_with_norm_, which clips their (None) .grad",
         "[b.master for b, g in zip(self.buckets, grads) if g is not None]",
         "[g for g in grads if g is not None]", "clip"),
        ("the all-gather forgotten: each rank holds only its own shard's update",
         "            self.all_gather_parameters()       # 7",
         "            pass       # 7", "all-gather the parameters"),
        ("a bf16 model's shard never gets its fp32 master: the all-gather sends the old one",
         "self._master_into_model(shard, bucket.master)", "pass",
         "all-gather 16-bit parameters"),
        ("step() never clips, though clip_grad_norm_ asked for it",
         "self.clip(self.max_norm, norm)", "pass", "the whole step"),
        ("ZeRO-2 keeps each whole gradient: its .grad not dropped once copied",
         "bucket.params[i].grad = None", "pass", "ZeRO-2: reduce-scatter during backward"),
        ("ZeRO-2 never hands a full bucket on: every reduce-scatter waits for backward's end",
         "            self._order.ready(bucket)", "            pass",
         "ZeRO-2: reduce-scatter during backward"),
        ("ZeRO-2's buffer in fp32 whatever the parameters' dtype, when reduce_dtype is None",
         "torch.zeros_like(bucket.flat, dtype=self.reduce_dtype)",
         "torch.zeros_like(bucket.flat, dtype=self.reduce_dtype or torch.float32)",
         "ZeRO-2: reduce-scatter during backward"),
        ("ZeRO-2's second micro-batch overwrites the first's shard instead of adding to it",
         "output if bucket.grad_shard is None else bucket.grad_shard.add_(output)", "output",
         "ZeRO-2: micro-batches add up"),
    ],

    # ---- fsdp ----
    "fsdp": [
        ("the all-gather does not mark the unit gathered: FSDP would gather it again",
         "        self.gathered = True\n", "", "all-gather"),
        ("free leaves the memory: the unit's flat keeps its storage",
         "            flat.untyped_storage().resize_(0)\n", "            pass\n", "free"),
        ("free does not mark the unit not gathered: FSDP would never gather it again",
         "        self.gathered = False\n", "", "free"),
        ("the unit is not freed after its forward: every unit stays whole",
         "        self._free(unit)\n        if torch.is_grad_enabled():",
         "        if torch.is_grad_enabled():", "forward"),
        ("forward prefetches the previous unit (backward's way), not the next",
         "self._prefetch(self.forward_order.index(unit), +1)",
         "self._prefetch(self.forward_order.index(unit), -1)", "prefetch"),
        ("no prefetch before forward: each unit's all-gather waits for its turn",
         "        self._prefetch(self.forward_order.index(unit), +1)    # overlaps",
         "        # overlaps", "prefetch"),
        ("the unit is not gathered again before its backward: its weights were freed",
         "        self._gather(unit)\n        unit.wait()\n        self._tell(\"backward\"",
         "        unit.wait()\n        self._tell(\"backward\"", "backward"),
        ("backward prefetches the next unit in forward order, which has already run",
         "self._prefetch(self.forward_order.index(unit), -1)",
         "self._prefetch(self.forward_order.index(unit), +1)", "prefetch in backward"),
        ("the gradient is summed over the ranks, not averaged (no division by N)",
         "op=unit.op", "op=\"sum\"", "reduce-scatter"),
        ("the whole gradients are kept after the reduce-scatter",
         "                p.grad = None\n", "", "reduce-scatter"),
        ("prefetch never counts the units gathered: a pipeline's step holds every unit whole",
         " or gathered >= limit:", ":", "prefetch's limit"),
        ("the all-gather keeps (shard, handle): wait() reads (handle, shard)",
         "self.gathering.append((handle, shard))", "self.gathering.append((shard, handle))",
         "all-gather"),
    ],

    # ---- pipeline ----
    "pipeline": [
        ("the last stage sends its output on, to a stage that does not exist",
         '[Action("send_act", m, chunk)] if vs < V - 1',
         '[Action("send_act", m, chunk)] if vs < V', "a forward's actions"),
        ("1F1B's warm-up one forward too long: stage s holds P-s+1 micro-batches",
         "warmup = min(P - 1 - s, M)", "warmup = min(P - s, M)", "1F1B's lists"),
        ("1F1B's steady state runs the backward first: the last stage's B0 before its F0",
         "forward_actions(s, P, warmup + i) + backward_actions(s, P, i)",
         "backward_actions(s, P, i) + forward_actions(s, P, warmup + i)", "1F1B's lists"),
        ("1F1B's steady state backs the newest micro-batch, not the oldest",
         "forward_actions(s, P, warmup + i) + backward_actions(s, P, i)",
         "forward_actions(s, P, warmup + i) + backward_actions(s, P, warmup + i)",
         "1F1B's lists"),
        ("a forward receives only on stage s > 0: interleaving's later chunks of stage 0 too",
         '[Action("recv_act", m, chunk)] if vs > 0',
         '[Action("recv_act", m, chunk)] if s > 0', "a forward's actions"),
        ("the step's loss is the sum of the micro-batches' losses, not their mean",
         "cache.loss += output.detach().float() / self.M",
         "cache.loss += output.detach().float()", "F: a micro-batch's forward"),
        ("the loss's backward is not divided by M: every gradient M times too large",
         "scale_loss(cache.outputs.pop(key) / self.M).backward()",
         "scale_loss(cache.outputs.pop(key)).backward()", "B: a micro-batch's backward"),
        ("the next and the previous stage swapped: activations go backwards",
         "after, before = (self.stage + 1) % self.P, (self.stage - 1) % self.P",
         "after, before = (self.stage - 1) % self.P, (self.stage + 1) % self.P",
         "messages: activations to the next stage"),
        ("the received activation does not require grad: B has no gradient to send back",
         "cache.inputs[a.m, a.chunk] = buffer.requires_grad_(torch.is_grad_enabled())",
         "cache.inputs[a.m, a.chunk] = buffer", "messages: activations to the next stage"),
        ("evaluating, send_act never drops the output it sent: every activation is kept",
         "output = cache.outputs[key] if torch.is_grad_enabled() else cache.outputs.pop(key)",
         "output = cache.outputs[key]", "evaluation: the forwards alone"),
        ("evaluating, F keeps the last stage's loss too, for a B that never comes",
         "if torch.is_grad_enabled() or not has_loss:", "if True:",
         "evaluation: what F keeps"),
        ("a received activation requires grad when evaluating too",
         "buffer.requires_grad_(torch.is_grad_enabled())", "buffer.requires_grad_()",
         "evaluation: the forwards alone"),
    ],

    # ---- tensor_parallel ----
    "tensor_parallel": [
        ("f all-reduces in forward too: each rank's columns read N times x",
         "_Conjugate.apply(x, comm, _identity, _all_reduced)",
         "_Conjugate.apply(x, comm, _all_reduced, _all_reduced)", "f"),
        ("g does not all-reduce: each rank keeps its partial sum as the output",
         "_Conjugate.apply(x, comm, _all_reduced, _identity)",
         "_Conjugate.apply(x, comm, _identity, _identity)", "g"),
        ("gather_features sums the gradient over the ranks instead of keeping its slice",
         "partial(_all_gathered, dim=-1), _my_piece)",
         "partial(_all_gathered, dim=-1), lambda grad, comm: _my_piece("
         "_all_reduced(grad, comm), comm))", "gather and split the features"),
        ("the column layer skips f: x's gradient holds only this rank's columns' part",
         "x = enter_region(x, self.comm, self.sequence_parallel)", "pass",
         "the column linear"),
        ("the column layer gathers its output whether gather_output or not (an extra gather)",
         "gather_features(y, self.comm) if self.gather_output else y",
         "gather_features(y, self.comm)", "the column linear"),
        ("the row layer adds the bias on every rank, before the partial products are summed",
         "share = self.local_product(y)", "share = self.local_product(y, self.bias)",
         "the row linear"),
        ("the row layer leaves the region with f: the partial products are never summed",
         "scatter_sequence(x, comm) if sequence_parallel else g(x, comm)",
         "scatter_sequence(x, comm) if sequence_parallel else f(x, comm)", "the row linear"),
        ("f and g swapped: the column layer enters with g, all-reducing x forward, not its "
         "gradient backward",
         "gather_sequence(x, comm) if sequence_parallel else f(x, comm)",
         "gather_sequence(x, comm) if sequence_parallel else g(x, comm)", "the column linear"),
        ("sequence parallelism enters the region with f: the column layer sees T/N tokens",
         "gather_sequence(x, comm) if sequence_parallel else f(x, comm)",
         "f(x, comm) if sequence_parallel else f(x, comm)", "the MLP, sequence parallel"),
    ],

    # ---- context_parallel ----
    "context_parallel": [
        ("the old sums are not rescaled: acc keeps exponentials taken against the old max",
         "acc.mul_(rescale.unsqueeze(-1)).add_(", "acc.add_(", "a second key block"),
        ("acc divided by the running sum at every block, not once after the last",
         ".add_(p @ _upcast(_grouped(v, q)))",
         ".add_(p @ _upcast(_grouped(v, q))).div_(denom.unsqueeze(-1))", "one key block"),
        ("the diagonal block left unmasked: queries see their chunk's later keys",
         "scores = _scores(q, k, causal)", "scores = _scores(q, k, False)",
         "the diagonal block"),
        ("the causal mask on every block of the rank's own K/V, not only the diagonal ones",
         "kv[1][:, :, cols], causal)", "kv[1][:, :, cols], step == 0)", "the ring"),
        ("the ring turned the wrong way: the block held at step s taken for rank r+s's",
         "source = (r - step) % cp", "source = (r + step) % cp", "the ring"),
        ("the chunk size taken as t / cp, not t / 2: the rank's second chunk half folded in",
         "c = q.shape[2] // len(split.chunks(r))", "c = q.shape[2] // cp",
         "every query row folded in"),
        ("the running max kept as the log-sum-exp, without log(denom)",
         "m + denom.log())", "m)", "the log-sum-exp kept for backward"),
    ],

    # ---- moe ----
    "moe": [
        ("the gates not renormalised: the top-k probabilities as they came from the softmax",
         "gates = top_probs / top_probs.sum(dim=-1, keepdim=True)", "gates = top_probs",
         "the router's top-k"),
        ("the experts laid out token-major (no transpose) beside the choice-major tokens",
         "expert = top_experts.t().reshape(-1)", "expert = top_experts.reshape(-1)",
         "the router's top-k"),
        ("positions counted over every assignment, not restarted at each expert's queue",
         "order.device) - starts[queue[order]]", "order.device)",
         "each assignment's place in its queue"),
        ("one queue per expert over every routing group: the groups' counts run on",
         "queue = (token // group_size) * E + expert", "queue = expert",
         "each assignment's place in its queue"),
        ("the router's logits not promoted: a bf16 model's softmax and gates run in bf16",
         "        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))\n", "",
         "a bf16 router"),
        ("capacity off by one: position K kept, K + 1 assignments in a queue",
         "keep = position < capacity", "keep = position <= capacity", "capacity"),
        ("the splits swapped: the rows a rank sends taken for those it receives",
         "_AllToAll.apply(x, comm, receive_splits, send_splits)",
         "_AllToAll.apply(x, comm, send_splits, receive_splits)", "the all-to-all"),
        ("backward's splits not exchanged: the gradient sent back as the rows came",
         "grad.contiguous(), send_splits, receive_splits)",
         "grad.contiguous(), receive_splits, send_splits)", "the all-to-all"),
        ("the arrived slots run as they came, [source rank][expert], not regrouped by expert",
         "mine = received.view(P, len(self.local), slots, C).transpose(0, 1)",
         "mine = received.view(P, len(self.local), slots, C)", "the experts on their ranks"),
    ],

    # ---- lora ----
    "lora": [
        ("the update forgets the scale alpha / r",
         "return self.scale * self.lora_B @ self.lora_A", "return self.lora_B @ self.lora_A",
         "the update (alpha/r) B A"),
        ("the forward adds B A x without the scale alpha / r",
         "return h + self.scale * self.linear(", "return h + self.linear(",
         "forward: W0 x + (alpha/r) B A x"),
        ("the factors in the wrong order: B applied to x first",
         "self.linear(self.linear(x, self.lora_A), self.lora_B)",
         "self.linear(self.linear(x, self.lora_B), self.lora_A)",
         "forward: W0 x + (alpha/r) B A x"),
        ("A detached, frozen like W0: it never gets a gradient",
         "self.linear(x, self.lora_A)", "self.linear(x, self.lora_A.detach())",
         "gradients only on A and B"),
        ("dropout without the training flag: it still drops in evaluation",
         "F.dropout(x, self.dropout, self.training)", "F.dropout(x, self.dropout)",
         "no dropout in evaluation"),
        ("a merged layer's forward adds B A x again, on top of the merged W0",
         "        if self.merged:        # W0 + s B A is in weight already: A and B get no "
         "gradient\n            return h\n", "", "a merged layer's forward"),
        ("merge without its guard: a second merge adds the update twice",
         "if not self.merged:\n            self.weight +=",
         "if True:\n            self.weight +=", "merge, and merge again: W0 + (alpha/r) B A"),
        ("unmerge adds the update instead of taking it out",
         "self.weight -= self.delta()", "self.weight += self.delta()",
         "unmerge, twice or unmerged: W0 back"),
        ("unmerge without its guard: an unmerged layer loses the update from W0",
         "if self.merged:\n            self.weight -=",
         "if True:\n            self.weight -=", "unmerge, twice or unmerged: W0 back"),
        ("merge builds a new weight: the model's own W0 tensor never gets the update",
         "self.weight += self.delta().to(self.weight.dtype)",
         "self.weight = torch.nn.Parameter(self.weight + self.delta(), requires_grad=False)",
         "merge in the weight's dtype (bf16)"),
        ("merge sums in fp64 for accuracy and keeps the sum: a bf16 weight becomes fp64",
         "self.weight += self.delta().to(self.weight.dtype)",
         "self.weight.data = self.weight.double() + self.delta().double()",
         "merge in the weight's dtype (bf16)"),
    ],

    # ---- quantization ----
    "quantization": [
        ("the scale is the block's largest value, not its largest magnitude",
         "padded.abs().amax(dim=1)", "padded.amax(dim=1)", "blockwise absmax scales"),
        ("an all-zero block keeps the scale 0 (its values become 0 / 0)",
         ".clamp(min=torch.finfo(torch.float32).tiny)", "", "blockwise absmax scales"),
        ("the values are rounded to the levels without being divided by their block's scale",
         "normalized = padded / scales[:, None]", "normalized = padded",
         "round to the nearest level"),
        ("the even position goes in the low nibble, the odd one in the high",
         "codes[0::2] << 4 | codes[1::2]", "codes[1::2] << 4 | codes[0::2]",
         "pack two codes a byte"),
        ("dequantize unpacks each byte low nibble first",
         "torch.stack([self.codes >> 4, self.codes & 0xF], dim=1)",
         "torch.stack([self.codes & 0xF, self.codes >> 4], dim=1)", "dequantize"),
        ("dequantize forgets the block's scale: the levels alone, in [-1, 1]",
         "self.levels[codes.long()] * self.block_scales()[:, None]",
         "self.levels[codes.long()]", "dequantize"),
        ("dequantize reads self.scales, which double quantization does not keep",
         "self.block_scales()[:, None]", "self.scales[:, None]", "double quantization"),
        ("dequantize casts the levels and scales to the dtype asked for, then multiplies: a "
         "bf16 weight rounded three times, not once",
         "self.levels[codes.long()] * self.block_scales()[:, None]",
         "self.levels[codes.long()].to(dtype) * self.block_scales()[:, None].to(dtype)",
         "dequantize"),
    ],

    # ---- checkpointing ----
    "checkpointing": [
        ("backward recomputes without setting the RNG back: other dropout masks",
         "            torch.set_rng_state(ctx.cpu_rng)\n", "",
         "backward: recompute with the RNG restored"),
        ("forward takes the RNG state after the block ran: backward's masks are the next ones",
         "            return run_function(*_rebuild(layout, inputs))",
         "            output = run_function(*_rebuild(layout, inputs))\n"
         "        ctx.cpu_rng = torch.get_rng_state()\n        return output",
         "backward: recompute with the RNG restored"),
        ("backward recomputes without enable_grad: nothing recorded to differentiate",
         "            with torch.enable_grad():\n", "            if True:\n",
         "backward: recompute with the RNG restored"),
        ("backward returns no gradient for the parameters",
         "wanted + list(ctx.params), grad_output", "wanted, grad_output",
         "backward: recompute with the RNG restored"),
        ("the reentrant way: backward() inside backward writes the parameters' .grad itself "
         "and returns None for them",
         "        grads = torch.autograd.grad(output, wanted + list(ctx.params), grad_output,\n"
         "                                    allow_unused=True)",
         "        torch.autograd.backward(output, grad_output)\n"
         "        grads = [t.grad for t in wanted] + [None] * len(ctx.params)",
         "backward returns the parameters' gradients"),
        ("backward sets the RNG back outside fork_rng: the outer stream is rewound",
         "with torch.random.fork_rng(devices=ctx.cuda_devices):", "if True:",
         "backward leaves the RNG stream alone"),
        ("forward records the graph (enable_grad): every activation is kept anyway",
         "        with torch.no_grad():\n            return run_function(",
         "        with torch.enable_grad():\n            return run_function(",
         "forward keeps only the inputs"),
        ("backward differentiates every input, also those that need no gradient",
         "wanted = [t for t in inputs if t.requires_grad]", "wanted = list(inputs)",
         "an input that needs no gradient"),
        ("backward makes every input's fresh leaf require grad: a gradient computed and "
         "returned for a frozen input",
         "inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]",
         "inputs = [t.detach().requires_grad_() for t in ctx.saved_tensors]",
         "an input that needs no gradient"),
    ],
}


# ---- filling a blank with its concept file's code ------------------------------------------

def definitions(source: str) -> dict:
    """{qualified name: the def node} of every function in source, methods as Class.name."""
    found = {}

    def visit(node, prefix):
        for child in node.body:
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.FunctionDef):
                found[f"{prefix}{child.name}"] = child
    visit(ast.parse(source), "")
    return found


def segment(source: str, node) -> str:
    """The def's lines, decorators included."""
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    return "".join(source.splitlines(True)[first - 1:node.end_lineno])


def blank_path(name: str) -> str:
    return os.path.join(ROOT, "exercises", f"{name}.py")


def concept_source(name: str) -> str:
    return open(os.path.join(ROOT, f"{name}.py")).read()


def fill(name: str, mistake: tuple | None = None) -> str:
    """The blank with each part replaced by the concept file's def of the same name; then the
    mistake's text replaced, where it occurs once in those parts."""
    blank, concept = open(blank_path(name)).read(), concept_source(name)
    theirs, ours = definitions(blank), definitions(concept)
    filled = blank
    parts = "".join(segment(concept, ours[part]) for part in checker(name).PARTS)
    for part in checker(name).PARTS:
        filled = filled.replace(segment(blank, theirs[part]), segment(concept, ours[part]))
    if mistake:
        _, text, wrong, _ = mistake
        assert parts.count(text) == 1, f"the mistake's text occurs {parts.count(text)} times"
        filled = filled.replace(text, wrong)
    return filled


def run_check(name: str, source: str, tmp_path) -> dict:
    """The checker's verdict on source, on the ranks the checker names (rank 0's combined)."""
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    world = checker(name).WORLD
    if world == 1:
        return grade(name, str(path))
    return combine(run_ranks(grade_on_rank, world, name, str(path)))


# ---- the tests -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", EXERCISES)
def test_each_blank_is_cut_from_its_concept_file(name):
    """Every part the blank asks for has the concept file's signature and docstring, word for
    word, and only a TODO (comments and a raise NotImplementedError) for a body."""
    blank, concept = definitions(open(blank_path(name)).read()), definitions(concept_source(name))
    assert checker(name).PARTS, f"{name}'s checker names no part to write"
    for part in checker(name).PARTS:
        assert part in blank, f"exercises/{name}.py has no {part}"
        assert part in concept, f"{name}.py has no {part}: the exercise drifted from it"
        mine, source = blank[part], concept[part]
        assert ast.dump(mine.args) == ast.dump(source.args), f"{part}'s arguments drifted"
        assert ast.dump(mine.returns) == ast.dump(source.returns) if source.returns else \
            mine.returns is None, f"{part}'s return annotation drifted"
        assert [ast.dump(d) for d in mine.decorator_list] == \
            [ast.dump(d) for d in source.decorator_list], f"{part}'s decorators drifted"
        assert ast.get_docstring(mine) == ast.get_docstring(source), f"{part}'s docstring drifted"
        body = mine.body[1:] if ast.get_docstring(mine) is not None else mine.body
        assert len(body) == 1 and isinstance(body[0], ast.Raise) and \
            "NotImplementedError" in ast.unparse(body[0]), f"{part}'s body is more than its TODO"


@pytest.mark.parametrize("name", EXERCISES)
def test_the_blank_is_not_implemented_yet(name, tmp_path):
    verdict = run_check(name, open(blank_path(name)).read(), tmp_path)
    assert verdict["status"] == "todo", verdict
    assert verdict["line"].startswith("not implemented yet: "), verdict
    assert "\n" not in verdict["line"]


@pytest.mark.parametrize("name", EXERCISES)
def test_the_concept_file_passes_its_checker(name, tmp_path):
    verdict = run_check(name, fill(name), tmp_path)
    assert verdict["status"] == "passed", verdict
    assert len(verdict["passed"]) >= 3, verdict


@pytest.mark.parametrize("name", EXERCISES)
def test_at_least_three_mistakes_each(name):
    assert len(MISTAKES.get(name, [])) >= 3


@pytest.mark.parametrize("name, mistake", [(name, m) for name in EXERCISES
                                           for m in MISTAKES.get(name, [])],
                         ids=lambda v: v if isinstance(v, str) else v[0][:50])
def test_a_mistake_is_caught_at_its_step(name, mistake, tmp_path):
    verdict = run_check(name, fill(name, mistake), tmp_path)
    assert verdict["status"] == "differs", verdict
    assert verdict["step"] == mistake[3], verdict
    assert verdict["line"].startswith(mistake[3] + ":") and verdict["hint"], verdict


def test_the_commands_print_a_few_lines():
    """python -m exercises list and check, as the student types them: no traceback."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    listed = subprocess.run([sys.executable, "-m", "exercises", "list"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0 and not listed.stderr, listed.stderr
    for name in EXERCISES:
        assert f"\n{name} " in listed.stdout
    checked = subprocess.run([sys.executable, "-m", "exercises", "check", "collectives"],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0 and not checked.stderr, checked.stderr
    todo = "not implemented yet: ring_reduce_scatter (exercises/collectives.py, line "
    assert checked.stdout.splitlines()[-1].strip().startswith(todo), checked.stdout
    wrong = subprocess.run([sys.executable, "-m", "exercises", "check", "zero3"], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=120)
    assert wrong.returncode == 2 and "no exercise 'zero3'" in wrong.stderr.splitlines()[-1]


def test_the_lecture_map_names_functions_that_exist_and_every_exercise():
    """docs/lecture.md: each row's "read first" names defs of the file it names (Class.method or
    a plain name), and its last column names every exercise, in the lecture's order."""
    rows = [line.split(" | ") for line in open(os.path.join(ROOT, "docs", "lecture.md"))
            if line.startswith("| ") and line[2].isdigit()]
    for cells in rows:
        for part in cells[2].split("; "):
            path, _, names = part.partition(": ")
            source = open(os.path.join(ROOT, path.strip("`"))).read()
            tree = ast.parse(source)
            defined = set(definitions(source)) | {
                n.name for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
            for name in re.findall(r"`([\w.]+)`", names):
                assert name in defined, f"docs/lecture.md: {path} has no {name}"
    written = [re.findall(r"`(\w+)\.py`", cells[4]) for cells in rows]
    assert [name for names in written for name in names] == EXERCISES
