"""Speculation while sampling: greedy versus probabilistic drafting at temperatures 0, 0.7 and 1, HF-native and vLLM.

When the draft proposes its argmax ("greedy" drafting, vLLM's default), a proposal is accepted with probability
``p_target(token)``, which collapses on a flat target distribution. "Probabilistic" drafting samples the proposal
from the draft's own distribution ``q`` and accepts with ``min(1, p/q)``: ``1 - TV(p, q)`` per token in
expectation. This script measures both on the cached benchmark target and warm-started draft of
`bench_assets.py`, with prompts that are real-text prefixes from held-out standard-library files:

* HF-native: `speculative_generate(draft_sampling=...)` versus `target.generate` sampling at the same temperature
  (no top-k, no top-p); temperature 0 is greedy decoding, where both drafting methods propose the argmax.
* vLLM: `VLLMRolloutEngine` without a draft, and with the draft at ``draft_sample_method="greedy"`` and
  ``"probabilistic"`` (``rejection_sample_method="standard"``), one engine at a time, each in its own subprocess
  (see `bench_speculative.py`).

Throughput is generated tokens per second (median of ``--repeats`` timed runs after a warm-up); acceptance length
is vLLM's ``1 + accepted / drafts``, summed over the timed runs. The last lines give, at temperature 1, the ratio
of probabilistic to greedy drafting's acceptance length (the goal is >= 1.5).

    OMP_NUM_THREADS=2 python scripts/bench_sampling.py            # full run
    OMP_NUM_THREADS=2 python scripts/bench_sampling.py --quick    # smoke run
"""

import argparse
import os
import sys
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_assets import ensure_bench_assets  # noqa: E402
from bench_speculative import (  # noqa: E402
    VLLMJob,
    batches,
    fmt,
    hf_baseline_run,
    hf_speculative_run,
    load_models,
    load_prompts,
    machine_load,
    print_table,
    run_vllm_job,
    time_alternating,
)


DRAFTING = ("greedy", "probabilistic")


