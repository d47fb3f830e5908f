"""napkin/machines.py: the machines napkin/step_time.py prices a training step on, as data.

A step's time needs four numbers of a machine: the FLOP/s its matmuls reach, the bytes/s its
memory streams (the optimizer step reads and writes every parameter's state), the host link
(ZeRO-Offload's transfers) and, between ranks, each link's bandwidth and per-message latency.
A collective on a link: its ring steps' latency, its ring bytes at the bandwidth
(collective_seconds; bucketed under backward, all but its last bucket hidden: overlapped).
The presets hold datasheet figures (dense peaks, no sparsity; links one direction per GPU).
`this` is measured on the spot by small benchmarks, never fitted to the runs it predicts, and
cached in .cache/this-machine.json (repo-local, git-ignored; delete it to measure again; where it
cannot be read or written, as in a read-only install, every run measures again).
Run: python -m napkin.machines (the presets); torchrun --nproc_per_node 2 -m napkin.machines --this
Test: python -m pytest tests/test_step_time.py tests/test_writes.py
"""
import contextlib
import json
import math
import os
import platform
import resource
import time
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.distributed as dist
from torch import nn

from foundations.comm import Comm, ring_bytes
from context_parallel import ATTENTIONS, SequenceSplit
from napkin.flops import Shape, block_flops
from napkin.memory_math import activation_bytes
from mixed_precision import DTYPES
from model import PRESETS as MODELS, Block, GPTConfig
from moe import feed_forward
from mechanics.offload import host_buffer
from pretrained.llama import LlamaBlock
from foundations.launch import Handle
from foundations.world import exit_distributed, init_distributed
from foundations.values import Parser, whole

GB = 1e9
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(ROOT, ".cache", "this-machine.json")
# Bytes per parameter torch's AdamW step reads and writes (optimizer_bandwidth measures by it;
# napkin/step_time.py prices the optimizer step with it). Unfused (its default on a CPU; foreach on a GPU
# makes the same passes): weight decay p r+w 8, m.lerp_(g) 12, v.mul_().addcmul_(g, g) 8 + 12,
# denominator sqrt, divide, add 3 x 8, p.addcdiv_(m, d) 16 = 80. Fused: p, g, m, v read once, p,
# m, v written once, 28.
ADAMW_BYTES = {"unfused": 80, "fused": 28}


@dataclass(frozen=True)
class Link:
    """A link between ranks: what one rank sends per second in one direction, and the fixed cost
    of one message (a ring step: an all-reduce of N ranks is 2 (N-1) of them)."""
    bandwidth: float              # bytes/s
    latency: float                # seconds per message

    def seconds(self, nbytes: float, messages: int = 1) -> float:
        return messages * self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class Machine:
    """One rank's device and its links. flops: what a training step's matmuls reach, per
    precision (presets: ACHIEVABLE x the datasheet's peak); peak_flops: the datasheet's dense
    peak, MFU's denominator. links: "node" between the ranks of one node, "network" between
    nodes (a ring is as slow as its slowest hop); per_node: ranks on one node. The host's memory:
    a server's DDR5 (8 channels, about 300 GB/s) shared by 8 GPUs' offloaded steps, 50 GB/s each
    as a round figure; on a CPU `this` measures it (it is the memory). overlaps: False on a CPU,
    where gloo's thread sums and copies the messages on the cores the compute runs on."""
    name: str
    flops: dict
    peak_flops: dict
    memory_bandwidth: float       # bytes/s a large elementwise kernel streams
    host_link: Link               # device <-> host memory (PCIe)
    links: dict = field(default_factory=dict)
    per_node: int = 8
    host_memory_bandwidth: float = 50e9     # bytes/s of host memory a rank's offloaded Adam streams
    overlaps: bool = True         # communication runs beside compute (a GPU's copy engines, NICs)
    memory: float = 0.0           # bytes of device memory (the datasheet's; 0: not known, `this`)

    def link(self, world: int) -> Link:
        """The link a ring over `world` ranks waits on: the node's, or the network's beyond it."""
        return self.links["node"] if world <= self.per_node else self.links["network"]


