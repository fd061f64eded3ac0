"""The main job's report: the runs' logs joined by step into ``results.csv``, the summary (``summary.json`` and the
console table) with the reward curves compared by a permutation test, and ``results.png``."""

import csv
import json
import math
from pathlib import Path

import torch


STEP_COLUMNS = {
    # column: (run, logged metric)
    "reward_spec": ("spec", "reward"),
    "reward_plain": ("plain", "reward"),
    "step_seconds_spec": ("spec", "time/step"),
    "step_seconds_plain": ("plain", "time/step"),
    "generation_seconds_spec": ("spec", "time/generation"),
    "generation_seconds_plain": ("plain", "time/generation"),
    "draft_training_seconds": ("spec", "time/draft_training"),
    "tokens_per_s_spec": ("spec", "spec/tokens_per_second"),
    "tokens_per_s_plain": ("plain", "rollout/tokens_per_second"),
    "num_speculative_tokens": ("spec", "spec/num_speculative_tokens"),
    "predicted_speedup": ("spec", "spec/predicted_speedup"),
    "acceptance_rollouts": ("spec", "spec/acceptance_length"),  # over the rounds that drafted (NaN: none did)
    "plain_round_share": ("spec", "spec/plain_round_share"),  # rounds the cost model decoded plainly (K = 0)
}
PROBE_COLUMNS = ["acceptance_cotrained", "acceptance_frozen", "kl_from_initial", "distinct_4grams"]
TIME_PARTS = ("generation", "draft_training", "weight_sync", "policy_training")


