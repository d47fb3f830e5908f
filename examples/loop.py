"""The README's "In your own training loop": DDP, ZeRO-2 and FSDP (with a plain torch AdamW,
then with FSDPOptimizer in bf16) train the same tiny GPT on the same batches, on 2 CPU processes:

    torchrun --nproc_per_node 2 examples/loop.py

Each way ends at the same loss (tests/test_examples.py runs it and checks that).
"""
import os
import sys

# The library's files sit one folder up, at the repository's root. In your own project, where
# they are importable (beside your script, or on PYTHONPATH), leave this line out.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if "RANK" not in os.environ:                   # plain `python examples/loop.py`: no ranks to join
    sys.exit("examples/loop.py trains on several processes: run it with torchrun --nproc_per_node 2 "
             "examples/loop.py")

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LambdaLR

from running.data import TextData
from ddp import DDP
from fsdp import FSDP, MixedPrecisionPolicy
from mechanics.fsdp_optimizer import FSDPOptimizer
from model import build_model
from foundations.world import exit_distributed
from zero import Zero2Optimizer

STEPS, BATCH, SEQ = 20, 8, 32   # small, to run in seconds on 2 CPU processes; raise them on GPUs
dist.init_process_group("gloo")                 # torchrun gives rank and world size; "nccl" on GPUs
rank, world = dist.get_rank(), dist.get_world_size()
data = TextData.from_file()                     # the embedded text: no download


def train(model, optimizer, clip):
    warmup = LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))
    for step in range(STEPS):
        x, y = data.batch(step, batch_size=BATCH, seq_len=SEQ, rank=rank, world_size=world)  # (B/N, T)
        optimizer.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        if hasattr(model, "finish_gradient_sync"):   # DDP, FSDP: wait for the gradient reductions
            model.finish_gradient_sync()
        clip(1.0)
        optimizer.step()
        warmup.step()
        if step == 0:
            first = loss.item()
    return first, loss.item()            # this rank's loss on its slice, at the first and last step


# DDP and any torch optimizer: every rank holds the whole averaged gradient, so torch's clip works.
torch.manual_seed(0)
ddp = DDP(build_model("tiny", n_layer=2))
adamw = torch.optim.AdamW(ddp.parameters(), lr=2e-3)
ddp_loss = train(ddp, adamw, lambda max_norm: torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm))

# ZeRO-2: the optimizer keeps 1/N of Adam's state and of the gradients, and clips globally.
torch.manual_seed(0)
model = build_model("tiny", n_layer=2)
zero = Zero2Optimizer(model.parameters(), optimizer_cls=torch.optim.AdamW, lr=2e-3)
zero_loss = train(model, zero, zero.clip_grad_norm_)

# FSDP: the shards are parameters like any others; any torch optimizer trains them ...
torch.manual_seed(0)
fsdp = FSDP(build_model("tiny", n_layer=2))
adamw = torch.optim.AdamW(fsdp.parameters(), lr=2e-3)
fsdp_loss = train(fsdp, adamw, fsdp.clip_grad_norm_)

# ... or FSDPOptimizer: fp16 loss scaling, CPU offload, parameters without a gradient left alone.
torch.manual_seed(0)
fsdp = FSDP(build_model("tiny", n_layer=2), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
optimizer = FSDPOptimizer(fsdp, torch.optim.AdamW, lr=2e-3)
bf16_loss = train(fsdp, optimizer, optimizer.clip_grad_norm_)

if rank == 0:
    for name, (first, last) in [("ddp", ddp_loss), ("zero2", zero_loss), ("fsdp", fsdp_loss),
                                ("fsdp bf16", bf16_loss)]:
        print(f"{name:10} loss {first:.4f} -> {last:.4f}")
exit_distributed()   # destroy_process_group, then exit before teardown, where gloo's threads can abort
