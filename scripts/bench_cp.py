"""Per-rank peak memory and time of a draft's context-parallel attention: ring vs all-gather vs one device (and for
DFlash the queries gathered instead of the K/V).

What runs, forward+backward, float32 on the CPU, on one document of length L of which every rank holds its zigzag
shard of L / W positions. EAGLE-3 (`--drafter eagle3`): the attention of a K = 3 training-time test: step 0
`branch_attention(q0, k, v)` (trunk only), then steps 1 and 2 with the same trunk plus S = 1 and S = 2 branch keys,
exactly the calls `ttt_loss` makes per draft layer. DFlash (`--drafter dflash`): one draft layer's
`block_draft_attention` of `--anchors` blocks of `--dflash-block` positions spread evenly over the document, each
over the context before its anchor and its own block; under CP each rank runs the anchors whose `anchor - 1` it
holds, as `dflash_loss` does. `--draft-layers` runs that many layers' attention (each with its own K/V, every
forward before the backward, as a draft of that depth does): what a layer keeps for its backward then adds up. Configurations: one device (`branch_attention` without a group, W = 1), and the
ring and the all-gather baseline (`cp_mode="allgather"`), and for DFlash `cp_mode="gather_queries"` (the queries
travel, the K/V stay home), at W = 2 and 4 on gloo, each configuration in its own processes (spawned once for all lengths, after a small warm-up).

Memory: the per-process peak resident set (VmHWM, reset through /proc/self/clear_refs just before the
measured forward+backward) minus the resident set at that moment, the maximum over the ranks. RSS counts
everything the step really allocates, gloo's buffers included, which a tensor-level tracker would miss; the
children run with `MALLOC_MMAP_THRESHOLD_=65536` so that glibc maps every large tensor separately and
returns it on free, which makes RSS follow the live tensors instead of the heap's high-water mark.
Time: wall seconds of the forward+backward (maximum over the ranks, after a barrier) and CPU seconds of the
busiest rank. With one thread per rank and W = 4 ranks on a 2-core machine the wall times of W = 4 include
waiting for a core: compare CPU seconds for the work per rank.

    python scripts/bench_cp.py     # L = 4K..32K: 28 minutes on 2 loaded cores (~10 estimated on idle ones)
    python scripts/bench_cp.py --lengths 4096 8192 --repeats 2 --configs single1 ring4
    python scripts/bench_cp.py --drafter dflash --lengths 8192 16384 32768 --repeats 3
    python scripts/bench_cp.py --drafter dflash --num-q-heads 8 --num-kv-heads 8 --head-dim 64 --anchors 64 \
        --draft-layers 2 --lengths 8192 16384 32768 --repeats 2
"""

import argparse
import os
import statistics
import sys
import tempfile
import time