# A large bf16 matmul reaches about this share of the datasheet's peak on Hopper and Ampere
# (cuBLAS, 8192^3: about 750 of H100 SXM's 989 TFLOP/s); a training step's matmuls, shaped by
# the model, rarely more.
ACHIEVABLE = 0.75
# Per-message latency of a collective's ring step, an order of magnitude (no datasheet gives it):
# NVLink and PCIe a few microseconds, a network hop through the NICs a few more.
NVLINK_LATENCY, PCIE_LATENCY, NETWORK_LATENCY = 5e-6, 5e-6, 10e-6
PCIE4, PCIE5 = Link(32 * GB, PCIE_LATENCY), Link(64 * GB, PCIE_LATENCY)        # x16, one direction
NETWORKS = {f"{gbit}gbit": Link(gbit / 8 * GB, NETWORK_LATENCY) for gbit in (100, 200, 400)}


def gpu(name, peaks_tflops, memory_gbs, host, node, memory_gb, per_node=8,
        network="400gbit") -> Machine:
    peaks = {precision: tflops * 1e12 for precision, tflops in peaks_tflops.items()}
    return Machine(name, {p: ACHIEVABLE * f for p, f in peaks.items()}, peaks, memory_gbs * GB,
                   host, {"node": node, "network": NETWORKS[network]}, per_node,
                   memory=memory_gb * GB)


# Datasheets: NVIDIA A100 (SXM4 80GB), H100 (SXM5 and PCIe), GeForce RTX 3090 (GA102 whitepaper)
# and RTX 4090 (Ada whitepaper; tensor cores with fp32 accumulation, what PyTorch's matmuls use).
# NVLink 3 is 600 GB/s and NVLink 4 900 GB/s both directions together: 300 and 450 one way.
PRESETS = {
    "a100": gpu("A100 SXM4 80GB", {"bf16": 312, "fp16": 312, "fp32": 19.5}, 2039, PCIE4,
                Link(300 * GB, NVLINK_LATENCY), 80),
    "h100-sxm": gpu("H100 SXM5", {"bf16": 989, "fp16": 989, "fp32": 67}, 3350, PCIE5,
                    Link(450 * GB, NVLINK_LATENCY), 80),
    "h100-pcie": gpu("H100 PCIe", {"bf16": 756, "fp16": 756, "fp32": 51}, 2000, PCIE5, PCIE5, 80),
    "rtx3090": gpu("GeForce RTX 3090", {"bf16": 71, "fp16": 71, "fp32": 35.6}, 936, PCIE4, PCIE4,
                   24, per_node=4, network="100gbit"),
    "rtx4090": gpu("GeForce RTX 4090", {"bf16": 165.2, "fp16": 165.2, "fp32": 82.6}, 1008, PCIE4,
                   PCIE4, 24, per_node=4, network="100gbit"),
}

LINKS = ("nvlink", "pcie", "network")


def joined_by(machine: Machine, link: str) -> Machine:
    """The machine with every ring between its ranks on one kind of link: nvlink (the node's,
    on a preset whose node link is not its host's PCIe), pcie (the host link's generation, GPU
    to GPU through the host) or network (each rank on a node of its own)."""
    if link not in LINKS:
        raise ValueError(f"--link {link!r}: choose one of {', '.join(LINKS)}")
    if link == "nvlink" and machine.links["node"] == machine.host_link:
        raise ValueError(f"--link nvlink: {machine.name} has no NVLink here (its ranks talk over "
                         f"PCIe): use --link pcie or network")
    ring = {"nvlink": machine.links["node"], "pcie": machine.host_link,
            "network": machine.links["network"]}[link]
    return replace(machine, name=f"{machine.name} over {link}",
                   links={"node": ring, "network": ring})


# ---- a collective on a link: its seconds, and what compute hides of it ------------------------

RING_STEPS = {"all_reduce": lambda n: 2 * (n - 1), "reduce_scatter": lambda n: n - 1,
              "all_gather": lambda n: n - 1}


def collective_seconds(kind: str, numel: int, element_size: int, world: int, link: Link,
                       calls: int = 1) -> float:
    """`calls` collectives of `kind` moving numel elements between them: each call's ring steps
    are messages (latency), and the ring's bytes sent per rank go at the link's bandwidth."""
    if world == 1 or numel == 0:
        return 0.0
    return link.seconds(ring_bytes(kind, numel, element_size, world),
                        calls * RING_STEPS[kind](world))


