"""napkin/memory.py: the ZeRO paper's numbers, the lecture's claims about bytes, and the command line."""
import dataclasses
import os
import re
import subprocess
import sys

import pytest
import torch

from foundations.comm import ring_bytes
from napkin.memory import main, parse_count
from napkin.memory_math import (STRATEGIES, active_params, activation_bytes, bytes_per_param, comm_bytes,
                         ep_comm_bytes, ep_params, ep_state_bytes, expert_params, human_bytes,
                         mesh_params, model_params, moe_exchange_bytes, moe_mlp_bytes, nf4_bytes,
                         state_bytes)
from model import PRESETS, GPTConfig, build_model
from moe import feed_forward
from multiprocess import run_ranks, train_logged

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GB = 1e9


PAPER = ("--params", "7.5e9", "--world", "64", "--reduce-dtype", "bf16")   # the paper reduces in 16 bits
BREAKDOWN = ("--model", "gpt2-small", "--strategy", "zero2", "--world", "8", "--batch-size", "8",
             "--seq-len", "1024", "--precision", "bf16")


@pytest.fixture(scope="module")
def cli():
    """The two documented commands, started together (each spends ~2 s importing torch)."""
    procs = {args: subprocess.Popen([sys.executable, "-m", "napkin.memory", *args], cwd=REPO, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for args in (PAPER, BREAKDOWN)}
    results = {}
    for args, proc in procs.items():
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        results[args] = out
    return results


def test_the_lectures_bytes_per_parameter():
    # Mixed precision with Adam: 2 (16-bit weight) + 2 (16-bit gradient) + 12 (fp32 master,
    # momentum, variance) = 16 bytes per parameter on every DDP rank.
    for precision in ("bf16", "fp16"):
        assert bytes_per_param(precision) == {"params": 2, "grads": 2, "optimizer": 12}
        assert state_bytes(1000, "ddp", precision, world_size=8)["total"] == 16 * 1000
    assert bytes_per_param("fp32") == {"params": 4, "grads": 4, "optimizer": 8}  # own master
    assert bytes_per_param("fp32", "sgd")["optimizer"] == 0
    assert bytes_per_param("bf16", "sgd")["optimizer"] == 4                       # master only
    assert state_bytes(1000, "single", "fp32", world_size=1) == state_bytes(1000, "ddp", "fp32", 1)


@pytest.mark.parametrize("strategy, paper_gb", [("ddp", 120), ("zero1", 31.4), ("zero2", 16.6),
                                                ("zero3", 1.9)])
def test_zero_paper_figure_1(strategy, paper_gb):
    # Rajbhandari et al. 2020, figure 1: 7.5B parameters, N_d = 64 GPUs, K = 12.
    held = state_bytes(7_500_000_000, strategy, "fp16", world_size=64)
    assert held["total"] / GB == pytest.approx(paper_gb, abs=0.05)
    assert held["total"] == held["params"] + held["grads"] + held["optimizer"]


def test_zero_shards_hold_one_nth_and_fsdp_is_zero3():
    full = state_bytes(64_000, "ddp", "bf16", world_size=8)
    for strategy, sharded in (("zero1", {"optimizer"}), ("zero2", {"grads", "optimizer"}),
                              ("zero3", {"params", "grads", "optimizer"})):
        held = state_bytes(64_000, strategy, "bf16", world_size=8)
        for name in ("params", "grads", "optimizer"):
            assert held[name] == (full[name] // 8 if name in sharded else full[name]), (strategy, name)
    assert state_bytes(64_000, "fsdp", "bf16", 8) == state_bytes(64_000, "zero3", "bf16", 8)
    assert comm_bytes(64_000, "fsdp", "bf16", 8) == comm_bytes(64_000, "zero3", "bf16", 8)


def test_padding_is_counted():
    # 10 parameters on 4 ranks: shards of ceil(10/4) = 3 elements, a flat buffer of 12.
    n, world = 10, 4
    assert state_bytes(n, "ddp", "bf16", world) == {"params": 20, "grads": 20, "optimizer": 120,
                                                   "total": 160}     # unpadded tensors
    assert state_bytes(n, "zero1", "bf16", world) == {"params": 24, "grads": 24, "optimizer": 36,
                                                     "total": 84}
    assert state_bytes(n, "zero2", "bf16", world) == {"params": 24, "grads": 6, "optimizer": 36,
                                                     "total": 66}
    assert state_bytes(n, "zero3", "fp32", world) == {"params": 12, "grads": 12, "optimizer": 24,
                                                     "total": 48}
    assert comm_bytes(n, "zero3", "bf16", world) == {"all_gather": 2 * 3 * 3 * 2,
                                                     "reduce_scatter": 3 * 3 * 2}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("n_params, world", [(124_466_688, 8), (1_000_003, 7), (4096, 2)])
def test_zero1_and_zero2_send_what_ddp_sends_and_zero3_half_again(n_params, world, precision):
    ddp = comm_bytes(n_params, "ddp", precision, world)
    size = 4 if precision == "fp32" else 2                       # gradients in the params' dtype
    assert ddp == {"all_reduce": ring_bytes("all_reduce", n_params, size, world)}
    for strategy in ("zero1", "zero2"):                          # the lecture's "free" claim
        sent = comm_bytes(n_params, strategy, precision, world)
        assert set(sent) == {"reduce_scatter", "all_gather"}
        assert sum(sent.values()) == ddp["all_reduce"]
    # 3 (N-1) chunks against 2 (N-1): exactly 1.5x, padded or not, as both pad to N chunks
    zero3 = sum(comm_bytes(n_params, "zero3", precision, world).values())
    assert zero3 == 1.5 * ddp["all_reduce"]
    assert comm_bytes(n_params, "single", precision, 1) == {}
    assert all(v == 0 for v in comm_bytes(n_params, "ddp", precision, 1).values())


def test_model_params_matches_the_built_model():
    for name in PRESETS:
        with torch.device("meta"):                  # the real modules, no memory or init time
            assert model_params(name) == build_model(name, feed_forward=feed_forward).num_parameters(), name
    untied = dataclasses.replace(PRESETS["gpt2-small"], tie_embeddings=False)
    assert model_params(untied) == model_params("gpt2-small") + 50304 * 768
    with pytest.raises(ValueError, match="unknown model 'gpt5'"):
        model_params("gpt5")


def test_activation_formula_by_hand_and_checkpointing_saves():
    # s=4, b=2, h=8, a=2: sbh = 64, so 34 sbh + 5 a s^2 b = 2176 + 320 = 2496 bytes per layer.
    shape = dict(seq_len=4, batch=2, hidden=8, heads=2)
    assert activation_bytes(**shape) == 2496
    assert activation_bytes(**shape, layers=3) == 3 * 2496
    assert activation_bytes(**shape, layers=3, bytes_per_value=4) == 2 * 3 * 2496
    # checkpointed: each layer's 16-bit input (2 sbh = 128) plus one layer recomputed
    assert activation_bytes(**shape, layers=3, checkpointing=True) == 3 * 128 + 2496
    gpt2 = dict(seq_len=1024, batch=8, hidden=768, heads=12, layers=12)
    full, ckpt = activation_bytes(**gpt2), activation_bytes(**gpt2, checkpointing=True)
    assert ckpt < full / 5


# ---- mixture of experts ------------------------------------------------------------------------

def _sharded(name, ep, rank=0):
    """A preset built on the meta device (no memory) with its experts split as rank `rank` of ep
    would hold them: shard_experts reads only the group's size and rank."""
    from types import SimpleNamespace
    from moe import MoE
    with torch.device("meta"):
        gpt = build_model(name, feed_forward=feed_forward)
    for module in gpt.modules():
        if isinstance(module, MoE):
            module.shard_experts(SimpleNamespace(world_size=ep, rank=rank))
    return gpt


@pytest.mark.parametrize("name, ep", [("tiny-moe", 2), ("tiny-moe", 8), ("gpt2-small-moe", 4)])
def test_a_rank_holds_what_ep_params_says(name, ep):
    from napkin.memory_math import is_expert
    gpt = _sharded(name, ep, rank=ep - 1)
    held, experts = ep_params(name, ep)
    assert held == sum(p.numel() for p in gpt.parameters())
    assert experts == sum(p.numel() for p in gpt.parameters() if is_expert(p))
    assert experts == expert_params(name) // ep
    assert ep_params(name, 1) == (model_params(name), 0)
    assert expert_params("tiny") == expert_params("tiny", 2) == 0
    assert active_params("gpt2-small") == model_params("gpt2-small")      # dense: every one


def test_expert_parallel_state_and_traffic_by_hand():
    # tiny-moe: 352,000 parameters outside the experts, 4,214,784 in them; ep 2 on 2 ranks keeps
    # half the experts on each rank, and ddp (16 bytes each in bf16 with AdamW) holds them whole:
    # the 37.5 MiB per rank train.py measures (README), against 69.7 replicated.
    n, experts = ep_params("tiny-moe", 2)
    assert (n, experts) == (352_000 + 4_214_784 // 2, 4_214_784 // 2)
    assert ep_state_bytes(n, experts, "ddp", "bf16", 2, 2)["total"] == 16 * n
    assert ep_state_bytes(n, 0, "ddp", "bf16", 2, 1) == state_bytes(n, "ddp", "bf16", 2)
    # zero2 at ep 2 on 4 ranks: the experts' gradients and optimizer over the 2 ranks holding them
    held = ep_state_bytes(n, experts, "zero2", "bf16", 4, 2)
    assert held["grads"] == 2 * (-(-(n - experts) // 4) + experts // 2)
    assert held["optimizer"] == 12 * (-(-(n - experts) // 4) + experts // 2)
    # The experts' gradients travel only between the ranks holding them: at ep = world, nowhere.
    assert ep_comm_bytes(n, experts, "ddp", "bf16", 2, 2) == comm_bytes(n - experts, "ddp", "bf16", 2)
    four = ep_comm_bytes(n, experts, "ddp", "bf16", 4, 2)["all_reduce"]
    assert four == (comm_bytes(n - experts, "ddp", "bf16", 4)["all_reduce"]
                    + ring_bytes("all_reduce", experts, 2, 2))      # among the 2 holding them


@pytest.mark.parametrize("name, ep, tokens, capacity_factor",
                         [("tiny-moe", 2, 512, 1.25), ("tiny-moe", 4, 128, 0.5),
                          ("gpt2-small-moe", 8, 8192, 1.25)])
def test_all_to_all_napkin_is_the_layers_formula(name, ep, tokens, capacity_factor):
    """napkin/memory.py's closed form equals composition.parallelize.exchange_bytes on the model split over ep ranks (the
    formula train.py logs beside the counter, and test_moe checks against the counter): 4 (P-1)/P
    of the E x K slots of C values per layer and micro-batch, K = ceil(1.25 x 2 x 512 / 8) = 160."""
    from types import SimpleNamespace
    from composition.parallelize import exchange_bytes
    gpt = _sharded(name, ep)
    for module in gpt.modules():
        if hasattr(module, "capacity_factor"):
            module.capacity_factor = capacity_factor
    options = SimpleNamespace(batch_size=3 * ep * tokens // 64, seq_len=64, grad_accum=3)
    cfg = dataclasses.replace(PRESETS[name], capacity_factor=capacity_factor)
    assert moe_exchange_bytes(cfg, tokens, ep, "fp32", 3) == exchange_bytes(gpt, options, ep)
    assert moe_exchange_bytes(PRESETS["tiny-moe"], 512, 2, "fp32") == 4 * 4 * 8 * 160 * 128 * 4 // 2
    assert moe_exchange_bytes(PRESETS["tiny-moe"], 512, 1, "fp32") == 0


def test_moe_activation_formula_by_hand():
    # h = 8, E = 4 experts, k = 2, t = 16 tokens: A = 32 assignments. Per layer (16-bit, so
    # x h bytes): 2t input + 19 per expert row + 4 per kept assignment, + 8 tE for the fp32
    # router logits and probabilities.
    cfg = GPTConfig(n_embd=8, n_head=2, experts=4, top_k=2, capacity_factor=None)
    assert moe_mlp_bytes(16, cfg) == (2 * 16 + 19 * 32 + 4 * 32) * 8 + 8 * 16 * 4 == 6656
    # capacity 0.5: K = ceil(0.5 x 2 x 16 / 4) = 4 slots per expert, 16 rows run; all 32
    # assignments gathered (the 16 dropped with their gates zeroed: shapes fixed)
    half = dataclasses.replace(cfg, capacity_factor=0.5)
    assert moe_mlp_bytes(16, half) == (2 * 16 + 19 * 16 + 4 * 32) * 8 + 512
    # capacity 1.25: every expert runs its K = 10 slots, empty or not, with or without expert
    # parallelism (32 of the 40 slots used)
    ep = dataclasses.replace(cfg, capacity_factor=1.25)
    assert moe_mlp_bytes(16, ep, ep=2) == (2 * 16 + 19 * 40 + 4 * 32) * 8 + 512
    assert moe_mlp_bytes(16, ep, ep=1) == moe_mlp_bytes(16, ep, ep=2)
    # A block: attention and norms as the dense one, the MLP's 19 sbh replaced (s=4, b=4).
    dense = activation_bytes(seq_len=4, batch=4, hidden=8, heads=2)
    assert activation_bytes(4, 4, 8, 2, moe=cfg) == dense - 19 * 16 * 8 + 6656
    assert activation_bytes(4, 4, 8, 2, moe=PRESETS["tiny"]) == dense      # no experts: dense
    assert activation_bytes(4, 4, 8, 2, layers=3, checkpointing=True, moe=cfg) == \
        3 * 2 * 16 * 8 + activation_bytes(4, 4, 8, 2, moe=cfg)


def _moe_layer_saves(capacity_factor, ep):
    """Bytes tiny-moe's first MoE layer keeps for backward on 4 x 64 fp32 tokens (saved-tensor
    hooks, each storage once), this rank's experts split over the world when ep."""
    from foundations.meters import saved_activation_bytes
    from foundations.comm import Comm
    torch.manual_seed(0)
    moe = build_model("tiny-moe", feed_forward=feed_forward, capacity_factor=capacity_factor).blocks[0].mlp
    if ep:
        moe.shard_experts(Comm())
    x = torch.randn(4, 64, 128, requires_grad=True)
    saved, _ = saved_activation_bytes(lambda: moe(x), exclude=list(moe.parameters()))
    return saved


@pytest.mark.parametrize("capacity_factor, ep", [(None, 1), (0.5, 1), (1.25, 2)])
def test_an_moe_layer_keeps_what_the_formula_says(capacity_factor, ep):
    """Measured with saved-tensor hooks, as the dense block in tests/test_checkpointing.py: dropless
    (every token's 2 copies run), capacity 0.5 (every expert full, K = 32; the dropped
    assignments gathered too) and ep 2 in capacity mode on 2 ranks (each expert runs all its
    K = 80 slots, empty ones too). Between 95% and 100% of moe_mlp_bytes: the formula counts
    dropout masks, at most 1/19 of it, that dropout 0 does not keep, and leaves out the int64
    indices and fp32 gates, about 1% (measured: 96.4% dropless, 97.8% at capacity 0.5).
    Forgetting the buffer's empty slots, or counting them as kept outputs too,
    falls outside."""
    cfg = dataclasses.replace(PRESETS["tiny-moe"], capacity_factor=capacity_factor)
    formula = moe_mlp_bytes(4 * 64, cfg, ep, bytes_per_value=4)
    measured = run_ranks(_moe_layer_saves, 2, capacity_factor, True) if ep > 1 else \
        [_moe_layer_saves(capacity_factor, False)]
    for saved in measured:
        assert 0.95 * formula <= saved <= formula, (saved, formula, saved / formula)


def test_cli_reproduces_the_zero_paper_table(cli):
    out = cli[PAPER]
    assert "GB (1 GB = 1e9 bytes" in out
    totals = {m[0]: float(m[1]) for m in re.findall(r"^(\w+)(?:\s+[\d.]+){3}\s+([\d.]+) \|",
                                                     out, re.M)}
    assert list(totals) == list(STRATEGIES)
    for strategy, paper_gb in zip(STRATEGIES, (120, 31.4, 16.6, 1.9)):
        assert totals[strategy] == pytest.approx(paper_gb, abs=0.05), out


def test_cli_breakdown_of_one_strategy(cli):
    """zero2's gradient shard, and what it reduce-scatters, in fp32 (train.py's default
    --reduce-dtype) under bf16 parameters and all-gathers."""
    out = cli[BREAKDOWN]
    shard = 124_466_688 // 8
    shape = dict(seq_len=1024, batch=1, hidden=768, heads=12, layers=12)
    for label, value in (("parameters (full)", 2 * 124_466_688),
                         ("gradients (1/8 shard)", 4 * shard),
                         ("optimizer state (1/8 shard)", 12 * shard),
                         ("activations, L x sbh(34 + 5as/h)", activation_bytes(**shape)),
                         ("activations checkpointed", activation_bytes(**shape, checkpointing=True)),
                         ("reduce_scatter", 7 * shard * 4), ("all_gather", 7 * shard * 2)):
        line = next((l for l in out.splitlines() if l.strip().startswith(label)), None)
        assert line is not None and f"{value:,}" in line, f"{label}: {value:,} not in\n{out}"
    assert re.search(r"^  total\s+[\d,]+", out, re.M) and "total with checkpointing" in out


def test_cli_splits_the_experts_under_ep(capsys):
    """tiny-moe on 2 ranks: total against active parameters; under --ep 2 each rank holds half
    the experts (ddp: 37.53 MiB, not 69.68) and sends the all-to-alls beside the gradients."""
    main(["--model", "tiny-moe", "--world", "2"])
    replicated = capsys.readouterr().out
    assert "a token computes with 1,405,696 of the 4,566,784 parameters (31%)" in replicated
    assert next(l for l in replicated.splitlines() if l.startswith("ddp")).split()[4] == "69.68"
    main(["--model", "tiny-moe", "--world", "2", "--ep", "2", "--reduce-dtype", "bf16"])
    out = capsys.readouterr().out
    assert "--ep 2: a rank holds 4 of each block's 8 experts, 2,459,392 parameters" in out
    ddp = next(l for l in out.splitlines() if l.startswith("ddp")).split()
    # the non-experts' all-reduce, and 4 layers x 4 all-to-alls of half the 8 x 40 slots
    sent = ring_bytes("all_reduce", 352_000, 2, 2) + moe_exchange_bytes(PRESETS["tiny-moe"], 128, 2, "bf16")
    assert ddp[4] == "37.53" and ddp[6] == f"{sent / 2**20:.2f}" and out.count("+ all-to-all") == 4
    main(["--model", "tiny-moe", "--strategy", "zero2", "--world", "2", "--ep", "2",
          "--batch-size", "16", "--seq-len", "64"])
    out = capsys.readouterr().out
    a2a = moe_exchange_bytes(PRESETS["tiny-moe"], 8 * 64, 2, "bf16")
    assert re.search(rf"^  all_to_all\s+{a2a:,}", out, re.M), out
    act = activation_bytes(64, 8, 128, 4, 4, moe=PRESETS["tiny-moe"], ep=2)
    assert re.search(rf"^  activations, L x \(sbh\(15 \+ 5as/h\) \+ MoE MLP\)\s+{act:,}", out, re.M), out


def test_lora_is_the_model_plus_4x_the_trainable_parameters(capsys):
    """The talk's rule in fp32 with Adam: frozen weights once, then weights, gradients and two
    moments of the trainable ones (4 x 4 bytes); only their gradients travel under ddp."""
    held = state_bytes(1_000_000, "ddp", "fp32", 1, trainable=10_000)
    assert held["total"] == 4 * 990_000 + 4 * (4 * 10_000)
    main(["--params", "1e6", "--trainable", "1e4", "--world", "2", "--precision", "fp32"])
    ddp = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("ddp"))
    assert ddp.split()[1:7] == ["3.81", "0.04", "0.08", "3.93", "|", "0.04"], ddp   # MiB


def test_qlora_base_in_4_bits(capsys):
    """A 7B model's frozen base in NF4 with double quantization: 4.127 bits a weight, 3.6 GB."""
    main(["--params", "7e9", "--trainable", "4.2e6", "--quantize-base", "nf4", "--double-quant"])
    ddp = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("ddp"))
    assert ddp.split()[1] == f"{(nf4_bytes(7_000_000_000 - 4_200_000, True) + 2 * 4_200_000) / 1e9:.2f}" == "3.62"


def _printed(out, label) -> int:
    """The bytes column of napkin/memory.py's breakdown row `label`."""
    return int(re.search(rf"^  {label}\s+([\d,]+)", out, re.M).group(1).replace(",", ""))


def test_fsdp_gathers_a_4_bit_base_as_its_packed_bytes(capsys):
    """zero3 all-gathers the frozen base too, for forward and again for backward, and a 4-bit
    one as its codes and scales, one byte each (fsdp_frozen.FrozenBytes: 4.13 bits a weight with double
    quantization), not in the compute dtype; only the adapters' gradients are reduce-scattered.
    tests/test_fsdp_qlora.py compares the napkin with FSDP's counter on the tiny GPT."""
    n, trainable = 7_000_000_000, 4_200_000
    quantized = n - trainable
    sent = comm_bytes(n, "zero3", "bf16", 8, trainable, quantized, double_quant=True)
    gather = (ring_bytes("all_gather", trainable, 2, 8)                          # bf16 adapters
              + ring_bytes("all_gather", nf4_bytes(quantized, True), 1, 8))      # 4-bit base
    assert sent == {"all_gather": 2 * gather,
                    "reduce_scatter": ring_bytes("reduce_scatter", trainable, 2, 8)}
    assert sent["all_gather"] < 0.26 * comm_bytes(n, "zero3", "bf16", 8)["all_gather"]   # 4.13 of 16 bits
    main(["--params", "7e9", "--trainable", "4.2e6", "--quantize-base", "nf4", "--double-quant",
          "--strategy", "fsdp", "--world", "8", "--reduce-dtype", "bf16"])
    out = capsys.readouterr().out
    assert (_printed(out, "all_gather"), _printed(out, "reduce_scatter")) == (sent["all_gather"],
                                                                              sent["reduce_scatter"])


def test_hsdp_holds_zero3_over_its_group_and_all_reduces_the_shard_across_copies(capsys):
    """--shard-group S: a rank holds what zero3 over S ranks holds, and sends per step two
    all-gathers and a reduce-scatter among its S, plus the all-reduce of its 1/S gradient shard
    over the world/S copies. tests/test_fsdp_qlora.py compares it with FSDP's HSDP counter."""
    n, shard = model_params("tiny"), -(-model_params("tiny") // 2)
    sent = comm_bytes(n, "zero3", "fp32", 4, shard_group=2)
    assert sent == {"all_gather": 2 * ring_bytes("all_gather", n, 4, 2),
                    "reduce_scatter": ring_bytes("reduce_scatter", n, 4, 2),
                    "all_reduce": ring_bytes("all_reduce", shard, 4, 2)}
    assert sum(sent.values()) == 4 * 4 * shard            # 2 x 1/2, 1/2, then 2 x 1/2 of the shard
    main(["--model", "tiny", "--strategy", "fsdp", "--world", "4", "--shard-group", "2",
          "--precision", "fp32"])
    out = capsys.readouterr().out
    assert "fsdp on 4 rank(s), sharded over groups of 2 (HSDP), 2 copies" in out
    held = state_bytes(n, "zero3", "fp32", 2)
    assert _printed(out, r"parameters \(1/2 shard\)") == held["params"] == 4 * shard
    assert _printed(out, r"optimizer state \(1/2 shard\)") == held["optimizer"]
    for collective, value in sent.items():
        assert _printed(out, collective) == value, collective
    with pytest.raises(ValueError, match="zero3/fsdp only"):
        comm_bytes(n, "zero2", "fp32", 4, shard_group=2)


@pytest.mark.parametrize("argv, message", [
    (["--model", "tiny", "--world", "4", "--shard-group", "2"], "give --strategy fsdp"),
    (["--model", "tiny", "--strategy", "fsdp", "--world", "4", "--shard-group", "3"],
     "use a divisor of 4"),
    (["--params", "1e9", "--quantize-base", "nf4"], "give --trainable"),
    (["--params", "1e9", "--trainable", "2e9"], "--trainable 2e+09 must be between 0"),
    (["--params", "1e9", "--strategy", "zero4"], "invalid choice: 'zero4'"),
    (["--params", "1e9", "--world", "0"], "--world must be at least 1"),
    ([], "give exactly one of --params"),
    (["--model", "tiny", "--world", "3", "--batch-size", "8"], "use a multiple of 3"),
    (["--params", "1e9", "--strategy", "single", "--world", "2"], "use --strategy ddp"),
    (["--params", "1e9", "--strategy", "ddp", "--offload", "optimizer"], "use --strategy zero1, zero2 or fsdp"),
    (["--params", "1e9", "--world", "2", "--ep", "2"], "--ep splits a model's experts: give --model"),
    (["--model", "tiny", "--world", "2", "--ep", "2"], "--ep splits a model's experts: give --model"),
    (["--model", "tiny-moe", "--world", "3", "--ep", "3"], "use an --ep dividing both"),
    (["--model", "tiny-moe", "--world", "2", "--ep", "4"], "use an --ep dividing both"),
    (["--model", "tiny-moe", "--world", "2", "--ep", "2", "--trainable", "1e4"], "LoRA keeps the experts whole"),
    (["--advise", "--model", "tiny-moe", "--world", "2", "--ep", "2"], "drop --ep"),
    (["--params", "seven"], "write it like 7e9, 7B or 350M"),
    (["--advise", "--params", "inf"], "write it like 7e9, 7B or 350M"),
    (["--advise", "--params", "0"], "--params must be at least 1"),
    (["--advise"], "--advise needs a shape: give --model (a preset, e.g. 7b) or --params N"),
    (["--advise", "--model", "7b", "--params", "7e9"], "--advise needs a shape: give --model"),
    (["--model", "tiny", "--pp", "2", "--microbatches", "0"], "--microbatches must be at least 1, got 0"),
    (["--model", "tiny", "--tp", "3", "--world", "3"], "--model tiny: tensor parallelism over 3 ranks "
     "splits the heads (n_head) = 4 into 3 equal parts, but 4 % 3 = 1: use a --tp that divides"),
])
def test_bad_input_stops_with_one_clear_message(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err and sum("error:" in line for line in err.splitlines()) == 1, err


def test_offload_moves_the_optimizer_to_the_host(capsys):
    """ZeRO-Offload: the device keeps parameters and gradients; the host the fp32 master and the
    moments (fp32 training too: the CPU needs its own copy) and the gradient shard's fp32 copy."""
    shard = -(-1000 // 4)
    for precision in ("bf16", "fp32"):
        for strategy in ("zero1", "zero2", "zero3"):
            on = state_bytes(1000, strategy, precision, 4, offload=True)
            off = state_bytes(1000, strategy, precision, 4)
            assert on["optimizer"] == 0 and on["host"] == 16 * shard, (precision, strategy, on)
            assert (on["params"], on["grads"]) == (off["params"], off["grads"])
            assert on["total"] == off["total"] - off["optimizer"]
    with pytest.raises(ValueError, match="use zero1, zero2 or zero3/fsdp"):
        state_bytes(1000, "ddp", "bf16", 4, offload=True)
    main([*PAPER, "--offload", "optimizer"])
    rows = {l.split()[0]: l.split() for l in capsys.readouterr().out.splitlines()[3:]}
    assert rows["ddp"][1:6] == ["15.00", "15.00", "90.00", "120.00", "-"], rows["ddp"]   # no offload
    assert rows["zero2"][1:6] == ["15.00", "0.23", "0.00", "15.23", "1.88"], rows["zero2"]   # GB


def test_bad_arguments_to_the_functions():
    with pytest.raises(ValueError, match="unknown strategy 'zero4'"):
        state_bytes(100, "zero4", "bf16", 2)
    with pytest.raises(ValueError, match="world_size must be at least 1"):
        comm_bytes(100, "ddp", "bf16", 0)
    with pytest.raises(ValueError, match="'single' runs on one rank"):
        state_bytes(100, "single", "bf16", 4)
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        bytes_per_param("fp8")


# ---- prediction against measurement, on live ranks ------------------------------------------

def _measured_after_one_step():
    """held_bytes() of every (strategy, precision) after one step of the tiny GPT."""
    from ddp import DDP
    from napkin.memory_math import held_bytes
    from mixed_precision import DTYPES, MixedPrecisionOptimizer
    from extensions.zero_offload import zero_optimizer
    measured = {}
    for strategy, offload in (("ddp", False), ("zero1", False), ("zero2", False), ("zero1", True),
                              ("zero2", True)):
        for precision in ("fp32", "bf16"):
            torch.manual_seed(0)
            model = build_model("tiny").to(DTYPES[precision])
            if strategy == "ddp":
                model = DDP(model)
                optimizer = MixedPrecisionOptimizer(model.parameters(), precision=precision)
            else:
                optimizer = zero_optimizer(model.parameters(), stage=int(strategy[-1]), offload=offload)
            idx = torch.randint(0, 256, (2, 33))
            _, loss = model(idx[:, :-1], idx[:, 1:])
            optimizer.scale_loss(loss).backward()
            if strategy == "ddp":
                model.finish_gradient_sync()
            optimizer.step()               # state exists now; gradients are held until zero_grad
            measured[strategy, precision, offload] = held_bytes(model, optimizer)
    return measured


@pytest.mark.parametrize("world_size", [2, 4])
def test_prediction_matches_the_bytes_ranks_hold(world_size):
    n_params = model_params("tiny")
    for rank_measured in run_ranks(_measured_after_one_step, world_size):
        for (strategy, precision, offload), measured in rank_measured.items():
            predicted = state_bytes(n_params, strategy, precision, world_size, offload=offload)
            assert measured.keys() | {"total"} == predicted.keys()
            for part in measured:
                # 1%: the bar; the only gap allowed is what the napkin math leaves
                # out, and with one bucket the padding is counted on both sides.
                assert measured[part] == pytest.approx(predicted[part], rel=0.01), \
                    (strategy, precision, world_size, part, measured, predicted)


# ---- pipeline schedules: activations held per stage ------------------------------------------

def test_pipeline_activations_follow_each_schedules_peak():
    """Per stage, the peak micro-batches (or chunks) extensions/schedules.py counts, times one micro-batch's
    activations through the stage's blocks (and the logits, on the last stage)."""
    from napkin.memory_math import logits_bytes, pipeline_activation_bytes
    cfg, P, M, b, s = PRESETS["gpt2-small"], 4, 8, 1, 1024          # 12 blocks: 3 a stage
    layer = activation_bytes(s, b, cfg.n_embd, cfg.n_head)          # one block, one micro-batch
    logits = logits_bytes(s, b, cfg.vocab_size)
    one_f_one_b = pipeline_activation_bytes(cfg, "1f1b", P, M, b, s)
    assert one_f_one_b == [(P - st) * 3 * layer + (logits if st == P - 1 else 0) for st in range(P)]
    assert pipeline_activation_bytes(cfg, "gpipe", P, M, b, s)[0] == M * 3 * layer
    # ZB-H1 holds P micro-batches on every stage: 1F1B's stage 0 everywhere.
    zb = pipeline_activation_bytes(cfg, "zb", P, M, b, s)
    assert zb[:-1] == [one_f_one_b[0]] * (P - 1) and zb[-1] == P * (3 * layer + logits)
    # Interleaved, v = 3 (12 chunks of one block): stage 0 holds 2(P-1) + (v-1)P + 1 chunks.
    assert pipeline_activation_bytes(cfg, "interleaved", P, M, b, s, v=3)[0] == (6 + 8 + 1) * layer
    with pytest.raises(ValueError, match="12 blocks, fewer than 16 chunks"):
        pipeline_activation_bytes(cfg, "interleaved", P, M, b, s, v=4)


def test_pipeline_table_prints_every_schedule(capsys):
    main(["--model", "gpt2-small", "--pp", "4", "--microbatches", "8"])
    out = capsys.readouterr().out
    for row in ("1f1b               0.273  (P-1)/(M+P-1)", "interleaved v=2    0.158  (P-1)/(vM+P-1)",
                "zb                 0.111  (P-1)/(3M+P-1)", "interleaved v=4   12 blocks, fewer than 16"):
        assert row in out, out


def test_mesh_table_splits_the_model_over_its_stages_and_the_data_dimension(capsys):
    """python -m napkin.memory --tp --pp --world: one row per stage; the stages' parameters add up to
    the tp-split model, ZeRO-2 over dp 2 holds less than ddp, and ddp's dp column is the
    all-reduce of the stage's parameters (fp32, 2 ranks: one stage's bytes)."""
    argv = ["--model", "tiny", "--world", "8", "--tp", "2", "--pp", "2", "--precision", "fp32",
            "--batch-size", "8", "--seq-len", "32", "--strategy"]
    tables = {}
    for strategy in ("ddp", "zero2"):
        main([*argv, strategy])
        tables[strategy] = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    ddp, zero2 = tables["ddp"], tables["zero2"]
    assert [int(row[0]) for row in ddp] == [0, 1]
    params = [int(row[1].replace(",", "")) for row in ddp]
    assert sum(params) == mesh_params("tiny", tp=2)
    assert all(float(z[2]) < float(d[2]) for z, d in zip(zero2, ddp)), (zero2, ddp)
    assert float(ddp[0][6]) == round(ring_bytes("all_reduce", params[0], 4, 2) / 2**20, 2)


def test_offloaded_parameters_leave_the_device_with_the_optimizer():
    """offload="params" (FSDP's --offload params): zero3's parameter shards join the optimizer's
    host bytes; the device keeps the gradient shard. Other strategies keep whole parameters."""
    n = model_params("gpt2-small")
    optimizer_only = state_bytes(n, "zero3", "bf16", 4, offload=True)
    both = state_bytes(n, "zero3", "bf16", 4, offload="params")
    assert both["params"] == 0 and both["grads"] == optimizer_only["grads"]
    assert both["host"] == optimizer_only["host"] + optimizer_only["params"]
    assert both["total"] == optimizer_only["total"] - optimizer_only["params"]
    with pytest.raises(ValueError, match="zero3/fsdp only"):
        state_bytes(n, "zero2", "bf16", 4, offload="params")


def test_a_reduction_in_fp32_doubles_the_gradients_bytes_and_zero2s_shard():
    """--reduce-dtype fp32 under bf16 (train.py's default): the gradients' collective moves 4-byte
    elements, the parameters' all-gathers stay 2-byte; ZeRO-2 keeps its shard in fp32 and
    FSDP in fp32 after the wire. Written out with the ring formula for 1000 elements on 4 ranks."""
    n, N = 1000, 4
    assert comm_bytes(n, "ddp", "bf16", N, reduce_precision="fp32") == {
        "all_reduce": ring_bytes("all_reduce", n, 4, N)}
    for strategy in ("zero1", "zero2"):
        assert comm_bytes(n, strategy, "bf16", N, reduce_precision="fp32") == {
            "reduce_scatter": ring_bytes("reduce_scatter", n, 4, N), "all_gather": ring_bytes("all_gather", n, 2, N)}
    assert comm_bytes(n, "zero3", "bf16", N, reduce_precision="fp32") == {
        "reduce_scatter": ring_bytes("reduce_scatter", n, 4, N), "all_gather": 2 * ring_bytes("all_gather", n, 2, N)}
    assert comm_bytes(n, "zero3", "bf16", N, reduce_precision="bf16") == comm_bytes(n, "zero3", "bf16", N)
    assert state_bytes(n, "zero2", "bf16", N, reduce_precision="fp32")["grads"] == 4 * 250
    assert state_bytes(n, "zero2", "bf16", N, reduce_precision="bf16")["grads"] == 2 * 250
    assert state_bytes(n, "zero3", "bf16", N, reduce_precision="bf16")["grads"] == 4 * 250
    assert state_bytes(n, "zero1", "bf16", N, reduce_precision="fp32")["grads"] == 2 * n


# ---- the command line's manners: units, help, warnings ---------------------------------------

def test_the_7b_preset_has_llama_2_7b_shape_and_its_count():
    """32 layers of width d = 4096, 32 heads, vocabulary V = 32000, T = 4096 positions. Per block:
    query, value and output d^2 + d, key d^2 (no bias), MLP 4d^2 + 4d and 4d^2 + d, two norms 2d
    each = 12 d^2 + 12 d; around them the token embedding and the untied head V d each, the
    positions T d and the final norm 2d."""
    cfg, (L, d, V, T) = PRESETS["7b"], (32, 4096, 32000, 4096)
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size, cfg.block_size) == (L, d, 32, V, T)
    assert not cfg.tie_embeddings and not cfg.experts
    assert model_params("7b") == L * (12 * d * d + 12 * d) + 2 * V * d + T * d + 2 * d == 6_722_953_216


def test_counts_and_sizes_read_as_people_write_them():
    assert [parse_count(t) for t in ("7e9", "7B", "7b", "350M", "1.2T", "4.2e6")] == \
           [7e9, 7e9, 7e9, 350e6, 1.2e12, 4.2e6]
    # GB (1e9) from 1 GB up, as the ZeRO paper counts; below, MiB and KiB as train.py logs: never 0.00
    assert [human_bytes(n) for n in (24e9, 1e9, 999e6, 2**20, 1e6, 1536, 100)] == \
           ["24.00 GB", "1.00 GB", "952.72 MiB", "1.00 MiB", "976.56 KiB", "1.50 KiB", "100 bytes"]


def test_help_shows_each_default_once(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0
    text = " ".join(capsys.readouterr().out.split())           # argparse's line breaks undone
    for none in ("(default: None)", "(default: True)", "(default: False)"):
        assert none not in text
    options = re.split(r" (?=--[a-z])", text.split("options:", 1)[1])   # one piece per option
    assert len(options) > 20
    for option in options:
        assert option.count("default:") <= 1, option
    assert "--world WORLD N, the number of ranks (default: 1)" in text


@pytest.mark.parametrize("argv, warning", [
    (["--params", "7e9", "--seq-len", "2048", "--batch-size", "8"],
     "memory.py: warning: --batch-size, --seq-len ignored: activations need a shape: give --model"),
    (["--model", "tiny", "--grad-accum", "2"],
     "memory.py: warning: --grad-accum ignored: the table of strategies shows no activations"),
    (["--params", "1e9", "--gpu-mem", "80GB"], "memory.py: warning: --gpu-mem ignored: only --advise"),
    (["--model", "tiny", "--strategy", "ddp", "--measure"],
     "memory.py: warning: --measure ignored: only --advise reads them: add --advise, or drop them"),
    (["--model", "tiny", "--gpu", "a100", "--link", "pcie"],
     "memory.py: warning: --gpu, --link ignored: only --advise reads them: add --advise, or drop them"),
    (["--advise", "--model", "tiny", "--batch-size", "16", "--precision", "fp32"],
     "memory.py: warning: --batch-size, --precision ignored: --advise walks every rung itself"),
    (["--model", "tiny", "--strategy", "zero2", "--seq-len", "64"], None),     # read: no warning
    (["--advise", "--params", "7B", "--seq-len", "2048"], None),
])
def test_an_option_given_but_not_read_is_named_in_one_line(argv, warning, capsys):
    main(argv)
    err = capsys.readouterr().err
    if warning is None:
        assert err == ""
    else:
        assert err.startswith(warning) and err.count("\n") == 1, err


def test_memory_py_prints_no_warning():
    """torch warns "Failed to initialize NumPy" as it is imported where numpy is absent:
    requirements.txt installs numpy, so neither torch nor napkin/memory.py prints anything on stderr."""
    runs = {name: subprocess.Popen([sys.executable, *argv], cwd=REPO, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for name, argv in (("torch", ["-c", "import torch"]),
                               ("memory", ["-m", "napkin.memory", "--model", "tiny"]))}
    err = {name: proc.communicate(timeout=120)[1] for name, proc in runs.items()}
    assert err == {"torch": "", "memory": ""}, err


@pytest.mark.parametrize("precision, reduce, ratios", [
    # bytes a parameter on the wire: all-reduce 2 x 4 (fp32); reduce-scatter 4 + all-gather 2;
    # ZeRO-3 gathers twice: 2 + 2 + 4. The lecture's 1x and 1.5x hold in one dtype.
    ("bf16", "fp32", {"zero1": (4 + 2) / 8, "zero2": (4 + 2) / 8, "zero3": (2 + 2 + 4) / 8}),
    ("bf16", "bf16", {}),
    ("fp32", "fp32", {}),
])
def test_bytes_sent_departing_from_the_lecture_say_why_on_their_row(precision, reduce, ratios, capsys):
    """napkin.memory's table: a row whose bytes sent are not the lecture's multiple of DDP's
    (1x for ZeRO-1/2, 1.5x for ZeRO-3) says its multiple and why on the same line; DDP's row
    says when its gradients travel wider than the parameters."""
    main(["--model", "gpt2-small", "--world", "8", "--precision", precision, "--reduce-dtype", reduce])
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    for strategy in ("zero1", "zero2", "zero3"):
        if strategy in ratios:
            lecture = {"zero1": 1, "zero2": 1, "zero3": 1.5}[strategy]
            assert (f"; {ratios[strategy]:.2f}x ddp's, not the lecture's {lecture:g}x: grads "
                    f"reduced in fp32, params gathered in bf16") in rows[strategy], rows[strategy]
        else:
            assert "ddp's" not in rows[strategy], rows[strategy]
    assert ("grads reduced in fp32, 4 bytes each" in rows["ddp"]) == (reduce != precision), rows["ddp"]


def test_the_runs_bytes_sent_say_why_they_depart_from_the_lecture():
    """train.py's step line, bf16 ZeRO-2 on 2 ranks: its gradients reduced in fp32 send 4 + 2
    bytes a parameter where DDP sends 2 x 4, and the line says so beside its ring formula."""
    argv = ["--steps", "1", "--eval-every", "0", "--eval-batches", "1", "--seq-len", "32",
            "--batch-size", "8", "--precision", "bf16", "--strategy", "zero2"]
    _, out = run_ranks(train_logged, 2, argv)[0]
    line = next(line for line in out.splitlines() if "(ring formula " in line)
    assert (" MiB/step (ring formula " in line and "); 0.75x ddp's, not the lecture's 1x: grads reduced in fp32, params "
            "gathered in bf16" in line), line
