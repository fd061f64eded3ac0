"""The model cards the package writes, end to end: the trainer's (`SpecCoTrainGRPOTrainer.save_draft`, after a short
GRPO run) and `hf-spec-cotrain train-draft`'s. Their front matter is read back with huggingface_hub as the Hub reads
it, and the Python snippet of each card runs as written, with local folders in place of the repo ids."""

import json
import re
import shutil
from pathlib import Path

import pytest
from datasets import Dataset
from huggingface_hub import ModelCard
from model_card_utils import assert_no_local_path, run_card_snippet
from tiny_policy import tiny_grpo_kwargs

from hf_spec_cotrain import SpecCoTrainConfig, SpecCoTrainGRPOTrainer, cli
from hf_spec_cotrain.testing import build_char_tokenizer


FINAL_POLICY_ID = "me/tiny-policy-grpo"
DRAFT_ID = "me/tiny-policy-grpo-eagle3"
LICENSED_README = "---\nlicense: apache-2.0\n---\n# A tiny policy\n"


@pytest.fixture(scope="module")
def licensed_policy_dir(tiny_policy_dir, tmp_path_factory) -> Path:
    """The tests' tiny policy with a model card that states its license."""
    folder = tmp_path_factory.mktemp("licensed") / "tiny-policy"
    shutil.copytree(tiny_policy_dir, folder)
    (folder / "README.md").write_text(LICENSED_README)
    return folder


@pytest.fixture(scope="module")
def cotrained(licensed_policy_dir, tmp_path_factory):
    """Two GRPO steps with co-training, the final policy published as `FINAL_POLICY_ID` (hub_model_id, not pushed):
    the trainer, its saved draft folder and its final policy saved to a folder."""
    output_dir = tmp_path_factory.mktemp("run")
    config = SpecCoTrainConfig(
        **tiny_grpo_kwargs(output_dir, max_steps=2, hub_model_id=FINAL_POLICY_ID),
        draft_learning_rate=1e-3,
        draft_warmup_steps=0,
    )
    trainer = SpecCoTrainGRPOTrainer(
        model=str(licensed_policy_dir),
        reward_funcs=lambda completions, **kwargs: [float(len(text)) for text in completions],
        args=config,
        train_dataset=Dataset.from_dict({"prompt": ["abc", "hello", "xyz!", "spec"]}),
        processing_class=build_char_tokenizer(),
    )
    trainer.train()
    final_policy = output_dir / "final-policy"
    trainer.save_model(str(final_policy))
    return trainer, output_dir / "draft", final_policy


def test_cotrained_card_front_matter_is_what_the_hub_and_serving_tools_read(cotrained, tmp_path_factory):
    trainer, draft_folder, _ = cotrained
    card = (draft_folder / "README.md").read_text()
    data = ModelCard(card).data
    assert data.license == "apache-2.0"  # from the policy's own card
    assert data.pipeline_tag == "text-generation"
    # No library loads the draft with its standard call: `AutoModelForCausalLM` would build a random Llama from it.
    assert data.library_name is None and "library_name" not in card
    assert data.base_model is None  # the starting policy is a local folder: named in the text, not in the metadata
    assert "The run started from `tiny-policy` (a local model" in card
    assert {"eagle3", "speculative-decoding", "draft-model", "hf_spec_cotrain", "grpo"} <= set(data.tags)
    assert_no_local_path(card, tmp_path_factory)
    # The draft pairs with the run's final policy, which the serving commands name.
    assert f"final policy of the same run**, [`{FINAL_POLICY_ID}`]" in card
    assert f"vllm serve {FINAL_POLICY_ID}" in card and f"--model-path {FINAL_POLICY_ID}" in card
    # Versions, hyperparameters, citation.
    assert "- transformers " in card and "- TRL " in card and "- hf_spec_cotrain " in card
    assert "| Policy learning rate | 0.001 |" in card and "| Drafted tokens per round (K) | 3 |" in card
    assert "| Generations per prompt x max completion length | 4 x 12 tokens |" in card
    assert "doi           = {10.48550/arXiv.2609.07108}" in card and "eprint        = {2503.01840}" in card
    # Steps as the logs number them (1-based optimizer steps).
    acceptance = card.split("## Acceptance during RL", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d+) \| (\d+\.\d{3}) \|$", acceptance, flags=re.MULTILINE)
    logged = [entry["step"] for entry in trainer.state.log_history if "spec/acceptance_length" in entry]
    assert [int(step) for step, _ in rows] == logged == [1, 2]


def test_cotrained_card_snippet_runs_as_written(cotrained, tmp_path):
    _, draft_folder, final_policy = cotrained
    card = (draft_folder / "README.md").read_text()
    printed = run_card_snippet(card, {FINAL_POLICY_ID: final_policy, DRAFT_ID: draft_folder}, tmp_path)
    assert printed.startswith("Speculative decoding is") and len(printed.strip()) > len("Speculative decoding is")


def test_train_draft_writes_a_card_whose_front_matter_and_snippet_work(
    licensed_policy_dir, tmp_path, tmp_path_factory
):
    data_file = tmp_path / "train.jsonl"
    data_file.write_text("".join(json.dumps({"text": f"speculative decoding is fast {i}"}) + "\n" for i in range(12)))
    out = tmp_path / "warm-draft"
    cli.main(
        ["train-draft", "--model_name_or_path", str(licensed_policy_dir), "--dataset_name", "json"]
        + ["--data_files", str(data_file), "--output_dir", str(out), "--hub_model_id", "me/tiny-warm-eagle3"]
        + ["--max_steps", "2", "--batch_size", "4", "--max_length", "32", "--eval_fraction", "0.25"]
    )
    card = (out / "README.md").read_text()
    data = ModelCard(card).data
    assert data.license == "apache-2.0" and data.pipeline_tag == "text-generation"
    assert data.library_name is None and data.base_model is None
    assert {"eagle3", "warm-start"} <= set(data.tags) and "grpo" not in data.tags
    assert_no_local_path(card, tmp_path_factory)
    assert "**warm-started\noffline**" in card and "`tiny-policy`" in card
    assert "| Training steps | 2 |" in card and "## Acceptance during RL" not in card
    agreement = card.split("## Held-out agreement", 1)[1].split("\n## ", 1)[0]
    assert re.findall(r"^\| (\d) \| \d\.\d{3} \|$", agreement, flags=re.MULTILINE) == ["0", "1", "2"]
    assert "vllm serve tiny-policy" in card
    printed = run_card_snippet(card, {"tiny-policy": licensed_policy_dir, "me/tiny-warm-eagle3": out}, tmp_path)
    assert printed.startswith("Speculative decoding is")