def overlapped(kind: str, numel: int, element_size: int, world: int, link: Link, bucket: int,
               hidden_under: float) -> tuple[float, float]:
    """(seconds, exposed) of a bucketed reduction launched during backward: each bucket goes as
    soon as its gradients exist, so all but the last hides under backward, as long as backward
    lasts (hidden_under); the last bucket, the rest of the model's first layers, waits alone."""
    buckets = max(1, math.ceil(numel / bucket))
    total = collective_seconds(kind, numel, element_size, world, link, buckets)
    last = collective_seconds(kind, numel - (buckets - 1) * bucket, element_size, world, link)
    return total, max(last, total - hidden_under)


# ---- `this`: measured on the spot -----------------------------------------------------------

def _seconds(fn, device=None, calls: int = 3, window: float = 0.0) -> float:
    """Mean seconds of a call, after one warm-up: `calls` calls, and more until `window` seconds
    have passed. A mean over a window, as a run's time is its steps' sum: on a shared machine both
    then see the neighbours' share of the cores. (A collective needs the same count on every
    rank: window 0.) On a GPU the clock waits for the queued kernels (synchronize)."""
    def run():
        fn()
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
    run()
    start, done = time.perf_counter(), 0
    while done < calls or time.perf_counter() - start < window:
        run()
        done += 1
    return (time.perf_counter() - start) / done


