"""The napkin math on a Hugging Face directory (issue 58): python -m napkin.memory --model DIR
reads the config.json train.py --init-from hf:DIR loads, its parameter count is the loaded
model's, a Llama's FLOPs per token follow its config (SwiGLU's three matrices, grouped K/V, no
position embedding, its own head width), train.py's log prices an hf run, and check_fits refuses
an hf model too big for this machine in one line before loading it."""
import re

import pytest
import torch

from multiprocess import run_ranks, train_logged
from napkin import machines
from napkin.flops import Shape, model_flops_per_token, step_flops
from napkin.memory import main
from napkin.memory_math import model_params
from pretrained.llama import Llama, LlamaConfig
from pretrained.load import load_pretrained, model_config, read_config
from running import cli
from test_hf_run import refusal
from test_pretrained import family_directory

FAMILIES = ["gpt2", "llama3", "smollm2", "qwen2"]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-napkin")
    for family in FAMILIES:
        family_directory(root / family, family)
    return {family: root / family for family in FAMILIES}


def config_of(directory) -> object:
    return model_config(read_config(str(directory)), str(directory / "config.json"))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_napkins_count_is_the_loaded_models(hf, family, capsys):
    model = load_pretrained(str(hf[family]))[0]
    numel = sum(p.numel() for p in model.parameters())             # a tied head counted once
    assert model_params(config_of(hf[family])) == numel
    assert Shape.of(config_of(hf[family])).params() == numel
    main(["--model", str(hf[family]), "--world", "2"])
    assert f"{numel:,} parameters on 2 ranks" in capsys.readouterr().out


def test_a_llamas_flops_per_token_follow_its_config():
    # H D = 64, not C = 48: query and output are C x H D, key and value C x G D
    cfg = LlamaConfig(n_layer=3, n_head=4, n_kv_head=2, n_embd=48, head_dim=16, hidden=100,
                      vocab_size=300, tie_embeddings=False)
    C, H, G, D, F, V, L, T = 48, 4, 2, 16, 100, 300, 3, 32
    matrices = 2 * C * H * D + 2 * C * G * D + 3 * C * F          # q, o; k, v; gate, up, down
    forward = L * (2 * matrices + 4 * T * H * D) + 2 * V * C      # + scores and weighted sum
    shape = Shape.of(cfg)
    assert step_flops(shape, T) == {"forward": forward, "backward": 2 * forward}
    assert model_flops_per_token(shape, T) == 3 * forward
    llama = Llama(cfg)                   # the same matrices, counted in the model built from it
    block = llama.blocks[0]
    assert sum(m.weight.numel() for m in block.modules()
               if isinstance(m, torch.nn.Linear)) == matrices == shape.block_params()
    # a tensor-parallel rank's block (machines.rank_block): half of each matrix
    half = machines.rank_block(cfg, split=2)
    assert sum(m.weight.numel() for m in half.modules()
               if isinstance(m, torch.nn.Linear)) == matrices // 2


def test_memory_py_takes_a_directory(hf, capsys):
    directory = hf["llama3"]
    main(["--model", str(directory), "--strategy", "fsdp", "--world", "2", "--seq-len", "16"])
    out = capsys.readouterr().out
    assert f"{directory}: {model_params(config_of(directory)):,} parameters | fsdp" in out
    main(["--advise", "--model", str(directory), "--world", "2", "--seq-len", "16"])
    out = capsys.readouterr().out
    assert re.search(rf"^torchrun --nproc_per_node 2 train\.py --strategy \S+ --init-from "
                     rf"hf:{re.escape(str(directory))} ", out, re.M), out
    for argv, words in [(["--model", str(directory / "nope")], "nor a directory"),
                        (["--model", str(directory.parent)], "config.json: missing")]:
        with pytest.raises(SystemExit):
            main(argv)
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(
            f"python -m napkin.memory: error: --model {argv[1]}") and words in lines[0], lines


def test_train_py_prices_an_hf_run(hf):
    argv = ["--init-from", f"hf:{hf['llama3']}", "--steps", "1", "--batch-size", "2",
            "--seq-len", "16", "--eval-batches", "1", "--log-every", "1", "--eval-every", "0"]
    printed = run_ranks(train_logged, 1, argv)[0][1]
    step = next(line for line in printed.splitlines() if re.match(r"step +0 \| loss", line))
    assert re.search(r"k tok/s \(\d+ ms/step, napkin \d+\) \|", step), step


def test_check_fits_refuses_an_hf_model_too_big_for_this_machine(hf, capsys, monkeypatch):
    directory = hf["llama3"]
    weights = 4 * model_params(config_of(directory))
    argv = ["--init-from", f"hf:{directory}", "--batch-size", "4", "--seq-len", "16"]
    monkeypatch.setattr(cli, "memory_per_rank", lambda: weights - 1)
    line = refusal(argv, capsys)
    assert line.startswith(f"train.py: error: --init-from hf:{directory}: the model has "
                           f"{weights // 4:,} parameters") and "fp32 alone" in line, line
    monkeypatch.setattr(cli, "memory_per_rank", lambda: weights + 1)   # weights fit, not a batch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)    # CPU ranks': activations
    line = refusal(argv, capsys)
    assert "--batch-size 4: a micro-batch of 4 x 16 tokens keeps about" in line, line
