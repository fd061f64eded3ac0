"""Adaptive speculation against every fixed K: HF-native sampled decoding at batch 1 to 64, float32 and bfloat16.

On the cached benchmark target and warm-started draft of `bench_assets.py` (built on first use), for each dtype and
batch size, one run each of: plain decoding (`target.generate`, which is K = 0), `speculative_generate` with
K = 1..5, and "auto" as the trainer runs it: ``AdaptiveSpeculation(5)``, whole calls decoded plainly where it
expects K = 0 to win (`prefers_plain`), else `speculative_generate` choosing K per round (K = 0 included).
Rollouts sample at ``--temperature`` with probabilistic drafting, as RL rollouts do. The runs of one cell
alternate (repeat 0 is a warm-up, and what the cost model first learns from: for auto two calls, one by each
route; its state is kept across the repeats of a cell, as a trainer keeps it across steps) and the table shows
medians, and as "spread" the median over the cell's columns of fastest / slowest timed run: a cell's ratios are
only as sharp as that. Prompts are the held-out real-text prefixes, repeated to fill large batches.

Goal: auto at or above 0.95x the best fixed K (K = 0 included) at every batch size.

    OMP_NUM_THREADS=2 python scripts/bench_adaptive.py            # full run
    OMP_NUM_THREADS=2 python scripts/bench_adaptive.py --quick    # smoke run
"""

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_assets import ensure_bench_assets  # noqa: E402
from bench_speculative import (  # noqa: E402
    DTYPES,
    fill,
    hf_auto_run,
    hf_baseline_run,
    hf_speculative_run,
    load_models,
    load_prompts,
    machine_load,
    mean_k,
    print_table,
    time_alternating,
)

from hf_spec_cotrain import AdaptiveSpeculation  # noqa: E402


FIXED_KS = (1, 2, 3, 4, 5)


def cell(target, draft, prompts, *, batch_size, max_new_tokens, temperature, repeats, max_k) -> dict:
    """Median tokens/s of plain decoding, each fixed K and auto on ``batch_size`` rows; auto's mean K."""
    group = torch.tensor(fill(prompts, batch_size))
    auto = AdaptiveSpeculation(max_k, draft_forwards=draft.draft_forwards)
    runs = {"K=0": hf_baseline_run(target, [group], max_new_tokens=max_new_tokens, temperature=temperature, seed=0)}
    sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, draft_sampling="probabilistic", seed=0)
    for k in FIXED_KS:
        runs[f"K={k}"] = hf_speculative_run(target, draft, [group], k=k, **sampling)
    rounds: list[tuple[int, int]] = []
    speculate = hf_speculative_run(target, draft, [group], k=auto, rounds=rounds, **sampling)
    runs["auto"] = hf_auto_run(auto, batch_size, runs["K=0"], speculate, rounds)
    timings = time_alternating(runs, repeats=repeats)
    result = {name: timing.tokens_per_second for name, timing in timings.items()}
    result["spread"] = statistics.median(timing.spread for timing in timings.values())
    result["auto_mean_k"] = mean_k(rounds)
    result["auto_predicted_speedup"] = auto.predicted_speedup(batch_size)
    return result


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 32 new tokens, batches 1 and 8, 1 repeat")
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--max_new_tokens", type=int, default=None, help="default 128 (--quick: 32)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs after the warm-up (default 3)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max_speculative_tokens", type=int, default=5)
    parser.add_argument("--output", type=Path, default=None, help="also write the table as JSON here")
    parser.add_argument("--cache_dir", default=None, help="benchmark assets (default: bench_assets' cache)")
    parser.add_argument("--target_minutes", type=float, default=None, help="bench_assets' target budget")
    parser.add_argument("--draft_minutes", type=float, default=None, help="bench_assets' draft budget")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: OMP_NUM_THREADS or 2)")
    return parser


def main(argv: list[str] | None = None) -> list[dict]:
    args = make_parser().parse_args(argv)
    torch.set_num_threads(args.threads or int(os.environ.get("OMP_NUM_THREADS", 2)))
    max_new_tokens = args.max_new_tokens or (32 if args.quick else 128)
    repeats = args.repeats or (1 if args.quick else 3)
    batch_sizes = [1, 8] if args.quick else args.batch_sizes
    budgets = {name: getattr(args, name) for name in ("target_minutes", "draft_minutes") if getattr(args, name)}
    assets = ensure_bench_assets(args.cache_dir, **budgets)
    prompts = load_prompts(assets, 16)
    print(
        f"\ntarget {assets.target_dir}, draft {assets.draft_dirs['eagle3']}; {max_new_tokens} new tokens at temperature "
        f"{args.temperature}, median of {repeats} after a warm-up; {machine_load()}\n",
        flush=True,
    )
    results = []
    for dtype in args.dtypes:
        target, drafts = load_models(assets, DTYPES[dtype])
        draft = drafts["eagle3"]
        for batch_size in batch_sizes:
            result = cell(
                target,
                draft,
                prompts,
                batch_size=batch_size,
                max_new_tokens=max_new_tokens,
                temperature=args.temperature,
                repeats=repeats,
                max_k=args.max_speculative_tokens,
            )
            results.append({"dtype": dtype, "batch_size": batch_size, **result})
            print(f"{dtype} batch {batch_size} done ({machine_load()})", flush=True)
        del target, drafts, draft
    rows = []
    for result in results:
        plain = result["K=0"]
        fixed = {k: result[f"K={k}"] / plain for k in (0, *FIXED_KS)}
        best_k = max(fixed, key=fixed.get)
        auto = result["auto"] / plain
        rows.append(
            [
                result["dtype"],
                str(result["batch_size"]),
                f"{plain:.0f}",
                *[f"{fixed[k]:.2f}x" for k in FIXED_KS],
                f"{auto:.2f}x",
                f"{result['auto_mean_k']:.2f}",
                f"K={best_k}",
                f"{auto / fixed[best_k]:.2f}",
                f"{result['spread']:.2f}",
            ]
        )
    print()
    print_table(
        [
            "dtype",
            "batch",
            "plain tok/s",
            *[f"K={k}" for k in FIXED_KS],
            "auto",
            "auto mean K",
            "best",
            "auto/best",
            "spread",
        ],
        rows,
    )
    print(f"\nSpeed-ups over plain decoding (K = 0) in the same run; goal auto/best >= 0.95. {machine_load()}")
    if args.output:
        args.output.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