def bench_hf(target, draft, prompts, *, batch_size, temperatures, max_new_tokens, k, repeats, seed) -> dict:
    """``{(temperature, drafting or None): Timing}``; None is `target.generate`. Runs of one temperature alternate."""
    groups = batches(prompts, batch_size)
    results = {}
    for temperature in temperatures:
        runs = {
            None: hf_baseline_run(target, groups, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
        }
        # At temperature 0 both methods verify the draft's argmax: one run serves both rows.
        for drafting in DRAFTING if temperature else DRAFTING[:1]:
            runs[drafting] = hf_speculative_run(
                target,
                draft,
                groups,
                max_new_tokens=max_new_tokens,
                k=k,
                temperature=temperature,
                draft_sampling=drafting,
                seed=seed,
            )
        timings = time_alternating(runs, repeats=repeats)
        results.update({(temperature, name): timing for name, timing in timings.items()})
        print(f"HF-native T={temperature:g} done ({machine_load()})", flush=True)
    return results


def bench_vllm(assets, prompts, *, batch_size, temperatures, max_new_tokens, k, repeats, seed, threads) -> dict:
    """``{(temperature, drafting or None): run}`` from three engines: no draft, greedy and probabilistic drafting."""
    results = {}
    for drafting in (None, *DRAFTING):
        job = VLLMJob(
            target_dir=str(assets.target_dir),
            draft_dir=None if drafting is None else str(assets.draft_dirs["eagle3"]),
            prompts=prompts,
            max_new_tokens=max_new_tokens,
            repeats=repeats,
            batch_sizes=[batch_size],
            temperatures=list(temperatures),
            num_speculative_tokens=k,
            draft_sample_method=drafting,
            rejection_sample_method=None if drafting is None else "standard",
            seed=seed,
        )
        out = run_vllm_job(job, threads=threads)
        results.update({(run["temperature"], drafting): run for run in out["runs"]})
        print(f"vLLM engine ({drafting or 'no draft'}) done, startup {out['startup_seconds']:.0f} s", flush=True)
    return results


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: short generations, one timed repeat")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7, 1.0])
    parser.add_argument("--max_new_tokens", type=int, default=None, help="default 128 (--quick: 32)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs after the warm-up (default 3, quick 1)")
    parser.add_argument("--num_prompts", type=int, default=8)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--num_speculative_tokens", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip_vllm", action="store_true", help="HF-native columns only")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: OMP_NUM_THREADS or 2)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = make_parser().parse_args(argv)
    threads = args.threads or int(os.environ.get("OMP_NUM_THREADS", 2))
    torch.set_num_threads(threads)
    max_new_tokens = args.max_new_tokens or (32 if args.quick else 128)
    repeats = args.repeats or (1 if args.quick else 3)
    k = args.num_speculative_tokens

    assets = ensure_bench_assets()
    target, drafts = load_models(assets)
    draft = drafts["eagle3"]
    prompts = load_prompts(assets, args.num_prompts)
    print(
        f"\ntarget {assets.target_dir}, draft {assets.draft_dirs['eagle3']}\nK={k}, {len(prompts)} prompts of {len(prompts[0])} "
        f"tokens at batch {args.batch_size}, {max_new_tokens} new tokens, {threads} torch thread(s), median of "
        f"{repeats} after a warm-up; {machine_load()}\n",
        flush=True,
    )
    settings = dict(
        batch_size=args.batch_size,
        temperatures=args.temperatures,
        max_new_tokens=max_new_tokens,
        k=k,
        repeats=repeats,
        seed=args.seed,
    )
    hf = bench_hf(target, draft, prompts, **settings)
    vllm = {} if args.skip_vllm else bench_vllm(assets, prompts, threads=threads, **settings)

    rows = []
    for temperature in args.temperatures:
        for drafting in DRAFTING:
            hf_base = hf[(temperature, None)]
            # Temperature 0 is greedy decoding for both methods: the greedy-drafting run stands for both.
            hf_spec = hf[(temperature, drafting if temperature else DRAFTING[0])]
            row = [
                f"{temperature:g}",
                drafting,
                fmt(hf_base.tokens_per_second),
                fmt(hf_spec.tokens_per_second),
                fmt(hf_spec.tokens_per_second / hf_base.tokens_per_second, ".2f") + "x",
                fmt(hf_spec.acceptance_length, ".2f"),
            ]
            if vllm:
                vllm_base, vllm_spec = vllm[(temperature, None)], vllm[(temperature, drafting)]
                row += [
                    fmt(vllm_base["tokens_per_second"]),
                    fmt(vllm_spec["tokens_per_second"]),
                    fmt(vllm_spec["tokens_per_second"] / vllm_base["tokens_per_second"], ".2f") + "x",
                    fmt(vllm_spec["acceptance_length"], ".2f"),
                ]
            rows.append(row)
    headers = ["T", "drafting", "HF no-spec tok/s", "HF spec tok/s", "HF speedup", "HF accept len"]
    if vllm:
        headers += ["vLLM no-spec tok/s", "vLLM spec tok/s", "vLLM speedup", "vLLM accept len"]
    print()
    print_table(headers, rows)

    hottest = max(args.temperatures)
    if hottest > 0:
        engines = {"HF-native": {d: hf[(hottest, d)].acceptance_length for d in DRAFTING}}
        if vllm:
            engines["vLLM"] = {d: vllm[(hottest, d)]["acceptance_length"] for d in DRAFTING}
        for engine, lengths in engines.items():
            greedy, probabilistic = lengths["greedy"], lengths["probabilistic"]
            ratio = probabilistic / greedy if greedy and probabilistic else None
            print(
                f"{engine} at T={hottest:g}: acceptance length probabilistic {fmt(probabilistic, '.2f')} / greedy "
                f"{fmt(greedy, '.2f')} = {fmt(ratio, '.2f')}x (goal >= 1.5x)"
            )
    print(machine_load())


if __name__ == "__main__":
    main()
