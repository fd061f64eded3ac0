"""The main job's report: the runs' logs joined by step into ``results.csv``, the summary (``summary.json`` and the
console table) with the reward curves compared by a permutation test, and ``results.png``."""

import csv
import json
import math
from pathlib import Path

import torch


PLAIN = "plain"
"""The run without speculation; every other run is named by its drafter family and compared with it."""

RUN_COLUMNS = {
    # column (suffixed with the run's name): logged metric, in every run
    "reward": "reward",
    "step_seconds": "time/step",
    "generation_seconds": "time/generation",
}
SPEC_COLUMNS = {
    # column (suffixed with the run's name): logged metric, in the speculative runs
    "tokens_per_s": "spec/tokens_per_second",
    "draft_training_seconds": "time/draft_training",
    "num_speculative_tokens": "spec/num_speculative_tokens",
    "predicted_speedup": "spec/predicted_speedup",
    "acceptance_rollouts": "spec/acceptance_length",  # over the rounds that drafted (NaN: none did)
    "plain_round_share": "spec/plain_round_share",  # rounds the cost model decoded plainly (K = 0)
}
PLAIN_COLUMNS = {"tokens_per_s": "rollout/tokens_per_second"}
TOOL_COLUMNS = {
    # column (suffixed with the run's name): logged metric, in the runs whose rollouts call tools
    "turns_per_rollout": "tools/turns_per_rollout",  # assistant turns
    "tool_calls_per_rollout": "tools/call_frequency",
    "tool_calls_seconds": "time/tool_calls",  # the tools' own time
}
PROBE_COLUMNS = ["acceptance_cotrained", "acceptance_frozen", "kl_from_initial", "distinct_4grams"]
TIME_PARTS = ("generation", "draft_training", "weight_sync", "policy_training")
TOOL_TIME_PART = "tool_calls"  # a part of the step where the runs log it (rollouts that call tools)


