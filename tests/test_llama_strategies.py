"""Every strategy and mesh on a Llama (pretrained/llama.py) trains as one process does.

A small random Llama (grouped-query attention, Qwen2's q/k/v biases, RMSNorm, rotary positions,
SwiGLU) in fp64, where "equal to one process" is exact up to rounding, trains 3 clipped AdamW
steps under each strategy: ddp, zero1, zero2, fsdp (each LlamaBlock a unit), ZeRO-Offload
(zero2's and fsdp's), fsdp's parameters on the host, tp (query heads, key/value heads and
SwiGLU split; sequence parallel with RMSNorm), cp (the rotary positions each token's own in the
whole sequence; ring and all-gather, zigzag, sending the G key/value heads, not H copies), pp
(the head tied and not), LoRA on every linear and QLoRA (an NF4 base) under FSDP; and on 4
ranks tp 2 x dp 2 and cp 4. One launch per world size; each against one process on the same
batches.
The GPT's own equivalence tests are in test_ddp, test_zero, test_fsdp, test_tensor_parallel,
test_context_parallel and test_pipeline.
"""
import pytest
import torch
import torch.distributed as dist

import lora
from composition.context_parallel_gpt import ContextParallelGPT
from composition.tensor_parallel_gpt import TensorParallelGPT
from context_parallel import cp_kv_bytes
from ddp import DDP
from equivalence import Fp64AdamW
from extensions.fsdp_frozen import FrozenBaseFSDP
from extensions.fsdp_offload import OffloadedFSDP
from extensions.zero_offload import zero_optimizer
from foundations.comm import Comm
from foundations.placements import tensor_dim
from foundations.process_groups import make_mesh
from fsdp import FSDP, MixedPrecisionPolicy
from mechanics.fsdp_optimizer import FSDPOptimizer
from multiprocess import assert_tensors_close, run_ranks
from pipeline import GPTStage, Pipeline
from pretrained.llama import Llama, LlamaBlock, LlamaConfig

CFG = LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, hidden=48, vocab_size=64,
                  block_size=16, qkv_bias=True)
B, T, STEPS, CLIP = 4, 16, 3, 0.5
ADAMW = dict(lr=1e-2, weight_decay=0.1)
# fp64: the same sums in another order round at 1e-16 of their terms, which Adam amplifies by at
# most lr / eps = 1e6 (test_zero's and test_tensor_parallel's bound, on any CPU).
FP64_ATOL, FP64_RTOL = 1e-10, 1e-12
# The pipeline adds its micro-batches' losses into an fp32 sum (pipeline.StepCache): the loss
# it reports is one process's rounded to fp32 (its weights are fp64's, to FP64_ATOL).
PIPELINE_LOSS_RTOL = 2 ** -23
LORA_TARGETS = ("query", "key", "value", "output", "gate", "up", "down")
# LoRA on every one of a Llama's linears; QLoRA on query and value, the others (SwiGLU's gate
# among them) stored in NF4 beside them (lora.QUANTIZED).
ADAPTERS = {"lora": dict(targets=LORA_TARGETS), "qlora": dict(quantize="nf4")}


def _llama(tied=False, adapters=None):
    """The fp64 Llama every run starts from, the head tied or not, with ADAPTERS[adapters]."""
    torch.manual_seed(0)
    llama = Llama(LlamaConfig(**{**CFG.__dict__, "tie_embeddings": tied})).double()
    if adapters:                              # after the cast: an NF4 base keeps fp32 scales
        torch.manual_seed(1)
        lora.apply_lora(llama, rank=4, **ADAPTERS[adapters])
    return llama


def _batches():
    torch.manual_seed(2)
    return torch.randint(0, CFG.vocab_size, (STEPS, B, T + 1))


def _trained(llama):
    return {n: p.detach().clone() for n, p in llama.named_parameters() if p.requires_grad}


def _kv_bytes(attention: str, cp: int) -> int:
    """What a cp rank's attention sends in the run: the G = n_kv_head heads of K and V (and
    their gradients), not H copies: context_parallel.cp_kv_bytes with hidden G x D, in fp64."""
    sent = cp_kv_bytes(T, B, CFG.n_kv_head * CFG.D, cp, attention, bytes_per_value=8)
    return STEPS * CFG.n_layer * sum(sent.values())


