"""Greedy decoding speed with and without speculation, EAGLE-3 and DFlash drafts side by side: HF-native
`speculative_generate` and vLLM, one table.

On the cached benchmark target and warm-started drafts of `bench_assets.py` (built on first use), with prompts
that are real-text prefixes from held-out standard-library files (repeated to fill batches larger than their count):

* HF-native: `target.generate(do_sample=False)` against `speculative_generate` with each drafter at its fixed K
  (``--num_speculative_tokens``) and under "auto" as the trainer runs it (`AdaptiveSpeculation` with that K as its
  most: each whole call decoded plainly where the cost model expects K = 0 to win, else K chosen per round), all
  runs of one (dtype, batch) alternating; in float32 the outputs must be token-for-token equal (`== target`).
* vLLM: `VLLMRolloutEngine` without a draft and with each drafter at its fixed K (temperature 0). Each engine runs
  in its own subprocess, one after the other: every engine gets a fresh OpenMP state, vLLM's thread binding and
  (when the venv has it) Intel OpenMP preloaded, which vLLM-CPU needs for fast speculative decoding; none of this
  can be undone in the parent process, which measures the HF side.

Throughput is generated tokens (up to and including EOS) per second of wall clock, median of ``--repeats`` timed
runs after one warm-up run. Acceptance length is ``1 + accepted / drafts`` over the speculative rounds.

``--dtypes`` runs every measurement once per dtype, target and drafts alike (default float32 and bfloat16, side by
side). The dtype sets the cost of verification: on this CPU a float32 matmul over the ``K + 1`` verified tokens
costs about ``(K + 1) / 2`` single-token ones, a bfloat16 one little more than one (the `round cost` column). In
bfloat16 the verification forward rounds differently from `generate`'s one-token forwards, so a greedy output may
leave `generate`'s at a near-tie: `== target` counts the rows that never do.

    OMP_NUM_THREADS=2 python scripts/bench_speculative.py            # full run
    OMP_NUM_THREADS=2 python scripts/bench_speculative.py --quick    # smoke run, a few minutes
    OMP_NUM_THREADS=2 python scripts/bench_speculative.py --drafters dflash --num_speculative_tokens dflash=3
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


def fill(prompts: list[list[int]], count: int) -> list[list[int]]:
    """``count`` prompts: ``prompts`` repeated as often as needed."""
    return (prompts * (count // len(prompts) + 1))[:count]


def load_prompts(assets: BenchAssets, count: int) -> list[list[int]]:
    """The first ``count`` held-out prompts: ``prefix_len``-token windows of held-out stdlib files."""
    sequences = json.loads((assets.cache_dir / "generated" / "sequences.json").read_text())["eval"]
    if count > len(sequences):
        raise ValueError(f"Asked for {count} prompts; the benchmark assets hold {len(sequences)} held-out prompts.")
    prefix_len = GenerationConfig().prefix_len
    return [row[:prefix_len] for row in sequences[:count]]


def speed_up_cells(baseline_tps: float, speculative_tps: float, acceptance: float | None, k: int | None) -> list[str]:
    """Speed-up, acceptance, the cost of one speculative round in plain decoding steps (a round emits
    ``acceptance`` tokens in the time plain decoding emits ``acceptance / speed-up``), and the speed-up at full
    acceptance for that cost: what a better draft could reach on this machine. ``k`` None (K varies between
    rounds): no round cost or ceiling."""
    speed_up = speculative_tps / baseline_tps
    # None: no spec-decode counters, or rounds of different K
    round_cost = None if acceptance is None or k is None else acceptance / speed_up
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


def prompt_count(num_prompts: int, batch_size: int, *, quick: bool) -> int:
    """Prompts decoded at ``batch_size``: whole batches of at least ``num_prompts`` (batch 1 decodes them one after
    the other; a quick run keeps only two of them there)."""
    count = 2 if quick and batch_size == 1 else max(num_prompts, batch_size)
    return count - count % batch_size


def batches(prompts: list[list[int]], batch_size: int) -> list[torch.Tensor]:
    """Consecutive batches of equal-length prompts (the benchmark prompts need no padding)."""
    return [torch.tensor(prompts[start : start + batch_size]) for start in range(0, len(prompts), batch_size)]


def load_models(assets: BenchAssets, dtype: torch.dtype = torch.float32, drafters: tuple[str, ...] = ("eagle3",)):
    """The target and ``{drafter: draft}`` in ``dtype``."""
    from transformers import AutoModelForCausalLM

    from hf_spec_cotrain.draft import load_draft

    target = AutoModelForCausalLM.from_pretrained(assets.target_dir, dtype=dtype).eval()
    drafts = {
        drafter: load_draft(assets.draft_dirs[drafter], drafter, target=target).to(dtype).eval()
        for drafter in drafters
    }
    return target, drafts


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


def hf_auto_run(
    auto,
    batch_size: int,
    plain: Callable[[int], RunOutput],
    speculative: Callable[[int], RunOutput],
    rounds: list[tuple[int, int]],
) -> Callable[[int], RunOutput]:
    """What the trainer does under "auto": a whole call decoded plainly or by ``speculative`` (a run whose K is the
    `AdaptiveSpeculation` ``auto``) as ``auto.prefers_plain`` says, its tokens per second fed back; a plain call
    counts as one K = 0 round of ``batch_size`` rows in ``rounds``. The warm-up makes two calls, a speculative one
    and a plain one, so that the timed calls start from both routes measured, as a trainer's do from its second
    step on."""

    def call(repeat: int) -> RunOutput:
        prefers_plain = auto.prefers_plain(batch_size)
        started = time.perf_counter()
        out = plain(repeat) if prefers_plain else speculative(repeat)
        num_tokens = sum(map(len, out.completions))
        auto.observe_call(
            batch_size, plain=prefers_plain, seconds=time.perf_counter() - started, num_tokens=num_tokens
        )
        if prefers_plain:
            rounds.append((batch_size, 0))
        return out

    def run(repeat: int) -> RunOutput:
        if repeat == 0:
            call(repeat)
        return call(repeat)

    return run


def mean_k(rounds: list[tuple[int, int]]) -> float:
    """Tokens proposed per row and round over ``(live rows, K)`` rounds."""
    return sum(live * k for live, k in rounds) / max(sum(live for live, _ in rounds), 1)


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
    # per batch size (in order) the first so many prompts, as the HF side decodes them; None: all of them
    prompt_counts: list[int] | None = None


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

    counts = dict(zip(job.batch_sizes, job.prompt_counts or [len(job.prompts)] * len(job.batch_sizes)))

    def vllm_run(batch_size: int, temperature: float) -> Callable[[int], RunOutput]:
        prompts = job.prompts[: counts[batch_size]]
        groups = [prompts[start : start + batch_size] for start in range(0, len(prompts), batch_size)]

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
    prompt_counts: list[int],
    hf_greedy: dict[int, list[list[int]]],
    *,
    dtype: str,
    eos: int,
    threads: int,
    repeats: int,
    max_new_tokens: int,
    batch_sizes: list[int],
    ks: dict[str, int],
) -> list[list[str]]:
    """Table rows of vLLM without a draft and with each drafter of ``ks`` (at its K) in ``dtype``, each engine in
    its own subprocess; at each batch size the engines decode the first ``prompt_counts`` prompts, as HF did."""
    jobs = {}
    for name, draft_dir in (("plain", None), *((drafter, str(assets.draft_dirs[drafter])) for drafter in ks)):
        jobs[name] = run_vllm_job(
            VLLMJob(
                target_dir=str(assets.target_dir),
                draft_dir=draft_dir,
                prompts=prompts,
                max_new_tokens=max_new_tokens,
                repeats=repeats,
                batch_sizes=batch_sizes,
                num_speculative_tokens=ks.get(name, 1),  # unused without a draft
                dtype=dtype,
                prompt_counts=prompt_counts,
            ),
            threads=threads,
        )
        print(f"vLLM {dtype} {name} engine done (startup {jobs[name]['startup_seconds']:.0f} s)", flush=True)
    rows = []
    for index, baseline in enumerate(jobs["plain"]["runs"]):
        batch_size = baseline["batch_size"]
        reference = hf_greedy.get(batch_size) or []
        for drafter, k in ks.items():
            speculative = jobs[drafter]["runs"][index]
            produced = [row[: row.index(eos) + 1] if eos in row else row for row in speculative["completions"]]
            equal = sum(a == b for a, b in zip(reference, produced))
            rows.append(
                [
                    "vLLM",
                    dtype,
                    str(batch_size),
                    drafter,
                    str(k),
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


def hf_rows(
    target,
    drafts: dict,
    ks: dict[str, int],
    prompts: list[list[int]],
    *,
    dtype: str,
    batch_size: int,
    max_new_tokens: int,
    repeats: int,
) -> tuple[list[list[str]], list[list[int]]]:
    """Table rows of HF-native plain decoding against each draft at its fixed K and under "auto", all alternating,
    and the plain greedy completions (the reference of the engines' `== target`)."""
    from hf_spec_cotrain import AdaptiveSpeculation

    groups = batches(prompts, batch_size)
    runs = {"plain": hf_baseline_run(target, groups, max_new_tokens=max_new_tokens, temperature=0, seed=0)}
    speculative = dict(max_new_tokens=max_new_tokens, temperature=0, draft_sampling=None, seed=0)
    auto_rounds = {}
    for drafter, draft in drafts.items():
        runs[f"{drafter} K"] = hf_speculative_run(target, draft, groups, k=ks[drafter], **speculative)
        auto, auto_rounds[drafter] = AdaptiveSpeculation(ks[drafter], draft_forwards=draft.draft_forwards), []
        adaptive = hf_speculative_run(target, draft, groups, k=auto, rounds=auto_rounds[drafter], **speculative)
        runs[f"{drafter} auto"] = hf_auto_run(auto, batch_size, runs["plain"], adaptive, auto_rounds[drafter])
    timings = time_alternating(runs, repeats=repeats)
    plain = timings["plain"]
    rows = []
    for drafter in drafts:
        for name, k_cell, k in (
            (f"{drafter} K", str(ks[drafter]), ks[drafter]),
            (f"{drafter} auto", f"auto ({mean_k(auto_rounds[drafter]):.2f})", None),
        ):
            timing = timings[name]
            equal = sum(a == b for a, b in zip(plain.completions, timing.completions))
            rows.append(
                [
                    "HF-native",
                    dtype,
                    str(batch_size),
                    drafter,
                    k_cell,
                    fmt(plain.tokens_per_second),
                    fmt(timing.tokens_per_second),
                    *speed_up_cells(plain.tokens_per_second, timing.tokens_per_second, timing.acceptance_length, k),
                    f"{equal}/{len(plain.completions)}",
                ]
            )
    return rows, plain.completions


# ---------------------------------------------------------------------------------------------- main


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_KS = {"eagle3": 3, "dflash": 7}  # EAGLE-3 as it was benchmarked; DFlash its whole block of 8 but the anchor


def drafter_k(value: str) -> tuple[str, int]:
    """``DRAFTER=K`` of ``--num_speculative_tokens``."""
    drafter, _, k = value.partition("=")
    if drafter not in DEFAULT_KS or not k.isdigit() or int(k) < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: expected DRAFTER=K with DRAFTER in {list(DEFAULT_KS)}, K >= 1")
    return drafter, int(k)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: short generations, one timed repeat")
    parser.add_argument("--max_new_tokens", type=int, default=None, help="default 128 (--quick: 32)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs after the warm-up (default 3, quick 1)")
    parser.add_argument(
        "--num_prompts", type=int, default=None, help="prompts per measurement, default 8 (--quick: 8, at batch 1: 2)"
    )
    parser.add_argument("--drafters", nargs="+", choices=list(DEFAULT_KS), default=list(DEFAULT_KS))
    parser.add_argument(
        "--num_speculative_tokens",
        type=drafter_k,
        nargs="+",
        default=[],
        metavar="DRAFTER=K",
        help=f"fixed K of a drafter, and the most 'auto' may choose (default: {DEFAULT_KS})",
    )
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument(
        "--dtypes",
        nargs="+",
        choices=list(DTYPES),
        default=list(DTYPES),
        help="dtypes of target and drafts, each measured in full (default: all)",
    )
    parser.add_argument("--skip_vllm", action="store_true", help="HF-native rows only")
    parser.add_argument("--cache_dir", default=None, help="benchmark assets (default: bench_assets' cache)")
    parser.add_argument("--target_minutes", type=float, default=None, help="bench_assets' target budget")
    parser.add_argument("--draft_minutes", type=float, default=None, help="bench_assets' draft budgets")
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
    ks = {drafter: dict(DEFAULT_KS, **dict(args.num_speculative_tokens))[drafter] for drafter in args.drafters}

    budgets = {name: getattr(args, name) for name in ("target_minutes", "draft_minutes") if getattr(args, name)}
    assets = ensure_bench_assets(args.cache_dir, **budgets)
    prompts = load_prompts(assets, num_prompts)
    print(
        f"\ntarget {assets.target_dir} (held-out loss {assets.target_metrics['held_out_loss']:.2f}), drafts "
        + ", ".join(f"{drafter} {assets.draft_dirs[drafter]} (K={k})" for drafter, k in ks.items())
        + f"\n{max_new_tokens} new tokens, prompts of {len(prompts[0])} tokens, {threads} torch thread(s), median of "
        f"{repeats} after a warm-up; {machine_load()}\n",
        flush=True,
    )
    config = json.loads((Path(assets.target_dir) / "config.json").read_text())
    shape = (config["hidden_size"], config["intermediate_size"])
    row_counts = (1, *sorted({k + 1 for k in ks.values()}))
    for dtype in args.dtypes:
        costs = " / ".join(f"{matmul_microseconds(*shape, rows, DTYPES[dtype]):.0f}" for rows in row_counts)
        print(f"one {shape[0]} x {shape[1]} matmul over {' / '.join(map(str, row_counts))} rows, {dtype}: {costs} us")
    rows = []
    for dtype in args.dtypes:
        target, drafts = load_models(assets, DTYPES[dtype], tuple(ks))
        hf_greedy = {}
        for batch_size in args.batch_sizes:
            cell_rows, hf_greedy[batch_size] = hf_rows(
                target,
                drafts,
                ks,
                fill(prompts, prompt_count(num_prompts, batch_size, quick=args.quick)),
                dtype=dtype,
                batch_size=batch_size,
                max_new_tokens=max_new_tokens,
                repeats=repeats,
            )
            rows += cell_rows
            print(f"HF-native {dtype} batch {batch_size} done ({machine_load()})", flush=True)
        if not args.skip_vllm:
            counts = [prompt_count(num_prompts, batch_size, quick=args.quick) for batch_size in args.batch_sizes]
            rows += vllm_rows(
                assets,
                fill(prompts, max(counts)),
                counts,
                hf_greedy,
                dtype=dtype,
                eos=target.generation_config.eos_token_id,
                threads=threads,
                repeats=repeats,
                max_new_tokens=max_new_tokens,
                batch_sizes=args.batch_sizes,
                ks=ks,
            )
        del target, drafts

    print()
    print_table(
        [
            "engine",
            "dtype",
            "batch",
            "drafter",
            "K",
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
        "\n`K`: tokens proposed per round; `auto (m)`: chosen per call and round by the cost model, m per row and "
        "round on average (a plain call counts as K = 0). `round cost`: one draft-and-verify round in plain decoding "
        "steps (acceptance / speed-up); `ceiling`: the speed-up if every draft token were accepted at that cost "
        "(K + 1 tokens per round).\n`== target`: rows whose speculative greedy output equals HF `target.generate`'s "
        "in the same dtype. " + machine_load()
    )


if __name__ == "__main__":
    main()
