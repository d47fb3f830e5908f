"""train.py on a Hugging Face directory written here (GPT-2 and Llama 3 shapes, random weights
under the real names, a trained tokenizer; nothing downloaded): --init-from hf:DIR trains it on
one and two ranks from the loaded model's own loss, --data is read in the directory's tokens,
--export-hf writes what load_pretrained reads back, --sample decodes, bad input gets one line."""
import contextlib
import dataclasses
import io
import json
import shutil

import pytest
import torch

import train
from multiprocess import run_ranks, torchrun_worker, train_logged
from pretrained.load import load_pretrained
from pretrained.tokenizer import Tokenizer
from lora import QUANTIZED
from quantization import normal_float_levels
from napkin.memory_math import mesh_params, model_params
from pipeline import GPTStage
from composition import mesh_checks
from running import cli
from running.data import TextData
from test_pretrained import family_directory, gpt2_files, llama_files, small_spec, write_directory
from test_pretrained_formats import stdlib_sample

FAMILIES = ["gpt2", "llama3"]
SHAPE = ["--batch-size", "4", "--seq-len", "16", "--eval-batches", "2", "--warmup", "1",
         "--log-every", "1", "--eval-every", "0", "--lr", "3e-3"]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """{family: its directory}, and "data": a text file to fine-tune on, written once."""
    root = tmp_path_factory.mktemp("hf")
    paths = {family: root / family for family in FAMILIES}
    for family, path in paths.items():
        family_directory(path, family)
    for family in FAMILIES:        # an even vocabulary: tensor parallelism splits it in two
        spec = small_spec(family if family == "llama3" else "gpt2")
        V = len(spec["model"]["vocab"]) + 1
        V += V % 2
        files = llama_files(V, family) if family == "llama3" else gpt2_files(V, "transformer.")
        write_directory(root / f"{family}-even", *files, spec)
        paths[f"{family}-even"] = root / f"{family}-even"
    paths["data"] = root / "data.txt"
    paths["data"].write_text(stdlib_sample()[8000:20000])      # text the tokenizer was not fit on
    return paths


def reference_eval_loss(directory, data_path) -> float:
    """The loaded model's mean loss over the eval batches train.py draws (seed 0, one rank)."""
    model, tokenizer, _ = load_pretrained(str(directory))
    data = TextData.from_file(str(data_path), tokenizer)
    with torch.no_grad():
        losses = [model(*data.batch(i, 4, 16, 0, "eval"))[1] for i in range(2)]
    return torch.stack(losses).mean().item()


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_run_from_hf_dir_starts_at_the_loaded_models_loss_and_falls(hf, family, world):
    argv = ["--init-from", f"hf:{hf[family]}", "--data", str(hf["data"]), "--steps", "8",
            *SHAPE]
    preset = ["--model", "medium"] if world == 1 else []        # given, and not the model
    (history, printed), *_ = run_ranks(train_logged, world, [*argv, *preset])
    # two ranks: each half the rows, the mean of equal halves' means (summation order: 1e-6)
    assert history["eval_loss_before"] == pytest.approx(
        reference_eval_loss(hf[family], hf["data"]), rel=0 if world == 1 else 1e-6)
    assert history["eval_loss"] < history["eval_loss_before"]
    losses = history["losses"]
    assert losses[max(losses)] < losses[0]
    assert f"model hf:{hf[family]}" in printed
    assert ("note: --model medium is not the model" in printed) == bool(preset)


def test_the_data_is_the_directorys_tokens(hf):
    tokenizer = Tokenizer.read(str(hf["llama3"] / "tokenizer.json"))
    data = TextData.from_file(str(hf["data"]), tokenizer)
    ids = torch.cat([data.splits["train"], data.splits["eval"]]).tolist()
    assert ids == tokenizer.encode(hf["data"].read_text())
    assert max(ids) >= 256                                     # merged tokens, not bytes


