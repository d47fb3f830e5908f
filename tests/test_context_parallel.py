"""Context parallelism (context_parallel.py): attention over a split sequence equals one process's.

Both attentions (all-gather K/V, ring) at cp 2, 3 and 4, zigzag and not, against PyTorch's causal
attention on the whole sequence: outputs and q/k/v gradients separately, fp32 and bf16, and fp64 at
a second length; the bytes they send against context_parallel.cp_kv_bytes; the messages paired the way
NCCL pairs them; the blocks each rank computes (counted) against the split's causal count, so
zigzag's balance is measured without a clock; the activations a rank keeps falling as 1/cp.
train.py --strategy cp trains the one-process model step by step: the all-gather at cp 2, the ring
at cp 2 x dp 2 and with LoRA and activation checkpointing; its checkpoints resume on one process;
bad command lines stop every rank with one message.
"""
import contextlib
import json
import os
from collections import Counter
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import context_parallel as cp_module
from composition.context_parallel_gpt import ContextParallelGPT
from napkin import memory
from foundations.comm import Comm
from context_parallel import cp_kv_bytes
from napkin.memory_math import cp_activation_bytes
from foundations.meters import saved_activation_bytes
from model import GPT, GPTConfig
from equivalence import assert_adam_close
from multiprocess import assert_mean_close, assert_tensors_close, bench_logged, run_ranks
from running.snapshot import load_weights
from test_tensor_parallel import (RUN, _single_runs, _straight_and_resumed, _train, _usage_errors,
                                  _weights)

B, H, D = 2, 4, 16
# fp32: the ring sums its blocks' exponentials in another order than PyTorch's kernel, and the
# all-gather attends chunk by chunk: fp32 rounding of values of order 1 (measured: at most 1.1e-6
# absolute, on a gradient of about 2; 4e-7 on the outputs).
FP32_TOL = 1e-6
# bf16: both sides compute in fp32 and round to bf16, whose ulp is 2^-8 to 2^-7 of a value; the
# all-gather's dK/dV are also summed over the ranks in bf16. Measured: one ulp at most (1.6e-2 on
# gradients between 2 and 4, 7.8e-3 on outputs), within 2^-6 relative or absolute.
BF16_RTOL, BF16_ATOL = 2 ** -6, 2 ** -6
# fp64: both exact up to fp64's rounding (measured: at most 1.8e-15, at 8cp and 4cp tokens), so the
# fp32 and bf16 gaps are rounding, not a wrong block, mask or split.
FP64_TOL = 1e-12
TOLERANCES = {torch.float32: (FP32_TOL, FP32_TOL), torch.bfloat16: (BF16_RTOL, BF16_ATOL),
              torch.float64: (FP64_TOL, FP64_TOL)}


def _cases(cp):
    """(sequence length, dtype) of the attention cases: fp32 and bf16 at 8cp tokens (4 a zigzag
    chunk); a second length for the split, 4cp (2 a chunk), in fp64, checked exactly: in fp32 its
    rounding passes FP32_TOL (measured at cp 2: 1.16e-6 on a dK of scale 1)."""
    return [(8 * cp, torch.float32), (8 * cp, torch.bfloat16), (4 * cp, torch.float64)]


def _recording(comm):
    """comm with its exchanges recorded, per batch: [(kind, peer, shape, dtype), ...]."""
    batches, exchange = [], comm.exchange

    def record(ops):
        batches.append([(kind, peer, tuple(t.shape), t.dtype) for kind, t, peer in ops])
        return exchange(ops)
    comm.exchange = record
    return batches


@contextlib.contextmanager
def _counting_scores(counts: Counter, phase: str):
    """Within: every attention score the cp attentions compute, counted into counts[phase] as
    queries x keys per batch row and head: the ring's blocks (context_parallel._scores, in forward
    and in backward) and the all-gather's SDPA calls (forward; autograd runs their backward)."""
    def counting(fn):
        def counted(q, k, *args, **kwargs):
            counts[phase] += q.shape[-2] * k.shape[-2]
            return fn(q, k, *args, **kwargs)
        return counted
    with mock.patch.object(cp_module, "_scores", counting(cp_module._scores)), \
            mock.patch.object(F, "scaled_dot_product_attention", counting(F.scaled_dot_product_attention)):
        yield


