"""Activation checkpointing (also called gradient checkpointing): keep a block's input, forget
its insides, recompute them in backward.

Backward needs the activations forward produced. For a transformer layer they are
sbh(34 + 5as/h) bytes, with s = T, b = B, h = C, a heads and 2 bytes per fp16 value
(napkin/memory_math.py's activation_bytes). Its input alone is 2sbh bytes.
The demo below runs fp32, 4 bytes a value: twice these.
A checkpointed block runs forward without recording anything, keeps only its input, and in
backward runs that forward again, this time recording, then backpropagates through the fresh
copy. One extra forward pass per block buys every checkpointed block's input plus one block's
insides at a time (the one being recomputed) instead of all of them (Chen et al. 2016,
"Training Deep Nets with Sublinear Memory Cost"; Korthikanti et al. 2022, section 5).
Left out: selective recomputation of attention only, offloading activations to the CPU.
Run alone: python checkpointing.py (gradients and bytes kept, with and without, on the tiny
GPT); in training: python train.py --checkpoint-activations;
test: python -m pytest tests/test_checkpointing.py

Shapes: B batch, T sequence, C channels.
"""
import copy

import torch
import torch.nn as nn

from foundations.alone import start_alone
from foundations.meters import saved_activation_bytes
from model import build_model


class CheckpointFunction(torch.autograd.Function):
    """forward: run_function, keep the inputs; backward: recompute, backpropagate.

    Function.forward records no graph anyway; the no_grad in forward makes that explicit.

    The block's trainable parameters are passed as inputs too, and their gradients returned
    like the inputs' ones: the output then requires grad even when the block's input does not
    (LoRA behind frozen embeddings), and autograd accumulates the parameters' gradients the
    usual way, so DDP's and ZeRO's gradient hooks fire as without checkpointing.
    """

    @staticmethod
    def forward(ctx, run_function, layout, n_inputs, *tensors):
        # layout: the call's arguments with each tensor replaced by a placeholder, _TENSOR;
        # _rebuild puts the tensors back. The first n_inputs tensors are the inputs, the rest
        # the parameters (checkpoint, below, builds all three).
        inputs, params = tensors[:n_inputs], tensors[n_inputs:]
        ctx.run_function, ctx.layout = run_function, layout
        ctx.params = params                      # leaves: a reference, not a saved activation
        # The RNG state as forward found it: the recomputation must draw the same dropout masks.
        # Autocast's state is not kept (torch.utils.checkpoint keeps it): the models here run
        # in one dtype, without autocast (mixed_precision.py), so the recomputation casts as
        # forward did.
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_devices = sorted({t.device.index for t in inputs if t.is_cuda})
        ctx.cuda_rng = [torch.cuda.get_rng_state(d) for d in ctx.cuda_devices]
        ctx.save_for_backward(*inputs)           # (B, T, C) per block: all that stays alive
        with torch.no_grad():
            return run_function(*_rebuild(layout, inputs))

    @staticmethod
    def backward(ctx, grad_output):
        # Fresh leaves: the recomputed graph stops here.
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with torch.random.fork_rng(devices=ctx.cuda_devices):   # leave the outer stream alone
            torch.set_rng_state(ctx.cpu_rng)
            for device, state in zip(ctx.cuda_devices, ctx.cuda_rng):
                torch.cuda.set_rng_state(state, device)
            with torch.enable_grad():
                output = ctx.run_function(*_rebuild(ctx.layout, inputs))  # the activations, again
        wanted = [t for t in inputs if t.requires_grad]
        grads = torch.autograd.grad(output, wanted + list(ctx.params), grad_output,
                                    allow_unused=True)
        input_grads = iter(grads[:len(wanted)])
        # run_function, layout, n_inputs: no gradient; then one per input, then one per param.
        return (None, None, None,
                *[next(input_grads) if t.requires_grad else None for t in inputs],
                *grads[len(wanted):])


_TENSOR = object()          # a placeholder in a call's layout for "the next tensor argument"


def _rebuild(layout, tensors):
    """The call's arguments: tensors back in their places among the non-tensor ones."""
    tensors = iter(tensors)
    return [next(tensors) if arg is _TENSOR else arg for arg in layout]


def checkpoint(function, *args, parameters=()):
    """function(*args), with its activations recomputed in backward instead of kept.

    args may mix tensors and other values; function returns one tensor. `parameters`: the
    tensors function uses that need gradients (a module's .parameters(); frozen ones skipped).
    """
    layout = [_TENSOR if torch.is_tensor(a) else a for a in args]
    inputs = [a for a in args if torch.is_tensor(a)]
    params = [p for p in parameters if p.requires_grad]
    return CheckpointFunction.apply(function, layout, len(inputs), *inputs, *params)


def checkpoint_blocks(model: nn.Module, every: int = 1) -> int:
    """Checkpoint every `every`-th block of model.blocks in place; how many were checkpointed.

    The block's own forward is wrapped, so parameter names (and saved state_dicts) do not change,
    and the parameters are looked up at each call: LoRA applied later is included.
    With every > 1 the blocks in between keep all their activations: each checkpoint covers
    one block only. This code does not do Chen et al.'s sqrt(n) segments, where one
    checkpoint covers the run of blocks up to the next.
    """
    if every < 1:
        raise ValueError(f"checkpoint every {every}-th block: use 1 (every block) or more")
    chosen = [block for i, block in enumerate(model.blocks) if i % every == 0]
    for block in chosen:
        # Defaults bind this loop's block now (a plain closure would see the last one).
        # deepcopy shares function objects, so a copy's defaults would still point at the
        # original's blocks: copy the model first, then checkpoint.
        def forward(x, _forward=block.forward, _block=block):
            if not torch.is_grad_enabled():      # evaluation: nothing is kept anyway
                return _forward(x)
            return checkpoint(_forward, x, parameters=_block.parameters())
        block.forward = forward
    return len(chosen)


if __name__ == "__main__":
    start_alone()
    # One forward and backward of the tiny GPT (no optimizer step), plain and with every block
    # checkpointed, the same dropout masks drawn in both: recomputation runs the same operations
    # on the same inputs with the same random numbers, so every gradient is the plain one bit
    # for bit (bound 0).
    torch.manual_seed(0)
    plain = build_model("tiny", dropout=0.1)
    checkpointed = copy.deepcopy(plain)
    blocks = checkpoint_blocks(checkpointed)
    tokens = torch.randint(0, 256, (4, 64))                  # (B, T), vocabulary 256
    targets = torch.randint(0, 256, (4, 64))
    kept, grads = [], []
    for model in (plain, checkpointed):
        torch.manual_seed(1)                                     # the same dropout masks
        saved, (_, loss) = saved_activation_bytes(lambda: model(tokens, targets),
                                                  exclude=list(model.parameters()))
        loss.backward()
        kept.append(saved)
        grads.append({name: p.grad for name, p in model.named_parameters()})
    difference = max((grads[1][n] - g).abs().max().item() for n, g in grads[0].items())
    print(f"bytes kept for backward (B=4, T=64, fp32): {kept[0] / 2**20:.2f} MiB plain, "
          f"{kept[1] / 2**20:.2f} MiB with {blocks} blocks checkpointed (each keeps its input; "
          f"the rest is outside the blocks: embedding, final norm, head, logits, loss)")
    print(f"max |difference| of the gradients, checkpointed vs plain (both in one process): "
          f"{difference:.1e} (bound 0: the same operations recomputed on the same inputs and "
          f"random numbers)")
    raise SystemExit(0 if difference == 0 else 1)