def report(
    runs: dict[str, tuple[list[dict], float]],
    probes: dict[str, list[dict]],
    output_dir: Path,
    rollout_rewards: dict[str, list[tuple[list[float], list[float]]]] | None = None,
    baseline: str = "plain TRL",
) -> dict:
    """Join the logs by step; print and write the summary (summary.json), the per-step table (results.csv) and
    the plot (results.png). ``runs``: (log history, GRPO seconds) of each speculative run, named by its drafter, and
    with the baseline of `PLAIN`; ``probes``: each speculative run's probe rows; ``rollout_rewards``: each run's
    probe rewards of speculative and of plain samples at the same policy."""
    speculative = [run for run in runs if run != PLAIN]
    by_step: dict[int, dict] = {}
    columns = ["step"]
    for run, (history, _) in runs.items():
        metrics = {**RUN_COLUMNS, **(PLAIN_COLUMNS if run == PLAIN else SPEC_COLUMNS)}
        metrics.update({column: metric for column, metric in TOOL_COLUMNS.items() if _logged(history, metric)})
        columns += [f"{column}_{run}" for column in metrics]
        for column, metric in metrics.items():
            for entry in history:
                if metric in entry and "step" in entry:
                    by_step.setdefault(entry["step"], {})[f"{column}_{run}"] = entry[metric]
    for run in speculative:
        columns += [f"{column}_{run}" for column in PROBE_COLUMNS]
        for probe in probes.get(run, []):
            values = {f"{key}_{run}": value for key, value in probe.items() if key != "step"}
            by_step.setdefault(probe["step"], {}).update(values)
    rows = [{"step": step, **{c: by_step[step].get(c, math.nan) for c in columns[1:]}} for step in sorted(by_step)]
    with open(output_dir / "results.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)

    summary = {"baseline": baseline, **summarize(runs, rows, probes, rollout_rewards or {})}
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print_summary(summary, list(runs))
    plot(rows, list(runs), output_dir / "results.png", baseline)
    return {"summary": summary, "rows": rows}


def summarize(
    runs: dict[str, tuple[list[dict], float]], rows: list[dict], probes: dict[str, list[dict]], rollout_rewards: dict
) -> dict:
    """Per run: its time, throughput and shares of the step; per speculative run also its speed-ups over `PLAIN`,
    its reward against the plain run's (block permutation test), the cost model's figures and its probes'."""
    summary: dict = {}
    for run, (history, seconds) in runs.items():
        totals = {part: sum(e.get(f"time/{part}", 0.0) for e in history) for part in time_parts(runs)}
        step_total = sum(totals.values()) or math.nan
        summary[run] = {
            "grpo_seconds": seconds,
            "rollout_tokens_per_second": _mean(_column(rows, f"tokens_per_s_{run}")),
            "generation_seconds": totals["generation"],
            **{f"share_{part}": total / step_total for part, total in totals.items()},
            "reward_last_half": _mean(_last_half(rows, f"reward_{run}")),
        }
        for column in ("turns_per_rollout", "tool_calls_per_rollout"):
            if f"{column}_{run}" in rows[0]:
                summary[run][column] = _mean(_column(rows, f"{column}_{run}"))
    plain = summary.get(PLAIN)
    for run, (history, _) in runs.items():
        if run == PLAIN:
            continue
        spec = summary[run]
        if plain is not None:
            spec["end_to_end_speedup"] = plain["grpo_seconds"] / spec["grpo_seconds"]
            spec["rollout_speedup"] = spec["rollout_tokens_per_second"] / plain["rollout_tokens_per_second"]
            # The same rollouts kept, timed: tokens/s also counts what TRL generates past a tool-loop turn's budget
            # and then cuts (the speculative turns stop at the budget).
            spec["generation_speedup"] = plain["generation_seconds"] / spec["generation_seconds"]
            # Steps of one run are not independent (each starts from the policy the previous ones made), so the
            # curves are compared by blocks of REWARD_BLOCK steps.
            halves = [_last_half(rows, f"reward_{name}") for name in (run, PLAIN)]
            spec["reward_block_p_value"] = permutation_p_value(*[_block_means(h, REWARD_BLOCK) for h in halves])
        if rollout_rewards.get(run):
            pairs = rollout_rewards[run]
            spec["probe_rollout_reward"] = {
                "spec": _mean([r for sampled, _ in pairs for r in sampled]),
                "plain": _mean([r for _, sampled in pairs for r in sampled]),
            }
            spec["probe_rollout_p_value"] = permutation_p_value(*map(list, zip(*pairs)), stratified=True)
        for name in ("num_speculative_tokens", "predicted_speedup", "measured_speedup"):
            spec[name] = _mean([e[f"spec/{name}"] for e in history if f"spec/{name}" in e])
        if probes.get(run):
            first, last = probes[run][0], probes[run][-1]
            spec["acceptance"] = {
                "cotrained_start": first["acceptance_cotrained"],
                "cotrained_end": last["acceptance_cotrained"],
                "frozen_end": last["acceptance_frozen"],
                "cotrained_over_frozen_end": last["acceptance_cotrained"] / last["acceptance_frozen"],
                "cotrained_end_over_start": last["acceptance_cotrained"] / first["acceptance_cotrained"],
            }
            spec["kl_from_initial_end"] = last["kl_from_initial"]
    return summary


def time_parts(runs: dict[str, tuple[list[dict], float]]) -> tuple[str, ...]:
    """The parts of a step to report: `TIME_PARTS`, and the tool loop's own time where a run's rollouts called tools
    (every run logs it, 0 without tools)."""
    tools = any(entry.get(f"time/{TOOL_TIME_PART}", 0.0) > 0 for history, _ in runs.values() for entry in history)
    return (*TIME_PARTS, TOOL_TIME_PART) if tools else TIME_PARTS


def _logged(history: list[dict], metric: str) -> bool:
    return any(metric in entry for entry in history)


def _column(rows: list[dict], column: str) -> list[float]:
    return [row[column] for row in rows if not math.isnan(row[column])]


def _last_half(rows: list[dict], column: str) -> list[float]:
    values = _column(rows, column)
    return values[len(values) // 2 :]


def permutation_p_value(a, b, *, stratified: bool = False, permutations: int = 10_000, seed: int = 0) -> float:
    """Two-sided p-value of ``mean(a) - mean(b)`` under random relabelling of the pooled values: the chance that
    samples of one law differ by at least this much. ``stratified``: ``a`` and ``b`` are lists of groups (one per
    probe) and labels are exchanged within a group only; the statistic is the mean of the groups' differences."""
    groups = list(zip(a, b)) if stratified else [(a, b)]
    groups = [(list(x), list(y)) for x, y in groups if len(x) and len(y)]
    if not groups:
        return math.nan
    generator = torch.Generator().manual_seed(seed)
    observed = torch.zeros((), dtype=torch.float64)
    shuffled_total = torch.zeros(permutations, dtype=torch.float64)
    for x, y in groups:
        pooled = torch.tensor(x + y, dtype=torch.float64)
        observed += pooled[: len(x)].mean() - pooled[len(x) :].mean()
        order = torch.stack([torch.randperm(len(pooled), generator=generator) for _ in range(permutations)])
        shuffled = pooled[order]
        shuffled_total += shuffled[:, : len(x)].mean(1) - shuffled[:, len(x) :].mean(1)
    return float(((shuffled_total.abs() >= observed.abs() - 1e-12).sum() + 1) / (permutations + 1))


REWARD_BLOCK = 10


def _block_means(values: list[float], size: int) -> list[float]:
    return [_mean(values[start : start + size]) for start in range(0, len(values) - size + 1, size)] or [_mean(values)]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def print_summary(summary: dict, runs: list[str]) -> None:
    """The console table: a column per run (the speculative runs by drafter, then the baseline), then a line per
    speculative run with its speed-ups, reward test, K and acceptance."""
    names = {run: summary["baseline"] if run == PLAIN else f"{run} co-trained" for run in runs}
    width = max(14, *(len(name) + 2 for name in names.values()))

    def line(label: str, values, fmt: str) -> None:
        print(f"{label:34}" + "".join(f"{value:>{width}{fmt}}" for value in values))

    print()
    print(f"{'':34}" + "".join(f"{names[run]:>{width}}" for run in runs))
    line("GRPO steps, wall seconds", [summary[run]["grpo_seconds"] for run in runs], ".1f")
    line("rollout tokens / s", [summary[run]["rollout_tokens_per_second"] for run in runs], ".0f")
    for part in (*TIME_PARTS, TOOL_TIME_PART):
        if all(f"share_{part}" in summary[run] for run in runs):
            line(f"share of step: {part}", [summary[run][f"share_{part}"] for run in runs], ".1%")
    for column, label in (
        ("turns_per_rollout", "assistant turns per rollout"),
        ("tool_calls_per_rollout", "tool calls per rollout"),
    ):
        if any(column in summary[run] for run in runs):
            line(label, [summary[run].get(column, math.nan) for run in runs], ".2f")
    line("reward, mean over last half", [summary[run]["reward_last_half"] for run in runs], ".3f")
    for run in runs:
        if run == PLAIN:
            continue
        spec = summary[run]
        print(f"\n{run}:")
        if "end_to_end_speedup" in spec:
            print(
                f"  end to end {spec['end_to_end_speedup']:.2f}x, rollouts {spec['rollout_speedup']:.2f}x (tokens/s; "
                f"generation time {spec['generation_speedup']:.2f}x); reward "
                f"curves against {summary['baseline']}, permutation test over blocks of {REWARD_BLOCK} steps of the "
                f"last half: p = {spec['reward_block_p_value']:.2f}"
            )
        if "probe_rollout_p_value" in spec:
            probe = spec["probe_rollout_reward"]
            print(
                f"  at the same policy (probes), reward of speculative / plain samples {probe['spec']:.3f} / "
                f"{probe['plain']:.3f}: permutation test within probes p = {spec['probe_rollout_p_value']:.2f}"
            )
        print(
            f"  K per round (auto) {spec['num_speculative_tokens']:.2f}; the cost model's speed-up over plain "
            f"decoding: predicted {spec['predicted_speedup']:.2f}x, measured {spec['measured_speedup']:.2f}x"
        )
        if "acceptance" in spec:
            acceptance = spec["acceptance"]
            print(
                f"  acceptance at the end: co-trained {acceptance['cotrained_end']:.2f} / frozen "
                f"{acceptance['frozen_end']:.2f} = {acceptance['cotrained_over_frozen_end']:.2f}x; co-trained kept "
                f"{acceptance['cotrained_end_over_start']:.2f}x of its start ({acceptance['cotrained_start']:.2f}); "
                f"KL from initial {spec['kl_from_initial_end']:.2f}"
            )


def plot(rows: list[dict], runs: list[str], path: Path, baseline: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[grpo] matplotlib is not installed: no plot (pip install 'hf-spec-cotrain[notebook]').")
        return

    def series(axis, key, label=None, **style):
        points = [(row["step"], row[key]) for row in rows if key in row and not math.isnan(row[key])]
        if points:
            axis.plot(*zip(*points), label=label, **style)

    colors = dict(zip(runs, ("tab:blue", "tab:green", "tab:purple", "tab:brown")))
    colors[PLAIN] = "tab:orange"
    labels = {run: baseline if run == PLAIN else f"{run} co-trained" for run in runs}
    figure, axes = plt.subplots(1, 4, figsize=(20, 4))
    for run in runs:
        color, label = colors[run], labels[run]
        series(axes[0], f"reward_{run}", label, color=color)
        series(axes[1], f"step_seconds_{run}", f"step, {label}", color=color)
        series(axes[1], f"generation_seconds_{run}", f"generation, {label}", color=color, linestyle="--")
        series(axes[2], f"acceptance_cotrained_{run}", f"{run} co-trained", color=color, marker="o")
        series(axes[2], f"acceptance_frozen_{run}", f"{run} frozen warm start", color=color, marker="x", linestyle=":")
        series(axes[3], f"kl_from_initial_{run}", label, color=color, marker="o")
    axes[0].set(title="reward", xlabel="step")
    axes[1].set(title="seconds per GRPO step", xlabel="step")
    axes[2].set(title="acceptance length (same prompts, same seed)", xlabel="step")
    axes[3].set(title="KL(policy || initial policy) per token", xlabel="step")
    for axis in axes:
        if axis.get_legend_handles_labels()[0]:  # the probes' panels are empty with --probe_prompts 0
            axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