def _attention_cases():
    """On each rank: every attention x balance x (length, dtype) against the whole sequence's SDPA."""
    comm = Comm()
    r, n = comm.rank, comm.world_size
    batches = _recording(comm)
    results = {}
    for T, dtype in _cases(n):
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, H, T, D, dtype=dtype, requires_grad=True) for _ in range(3))
        dout = torch.randn(B, H, T, D, dtype=dtype)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        ref.backward(dout)
        for attention in cp_module.ATTENTIONS:
            for zigzag in (True, False):
                split = cp_module.SequenceSplit(n, zigzag)
                mine = lambda t: cp_module.split_sequence(t.detach(), split, r, dim=2)
                inputs = [mine(t).requires_grad_() for t in (q, k, v)]
                comm.bytes_sent.clear()
                scores = Counter()
                with _counting_scores(scores, "forward"):
                    out = cp_module.ATTENTIONS[attention](*inputs, comm, split)
                with _counting_scores(scores, "backward"):
                    out.backward(mine(dout))
                sent = sum(comm.bytes_sent[name] for name in cp_module.KV_COLLECTIVES)
                results[attention, zigzag, dtype, T] = {
                    "got": {"out": out.detach(), **{f"grad_{x}": t.grad for x, t in zip("qkv", inputs)}},
                    "want": {"out": mine(ref), **{f"grad_{x}": mine(t.grad) for x, t in zip("qkv", (q, k, v))}},
                    "whole": cp_module.unsplit_sequence(mine(ref), comm, split, dim=2),
                    "ref": ref.detach(), "sent": sent, "scores": scores}
    return {"results": results, "batches": batches}


@pytest.fixture(scope="module", params=[2, 3, 4])
def attention(request):
    return request.param, run_ranks(_attention_cases, request.param)


@pytest.mark.equivalence
def test_both_attentions_equal_causal_attention_on_the_whole_sequence(attention):
    cp, ranks = attention
    for r, rank in enumerate(ranks):
        for (name, zigzag, dtype, T), res in rank["results"].items():
            what = f"{name} attention, cp {cp}, zigzag {zigzag}, {dtype}, T {T}, rank {r}"
            rtol, atol = TOLERANCES[dtype]
            assert_tensors_close(res["got"], res["want"], rtol=rtol, atol=atol, what=what)
            assert torch.equal(res["whole"], res["ref"]), what         # split then unsplit: itself