def test_export_hf_of_a_lora_run_loads_with_the_adapters_merged(hf, tmp_path):
    out, exported = tmp_path / "run", tmp_path / "exported"
    argv = ["--init-from", f"hf:{hf['llama3']}", "--data", str(hf["data"]), "--steps", "4",
            "--lora", "--lora-targets", "query,value,head", "--out", str(out),
            "--export-hf", str(exported), *SHAPE]
    run_ranks(train_logged, 2, argv)
    base, _, _ = load_pretrained(str(hf["llama3"]))
    merged, tokenizer, config = load_pretrained(str(exported))
    trained = train.load_weights(str(out)).eval()     # the run's checkpoint, adapters folded in
    ids = torch.tensor([tokenizer.encode("def main(argv):\n    return 0\n")])
    with torch.no_grad():           # the same fp32 tensors: identical logits, not just close
        assert torch.equal(merged(ids), trained(ids))
    weights, before = merged.state_dict(), base.state_dict()
    for name in weights:            # only the adapted layers moved: W0 + (alpha / r) B A
        adapted = name.split(".")[-2] in ("query", "value", "head")
        assert torch.equal(weights[name], before[name]) != adapted, name
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert tokenizer.encode("x = 1") == Tokenizer.read(str(hf["llama3"] / "tokenizer.json")).encode(
        "x = 1")


def nf4_round_trip(weight: torch.Tensor) -> torch.Tensor:
    """Each block of 64 values over its largest magnitude, rounded to the nearest NF4 level, scaled
    back: the weight a 4-bit base computes with."""
    levels = normal_float_levels()
    flat = weight.reshape(-1)
    blocks = torch.nn.functional.pad(flat, (0, -flat.numel() % 64)).view(-1, 64)
    scales = blocks.abs().amax(dim=1, keepdim=True)
    nearest = (blocks / scales)[..., None].sub(levels).abs().argmin(dim=-1)
    return (levels[nearest] * scales).view(-1)[:flat.numel()].view(weight.shape)


@pytest.mark.parametrize("layout", [[], ["--strategy", "tp", "--tp", "2"]])
def test_export_hf_of_a_qlora_run_holds_the_base_as_it_was_computed_with(hf, tmp_path, layout):
    exported = tmp_path / "exported"
    tp = 2 if "--tp" in layout else 1
    argv = ["--init-from", f"hf:{hf['llama3-even']}", "--data", str(hf["data"]), "--steps", "3",
            *layout, "--lora", "--quantize-base", "nf4", "--export-hf", str(exported), *SHAPE]
    run_ranks(train_logged, tp, argv)
    before = load_pretrained(str(hf["llama3-even"]))[0].state_dict()
    computed = four_bit_base(before, tp)        # under tp: each rank's slices, gathered
    weights = load_pretrained(str(exported))[0].state_dict()
    for name, weight in weights.items():
        kind = name.split(".")[-2]
        if kind in ("query", "value"):        # adapted: the 4-bit W0 plus the trained update
            assert not torch.allclose(weight, computed[name]), name
        elif kind in QUANTIZED:                                # 4-bit, not adapted
            assert torch.equal(weight, computed[name]), name
        else:                  # kept in fp32: embeddings, norms, the head (and SwiGLU's gate)
            assert torch.equal(weight, before[name]), name


@pytest.mark.parametrize("layout", [["--lora"], ["--lora", "--strategy", "tp", "--tp", "2",
                                                "--quantize-base", "nf4"]])
