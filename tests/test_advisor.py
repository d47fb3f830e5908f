"""napkin/advisor.py: the lecture's flow chart rung by rung, napkin/memory.py --advise, train.py --strategy auto."""
import re

import pytest

from napkin.advisor import advise, expert_parallel_options, params_shape, parse_bytes
from napkin.memory import main
from napkin.memory_math import GB, ep_params, expert_params, model_params, moe_exchange_bytes, root_params
from model import PRESETS
from multiprocess import run_ranks, torchrun_worker


@pytest.mark.parametrize("gpu_mem, world, rung, strategy, flags", [
    # gpt2-small, seq 1024: at 24 GB states and a big micro-batch fit replicated -> zero2
    ("24GB", 4, "zero2", "zero2", []),
    # replicated states (1.5 GB of Adam alone) plus one sequence do not fit 2.7 GB, zero2's
    # sharded gradients and Adam do (1.97 GB)
    ("3GB", 4, "zero2", "zero2", []),
    # nor zero2's in 1.89 GB: shard the parameters too (1.78 GB)
    ("2.1GB", 4, "zero3", "fsdp", []),
    ("1.2GB", 4, "activation checkpointing", "fsdp", ["--checkpoint-activations"]),
    ("0.5GB", 4, "offloaded", "fsdp", ["--checkpoint-activations", "--offload", "optimizer"]),
    # one GPU: full fine-tuning fits nowhere, not even offloaded -> LoRA, then QLoRA
    ("0.8GB", 1, "LoRA", "fsdp", ["--checkpoint-activations", "--lora"]),
    ("0.62GB", 1, "QLoRA", "fsdp", ["--checkpoint-activations", "--lora", "--quantize-base"]),
])
def test_advice_follows_the_flow_chart(gpu_mem, world, rung, strategy, flags):
    rungs = advise("gpt2-small", parse_bytes(gpu_mem), world, 1024, 8 * world)
    chosen = rungs[-1]
    assert chosen.fits and rung in chosen.rung and chosen.strategy == strategy, rungs
    assert all(flag in chosen.flags for flag in flags), chosen.flags
    assert not any(a.fits for a in rungs[:-1])                  # every earlier rung was too big
    assert chosen.held["total"] <= 0.9 * parse_bytes(gpu_mem)   # 10% headroom
    assert chosen.micro_batch * chosen.grad_accum * world == 8 * world     # the target batch