def test_bytes_sent_equal_the_formula(attention):
    cp, ranks = attention
    for rank in ranks:
        for (name, _, dtype, T), res in rank["results"].items():
            formula = cp_kv_bytes(T, B, H * D, cp, name, torch.finfo(dtype).bits // 8)
            assert res["sent"] == formula["forward"] + formula["backward"], (name, dtype, T)


def test_ring_messages_pair_up_as_nccl_pairs_them(attention):
    """NCCL runs two ranks' p2p calls in the order they were posted: every rank posts as many
    batches, batch i of rank r sends to the peer whose batch i receives from r, the same shape."""
    cp, ranks = attention
    batches = [rank["batches"] for rank in ranks]
    assert len({len(b) for b in batches}) == 1
    for i in range(len(batches[0])):
        for r in range(cp):
            for kind, peer, shape, dtype in batches[r][i]:
                if kind == "send":
                    assert ("recv", r, shape, dtype) in batches[peer][i], (i, r, peer)
            assert Counter(op[0] for op in batches[r][i]) == {"send": 1, "recv": 1}


def test_each_rank_computes_the_blocks_the_split_predicts(attention):
    """The causal work measured without a clock: the scores each rank computed (counted), in blocks
    of c x c, are SequenceSplit.blocks' count, so 1 - a rank's blocks / the busiest rank's is
    predicted_idle. Measured at cp 4: 1, 2, 3, 4 blocks of c = T/4 without zigzag (idle 0.75, 0.5,
    0.25, 0), 9 of c = T/8 on every rank with it (idle 0); the ring computes as many in backward."""
    cp, ranks = attention
    for case in ranks[0]["results"]:
        name, zigzag, _, T = case
        split = cp_module.SequenceSplit(cp, zigzag)
        c = T // split.n_chunks
        predicted = [sum(len(split.blocks(r, s)) for s in range(cp)) for r in range(cp)]
        for phase in ("forward", "backward") if name == "ring" else ("forward",):
            blocks = [rank["results"][case]["scores"][phase] / c ** 2 for rank in ranks]
            assert blocks == predicted, (case, phase)
            idle = [1 - b / max(blocks) for b in blocks]
            assert idle == pytest.approx(split.predicted_idle()), (case, phase)


def test_a_length_the_split_cannot_divide_is_a_clear_error():
    for cp in (2, 3, 4):
        T = 3 * cp                                            # divides into cp chunks, not 2cp
        assert cp_module.SequenceSplit(cp, zigzag=False).positions(0, T).numel() == T // cp
        with pytest.raises(ValueError, match=f"{T} tokens do not divide by {2 * cp}: use a "
                                             f"sequence length divisible by {2 * cp}"):
            cp_module.SequenceSplit(cp, zigzag=True).positions(0, T)


@pytest.mark.parametrize("attention", cp_module.ATTENTIONS)
def test_a_split_for_another_group_size_is_a_clear_error(attention):
    """A split made for 4 ranks on a group of 2 would read rank 2's and 3's chunks from ranks 0
    and 1: both attentions stop first, before any message (the group here sends nothing)."""
    group = mock.Mock(spec=Comm, rank=0, world_size=2)
    q = torch.randn(B, H, 4, D)                                 # (B, H, t, D): 2 chunks of 2
    with pytest.raises(ValueError, match=r"split for 4 .* group of 2: make the split SequenceSplit\(2\)"):
        cp_module.ATTENTIONS[attention](q, q, q, group, cp_module.SequenceSplit(4))
    assert not group.method_calls


def test_zigzag_gives_every_rank_the_same_causal_work():
    """Blocks computed per rank under the causal mask: rank r of cp holds r + 1 blocks without
    zigzag (rank 0 idles 1 - 1/cp of the time), and 2cp + 1 half-size ones with it on every rank."""
    for cp in (2, 3, 4):
        none, zigzag = cp_module.SequenceSplit(cp, False), cp_module.SequenceSplit(cp, True)
        assert none.predicted_idle() == pytest.approx([1 - (r + 1) / cp for r in range(cp)])
        assert zigzag.predicted_idle() == [0.0] * cp
        assert [sum(len(zigzag.blocks(r, s)) for s in range(cp)) for r in range(cp)] == [2 * cp + 1] * cp
    assert cp_module.SequenceSplit(2, True).chunks(0) == [0, 3]


# ---- activations per rank fall with cp ------------------------------------------------------------

CFG = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=64, vocab_size=64)


def _kept_bytes(attention):
    """Bytes one forward keeps for backward on this rank (saved-tensor hooks), whole batch (4, 64)."""
    torch.manual_seed(0)
    gpt = GPT(CFG)
    model = ContextParallelGPT(gpt, Comm(), attention)
    x = torch.randint(0, CFG.vocab_size, (4, 64))
    kept, _ = saved_activation_bytes(lambda: model(x, x), exclude=list(gpt.parameters()))
    return kept


@pytest.fixture(scope="module")
def kept():
    return {(cp, attention): run_ranks(_kept_bytes, cp, attention)
            for cp in (1, 2, 4) for attention in cp_module.ATTENTIONS}


def test_activations_per_rank_fall_with_cp(kept):
    one = kept[1, "ring"][0]
    for cp in (2, 4):
        ring, gathered = kept[cp, "ring"], kept[cp, "allgather"]
        assert len(set(ring)) == 1                        # every rank keeps as much
        # every saved tensor has T/cp rows, but for the loss's 4-byte scalar
        assert abs(ring[0] - one / cp) <= 8, (cp, ring[0], one)
        # all-gather keeps the whole sequence's K and V besides (B, T, 2, H, D) per layer
        assert 0 < gathered[0] - ring[0] <= CFG.n_layer * 4 * 64 * 2 * CFG.n_embd * 4, (cp, gathered, ring)
    # napkin/memory.py's napkin falls the same way: 1/cp of the tokens (the scores' s keys per query aside)
    napkin = {cp: cp_activation_bytes(64, 4, 32, 4, 2, cp) for cp in (1, 2, 4)}
    assert napkin[4] < napkin[2] < napkin[1] / 1.9