def report(
    runs: dict[str, tuple[list[dict], float]],
    probes: list[dict],
    output_dir: Path,
    rollout_rewards: list[tuple[list[float], list[float]]] = (),
    baseline: str = "plain TRL",
) -> dict:
    """Join the logs by step; print and write the summary (summary.json), the per-step table (results.csv) and
    the plot (results.png). ``runs``: "spec" and, with the baseline, "plain": (log history, GRPO seconds);
    ``rollout_rewards``: the probes' rewards of speculative and of plain samples at the same policy."""
    by_step: dict[int, dict] = {}
    for column, (run, metric) in STEP_COLUMNS.items():
        for entry in runs.get(run, ([], 0))[0]:
            if metric in entry and "step" in entry:
                by_step.setdefault(entry["step"], {})[column] = entry[metric]
    for probe in probes:
        by_step.setdefault(probe["step"], {}).update({k: v for k, v in probe.items() if k != "step"})
    columns = ["step", *STEP_COLUMNS, *PROBE_COLUMNS]
    rows = [{"step": step, **{c: by_step[step].get(c, math.nan) for c in columns[1:]}} for step in sorted(by_step)]
    with open(output_dir / "results.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)

    summary = {"baseline": baseline, **summarize(runs, rows, probes, rollout_rewards)}
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print_summary(summary)
    plot(rows, output_dir / "results.png", baseline)
    return {"summary": summary, "rows": rows}


def summarize(
    runs: dict[str, tuple[list[dict], float]], rows: list[dict], probes: list[dict], rollout_rewards
) -> dict:
    summary: dict = {}
    for run, (history, seconds) in runs.items():
        totals = {part: sum(e.get(f"time/{part}", 0.0) for e in history) for part in TIME_PARTS}
        step_total = sum(totals.values()) or math.nan
        tokens_key = "spec/tokens_per_second" if run == "spec" else "rollout/tokens_per_second"
        summary[run] = {
            "grpo_seconds": seconds,
            "rollout_tokens_per_second": _mean([e[tokens_key] for e in history if tokens_key in e]),
            **{f"share_{part}": totals[part] / step_total for part in TIME_PARTS},
        }
    if "plain" in runs:
        spec, plain = summary["spec"], summary["plain"]
        summary["end_to_end_speedup"] = plain["grpo_seconds"] / spec["grpo_seconds"]
        summary["rollout_speedup"] = spec["rollout_tokens_per_second"] / plain["rollout_tokens_per_second"]
        rewards = {run: [r[f"reward_{run}"] for r in rows if not math.isnan(r[f"reward_{run}"])] for run in runs}
        half = {run: values[len(values) // 2 :] for run, values in rewards.items()}
        summary["reward_last_half"] = {run: _mean(values) for run, values in half.items()}
        # Steps of one run are not independent (each starts from the policy the previous ones made), so the
        # curves are compared by blocks of REWARD_BLOCK steps.
        blocks = {run: _block_means(values, REWARD_BLOCK) for run, values in half.items()}
        summary["reward_block_p_value"] = permutation_p_value(blocks["spec"], blocks["plain"])
    if rollout_rewards:
        summary["probe_rollout_reward"] = {
            "spec": _mean([r for spec, _ in rollout_rewards for r in spec]),
            "plain": _mean([r for _, plain in rollout_rewards for r in plain]),
        }
        summary["probe_rollout_p_value"] = permutation_p_value(*map(list, zip(*rollout_rewards)), stratified=True)
    history = runs["spec"][0]
    for name in ("num_speculative_tokens", "predicted_speedup", "measured_speedup"):
        summary[name] = _mean([e[f"spec/{name}"] for e in history if f"spec/{name}" in e])
    if probes:
        first, last = probes[0], probes[-1]
        summary["acceptance"] = {
            "cotrained_start": first["acceptance_cotrained"],
            "cotrained_end": last["acceptance_cotrained"],
            "frozen_end": last["acceptance_frozen"],
            "cotrained_over_frozen_end": last["acceptance_cotrained"] / last["acceptance_frozen"],
            "cotrained_end_over_start": last["acceptance_cotrained"] / first["acceptance_cotrained"],
        }
        summary["kl_from_initial_end"] = last["kl_from_initial"]
    return summary


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


def print_summary(summary: dict) -> None:
    print()
    spec, plain = summary["spec"], summary.get("plain")
    header = f"{'':34}{'with speculation':>18}{summary['baseline']:>14}"
    print(header)
    print(
        f"{'GRPO steps, wall seconds':34}{spec['grpo_seconds']:>18.1f}{plain['grpo_seconds'] if plain else math.nan:>14.1f}"
    )
    print(
        f"{'rollout tokens / s':34}{spec['rollout_tokens_per_second']:>18.0f}"
        f"{plain['rollout_tokens_per_second'] if plain else math.nan:>14.0f}"
    )
    for part in TIME_PARTS:
        print(
            f"{'share of step: ' + part:34}{spec[f'share_{part}']:>18.1%}{plain[f'share_{part}'] if plain else math.nan:>14.1%}"
        )
    if plain:
        rewards = summary["reward_last_half"]
        print(f"{'reward, mean over last half':34}{rewards['spec']:>18.3f}{rewards['plain']:>14.3f}")
        print(
            f"\nend to end {summary['end_to_end_speedup']:.2f}x, rollouts {summary['rollout_speedup']:.2f}x; reward "
            f"curves, permutation test over blocks of {REWARD_BLOCK} steps of the last half: "
            f"p = {summary['reward_block_p_value']:.2f}"
        )
    if "probe_rollout_p_value" in summary:
        probe = summary["probe_rollout_reward"]
        print(
            f"at the same policy (probes), reward of speculative / plain samples {probe['spec']:.3f} / "
            f"{probe['plain']:.3f}: permutation test within probes p = {summary['probe_rollout_p_value']:.2f}"
        )
    print(
        f"K per round (auto) {summary['num_speculative_tokens']:.2f}; the cost model's speed-up over plain decoding: "
        f"predicted {summary['predicted_speedup']:.2f}x, measured {summary['measured_speedup']:.2f}x"
    )
    if "acceptance" in summary:
        acceptance = summary["acceptance"]
        print(
            f"acceptance at the end: co-trained {acceptance['cotrained_end']:.2f} / frozen {acceptance['frozen_end']:.2f} "
            f"= {acceptance['cotrained_over_frozen_end']:.2f}x; co-trained kept {acceptance['cotrained_end_over_start']:.2f}x "
            f"of its start ({acceptance['cotrained_start']:.2f}); KL from initial {summary['kl_from_initial_end']:.2f}"
        )


def plot(rows: list[dict], path: Path, baseline: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[grpo] matplotlib is not installed: no plot (pip install 'hf-spec-cotrain[notebook]').")
        return

    def series(axis, key, label=None, **style):
        points = [(row["step"], row[key]) for row in rows if not math.isnan(row[key])]
        if points:
            axis.plot(*zip(*points), label=label, **style)

    figure, axes = plt.subplots(1, 4, figsize=(20, 4))
    series(axes[0], "reward_spec", "with speculation")
    series(axes[0], "reward_plain", "without speculation")
    axes[0].set(title="reward", xlabel="step")
    series(axes[1], "step_seconds_spec", "step, with speculation", color="tab:blue")
    series(axes[1], "step_seconds_plain", f"step, {baseline}", color="tab:orange")
    series(axes[1], "generation_seconds_spec", "generation, with speculation", color="tab:blue", linestyle="--")
    series(axes[1], "generation_seconds_plain", f"generation, {baseline}", color="tab:orange", linestyle="--")
    axes[1].set(title="seconds per GRPO step", xlabel="step")
    series(axes[2], "acceptance_cotrained", "co-trained draft", marker="o")
    series(axes[2], "acceptance_frozen", "frozen warm-start draft", marker="o")
    axes[2].set(title="acceptance length (same prompts, same seed)", xlabel="step")
    series(axes[3], "kl_from_initial", marker="o", color="tab:red")
    axes[3].set(title="KL(policy || initial policy) per token", xlabel="step")
    for axis in axes[:3]:
        if axis.get_legend_handles_labels()[0]:  # the probe's panel is empty with --probe_prompts 0
            axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
