"""QLoRA + FSDP from a Hugging Face directory loaded unit by unit (pretrained/streamed.py): the
same NF4 codes and scales, the same adapters (LoRA's A from the seeded generator, in the same
order) and the same losses as loading the whole model first; and the load's peak, measured from
outside the loader on 2 ranks, within the rank's share plus one unit as read and as stored."""
import os

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import train
from composition import parallelize
from composition.mesh_checks import ParallelDims
from multiprocess import run_ranks, train_logged
from pretrained.load import load_pretrained
from napkin.memory_math import load_peak_bytes
from pretrained.streamed import StreamedFSDP
from running import cli, snapshot
from test_pretrained import family_directory
from test_pretrained_formats import stdlib_sample

VARIANTS = {"lora": [], "nf4": ["--quantize-base", "nf4"],
            "nf4_dq": ["--quantize-base", "nf4", "--double-quant"]}
# FSDP's extensions stacked with the streamed load (composition/parallelize.fsdp_with)
EXTENDED = {"nf4_offload": ["--quantize-base", "nf4", "--offload", "params"],
            "nf4_hsdp": ["--quantize-base", "nf4", "--shard-group", "1"]}
STEPS, B, T = 3, 4, 16


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "llama3"
    family_directory(path, "llama3")
    return path


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """GPT-2 and SmolLM2: the head is the token embedding (and, adapted, a 4-bit copy of it)."""
    paths = [tmp_path_factory.mktemp("hf") / family for family in ("gpt2", "smollm2")]
    for path in paths:
        family_directory(path, path.name)
    return paths


def _args(directory, extra):
    os.environ["WORLD_SIZE"] = str(dist.get_world_size())       # what torchrun would set
    args = cli.parse_args(["--init-from", f"hf:{directory}", "--strategy", "fsdp", "--lora",
                           "--lora-targets", "query,value,head", "--seq-len", str(T), *extra])
    args.timeout = 120
    return args


def _built(args, streamed: bool):
    """(the run build() makes on this rank, the generator's state after it): from a hollow model
    read unit by unit, or from the whole fp32 model load_pretrained reads."""
    if streamed:
        gpt = snapshot.pretrained_model(args)                    # seeds as it did before
    else:
        torch.manual_seed(args.seed)
        gpt = load_pretrained(args.hf)[0]
    job = parallelize.build(args, torch.device("cpu"), ParallelDims.from_args(
        args, dist.get_world_size()), gpt)
    assert isinstance(job.model, StreamedFSDP) == streamed
    return job, torch.get_rng_state()


def _trained(job, args) -> tuple[dict, list]:
    """(every tensor of the model, frozen ones gathered, after STEPS steps; the losses)."""
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        batch = torch.randint(job.gpt.cfg.vocab_size, (B, T + 1), generator=generator)
        rows = batch.chunk(dist.get_world_size())[dist.get_rank()]
        loss, _ = train.train_step(job.model, job.optimizer, job.sync, rows[:, :-1], rows[:, 1:],
                                   args)
        losses.append(loss.item())
    with job.model.frozen_gathered():             # collective: the 4-bit codes and scales whole
        frozen = {**dict(job.gpt.named_buffers()), **{n: p for n, p in job.gpt.named_parameters()
                                                      if not p.requires_grad}}
        frozen = {n: t.clone() for n, t in frozen.items()}
    return frozen, losses, [u.master.detach().clone() for u in job.model.units]


def _both_ways(directory, variants: dict) -> dict:
    out = {}
    for variant, extra in variants.items():
        args = _args(directory, extra)
        runs = [_built(args, streamed) for streamed in (True, False)]
        out[variant] = [(rng, *_trained(job, args)) for job, rng in runs]
    return out


def _each_way(directories: list, variants: dict) -> list:
    return [_both_ways(directory, variants) for directory in directories]


@pytest.mark.parametrize("family", ["llama3", "tied"])
def test_loading_unit_by_unit_is_bit_for_bit_the_whole_model_path(llama, tied, family):
    directories, variants = (([llama], {**VARIANTS, **EXTENDED}) if family == "llama3" else
                             (tied, {"nf4": VARIANTS["nf4"]}))
    for rank in (r for each in run_ranks(_each_way, 2, directories, variants) for r in each):
        for variant, (streamed, whole) in rank.items():
            assert torch.equal(streamed[0], whole[0]), variant       # the generator, after build
            assert streamed[1].keys() == whole[1].keys(), variant
            for name in whole[1]:                             # NF4 codes, scales, frozen weights
                assert torch.equal(streamed[1][name], whole[1][name]), (variant, name)
            assert streamed[2] == whole[2], variant                  # the losses, exactly
            assert all(torch.equal(a, b) for a, b in zip(streamed[3], whole[3])), variant


def _load_measured(directory, extra, streamed: bool = True):
    """On this rank: (the most bytes torch's CPU allocator held while the run's model was read
    and wrapped, beyond those before; the napkin's load peak, memory_math.load_peak_bytes)."""
    args = _args(directory, extra)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        job, _ = _built(args, streamed)
    held, peak = 0, 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        held += event.self_cpu_memory_usage               # allocated (+) or freed (-) by it
        peak = max(peak, held)
    return peak, load_peak_bytes(job.gpt, args, dist.get_world_size())


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_loads_peak_is_the_napkins_and_below_the_whole_models(llama, variant):
    """Measured by torch's CPU allocator (the profiler's memory events), outside the loader: at
    most the napkin's bound, which is at most 10% above it (it rounds each unit's temporaries up:
    5 x the matrix being quantized, FSDP's whole unit beside its shard); the whole-model path,
    measured alike, holds more."""
    streamed = run_ranks(_load_measured, 2, llama, VARIANTS[variant])
    whole = run_ranks(_load_measured, 2, llama, VARIANTS[variant], False)
    for (peak, napkin), (whole_peak, _) in zip(streamed, whole):
        assert peak <= napkin <= 1.1 * peak, (variant, peak, napkin)
        assert peak < whole_peak, (variant, peak, whole_peak)


def test_train_says_the_loads_peak_beside_the_steps(llama, tmp_path):
    data = tmp_path / "data.txt"
    data.write_text(stdlib_sample()[8000:20000])
    extra = ["--quantize-base", "nf4"]
    napkin = run_ranks(_load_measured, 2, llama, extra)[0][1]
    argv = ["--init-from", f"hf:{llama}", "--strategy", "fsdp", "--lora", "--lora-targets",
            "query,value,head", *extra, "--data", str(data), "--steps", "1", "--batch-size", "4",
            "--seq-len", "16", "--eval-batches", "1"]
    (_, printed), _ = run_ranks(train_logged, 2, argv)
    assert (f"memory per rank while loading hf:DIR unit by unit, predicted: at most "
            f"{napkin / 2**20:.2f} MiB") in printed, printed