def split_block(cfg: GPTConfig, ways: int) -> Block:
    """A block as one of `ways` tensor-parallel ranks computes it: H/ways heads, query, key and
    value C -> C/ways, output C/ways -> C, the MLP C -> 4C/ways -> C; the norms and the residual
    whole (every rank of the group repeats them). Its shapes only: no collective."""
    block, C, F = Block(cfg), cfg.n_embd, 4 * cfg.n_embd
    attn, mlp = block.attn, block.mlp
    for name in ("query", "key", "value"):
        setattr(attn, name, nn.Linear(C, C // ways, bias=getattr(attn, name).bias is not None))
    attn.output, attn.n_head = nn.Linear(C // ways, C), attn.n_head // ways
    mlp.up, mlp.down = nn.Linear(C, F // ways), nn.Linear(F // ways, C)
    return block


class LoneRank:
    """Rank 0 of a context-parallel group of cp, alone: the attention's compute, none of its
    messages. A receive copies the send, the all-gather repeats this rank's piece, the
    reduce-scatter sums the pieces: every block has the shapes the group's ranks compute."""

    def __init__(self, cp: int):
        self.rank, self.world_size = 0, cp

    def exchange(self, ops: list) -> Handle:
        sends = [tensor for kind, tensor, _ in ops if kind == "send"]
        receives = [tensor for kind, tensor, _ in ops if kind == "recv"]
        for received, sent in zip(receives, sends):
            received.copy_(sent)
        return Handle(lambda: None)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor):     # (c,) -> (cp c,)
        output.view(self.world_size, -1).copy_(input.view(1, -1).expand(self.world_size, -1))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor):  # (cp c,) -> (c,)
        torch.sum(input.view(self.world_size, -1), dim=0, out=output)


def rank_block(cfg: GPTConfig, split: int = 1, cp: int = 1, attention: str = "ring") -> Block:
    """The block one rank computes: split N, a tensor-parallel rank's 1/N of it (split_block);
    cp, a context-parallel rank's, its attention context_parallel's ring or all-gather (on a
    LoneRank); else model.py's block, an MoE one as moe.py builds it (router, dispatch, the
    experts' matmuls: a dense block's rate would price top_k experts' FLOPs at the MLP's).
    A Llama's (pretrained/llama.py): its block, split N with H/N and G/N heads of D, F/N wide."""
    if hasattr(cfg, "n_kv_head"):
        block = LlamaBlock(replace(cfg, n_head=cfg.n_head // split, head_dim=cfg.D,
                                   n_kv_head=cfg.n_kv_head // split, hidden=cfg.hidden // split))
    elif split > 1:
        return split_block(cfg, split)
    else:
        block = Block(cfg, feed_forward)
    if cp > 1:                # model.py's hook for it, as composition/context_parallel_gpt.py swaps it in
        group, sequence = LoneRank(cp), SequenceSplit(cp)
        attend = ATTENTIONS[attention]
        block.attn.attend = lambda q, k, v, dropout_p: attend(q, k, v, group, sequence)
    return block


def block_flops_per_second(cfg: GPTConfig, rows: int, seq_len: int, precision: str, device,
                           split: int = 1, window: float = 1.0, cp: int = 1,
                           attention: str = "ring") -> float:
    """FLOP/s of one forward + backward of one of the model's blocks on (rows, seq_len, C): the
    block a rank computes (rank_block). With split N, its 1/N; with cp, its rows x seq_len/cp
    tokens, each query against the whole sequence's keys (seq_len).

    Not a bare matmul's: on a CPU at these sizes the layer norms, softmax, GELU and Python's
    dispatch take a large share of a block's time, and a bare matmul would miss it; a split
    block's narrower matmuls run slower still, and its norms are not split. Context
    parallelism's attention is blockwise Python (online softmax over 2cp + 1 blocks, its own
    backward), slower per FLOP than model.py's fused call. This is a measurement of the machine
    on the model's shape (one block, random inputs), not of a run: no strategy, no collective,
    no optimizer. FLOPs as flops.block_flops counts them (/ N): an MoE block's with its top_k
    experts (its capacity mode runs capacity_factor times as many expert rows, empty slots
    included: the rate measured so prices that too)."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)                           # the run's random stream stays untouched
        block = rank_block(cfg, split, cp, attention).to(device=device, dtype=DTYPES[precision])
        x = torch.randn(rows, seq_len // cp, cfg.n_embd, dtype=DTYPES[precision], device=device,
                        requires_grad=True)

        def step():
            block(x).float().square().mean().backward()
        seconds = _seconds(step, device, window=window)
    return 3 * block_flops(Shape.of(cfg), seq_len) * rows * seq_len / cp / split / seconds


def memory_per_rank() -> int:
    """Bytes each rank on this machine can hold in host memory: the physical memory (or, under
    a ulimit -v, the address space this process has left), shared by the ranks torchrun started
    here."""
    page = os.sysconf("SC_PAGE_SIZE")
    have = page * os.sysconf("SC_PHYS_PAGES")
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit != resource.RLIM_INFINITY:
        with open("/proc/self/statm") as statm:                 # the address space in use, pages
            have = min(have, limit - page * int(statm.read().split()[0]))
    return have // int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def optimizer_bandwidth(device) -> float:
    """Bytes/s torch's AdamW streams (its default kernel on this device, 4M fp32 parameters):
    ADAMW_BYTES per parameter. Its own passes, not a copy's: each pass allocates a
    temporary and writes fresh memory, which a bare a + b does not (here a + b reads 1.3x this)."""
    n = 4 * 2**20
    p = torch.nn.Parameter(torch.ones(n, device=device))
    p.grad = torch.ones(n, device=device)
    adamw = torch.optim.AdamW([p], lr=1e-4)
    return ADAMW_BYTES["unfused"] * n / _seconds(adamw.step, device, window=1.0)


def host_copy_bandwidth(device) -> float:
    """Bytes/s of a 64 MiB fp32 copy from host memory to the device, as offload's copies run it:
    from page-locked memory on a GPU (offload.lock_pages), host to host on CPU ranks."""
    n = 16 * 2**20
    target = torch.empty(n, device=device)
    source = host_buffer(target).fill_(1.0)              # pinned where target is on a GPU
    return 4 * n / _seconds(lambda: target.copy_(source, non_blocking=True), device, window=0.5)


def collective_link(comm: Comm, device, sizes=(2**14, 2**18, 2**21)) -> Link:
    """Latency and bandwidth of an all-reduce between this run's ranks, fitted (least squares)
    to seconds = 2 (N-1) latency + bytes sent / bandwidth at three message sizes (fp32 elements)."""
    n, points = comm.world_size, []
    for numel in sizes:
        t = torch.ones(numel, device=device)
        seconds = torch.tensor([_seconds(lambda: comm.all_reduce(t), device, calls=5)],
                               dtype=torch.float64, device=device)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=comm.group)     # the slowest rank's
        points.append((ring_bytes("all_reduce", numel, 4, n), seconds.item()))
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in points)
             / sum((x - mean_x) ** 2 for x, _ in points))
    intercept = max(mean_y - slope * mean_x, 0.0)
    return Link(1 / slope, intercept / (2 * (n - 1)))


def _measured(cache: str | None, key: str, measure, comm: Comm, device, fields=()) -> dict:
    """cache[key], measured now (every rank at once) unless every rank finds it there, with
    every one of `fields` (an entry an older version wrote without one is measured again)."""
    saved = read_cache(cache) if cache else {}
    entry = saved.get(key)
    found = isinstance(entry, dict) and all(f in entry for f in fields)
    have = torch.tensor([float(found)], device=device)
    dist.all_reduce(have, op=dist.ReduceOp.MIN, group=comm.group)       # all measure, or none
    if have.item():
        return entry
    saved[key] = {**measure(), "measured": time.strftime("%Y-%m-%d %H:%M")}
    if cache and comm.rank == 0:
        write_cache(cache, saved)
    return saved[key]


def read_cache(cache: str) -> dict:
    """The cache's entries; none where it is missing, unreadable or not what write_cache writes
    (a cache only saves time: what it lacks is measured again)."""
    try:
        with open(cache) as f:
            saved = json.load(f)
    except (OSError, ValueError):               # ValueError: cut short, or not JSON at all
        return {}
    return saved if isinstance(saved, dict) else {}


def write_cache(cache: str, saved: dict):
    """saved into the cache whole (written beside it, then renamed over it: a reader never sees
    half a file), or not at all: where it cannot be written (a read-only install, a full disk)
    the cache stays as it was and the run goes on, measuring again next time."""
    tmp = f"{cache}.{os.getpid()}.tmp"          # per process: two runs never write one file
    try:
        os.makedirs(os.path.dirname(os.path.abspath(cache)), exist_ok=True)    # "x.json": the cwd
        with open(tmp, "w") as f:
            json.dump(saved, f, indent=1)
            f.flush()
            os.fsync(f.fileno())                # on disk before the rename: a crash keeps it whole
        os.replace(tmp, cache)
    except OSError:
        with contextlib.suppress(OSError):                # left half-written by a full disk
            os.remove(tmp)


def this(cfg: GPTConfig, rows: int, seq_len: int, precision: str = "fp32", comm: Comm | None = None,
         device=None, cache: str | None = CACHE, split: int = 1, window: float = 1.0, cp: int = 1,
         attention: str = "ring") -> Machine:
    """This machine, measured by every rank at once (as the run will share it): the FLOP/s of the
    block a rank computes at the run's (rows, seq_len) (rank_block: split, a tensor-parallel
    rank's 1/N; cp, a context-parallel rank's with its attention), the optimizer's memory
    bandwidth, the host-to-device copy's (offload's link), the all-reduce's link. A few seconds:
    a `window` of seconds for the block, a second for AdamW (a longer window averages out more of
    a shared machine's drift). Read from `cache` when measured before with the same threads and
    ranks (and block and shape, for the FLOP/s)."""
    comm, device = comm or Comm(), device or torch.device("cpu")
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"{platform.processor() or platform.machine()} x {os.cpu_count()}")
    key = f"{where}, {torch.get_num_threads()} threads, {comm.world_size} ranks"
    m = _measured(cache, key, lambda: {
        "memory_bandwidth": optimizer_bandwidth(device), "host_copy": host_copy_bandwidth(device),
        "link": asdict(collective_link(comm, device) if comm.world_size > 1
                       else Link(float("inf"), 0.0))},
        comm, device, fields=("memory_bandwidth", "host_copy", "link"))
    block = block_key(cfg, rows, seq_len, precision, split, cp, attention)
    flops = _measured(cache, f"{key}, {block}", lambda: {"flops": block_flops_per_second(
        cfg, rows, seq_len, precision, device, split, window, cp, attention)},
        comm, device, fields=("flops",))["flops"]
    return machine_of(key, m, flops, precision, device.type == "cuda")


def block_key(cfg: GPTConfig, rows: int, seq_len: int, precision: str, split: int = 1, cp: int = 1,
              attention: str = "ring") -> str:
    """The cache's name for the block `this` measures (rank_block's) at rows x seq_len."""
    llama = hasattr(cfg, "n_kv_head")        # pretrained/llama.py's block: its own rate
    return (f"{precision} block C{cfg.n_embd} H{cfg.n_head}"
            + (f" Llama G{cfg.n_kv_head} D{cfg.D} F{cfg.hidden}" if llama else "")
            + (f" split {split} ways" if split > 1 else "")
            + (f" E{cfg.experts} top-{cfg.top_k} capacity {cfg.capacity_factor} routed"
               if cfg.experts else "")         # routed: moe.py's block, not a dense one's rate
            + (f" cp {cp} {attention} attention" if cp > 1 else "")   # context_parallel.py's
            + f" at {rows} x {seq_len}")


def machine_of(key: str, measured: dict, flops: float, precision: str, on_gpu: bool) -> Machine:
    """The Machine `this` makes of its figures: key "where, threads, ranks" (the cache's), the
    bandwidths and link measured under it, a block's FLOP/s."""
    where, ranks = key.rsplit(", ", 2)[0], int(key.rsplit(", ", 1)[1].split()[0])
    link = Link(**measured["link"])
    memory = measured["memory_bandwidth"]
    return Machine(f"this ({where})", {precision: flops}, {precision: flops}, memory,
                   Link(measured["host_copy"], 0.0), {"node": link, "network": link},
                   per_node=ranks, host_memory_bandwidth=memory, overlaps=on_gpu)


def recorded(cache: str, block: str, precision: str, on_gpu: bool) -> Machine:
    """The Machine a run's `this` made from `cache` for `block` (block_key), read back: a bench
    run's NAME-this.json, one run's measurements, whose rows tests price again. A file from
    before host_copy was measured prices no offload (NaN)."""
    saved = read_cache(cache)
    key = next((k for k in saved if k.endswith(f", {block}")), None)
    if key is None:
        raise KeyError(f"{cache} holds no measurement of a {block}")
    base = key.removesuffix(f", {block}")
    measured = {"host_copy": math.nan, **saved[base]}
    return machine_of(base, measured, saved[key]["flops"], precision, on_gpu)


def measure_this(args):
    """--this: measure, print on rank 0 (under torchrun the links too)."""
    device = init_distributed()
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_ranks))
    m = this(MODELS[args.model], args.rows, args.seq_len, device=device)
    link = m.links["node"]
    if dist.get_rank() == 0:
        print(f"this: a {args.model} block at {args.rows} x {args.seq_len}: "
              f"{m.flops['fp32'] / 1e9:.1f} GFLOP/s fp32; AdamW streams "
              f"{m.memory_bandwidth / GB:.1f} GB/s; host to device "
              f"{m.host_link.bandwidth / GB:.1f} GB/s; all-reduce link "
              f"{link.bandwidth / GB:.2f} GB/s, {link.latency * 1e6:.0f} us per message "
              f"(cached in {CACHE})")
    exit_distributed()


def main(argv=None):
    p = Parser(prog="python -m napkin.machines", description=__doc__.split("\n")[0])
    p.add_argument("--this", action="store_true",
                   help="measure this machine (torchrun: its links too)")
    p.add_argument("--model", default="medium", choices=list(MODELS),
                   help="the shape `this` measures a block of; default medium")
    p.add_argument("--rows", type=whole, default=8, help="sequences per rank; default 8")
    p.add_argument("--seq-len", type=whole, default=None,
                   help="default: the model's block size (medium: 256)")
    args = p.parse_args(argv)
    block_size = MODELS[args.model].block_size
    args.seq_len = block_size if args.seq_len is None else args.seq_len
    if args.rows < 1 or not 1 <= args.seq_len <= block_size:
        p.error(f"--rows {args.rows} --seq-len {args.seq_len}: give --rows 1 or more and a "
                f"--seq-len from 1 to model {args.model}'s block size {block_size}")
    cfg = MODELS[args.model]
    need = activation_bytes(args.seq_len, args.rows, cfg.n_embd, cfg.n_head, bytes_per_value=4)
    if args.this and need > memory_per_rank():
        p.error(f"--rows {args.rows}: one block's activations at {args.rows} x {args.seq_len} take "
                f"about {need / GB:.1f} GB, more than the {memory_per_rank() / GB:.1f} GB a rank "
                f"has here: give fewer --rows")
    if args.this:
        return measure_this(args)
    print(f"{'machine':<18}{'TFLOP/s bf16 (peak)':>21}{'fp32 (peak)':>14}{'memory GB/s':>13}"
          f"{'host GB/s':>11}{'node GB/s':>11}{'network GB/s':>14}")
    for name, m in PRESETS.items():
        print(f"{name:<18}{m.flops['bf16'] / 1e12:>11.0f} ({m.peak_flops['bf16'] / 1e12:.0f})"
              f"{m.flops['fp32'] / 1e12:>7.1f} ({m.peak_flops['fp32'] / 1e12:.1f})"
              f"{m.memory_bandwidth / GB:>13.0f}{m.host_link.bandwidth / GB:>11.0f}"
              f"{m.links['node'].bandwidth / GB:>11.0f}{m.links['network'].bandwidth / GB:>14.1f}")


if __name__ == "__main__":
    main()