def test_an_adapted_tied_head_exports_untied_as_the_run_computed(hf, tmp_path, layout):
    """GPT-2's head is its token embedding. Adapted, the head computes with W0 + (alpha/r) B A
    (W0 in 4 bits under QLoRA, each tensor rank's slice) while the embedding keeps the table:
    the export writes the two apart (tie_word_embeddings false), and the exported model's eval
    loss, one process, is the run's last (fp32: the update merged into W0 rounds once)."""
    exported = tmp_path / "exported"
    ranks = 2 if "--tp" in layout else 1
    argv = ["--init-from", f"hf:{hf['gpt2-even']}", "--data", str(hf["data"]), "--steps", "3",
            *layout, "--lora-targets", "query,value,head", "--export-hf", str(exported), *SHAPE]
    history = run_ranks(train_logged, ranks, argv)[0][0]
    config = json.loads((exported / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    model = load_pretrained(str(exported))[0]
    before = load_pretrained(str(hf["gpt2-even"]))[0]
    assert torch.equal(model.token_emb.weight, before.token_emb.weight)
    assert not torch.allclose(model.head.weight, before.token_emb.weight)
    assert reference_eval_loss(exported, hf["data"]) == pytest.approx(history["eval_loss"],
                                                                      rel=1e-5)


def greedy_text(directory, prompt: str, n: int) -> str:
    """n tokens, each the likeliest, after prompt, decoded: written here, not by generate."""
    model, tokenizer, _ = load_pretrained(str(directory))
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(model(torch.tensor([ids]))[0, -1].argmax().item())
    return tokenizer.decode(ids)


def sampled(argv) -> str:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        train.main(argv)
    return printed.getvalue()


@pytest.mark.parametrize("family", FAMILIES)
def test_sample_decodes_the_directorys_tokens(hf, family):
    argv = ["--sample", "--init-from", f"hf:{hf[family]}", "--prompt", "def ",
            "--sample-tokens", "6", "--temperature", "0"]
    assert sampled(argv) == greedy_text(hf[family], "def ", 6) + "\n"


def test_a_checkpoint_of_an_hf_run_resumes_and_samples_as_that_model(hf, tmp_path, capsys):
    out, model = tmp_path / "run", tmp_path / "model"
    shutil.copytree(hf["gpt2"], model)
    argv = ["--init-from", f"hf:{model}", "--data", str(hf["data"]), "--out", str(out), *SHAPE]
    whole, _ = run_ranks(train_logged, 1, [*argv, "--steps", "3"])[0]
    run_ranks(train_logged, 1, [*argv, "--steps", "2", "--overwrite"])
    resumed_argv = ["--data", str(hf["data"]), "--out", str(out), "--resume", *SHAPE]
    resumed, printed = run_ranks(train_logged, 1, [*resumed_argv, "--steps", "3"])[0]
    assert "resumed from" in printed
    assert resumed["eval_loss"] == whole["eval_loss"]           # bit for bit
    exported = tmp_path / "exported"
    run_ranks(train_logged, 1, [*resumed_argv, "--steps", "3", "--export-hf", str(exported)])
    argv = ["--sample", "--prompt", "def ", "--sample-tokens", "5", "--temperature", "0"]
    assert (sampled([*argv, "--init-from", str(out)])
            == sampled([*argv, "--init-from", f"hf:{exported}"]))
    model.rename(tmp_path / "moved")             # the directory the checkpoints record is gone
    line = refusal([*resumed_argv, "--steps", "4"], capsys)
    assert f"--resume {out}: the run started from hf:{model}, which no longer loads" in line


def refusal(argv, capsys) -> str:
    with pytest.raises(SystemExit):
        cli.parse_args(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


BAD = [  # (argv given the directories, words of the line)
    (lambda d, t: ["--init-from", f"hf:{t / 'none'}"], "no such directory"),
    (lambda d, t: ["--init-from", f"hf:{d['data']}"], "a file, not a directory"),
    (lambda d, t: ["--init-from", f"hf:{t}"], "config.json: missing"),
    (lambda d, t: ["--init-from", f"hf:{t / 'bert'}"], "is not one read here"),
    (lambda d, t: ["--export-hf", str(t / "x")], "add --init-from hf:DIR"),
    (lambda d, t: ["--init-from", f"hf:{d['gpt2']}", "--seq-len", "25"],
     "--seq-len 25 is longer than the 24 positions"),
    (lambda d, t: ["--init-from", f"hf:{d['llama3']}", "--strategy", "auto"],
     "--strategy auto plans for --model's presets, not yet for hf:"),
    (lambda d, t: ["--init-from", f"hf:{d['llama3']}", "--ep", "2"],
     "--ep 2: hf:"),
    (lambda d, t: ["--init-from", f"hf:{d['llama3']}", "--model", "tiny-moe"],   # not the model
     None),
    (lambda d, t: ["--init-from", f"hf:{d['llama3']}", "--export", str(t / "m.pt")],
     "use --export-hf DIR"),
    (lambda d, t: ["--init-from", f"hf:{d['llama3']}", "--export-hf", str(d["llama3"])],
     "is --init-from hf:"),
]


@pytest.mark.parametrize("case", range(len(BAD)))
def test_each_bad_input_gets_its_line(hf, tmp_path, capsys, case):
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text('{"architectures": ["BertModel"]}')
    argv, words = BAD[case]
    if words is None:                      # accepted: the directory's shape is checked, dense
        assert cli.parse_args(argv(hf, tmp_path)).model == "tiny-moe"
        return
    line = refusal(argv(hf, tmp_path), capsys)
    assert words in line, line


def stopped_with(argv):
    """train.main(argv) on this rank: its RunError's line, or None if it ran."""
    try:
        train_logged(argv)
    except train.RunError as e:
        return str(e)


def test_a_text_too_short_in_the_models_tokens_is_said_on_every_rank(hf, tmp_path):
    short = tmp_path / "short.txt"                 # enough bytes for cli's check, too few tokens
    short.write_text(hf["data"].read_text()[:400])
    argv = ["--init-from", f"hf:{hf['llama3']}", "--data", str(short), "--steps", "1", *SHAPE]
    lines = run_ranks(stopped_with, 2, argv)
    assert lines[0] is not None and lines[0].startswith("the eval text has ") and "tokens" in \
        lines[0] and lines == [lines[0]] * 2, lines


# ---- every strategy and mesh on a loaded model ------------------------------------------------

STRATEGIES = [["--strategy", "zero2"], ["--strategy", "fsdp"], ["--strategy", "tp", "--tp", "2"],
              ["--strategy", "cp", "--cp", "2"], ["--strategy", "pipeline", "--pp", "2"],
              ["--strategy", "tp", "--tp", "2", "--sequence-parallel"],
              ["--strategy", "fsdp", "--offload", "params"]]
SPLITS = ("--tp", "--cp", "--pp")


def train_each(argvs: list) -> list:
    """train_logged(argv) for each argv in turn, on this rank: one launch for several runs."""
    return [train_logged(argv) for argv in argvs]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_strategy_starts_at_the_loaded_models_loss_and_falls(hf, family):
    directory = hf[f"{family}-even"]
    argv = ["--init-from", f"hf:{directory}", "--data", str(hf["data"]), "--steps", "4", *SHAPE]
    # GPT-2: tp, cp, and a pipeline fine-tuning LoRA's adapters, its tied head frozen on both ends
    strategies = (STRATEGIES if family == "llama3" else
                  [*STRATEGIES[2:4], ["--strategy", "pipeline", "--pp", "2", "--lora", "--lr", "3e-2"]])
    assert_each_run_is_the_loaded_models(directory, hf["data"], argv, strategies, 2)


def test_a_mesh_of_four_ranks_trains_a_llama_from_its_directory(hf):
    directory = hf["llama3-even"]
    argv = ["--init-from", f"hf:{directory}", "--data", str(hf["data"]), "--steps", "4", *SHAPE]
    meshes = [["--strategy", "fsdp", "--tp", "2", "--cp", "2"],
              ["--strategy", "zero1", "--tp", "2", "--pp", "2"]]
    assert_each_run_is_the_loaded_models(directory, hf["data"], argv, meshes, 4)


def assert_each_run_is_the_loaded_models(directory, data, argv, strategies, world: int):
    """Each strategy run in one launch of `world` ranks: its step-0 eval loss the loaded model's
    (one process, written here), its loss falling, what every rank holds and sends (a split's,
    by dimension) the napkin's formulas, to the byte."""
    ranks = run_ranks(train_each, world, [[*argv, *strategy] for strategy in strategies])
    reference = reference_eval_loss(directory, data)
    for i, strategy in enumerate(strategies):
        history, _ = ranks[0][i]
        # fp32: each strategy sums in its own order (sharded matrices, blockwise softmax, the
        # ranks' means), a few ulps of the loss apart
        assert history["eval_loss_before"] == pytest.approx(reference, rel=1e-6), strategy
        losses = history["losses"]
        assert losses[max(losses)] < losses[0], strategy
        assert history["eval_loss"] < history["eval_loss_before"], strategy
        for rank, (each, _) in enumerate(r[i] for r in ranks):
            for step, held in each["held"].items():
                assert held == {k: each["napkin"][k] for k in held}, (strategy, rank, step)
            if set(SPLITS) & set(strategy):     # a split's bytes by dimension, each its formula's
                assert each["sent"] and all(
                    measured == formula for sent in each["sent"].values()
                    for measured, formula in sent.values()), (strategy, rank, each["sent"])


@pytest.mark.parametrize("family", ["llama3", "smollm2", "qwen2"])
def test_the_napkins_parameter_count_is_the_loaded_models(tmp_path, family):
    family_directory(tmp_path, family)
    model, _, _ = load_pretrained(str(tmp_path))
    cfg = model.cfg
    assert model_params(cfg) == sum(p.numel() for p in model.parameters())
    for stage, layers in enumerate([range(0, 1), range(1, cfg.n_layer)]):   # a pipeline's stages
        part = GPTStage(load_pretrained(str(tmp_path))[0], layers, stage == 0, stage == 1)
        assert mesh_params(cfg, 1, len(layers), stage == 0, stage == 1) == sum(
            p.numel() for p in part.parameters()), (family, stage)


def test_the_mesh_checks_read_the_directorys_shape(hf, capsys, monkeypatch):
    torchrun_worker(monkeypatch, 2)
    directory = hf["llama3"]                                  # vocabulary 317: odd
    line = refusal(["--init-from", f"hf:{directory}", "--strategy", "tp", "--tp", "2"], capsys)
    assert f"hf:{directory}: tensor parallelism over 2 ranks splits the vocabulary " \
           f"(vocab_size) = 317" in line, line
    line = refusal(["--init-from", f"hf:{directory}", "--pp", "2", "--stage-layers", "1,3"],
                   capsys)                                    # 2 blocks, not --model's 4
    assert f"hf:{directory}: --stage-layers 1,3: give 2 numbers" in line and \
        "adding up to the model's 2 blocks" in line, line
    args = cli.parse_args(["--init-from", f"hf:{hf['llama3-even']}", "--strategy", "tp",
                           "--tp", "2"])
    cfg = load_pretrained(str(hf["llama3-even"]))[0].cfg
    args.hf_config = dataclasses.replace(cfg, n_kv_head=1, n_head=2)          # G = 1
    with pytest.raises(SystemExit):
        mesh_checks.check_tensor_parallel(cli.Parser(prog="train.py"), args, 2)
    assert "splits the key/value heads (n_kv_head) = 1 into 2 equal parts" in \
        capsys.readouterr().err


ROW_LAYERS = ("output", "down")     # tensor parallelism cuts their columns, the others' rows


def four_bit_base(weights: dict, tp: int) -> dict:
    """The weights a QLoRA run computes with, its adapters' B still 0: each matrix QUANTIZED
    names NF4 round-tripped, under tensor parallelism each rank's slice on its own (its own
    blocks of 64), the slices put back together."""
    def rounded(name, w):
        kind = name.split(".")[-2]
        if kind not in QUANTIZED or not name.endswith(".weight"):       # biases stay as they are
            return w
        dim = 1 if kind in ROW_LAYERS else 0
        return torch.cat([nf4_round_trip(part) for part in w.chunk(tp, dim)], dim)
    return {name: rounded(name, w) for name, w in weights.items()}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", [["--strategy", "fsdp"], ["--strategy", "tp", "--tp", "2"]])
def test_qlora_starts_at_the_4_bit_models_loss_and_falls(hf, layout, family):
    """Under FSDP the base is quantized whole; under tensor parallelism each rank quantizes its
    own slices (the small Llama's row layers' slices, 32 and 40 values a row, are not whole
    blocks of 64: not one process's codes). Either way the run starts at the loss of one process
    computing with the same 4-bit weights, and holds what the napkin says."""
    directory = hf[f"{family}-even"]
    argv = ["--init-from", f"hf:{directory}", "--data", str(hf["data"]), "--steps", "4",
            *layout, "--lora", "--quantize-base", "nf4", *SHAPE]
    ranks = run_ranks(train_logged, 2, argv)
    model, tokenizer, _ = load_pretrained(str(directory))
    model.load_state_dict(four_bit_base(model.state_dict(), 2 if "--tp" in layout else 1))
    data = TextData.from_file(str(hf["data"]), tokenizer)
    with torch.no_grad():
        reference = torch.stack([model(*data.batch(i, 4, 16, 0, "eval"))[1]
                                 for i in range(2)]).mean().item()
    history = ranks[0][0]
    # fp32: the two ranks' means of halves, FSDP's gathered shards or tp's partial sums, a few
    # ulps apart
    assert history["eval_loss_before"] == pytest.approx(reference, rel=1e-6)
    assert history["eval_loss"] < history["eval_loss_before"]
    for rank, (each, _) in enumerate(ranks):
        for step, held in each["held"].items():
            assert held == {k: each["napkin"][k] for k in held}, (rank, step)