# ---- train.py --strategy cp: the one-process curve, LoRA, checkpointing, checkpoints, bad input ----

LORA = ["--lora", "--lora-rank", "4", "--lora-targets", "query,value,up", "--checkpoint-activations"]
# Every step's loss in the history (RUN logs every 3rd), to compare step by step.
EVERY_STEP = ["--log-every", "1"]
STEPS = list(range(6))                                       # RUN's --steps 6
SEQ_LEN, BATCH = (int(RUN[RUN.index(flag) + 1]) for flag in ("--seq-len", "--batch-size"))


def _single_and_lora(root, cp_root):
    return {**_single_runs(root, cp_root, EVERY_STEP),
            "lora": _train(["--strategy", "single", *LORA, *EVERY_STEP,
                            "--export", os.path.join(root, "lora.pt")])}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("cp_runs"))
    paths = {name: os.path.join(root, name) for name in ("cp2", "cp2dp2", "lora", "single")}
    for p in paths.values():
        os.makedirs(p)
    # Each attention trained against one process: cp 2 the naive one with the unbalanced split;
    # cp 2 x dp 2 (DDP over 4 ranks) and LoRA with activation checkpointing the ring, zigzag.
    cp2 = run_ranks(_straight_and_resumed, 2, paths["cp2"],
                    ["--strategy", "cp", "--cp", "2", "--cp-attention", "allgather",
                     "--cp-balance", "none"], EVERY_STEP)[0]
    cp2dp2 = run_ranks(_train, 4, ["--strategy", "cp", "--cp", "2", *EVERY_STEP,
                                   "--export", os.path.join(paths["cp2dp2"], "straight.pt")])[0]
    lora = run_ranks(_train, 2, ["--strategy", "cp", "--cp", "2", *LORA, *EVERY_STEP,
                                 "--export", os.path.join(paths["lora"], "straight.pt")])[0]
    single = run_ranks(_single_and_lora, 1, paths["single"], paths["cp2"])[0]
    return {"cp2": cp2, "cp2dp2": cp2dp2, "lora": lora, "single": single, "paths": paths}


# The same sums in another order (each rank's tokens' gradient, then the all-reduce over the
# world) and attention in other kernels: fp32 noise, grown by 6 AdamW steps where Adam amplifies
# it on near-zero gradients: each weight within TRAIN_ATOL x max(1, ADAM_AMPLIFIED / d), d its
# smallest Adam denominator in one process (equivalence.assert_adam_close). Measured on 2 cores,
# every step: losses 1.1e-7 relative, weights 3.8e-6 at most and 2.0e-9 on average (cp 2 all-gather
# and cp 2 x dp 2 ring; LoRA less); the ring alone at cp 2 once reached 9.6e-6 and 4.8e-9.
# LoRA's export merges the adapters into the weights Adam never stepped: compared elementwise.
TRAIN_RTOL, TRAIN_ATOL, TRAIN_MEAN_ATOL = 1e-6, 5e-5, 5e-8


@pytest.mark.equivalence
@pytest.mark.parametrize("name, single", [("cp2", "straight"), ("cp2dp2", "straight"), ("lora", "lora")])
def test_train_cp_matches_single_process_step_by_step(runs, name, single):
    run = runs[name]["straight"] if name == "cp2" else runs[name]
    one = runs["single"][single]
    assert list(run["losses"]) == list(one["losses"]) == STEPS
    torch.testing.assert_close(list(run["losses"].values()), list(one["losses"].values()),
                               rtol=TRAIN_RTOL, atol=0)
    mine = _weights(os.path.join(runs["paths"][name], "straight.pt"))
    theirs = _weights(os.path.join(runs["paths"]["single"], "single.pt" if single == "straight" else "lora.pt"))
    if single == "straight":
        assert_adam_close(mine, theirs, runs["single"]["adam"]["straight"], TRAIN_ATOL,
                          f"{name} vs single after 6 steps")
    else:
        assert_tensors_close(mine, theirs, rtol=0, atol=TRAIN_ATOL, what=f"{name} vs single after 6 steps")
    assert_mean_close(mine, theirs, TRAIN_MEAN_ATOL, f"{name} vs single after 6 steps")


