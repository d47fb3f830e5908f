"""Batches are a function of (seed, step), sliced by rank, and the default text is embedded."""
import pytest
import torch

from running.data import TextData, stdlib_text


@pytest.fixture(scope="module")
def data():
    return TextData.from_file()


def test_default_corpus_is_the_standard_library(data):
    text = stdlib_text()
    assert len(text) > 1_000_000 and b"def " in text
    assert text == stdlib_text()                                  # sorted: the same every time
    assert len(data.splits["train"]) + len(data.splits["eval"]) == len(text)


def test_batch_is_a_function_of_seed_and_step(data):
    x1, y1 = data.batch(7, 8, 32, seed=1)
    x2, y2 = data.batch(7, 8, 32, seed=1)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(x1, data.batch(8, 8, 32, seed=1)[0])
    assert not torch.equal(x1, data.batch(7, 8, 32, seed=2)[0])
    assert x1.shape == (8, 32) and x1.dtype == torch.long
    assert torch.equal(x1[:, 1:], y1[:, :-1])                     # targets: the next byte


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_rank_slices_make_up_the_global_batch(data, world_size):
    whole_x, whole_y = data.batch(3, 8, 16)
    slices = [data.batch(3, 8, 16, rank=r, world_size=world_size) for r in range(world_size)]
    assert torch.equal(torch.cat([x for x, _ in slices]), whole_x)
    assert torch.equal(torch.cat([y for _, y in slices]), whole_y)


def test_eval_split_is_held_out(data):
    x, _ = data.batch(0, 4, 64, split="eval")
    tail = bytes(data.splits["eval"].tolist())
    for row in x:
        assert bytes(row.tolist()) in tail


def test_any_text_file(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text("hello world, " * 200)
    x, y = TextData.from_file(str(path)).batch(0, 2, 8)
    assert bytes(x[0].tolist()) in b"hello world, " * 200
    with pytest.raises(ValueError, match="use a larger --data file or a shorter --seq-len"):
        TextData.from_file(str(path)).batch(0, 2, 3000)