CONFIGS = ("single1", "ring2", "allgather2", "gather_queries2", "ring4", "allgather4", "gather_queries4")
RATIOS = (
    ("ring4", "single1"),
    ("ring4", "allgather4"),
    ("gather_queries4", "single1"),
    ("gather_queries4", "allgather4"),
    ("ring2", "single1"),
    ("ring2", "allgather2"),
)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument(
        "--configs",
        nargs="+",
        default=None,
        choices=CONFIGS,
        help="implementation and world size (default: all; gather_queries only for DFlash, whose queries are few)",
    )
    # Few, narrow heads keep 32K within minutes on a 2-core CPU; the query/key-value head ratio (GQA 4) is Llama-3's.
    parser.add_argument("--num-q-heads", type=int, default=4)
    parser.add_argument("--num-kv-heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=None, help="block size (default: BLOCK_SIZE)")
    parser.add_argument("--repeats", type=int, default=1, help="measured forward+backward runs per length")
    parser.add_argument("--drafter", choices=("eagle3", "dflash"), default="eagle3", help="whose attention runs")
    parser.add_argument("--draft-layers", type=int, default=1, help="layers whose attention runs, each its own K/V")
    parser.add_argument("--anchors", type=int, default=256, help="DFlash: blocks trained over the document")
    parser.add_argument("--dflash-block", type=int, default=8, help="DFlash: positions per block (its default 8)")
    return parser


def _split_config(config: str) -> tuple[str, int]:
    mode = config.rstrip("0123456789")
    return mode, int(config[len(mode) :])


def _memory_status() -> dict[str, int]:
    """VmRSS and VmHWM of this process, in bytes."""
    values = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) * 1024
    return values


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def run_rank(rank: int, world_size: int, mode: str, args: argparse.Namespace, init_file: str, results) -> None:
    """One rank of one configuration: for every length, fresh shards and `args.repeats` measured passes."""
    import torch
    import torch.distributed as dist

    from hf_spec_cotrain.attention import BLOCK_SIZE, anchor_query_positions, block_draft_attention, branch_attention

    torch.set_num_threads(1)
    group = None
    if world_size > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        group = dist.group.WORLD
    generator = torch.Generator().manual_seed(rank)
    block_size = args.block_size or BLOCK_SIZE
    cp_mode = "ring" if mode == "single" else mode

    def randn(*shape):
        return torch.randn(*shape, generator=generator).requires_grad_()

    def measured(run, inputs: list, upstream: list) -> tuple[float, float, int]:
        """One forward+backward of `run(*inputs)` (a list of outputs); wall s, CPU s, peak RSS increase."""
        if group is not None:
            dist.barrier()
        _reset_peak()
        baseline = _memory_status()["VmRSS"]
        wall, cpu = time.perf_counter(), time.process_time()
        torch.autograd.backward(run(*inputs), upstream)
        return time.perf_counter() - wall, time.process_time() - cpu, _memory_status()["VmHWM"] - baseline

    def ttt_attention(local_length: int) -> tuple[float, float, int]:
        """The three calls of a K = 3 TTT per layer on fresh shards."""
        layers = [
            [randn(1, args.num_q_heads, local_length, args.head_dim) for _ in range(3)]
            + [randn(1, args.num_kv_heads, local_length, args.head_dim) for _ in range(6)]
            for _ in range(args.draft_layers)
        ]

        def attention(*tensors):
            return branch_attention(*tensors, cp_group=group, cp_mode=cp_mode, block_size=block_size)

        def run(*inputs):
            outputs = []
            for q0, q1, q2, k, v, k1, v1, k2, v2 in layers:
                outputs += [
                    attention(q0, k, v),
                    attention(q1, k, v, torch.stack([k1]), torch.stack([v1])),
                    attention(q2, k, v, torch.stack([k1, k2]), torch.stack([v1, v2])),
                ]
            return outputs

        inputs = [tensor for layer in layers for tensor in layer]
        upstream = [torch.randn(layer[i].shape, generator=generator) for layer in layers for i in range(3)]
        return measured(run, inputs, upstream)

    def dflash_attention(local_length: int) -> tuple[float, float, int]:
        """Each layer's block attention of this rank's anchors on fresh shards."""
        length = local_length * world_size
        spread = torch.linspace(1, length - 1, min(args.anchors, length - 1)).round().long().unique()[None]
        _, held = anchor_query_positions(spread, local_length=local_length, cp_group=group)
        anchors = spread[held][None]
        blocks = (anchors.shape[1], args.dflash_block, args.head_dim)
        layers = [
            [
                randn(1, args.num_q_heads, *blocks),
                randn(1, args.num_kv_heads, local_length, args.head_dim),
                randn(1, args.num_kv_heads, local_length, args.head_dim),
                randn(1, args.num_kv_heads, *blocks),
                randn(1, args.num_kv_heads, *blocks),
            ]
            for _ in range(args.draft_layers)
        ]

        def run(*inputs):
            return [block_draft_attention(*layer, anchors, cp_group=group, cp_mode=cp_mode) for layer in layers]

        inputs = [tensor for layer in layers for tensor in layer]
        return measured(run, inputs, [torch.randn(layer[0].shape, generator=generator) for layer in layers])

    attention = dflash_attention if args.drafter == "dflash" else ttt_attention
    # A small warm-up first: the first call of every kernel maps library code, which would count as memory.
    attention(2 * block_size)
    for length in args.lengths:
        results.put((rank, length, [attention(length // world_size) for _ in range(args.repeats)]))
    if group is not None:
        dist.destroy_process_group()


def measure(config: str, args: argparse.Namespace) -> dict[int, dict[str, float]]:
    """Spawn the ranks of one configuration; per length, the medians over repeats of the worst rank's numbers."""
    import torch.multiprocessing as mp

    mode, world_size = _split_config(config)
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    per_rank: dict[int, dict[int, list]] = {length: {} for length in args.lengths}
    with tempfile.TemporaryDirectory() as folder:
        init_file = os.path.join(folder, "init")
        processes = [
            context.Process(target=run_rank, args=(rank, world_size, mode, args, init_file, results))
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        for _ in range(world_size * len(args.lengths)):
            rank, length, measurements = results.get()
            per_rank[length][rank] = measurements
        for process in processes:
            process.join()
            if process.exitcode:
                raise RuntimeError(f"{config}: a rank exited with {process.exitcode}")
    summary = {}
    for length, ranks in per_rank.items():
        worst = [
            [max(ranks[rank][repeat][index] for rank in ranks) for repeat in range(args.repeats)] for index in range(3)
        ]
        summary[length] = dict(zip(("wall", "cpu", "peak"), map(statistics.median, worst)))
    return summary


def main() -> None:
    args = make_parser().parse_args()
    # Read by glibc when each child starts: large tensors get their own mapping, returned to the OS on free.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    os.environ["OMP_NUM_THREADS"] = "1"
    asked = args.configs or [c for c in CONFIGS if args.drafter == "dflash" or not c.startswith("gather_queries")]
    configs = [config for config in CONFIGS if config in asked]
    workload = (
        f"DFlash block attention ({args.anchors} anchors, blocks of {args.dflash_block})"
        if args.drafter == "dflash"
        else "TTT attention (K=3: S=0,1,2)"
    ) + f" of {args.draft_layers} layer(s)"
    print(
        f"{workload} fwd+bwd, float32 CPU, one document, Hq={args.num_q_heads}, "
        f"Hkv={args.num_kv_heads}, D={args.head_dim}, 1 thread per rank, {os.cpu_count()} cores. "
        "MiB: max over ranks of the peak RSS increase; cpu s / wall s: the busiest rank",
        flush=True,
    )
    results = {}
    for config in configs:
        start = time.perf_counter()
        results[config] = measure(config, args)
        print(f"  {config} done in {time.perf_counter() - start:.0f} s", flush=True)
    ratios = [(a, b) for a, b in RATIOS if a in results and b in results]
    header = ["L", *(f"{c} MiB" for c in configs), *(f"{c} cpu s" for c in configs), *(f"{c} wall s" for c in configs)]
    header += [f"{a}/{b} mem" for a, b in ratios]
    print(" | ".join(header))
    mib = 2**20
    for length in args.lengths:
        row = [str(length)]
        row += [f"{results[config][length]['peak'] / mib:.1f}" for config in configs]
        row += [f"{results[config][length]['cpu']:.1f}" for config in configs]
        row += [f"{results[config][length]['wall']:.1f}" for config in configs]
        row += [f"{results[a][length]['peak'] / results[b][length]['peak']:.2f}" for a, b in ratios]
        print(" | ".join(row), flush=True)


if __name__ == "__main__":
    sys.exit(main())