def test_advice_takes_zero2_where_its_bytes_fit_and_ddps_do_not():
    """7b on 8 x 80 GB, seq 2048, one sequence per micro-batch: ddp's replicated Adam state does
    not fit, ZeRO-2's sharded gradients and state do, so the advice is zero2 (not zero3). The
    bytes are the lecture's per rank, in bf16 with fp32 masters: 2P parameters (the padded flat
    buffer, N c), 2c gradients and 12c optimizer for a shard of c = ceil(P/N), activations
    L sbh(34 + 5as/h) and the loss's 4sbV."""
    cfg, N, s, b = PRESETS["7b"], 8, 2048, 1
    P, L, h, a, V = model_params(cfg), cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size
    c = -(-P // N)
    kept = L * s * b * h * (34 + 5 * a * s // h) + 4 * s * b * V
    ddp, zero2 = (2 + 2 + 12) * P + kept, 2 * N * c + (2 + 12) * c + kept
    assert ddp > 0.9 * 80e9 > zero2                            # 138.4 GB against 56.1 GB
    rungs = advise("7b", parse_bytes("80GB"), N, s, 64)
    assert [a.strategy for a in rungs] == ["ddp", "zero2"] and rungs[-1].fits, rungs
    assert rungs[-1].micro_batch == b and rungs[-1].held["total"] == zero2


def test_advise_prints_a_command_train_py_accepts(capsys, monkeypatch):
    import train
    main(["--advise", "--model", "gpt2-small", "--gpu-mem", "0.5GB", "--world", "4",
          "--seq-len", "1024", "--target-batch", "64"])
    out = capsys.readouterr().out
    assert "too big" in out and "fits (+" in out                # the rungs walked, host bytes shown
    command = out.strip().splitlines()[-1]
    assert command.startswith("torchrun --nproc_per_node 4 train.py ")
    torchrun_worker(monkeypatch, 4)
    args = train.parse_args(command.split("train.py ")[1].split())
    assert (args.strategy, args.offload, args.grad_accum) == ("fsdp", "optimizer", 16)
    assert args.checkpoint_activations == 1 and args.precision == "bf16"


def test_advise_prices_a_mixture_of_experts_under_every_ep(capsys):
    """gpt2-small-moe on 8 GPUs of 80 GB: zero2 fits replicated; under --ep N a rank holds N
    times fewer expert weights (zero2 keeps the parameters whole; gradients and optimizer are
    sharded over the world either way), and sends (N-1)/N of every MoE layer's capacity buffer
    4 times per micro-batch."""
    main(["--advise", "--model", "gpt2-small-moe", "--world", "8", "--gpu-mem", "80GB"])
    out = capsys.readouterr().out
    assert "521,224,704 parameters, 181,209,600 of them active per token: top-2 of 8 experts" in out
    cfg, chosen = PRESETS["gpt2-small-moe"], advise("gpt2-small-moe", parse_bytes("80GB"), 8, 1024, 64)[-1]
    options = expert_parallel_options(cfg, chosen, 8, 1024, "bf16")
    assert [ep for ep, _, _ in options] == [1, 2, 4, 8]
    ep1 = options[0][1]
    for ep, held, sent in options:
        assert held["params"] == 2 * ep_params(cfg, ep)[0]                      # bf16, whole
        assert ep1["params"] - held["params"] == 2 * (expert_params(cfg) - expert_params(cfg) // ep)
        assert (held["grads"], held["optimizer"]) == (ep1["grads"], ep1["optimizer"])
        assert sent["all_to_all"] == moe_exchange_bytes(cfg, 8 * 1024, ep, "bf16")
        assert sent["all_to_all"] * ep == (ep - 1) * options[1][2]["all_to_all"] * 2
        row = next(l for l in out.splitlines() if l.split()[:2] == [str(ep), str(8 // ep)])
        assert row.split()[6:9] == [f"{held['total'] / GB:.2f}", f"{sent['all_to_all'] / 1e6:.1f}",
                                    f"{sum(sent.values()) / 1e6:.1f}"], row
    main(["--advise", "--model", "tiny-moe"])
    assert "expert parallelism (--ep): not priced, one GPU holds every expert" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--world", "0"], "the world must be at least 1 GPU"),
    (["--gpu-mem", "lots"], "write it like 24GB"),
    (["--gpu-mem", "0GB"], "write it like 24GB"),
    (["--seq-len", "4096"], "between 1 and model gpt2-small's block size 1024"),
    (["--world", "3", "--target-batch", "64"], "use a multiple of 3"),
    (["--link", "pcie"], "add --gpu"),
    (["--gpu", "rtx3090", "--link", "nvlink"], "has no NVLink here"),
])
def test_advise_bad_input_stops_with_one_clear_message(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--advise", "--model", "gpt2-small", *argv])
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def _auto(budgets):
    import train
    return {m: train.main(["--steps", "3", "--log-every", "1", "--eval-every", "0", "--strategy", "auto",
                           "--mem-budget", m]) for m in budgets}


def test_strategy_auto_runs_the_advice_on_cpu_ranks():
    """The tiny GPT on 2 CPU ranks, fp32, 16 x 64: 9 MB per rank leaves fsdp with
    checkpointing (7.9 MB predicted); 6 MB needs the optimizer offloaded."""
    assert "checkpointing" in advise("tiny", parse_bytes("9MB"), 2, 64, 16, "fp32")[-1].rung
    assert "offloaded" in advise("tiny", parse_bytes("6MB"), 2, 64, 16, "fp32")[-1].rung
    runs = run_ranks(_auto, 2, ("9MB", "6MB"))
    for history in runs[0].values():
        losses = list(history["losses"].values())
        assert len(losses) == 3 and losses[-1] < losses[0]


def test_strategy_auto_names_the_fix(monkeypatch, capsys):
    import train
    torchrun_worker(monkeypatch, 2)
    for argv, fix in ((["--strategy", "auto"], "needs --mem-budget"),
                      (["--strategy", "auto", "--mem-budget", "4MB"], "add --init-from RUN_DIR"),
                      (["--strategy", "auto", "--mem-budget", "1MB"], "does not fit in 976.56 KiB"),
                      (["--strategy", "auto", "--mem-budget", "abc"], "write it like 24GB")):
        with pytest.raises(SystemExit):
            train.parse_args(argv)
        assert fix in capsys.readouterr().err, argv


def test_the_talks_70b_case_fits_two_24_gb_gpus_only_with_the_parameters_offloaded(capsys):
    """A 70B-class model (65B parameters), 4-bit base, LoRA rank 8 on every linear, 2 GPUs of
    24 GB, sequences of 2048 under activation checkpointing: QLoRA with FSDP sharding the base
    needs 24.2 GB a GPU (18.7 of them the base's half), over the 21.6 GB budget; with the shards
    offloaded the GPU holds only the units FSDP gathers: the root (embeddings and untied head,
    bf16, whole from forward to the end of backward) and two blocks (4-bit), 2.02 GB in all,
    and the rest waits in CPU memory."""
    rungs = advise("70b", parse_bytes("24GB"), 2, 2048, 2)
    sharded, offloaded = rungs[-2], rungs[-1]
    assert "QLoRA" in sharded.rung and not sharded.fits
    assert 21.6 * GB < sharded.held["total"] < 25 * GB
    assert offloaded.fits and "--offload params" in " ".join(offloaded.flags)
    root = 2 * root_params(PRESETS["70b"])
    assert root == 2 * (2 * 32000 * 8192 + 4096 * 8192 + 2 * 8192)             # 1.12 GB
    assert 0.8 * GB < offloaded.held["params"] - root < GB                      # two 4-bit blocks
    assert round(offloaded.held["params"] / GB, 2) == 2.02
    assert round(offloaded.held["total"] / GB, 2) == 6.98
    assert 18 * GB < offloaded.held["host"] < 21 * GB           # the 4-bit base's half, Adam's
    main(["--advise", "--model", "70b", "--gpu-mem", "24GB", "--world", "2", "--seq-len", "2048",
          "--target-batch", "2"])
    out = capsys.readouterr().out
    assert "64,990,232,576 parameters" in out and "--offload params" in out.splitlines()[-1]


def _family_count(k: int) -> int:
    """Parameters of k layers of k heads of 128 (d = 128 k), vocabulary 32000, 4096 positions:
    L (12 d^2 + 12 d) + 2 V d + T d + 2 d (test_memory's 7b formula)."""
    d = 128 * k
    return k * (12 * d * d + 12 * d) + 2 * 32000 * d + 4096 * d + 2 * d


def test_advise_takes_a_parameter_count_and_says_the_shape_it_assumes(capsys):
    """--params 7B: the 7b preset's family (Llama 2 7B's proportions) at the nearest count, which
    is the 7b preset itself; on one 24 GB GPU full fine-tuning does not fit even with the
    optimizer offloaded (31.7 GB), LoRA does (18.4 GB). --params 70e9 has no preset: the nearest
    of the family is 71 layers of width 9088, and the command says train.py needs it as a preset."""
    main(["--advise", "--params", "7B", "--gpu-mem", "24GB"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("32 layers, d_model 4096, 32 heads, vocabulary 32000, 4096 positions, "
                             "6,722,953,216 parameters (preset 7b)"), lines[0]
    assert "LoRA (fsdp + checkpointing)" in lines[-3] and "fits" in lines[-3]
    assert " --model 7b " in lines[-1] and " --lora " in lines[-1]
    for n in (7e9, 70e9, 1e8):
        shape = params_shape(n)
        k = shape.n_layer
        assert (shape.n_head, shape.n_embd) == (k, 128 * k) and model_params(shape) == _family_count(k)
        assert all(abs(_family_count(k) - n) <= abs(_family_count(j) - n) for j in (k - 1, k + 1) if j)
    assert (params_shape(70e9).n_layer, params_shape(70e9).n_embd) == (71, 9088)
    main(["--advise", "--params", "70e9", "--world", "2", "--seq-len", "2048", "--target-batch", "2"])
    out = capsys.readouterr().out
    assert "71 layers, d_model 9088, 71 heads" in out and "(preset" not in out
    assert "--model SHAPE" in out.splitlines()[-1] and "add this shape to model.PRESETS" in out


def test_advise_prints_a_small_model_in_mib(capsys):
    """The tiny GPT's rungs in MiB, not rows of 0.00 GB."""
    main(["--advise", "--model", "tiny", "--world", "2"])
    text = capsys.readouterr().out
    assert "GPU(s) of 24.00 GB" in text and "total MiB" in text and "total GB" not in text
    row = next(l for l in text.splitlines() if l.startswith("zero2"))
    assert float(row.split()[-2]) > 1                               # 35.51 MiB, not 0.04 GB


def _reference_seconds(cfg, a, world, seq_len, machine) -> float:
    """A rung's step from step_time.predict of one micro-batch of world x b sequences, built
    here: k micro-batches of forward, backward and exposed communication (DDP's once, as
    no_sync does; ZeRO-2's all-gather once: (N-1)/N of the bf16 parameters sent, N-1 messages per
    25 MiB bucket), once the optimizer and the offload transfers; parameter offload: each
    micro-batch copies the rank's stored shards (4-bit base) to the device twice; QLoRA's FSDP
    gathers the 4-bit base (step_time's test prices that by hand)."""
    import math
    from napkin.memory_math import nf4_bytes, quantized_params
    from napkin.step_time import Shape, Step, predict
    shape = Shape.of(cfg)
    frozen = shape.layers * shape.block_params() + shape.vocab * shape.width
    lora = None
    if "--lora" in a.flags:
        targets = ("query", "key", "value", "output", "up", "down") if "--quantize-base" in a.flags else ("query", "value")
        lora = (8 * cfg.n_layer * sum({"query": 2, "key": 2, "value": 2, "output": 2, "up": 5, "down": 5}[t]
                                      * cfg.n_embd for t in targets), frozen)
    step = Step(shape, a.strategy, world, world * a.micro_batch, seq_len, "bf16", lora=lora,
                checkpointing=float("--checkpoint-activations" in a.flags), offload="--offload" in a.flags,
                quantized=quantized_params(cfg) if "--quantize-base" in a.flags else 0)
    p, k, P = predict(step, machine)["parts"], a.grad_accum, shape.params()
    once = p["optimizer"] + p.get("offload", 0.0)
    per_micro = p["forward"] + p["backward"] + p["exposed"]
    if a.strategy == "zero2":
        link = machine.links["node"]
        gather = (world - 1) * math.ceil(P / (25 * 2**19)) * link.latency + (world - 1) / world * 2 * P / link.bandwidth
        per_micro, once = per_micro - gather, once + gather
    if "params" in a.flags:
        stored = nf4_bytes(quantized_params(cfg)) + 2 * (model_params(cfg) - quantized_params(cfg))
        per_micro += machine.host_link.seconds(2 * stored / world, 2 * (cfg.n_layer + 1))
    return k * per_micro + once


@pytest.mark.parametrize("gpu, link, fits, winner", [
    # 7b, 8 GPUs, sequences of 2048, 64 a step. 80 GB: zero2 and fsdp fit a micro-batch of 1 and
    # NVLink hides their gathers; checkpointing's micro-batch of 8 costs a third more compute.
    ("h100-sxm", "nvlink", 7, "zero3 (fsdp)"),
    # 24 GB: only checkpointing (micro-batch 4) and the rungs after it fit; the offloaded
    # optimizer's micro-batch of 8 does not pay for its PCIe transfers and host Adam.
    ("rtx3090", "pcie", 5, "fsdp + activation checkpointing"),
])
def test_advise_ranks_the_rungs_that_fit_by_speed(gpu, link, fits, winner, capsys):
    from napkin.advisor_speed import every_rung
    from napkin.machines import PRESETS as MACHINES, joined_by
    main(["--advise", "--model", "7b", "--world", "8", "--seq-len", "2048", "--target-batch", "64",
          "--gpu", gpu, "--link", link])
    out = capsys.readouterr().out
    lines = out[out.index("by speed on 8 x "):].splitlines()
    machine, cfg = joined_by(MACHINES[gpu], link), PRESETS["7b"]
    fitting = [a for a in every_rung(cfg, MACHINES[gpu].memory, 8, 2048, 64) if a.fits]
    assert len(fitting) == fits
    reference = sorted((_reference_seconds(cfg, a, 8, 2048, machine), a) for a in fitting)
    for i, (seconds, a) in enumerate(reference, 1):
        row = lines[1 + i]
        assert row.split()[0] == str(i) and a.rung in row, (row, a.rung)        # fastest first
        assert row.split()[-1] == f"{64 * 2048 / seconds:,.0f}", row
        assert row.split()[-2] == f"{seconds * 1e3:.1f}", row
    full = [a for _, a in reference if "--lora" not in a.flags]
    assert f"fastest full training: {winner}," in out and full[0].rung == winner
    assert out.splitlines()[-1].startswith("why: ") and full[1].rung in out.splitlines()[-1]


def test_the_talks_slow_link_case_quantization_buys_a_batch_that_pays(capsys):
    """70b fine-tuned on 8 GPUs, 64 x 512 a step. Over a 100 Gb/s network between RTX 3090s,
    QLoRA's 4-bit base leaves room for micro-batch 8 where LoRA's bf16 base fits 4, so FSDP
    gathers the base once a step instead of twice, and in 4 bits: QLoRA wins. Over H100 SXM's
    NVLink the gathers hide under compute either way and the micro-batches are equal: QLoRA buys
    nothing. Each step against the test's own reference."""
    from napkin.advisor_speed import every_rung
    from napkin.machines import PRESETS as MACHINES, joined_by
    cfg, found = PRESETS["70b"], {}
    for gpu, link in (("rtx3090", "network"), ("h100-sxm", "nvlink")):
        main(["--advise", "--model", "70b", "--world", "8", "--seq-len", "512", "--target-batch", "64",
              "--gpu", gpu, "--link", link])
        rungs = {a.rung: a for a in every_rung(cfg, MACHINES[gpu].memory, 8, 512, 64) if a.fits}
        pair = rungs["QLoRA: the frozen base in 4-bit NF4, sharded"], rungs["LoRA (fsdp + checkpointing)"]
        step = [_reference_seconds(cfg, a, 8, 512, joined_by(MACHINES[gpu], link)) for a in pair]
        found[gpu] = [a.micro_batch for a in pair], step, capsys.readouterr().out
    batches, (quantized, plain), out = found["rtx3090"]
    assert batches == [8, 4] and plain / quantized > 1.2               # 38.4 s against 30.4 s a step
    assert "fastest fine-tune: QLoRA: the frozen base in 4-bit NF4, sharded," in out
    assert ("why: 'QLoRA: the frozen base in 4-bit NF4, sharded' is 8004.8 ms a step faster than "
            "'LoRA (fsdp + checkpointing)' because it fits micro-batch 8 where 'LoRA (fsdp + checkpointing)' "
            "fits 4 (1 micro-batch a step instead of 2), so its communication takes") in out
    batches, (quantized, plain), out = found["h100-sxm"]
    assert batches == [8, 8] and abs(plain / quantized - 1) < 0.001    # 2176.2 ms against 2176.7
    assert "fastest fine-tune: LoRA (fsdp + checkpointing)," in out


def _priced(rung: str, micro_batch: int, grad_accum: int, **parts_ms) -> tuple:
    """A rung as priced_rungs gives it: its Advice and its step's parts (given in ms)."""
    from napkin.advisor import Advice
    parts = {p: parts_ms.get(p, 0.0) / 1e3 for p in ("compute", "communication", "transfers", "optimizer")}
    return Advice(rung, "fsdp", micro_batch, grad_accum, [], {}, True), {"parts": parts,
                                                                          "seconds": sum(parts.values())}


@pytest.mark.parametrize("winner, other, sentence", [
    # The faster rung fits the larger micro-batch: that is the reason, and what it saves follows.
    (_priced("QLoRA", 2, 1, compute=100, communication=10), _priced("LoRA", 1, 2, compute=110, communication=25),
     "why: 'QLoRA' is 25.0 ms a step faster than 'LoRA' because it fits micro-batch 2 where 'LoRA' fits 1 "
     "(1 micro-batch a step instead of 2), so its communication takes 15.0 ms less and its compute 10.0 ms less"),
    # The slower rung fits the larger one, and pays more elsewhere: the faster one's savings, then
    # the other's micro-batch, then what the faster one spends more on.
    (_priced("fsdp", 1, 2, compute=120, communication=30, optimizer=5),
     _priced("QLoRA", 2, 1, compute=143.3, communication=10, optimizer=6.5),
     "why: 'fsdp' is 4.8 ms a step faster than 'QLoRA' because its compute takes 23.3 ms less and its "
     "optimizer 1.5 ms less, though 'QLoRA' fits micro-batch 2 where it fits 1 (its communication takes "
     "20.0 ms more)"),
    (_priced("zero3", 1, 1, communication=5), _priced("zero2", 1, 1, communication=18.7),
     "why: 'zero3' is 13.7 ms a step faster than 'zero2' because its communication takes 13.7 ms less"),
])
def test_why_names_the_faster_rung_and_its_reason(winner, other, sentence):
    from napkin.advisor_speed import why
    assert why(winner, other) == sentence


MEASURED = re.compile(r"memory per rank, measured: params [\d.]+ MiB, grads [\d.]+, optim [\d.]+ = ([\d.]+) on the device")


def test_measure_runs_every_rung_that_fits_and_prints_measured_beside_predicted(capsys):
    """The tiny GPT on 2 CPU ranks, 16 x 64: the eight rungs, ddp to QLoRA with the parameters
    offloaded, one torchrun; each row's measured state is its log's line, its tokens/s the log's
    last step's, and its predicted state napkin/memory.py's napkin."""
    from napkin.advisor_speed import every_rung
    from napkin.memory_math import MiB
    rows = main(["--advise", "--model", "tiny", "--world", "2", "--seq-len", "64", "--measure"])
    out = capsys.readouterr().out
    table = out[out.index("the experiment:"):].splitlines()
    fitting = [a for a in every_rung(PRESETS["tiny"], parse_bytes("24GB"), 2, 64, 16, "fp32") if a.fits]
    assert len(fitting) == len(rows) == 8 and fitting[0].rung == "ddp"
    kept = None
    for a, row in zip(fitting, rows):
        line = next(l for l in table if l.startswith(a.rung + " "))
        state = float(MEASURED.search(row["log"]).group(1))
        speed = 1e3 * float(re.findall(r"([\d.]+)k tok/s", row["log"])[-1])
        assert "6/6 in" in row["log"] and state == row["state_mib"] and speed == row["tokens_per_s"] > 0
        predicted = (a.held["params"] + a.held["grads"] + a.held["optimizer"]) / MiB
        numbers = line[len(a.rung):].replace(",", "").replace("/", " ").split()
        assert numbers[:3] == [str(a.micro_batch), "x", "1"], line
        assert [float(x) for x in numbers[3:7]] == [round(predicted, 1), state,
                                                    round(row["predicted_tokens_per_s"]), round(speed)], line
        keep = kept is None or speed > kept
        kept = speed if keep else kept
        assert line.endswith("kept" if keep else "not"), line


def test_the_measure_tables_columns_stay_apart_however_wide_the_numbers():
    """A row of napkin/memory.py --advise --measure's table with a GPU's numbers (10^8 tokens/s, a large
    state): every number its own word, as the header's columns."""
    from types import SimpleNamespace

    from napkin.experiment import table_row
    rung = SimpleNamespace(rung="zero2", micro_batch=16, grad_accum=16)
    assert table_row(rung, 12345678.9, 0.0, 116536046, 1165360460000, False).split() == [
        "zero2", "16", "x", "16", "12345678.9", "/", "0.0", "116,536,046", "/", "1,165,360,460,000", "not"]
    assert table_row(rung, 3.24, 3.5, 1234.4, 999.6, True).split()[4:] == ["3.2", "/", "3.5", "1,234", "/",
                                                                          "1,000", "kept"]