@pytest.mark.parametrize("name", ["cp2", "cp2dp2", "lora"])
def test_train_logs_kv_bytes_equal_to_the_formula_and_the_idle_shares(runs, name):
    run = runs[name]["straight"] if name == "cp2" else runs[name]
    for step, logged in run["cp"].items():
        assert logged["kv_sent"] == logged["kv_formula"] > 0, (name, step)
        assert len(logged["idle"]) == 2 and min(logged["idle"]) == 0.0
        assert all(0 <= x < 1 for x in logged["idle"])
    balance = [0.5, 0.0] if name == "cp2" else [0.0, 0.0]
    assert all(logged["predicted_idle"] == balance for logged in run["cp"].values())


def _kept_by_one_process(gpt, rows: int) -> int:
    """Bytes one process's forward keeps for backward over rows x SEQ_LEN tokens (saved-tensor
    hooks)."""
    x = torch.zeros(rows, SEQ_LEN, dtype=torch.long)
    return saved_activation_bytes(lambda: gpt(x, x), exclude=list(gpt.parameters()))[0]


def test_train_logs_half_of_one_processs_activation_bytes(runs):
    """The activation bytes a cp 2 rank logs (counted on its first step) against one process's
    forward over as many rows: train.py's model, loaded from the one-process run's export."""
    gpt = load_weights(os.path.join(runs["paths"]["single"], "single.pt"))
    C, layers, T, t = gpt.cfg.n_embd, gpt.cfg.n_layer, SEQ_LEN, SEQ_LEN // 2
    # Ring, cp 2 x dp 2 (BATCH / 2 rows a rank): half, within one (rows, t, C) tensor per layer and
    # 1 KiB. The ring's output (B, H, t, D) is copied by the heads' merge, and kept by the output
    # projection, where PyTorch's CPU kernel writes (B, T, H, D), which the merge only views; the
    # KiB: token positions. Measured: half + 128 KiB + 514 B.
    rows = BATCH // 2
    ring, half = runs["cp2dp2"]["cp"][0]["activation_bytes"], _kept_by_one_process(gpt, rows) / 2
    assert abs(ring - half) <= layers * rows * t * C * 4 + 1024, (ring, half)
    # All-gather, cp 2 (BATCH rows): half, with the whole sequence's K/V (B, T, 2, C) kept per layer
    # where the rank's own was: more than the other ranks' K/V, at most the whole. Measured: the
    # others' K/V (768 KiB) + 6 KiB (the masks as a float bias, the sequence-order index).
    gathered = runs["cp2"]["straight"]["cp"][0]["activation_bytes"]
    half, kv = _kept_by_one_process(gpt, BATCH) / 2, layers * BATCH * 2 * C * 4
    assert (T - t) * kv <= gathered - half <= T * kv, (gathered, half)
    assert gathered / BATCH > ring / rows                   # a row keeps more under the all-gather


@pytest.mark.equivalence
def test_cp_resume_is_bit_exact_and_resumes_on_one_process(runs):
    straight, again = runs["cp2"]["straight"], runs["cp2"]["resumed"]
    assert again["losses"] == {s: straight["losses"][s] for s in STEPS[3:]}
    a, b = (_weights(os.path.join(runs["paths"]["cp2"], f)) for f in ("resumed.pt", "straight.pt"))
    assert_tensors_close(a, b, rtol=0, atol=0, what="resumed cp 2 vs uninterrupted")
    # Whole parameters in the checkpoint: one process reads them as its own.
    from_cp = runs["single"]["from_split"]
    torch.testing.assert_close([from_cp["losses"][s] for s in STEPS[3:]],
                               [straight["losses"][s] for s in STEPS[3:]], rtol=TRAIN_RTOL, atol=0)