def _single(tied=False, adapters=None) -> dict:
    llama = _llama(tied, adapters)
    optimizer = Fp64AdamW([p for p in llama.parameters() if p.requires_grad], **ADAMW)
    losses = []
    for batch in _batches():
        _, loss = llama(batch[:, :-1], batch[:, 1:])
        loss.backward()
        optimizer.clip_grad_norm_(CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": _trained(llama), "norm": optimizer.last_grad_norm}


# ---- each strategy on this rank: (the model called, its optimizer, gradient syncs, weights) ----

def _data_parallel(strategy, comm, adapters=None):
    llama = _llama(adapters=adapters)
    trained = [p for p in llama.parameters() if p.requires_grad]
    if strategy == "ddp":
        model = DDP(llama, comm)
        return model, Fp64AdamW(trained, **ADAMW), [model], lambda: _trained(llama)
    if strategy in ("zero1", "zero2", "zero2 offload"):
        optimizer = zero_optimizer(trained, stage=int(strategy[4]), group=comm,
                                   offload="offload" in strategy, **ADAMW)
        return llama, optimizer, [optimizer], lambda: _trained(llama)
    names = {n for n, p in llama.named_parameters() if p.requires_grad}
    kind = FrozenBaseFSDP if adapters else OffloadedFSDP if "params" in strategy else FSDP
    model = kind(llama, mp_policy=MixedPrecisionPolicy(torch.float64), group=comm)
    assert [type(u.module) for u in model.forward_order] == [LlamaBlock] * CFG.n_layer
    optimizer = FSDPOptimizer(model, offload="offload" in strategy, **ADAMW)

    def trained():                                   # the frozen base's are not compared
        return {n: t for n, t in model.full_state_dict(all_ranks=True).items() if n in names}
    return model, optimizer, [model], trained


def _tensor_parallel(comm, tp, sequence_parallel):
    tensor, data = make_mesh(comm, tp)
    llama = _llama()
    split = TensorParallelGPT(llama, tensor, sequence_parallel)
    model = DDP(split, data) if data.world_size > 1 else split
    syncs = [model, split] if data.world_size > 1 else [split]

    def whole():                   # each slice gathered over the tensor group along its dim
        out = {}
        for name, p in llama.named_parameters():
            dim = tensor_dim(p)
            if dim is None:
                out[name] = p.detach().clone()
                continue
            pieces = [torch.empty_like(p) for _ in range(tensor.world_size)]
            dist.all_gather(pieces, p.detach().contiguous(), group=tensor.group)
            out[name] = torch.cat(pieces, dim)
        return out
    return model, Fp64AdamW(llama.parameters(), {"tp": tensor}, **ADAMW), syncs, whole


def _context_parallel(comm, attention):
    llama = _llama()
    split = ContextParallelGPT(llama, comm, attention, zigzag=True)
    model = DDP(split, comm)
    comm.bytes_sent.clear()                    # the earlier cases' and DDP's broadcast

    def weights():
        return {**_trained(llama), "kv bytes": torch.tensor(split.kv_bytes_sent())}
    return model, Fp64AdamW(llama.parameters(), **ADAMW), [model], weights


def _train(model, optimizer, syncs, data_rank, data_size) -> list:
    losses = []
    for batch in _batches():
        rows = batch.chunk(data_size)[data_rank]
        _, loss = model(rows[:, :-1], rows[:, 1:])
        loss.backward()
        for sync in syncs:
            sync.finish_gradient_sync()
        optimizer.clip_grad_norm_(CLIP)
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    return losses


def _pipelined(comm, tied) -> dict:
    """Two stages, one LlamaBlock each, 1F1B over 2 micro-batches."""
    llama = _llama(tied)
    stage = GPTStage(llama, range(comm.rank, comm.rank + 1), comm.rank == 0, comm.rank == 1)
    runner = Pipeline(stage, comm, "1f1b", 2, lambda b, t: (b, t, CFG.n_embd), torch.float64)
    optimizer = Fp64AdamW(stage.parameters(), {"pp": comm}, **ADAMW)
    losses = []
    for batch in _batches():
        losses.append(runner.train_step(batch[:, :-1], batch[:, 1:]).item())
        optimizer.clip_grad_norm_(CLIP)
        optimizer.step()
        optimizer.zero_grad()
    every = [None] * comm.world_size
    dist.all_gather_object(every, _trained(llama))
    return {"losses": losses, "params": {n: p for mine in every for n, p in mine.items()}}


def _run_cases(cases) -> list:
    """On this rank: each case's losses and whole trained weights."""
    comm, out = Comm(), []
    for case in cases:
        kind, option = case[0], case[1:]
        if kind == "pp":
            out.append(_pipelined(comm, *option))
            continue
        data = (comm.rank, comm.world_size)
        if kind == "tp":
            built = _tensor_parallel(comm, *option)
            data = comm.rank // option[0], comm.world_size // option[0]   # make_mesh's
        elif kind == "cp":
            built, data = _context_parallel(comm, *option), (0, 1)  # every rank: whole rows
        else:
            built = _data_parallel(kind, comm, *option)
        model, optimizer, syncs, weights = built
        losses = _train(model, optimizer, syncs, *data)
        out.append({"losses": losses, "params": weights()})
    return out


TWO = [("ddp",), ("zero1",), ("zero2",), ("fsdp",), ("fsdp offload",), ("fsdp params offload",),
       ("zero2 offload",),
       ("tp", 2, True), ("cp", "ring"), ("cp", "allgather"), ("pp", False), ("pp", True),
       ("ddp", "lora"), ("fsdp", "qlora")]
FOUR = [("tp", 2, True), ("tp", 2, False), ("cp", "ring")]
REFERENCE = {("pp", True): dict(tied=True), ("ddp", "lora"): dict(adapters="lora"),
             ("fsdp", "qlora"): dict(adapters="qlora")}


@pytest.mark.equivalence
@pytest.mark.parametrize("world, cases", [(2, TWO), (4, FOUR)])
def test_every_strategy_trains_a_llama_as_one_process(world, cases):
    """Each case's losses and every trained weight after 3 steps equal one fp64 process's."""
    every = run_ranks(_run_cases, world, cases)
    for i, case in enumerate(cases):
        expected = _single(**REFERENCE.get(case, {}))
        if case[0] == "cp":
            expected["params"]["kv bytes"] = torch.tensor(_kv_bytes(case[1], world))
        for r, rank in enumerate(every):
            got, what = rank[i], f"{case} on {world} ranks, rank {r}"
            rtol = PIPELINE_LOSS_RTOL if case[0] == "pp" else FP64_RTOL
            torch.testing.assert_close(got["losses"], expected["losses"], rtol=rtol, atol=0,
                                       msg=lambda m: f"{what} losses: {m}")
            assert_tensors_close(got["params"], expected["params"], rtol=0, atol=FP64_ATOL,
                                 what=what)


def test_tensor_parallelism_refuses_key_value_heads_it_cannot_split():
    class FourRanks(Comm):                         # the check comes before any collective
        def __init__(self):
            self.world_size, self.rank = 4, 0
    with pytest.raises(ValueError, match=r"key/value heads \(n_kv_head\) = 2 into 4") as e:
        TensorParallelGPT(_llama(), FourRanks())
    assert "\n" not in str(e.value)


def test_a_llama_refuses_experts():
    with pytest.raises(ValueError, match="drop --experts") as e:
        Llama(LlamaConfig(experts=4))
    assert "\n" not in str(e.value)


def test_a_llama_block_is_what_fsdp_wraps():
    from mechanics.fsdp_state import gpt_blocks
    assert all(gpt_blocks(block) and isinstance(block, LlamaBlock) for block in _llama().blocks)


def test_qlora_stores_every_llama_matrix_in_4_bits_the_gate_too():
    """apply_lora(quantize="nf4") on query and value: each block's other linears, SwiGLU's gate
    among them, become frozen NF4 layers; the head stays in full precision."""
    llama = _llama(adapters="qlora")
    for block in llama.blocks:
        for name in ("key", "output"):
            assert isinstance(getattr(block.attn, name), lora.FrozenNF4Linear), name
        for name in ("gate", "up", "down"):
            assert isinstance(getattr(block.mlp, name), lora.FrozenNF4Linear), name
        assert isinstance(block.attn.query, lora.QLoRALinear)
    assert type(llama.head) is torch.nn.Linear
