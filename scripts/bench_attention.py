"""Forward+backward time and peak memory of blockwise `branch_attention` against the dense reference.

Each (implementation, length) runs in a fresh subprocess, so that its peak resident memory
(`ru_maxrss`) is its own: the reported memory is the peak RSS increase over the process baseline
taken after imports and input creation. Time is the median of a few repeats after one warm-up
(fewer when a configuration would exceed `--budget-s`; a step that alone takes a third of the
budget is its own measurement).
The dense reference is skipped where its estimated peak exceeds `--dense-limit-gb`.

    python scripts/bench_attention.py                 # L = 1K, 2K, 4K, 8K; 2-4 minutes on 1 thread
    python scripts/bench_attention.py --lengths 512 1024 --repeats 5 --threads 2
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


IMPLEMENTATIONS = ("blockwise", "dense")


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--num-q-heads", type=int, default=8)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--num-branch", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=None, help="blockwise block size (default: BLOCK_SIZE)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats after one warm-up, at most")
    parser.add_argument(
        "--budget-s", type=float, default=30.0, help="stop repeating a configuration after this many seconds"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads; 1 by default because this shared 2-core machine makes multi-threaded timings erratic",
    )
    parser.add_argument("--dense-limit-gb", type=float, default=8.0, help="skip the dense reference above this")
    parser.add_argument("--child", choices=IMPLEMENTATIONS, help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    return parser


def _max_rss_bytes() -> int:
    # ru_maxrss is in KiB on Linux (bytes on macOS).
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def run_child(args: argparse.Namespace) -> None:
    """Measure one configuration in this (fresh) process and print the result as one JSON line."""
    import torch

    from hf_spec_cotrain.attention import BLOCK_SIZE, branch_attention, branch_attention_reference

    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    kv_shape = (1, args.num_kv_heads, args.length, args.head_dim)
    inputs = {
        "q": torch.randn(1, args.num_q_heads, args.length, args.head_dim, generator=generator),
        "k": torch.randn(*kv_shape, generator=generator),
        "v": torch.randn(*kv_shape, generator=generator),
        "branch_k": torch.randn(args.num_branch, *kv_shape, generator=generator),
        "branch_v": torch.randn(args.num_branch, *kv_shape, generator=generator),
    }
    upstream = torch.randn(inputs["q"].shape, generator=generator)
    if args.child == "blockwise":
        block_size = args.block_size or BLOCK_SIZE

        def attention(**tensors):
            return branch_attention(**tensors, block_size=block_size)
    else:
        attention = branch_attention_reference

    def step() -> float:
        leaves = {name: tensor.clone().requires_grad_() for name, tensor in inputs.items()}
        start = time.perf_counter()
        attention(**leaves).backward(upstream)
        return time.perf_counter() - start

    baseline = _max_rss_bytes()
    warmup = step()
    # A step that takes a large share of the budget needs no warm-up: keep it as a measurement.
    times = [warmup] if warmup > args.budget_s / 3 else []
    while len(times) < args.repeats and (not times or warmup + sum(times) < args.budget_s):
        times.append(step())
    result = {"seconds": statistics.median(times), "peak_bytes": _max_rss_bytes() - baseline}
    print(json.dumps(result))


def dense_peak_estimate(args: argparse.Namespace, length: int) -> int:
    """About four float32 [Hq, L, (1 + S) L] score-sized tensors live at once in the dense forward+backward."""
    return 4 * args.num_q_heads * length * (1 + args.num_branch) * length * 4


def measure(args: argparse.Namespace, implementation: str, length: int) -> dict | None:
    command = [sys.executable, __file__, "--child", implementation, "--length", str(length)]
    flags = ("num_q_heads", "num_kv_heads", "head_dim", "num_branch", "block_size", "repeats", "budget_s", "threads")
    for flag in flags:
        value = getattr(args, flag)
        if value is not None:
            command += [f"--{flag.replace('_', '-')}", str(value)]
    completed = subprocess.run(command, capture_output=True, text=True, check=False)
    if completed.returncode != 0:
        print(f"{implementation} L={length} failed:\n{completed.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(completed.stdout.strip().splitlines()[-1])


def _format(value: float | None, unit: str) -> str:
    return "skipped" if value is None else f"{value:.2f}{unit}"


def main() -> None:
    args = make_parser().parse_args()
    if args.child:
        run_child(args)
        return

    print(
        f"branch attention fwd+bwd, float32, B=1, Hq={args.num_q_heads}, Hkv={args.num_kv_heads}, "
        f"D={args.head_dim}, S={args.num_branch}, threads={args.threads}, median of <= {args.repeats} within {args.budget_s:g} s"
    )
    header = [
        "L",
        "blockwise s",
        "dense s",
        "dense/blockwise time",
        "blockwise MiB",
        "dense MiB",
        "dense/blockwise mem",
    ]
    widths = [max(len(title), 7) for title in header]
    print(" | ".join(title.rjust(width) for title, width in zip(header, widths)))
    print("-+-".join("-" * width for width in widths))
    mib = 2**20
    for length in args.lengths:
        blockwise = measure(args, "blockwise", length)
        dense = None
        if dense_peak_estimate(args, length) <= args.dense_limit_gb * 2**30:
            dense = measure(args, "dense", length)
        row = [
            str(length),
            _format(blockwise and blockwise["seconds"], ""),
            _format(dense and dense["seconds"], ""),
            _format(blockwise and dense and dense["seconds"] / blockwise["seconds"], "x"),
            _format(blockwise and blockwise["peak_bytes"] / mib, ""),
            _format(dense and dense["peak_bytes"] / mib, ""),
            _format(blockwise and dense and dense["peak_bytes"] / blockwise["peak_bytes"], "x"),
        ]
        print(" | ".join(cell.rjust(width) for cell, width in zip(row, widths)), flush=True)


if __name__ == "__main__":
    main()