def _bad_cp_inputs():
    return _usage_errors({"world": ["--strategy", "cp", "--cp", "3"],
                          "mesh_options": ["--strategy", "ddp", "--cp", "2", "--tp", "2", "--sequence-parallel",
                                           "--cp-balance", "none", "--seq-len", "30"],
                          "attention_alone": ["--strategy", "ddp", "--cp-attention", "allgather"],
                          "zigzag": ["--strategy", "cp", "--cp", "2", "--seq-len", "30"],
                          "none": ["--strategy", "cp", "--cp", "2", "--cp-balance", "none",
                                   "--seq-len", "31"],
                          "dropout": ["--strategy", "cp", "--cp", "2", "--dropout", "0.1"],
                          "experts": ["--strategy", "cp", "--cp", "2", "--model", "tiny-moe"]})


@pytest.fixture(scope="module")
def bad_cp():
    return run_ranks(_bad_cp_inputs, 2)


@pytest.mark.parametrize("case, fix", [
    ("world", "world size 2 is not --cp 3 x a data-parallel size: launch a multiple of 3"),
    ("mesh_options", "--sequence-parallel with --cp 2: each rank's 15 tokens of a sequence split "
                     "further into --tp 2 equal parts: use a --seq-len divisible by 4"),
    ("attention_alone", "add --cp N (--strategy ddp without it gives every rank whole sequences)"),
    ("zigzag", "--cp 2 with --cp-balance zigzag cuts each sequence into 4 equal chunks (two chunks per "
               "rank): use a --seq-len divisible by 4, e.g. 28"),
    ("none", "use a --seq-len divisible by 2, e.g. 30"),
    ("dropout", "use --dropout 0 with --cp"),
    ("experts", "--cp 2 with experts: each rank routes its own tokens, so route them in groups inside "
                "one chunk of a sequence: give a --routing-group dividing the 8 tokens"),
])
def test_bad_cp_input_stops_every_rank_with_the_same_message(bad_cp, case, fix):
    assert bad_cp[0][case] == bad_cp[1][case], bad_cp
    assert fix in bad_cp[0][case], bad_cp[0][case]


# ---- napkin/memory.py --cp and bench/compare.py's cp rows -------------------------------------------------------

def test_memory_cp_table_halves_a_ranks_activations(capsys):
    memory.main(["--model", "tiny", "--cp", "4", "--precision", "fp32", "--batch-size", "16",
                 "--seq-len", "64"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip()[:1].isdigit()]
    assert [int(row[0]) for row in rows] == [1, 2, 4]
    ring = [float(row[1]) for row in rows]
    assert ring[0] == 2 * ring[1] == 4 * ring[2]                   # 44.0, 22.0, 11.0 MiB
    # K/V per layer: ring (cp-1) x 3 K/V blocks in fp32, all-gather (cp-1) x 2: 1.5x
    assert [float(row[3]) for row in rows] == [1.5 * float(row[4]) for row in rows]


def test_bench_times_ring_beside_allgather(tmp_path):
    path = tmp_path / "bench.json"
    # bench/compare.py's run on 2 forked ranks (tests/test_bench.py's quick fixture is its torchrun launch)
    output = run_ranks(bench_logged, 2, ["--quick", "--strategies", "cp", "--warmup", "1", "--steps", "2",
                                         "--repeats", "1", "--json", str(path)])[0]
    assert "| cp attention (cp 2, zigzag) |" in output and "context_parallel not run" in output
    rows = {r["attention"]: r for r in json.loads(path.read_text())["context_parallel"]}
    assert set(rows) == {"ring", "allgather"}
    for r in rows.values():
        assert r["sent_per_step"] == r["napkin_sent"] and len(r["idle"]) == 2
    # the same training on both; the ring keeps less (no gathered K/V) and sends more (K/V again in backward)
    assert rows["ring"]["last_loss"] == pytest.approx(rows["allgather"]["last_loss"], rel=1e-5)
    assert rows["ring"]["activation_bytes"] < rows["allgather"]["activation_bytes"]
    assert rows["ring"]["sent_per_step"] > rows["allgather"]["sent_per_step"]
    # napkin/step_time.py's napkin beside each (test_bench's check): its K/V exchange among its parts
    from test_bench import assert_napkin_beside, table
    columns, printed = table(output, "cp attention (cp 2, zigzag)")
    assert [cells[0] for cells in printed] == ["ring", "allgather"]
    for cells in printed:
        row = rows[cells[0]]
        assert row["predicted"]["kv_exchange"] > 0
        assert_napkin_beside(row, row["ms_per_step"], cells[columns.index("predicted ms")])


