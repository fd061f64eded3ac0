"""The example script end to end with its smallest settings, and the notebook executed as a user would."""

import csv
import json
import math
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture
def grpo_spec(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import grpo_spec

    return grpo_spec


def test_embedded_reward_is_verifiable(grpo_spec):
    good = "efghaefgheabfghefghbefgh"
    assert grpo_spec.letters([good]) == [sum(c in "efgh" for c in good) / 24]
    assert (
        grpo_spec.letters([good[:-1], "eeefghabefghefghefghefgh", "efefefefefefefefefefefef", good + "x"]) == [0] * 4
    )


def test_example_runs_end_to_end_and_writes_its_outputs(grpo_spec, tmp_path):
    rows = grpo_spec.main(
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
            "--logging_steps",
            "1",
            "--probe_prompts",
            "4",
            "--per_device_train_batch_size",
            "4",
            "--num_generations",
            "4",
        ]
    )
    assert [row["step"] for row in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert 0.0 <= row["reward_spec"] <= 1.0 and 0.0 <= row["reward_plain"] <= 1.0
        assert row["acceptance_rollouts"] >= 1.0 and row["tokens_per_s_spec"] > 0 and row["tokens_per_s_plain"] > 0
    for row in rows:
        assert row["acceptance_cotrained"] >= 1.0 and row["acceptance_frozen"] >= 1.0
        assert row["kl_from_initial"] >= -1e-6 and 0.0 < row["distinct_4grams"] <= 1.0
    assert rows[0]["kl_from_initial"] == pytest.approx(0.0, abs=1e-6)
    # step 0: both drafts are the warm-start draft, same prompts, same seed
    assert rows[0]["acceptance_cotrained"] == rows[0]["acceptance_frozen"]
    run = tmp_path / "run"
    with open(run / "results.csv") as handle:
        table = list(csv.DictReader(handle))
    assert [int(r["step"]) for r in table] == [0, 1, 2]
    assert math.isclose(float(table[-1]["acceptance_frozen"]), rows[-1]["acceptance_frozen"], rel_tol=1e-6)
    assert (run / "results.png").stat().st_size > 10_000
    draft = run / "draft"
    assert json.loads((draft / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    assert (draft / "model.safetensors").exists() and "vllm serve" in (draft / "README.md").read_text()
    # the second run reuses the cached policy and draft
    cached = json.loads((tmp_path / "cache" / "embedded" / "manifest.json").read_text())
    assert cached["sft_steps"] == 4


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
