"""The draft's model card (hf_spec_cotrain/draft/card.py): how it names the models, the run's acceptance in short, and the
license it takes from the policy."""

import math
import re

import pytest
from huggingface_hub import ModelCard

from hf_spec_cotrain import Eagle3DraftModel
from hf_spec_cotrain.draft.card import (
    ACCEPTANCE_TABLE_ROWS,
    FINAL_POLICY_PLACEHOLDER,
    CoTrainingRecord,
    model_license,
    render_draft_card,
)
from hf_spec_cotrain.testing import build_tiny_target


@pytest.fixture(scope="module")
def draft():
    return Eagle3DraftModel.from_target(build_tiny_target("llama", num_layers=8, hidden_size=32))


def _card(draft, target_model: str, acceptance_history=(), final_policy=None) -> str:
    return render_draft_card(
        draft,
        target_model=target_model,
        repo_id="me/run-eagle3",
        training=CoTrainingRecord(acceptance_history=acceptance_history, final_policy=final_policy),
    )


def _acceptance_rows(card: str) -> list[tuple[int, float]]:
    section = card.split("## Acceptance during RL", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d+) \| (\d+\.\d{3}) \|$", section, flags=re.MULTILINE)
    return [(int(step), float(value)) for step, value in rows]


@pytest.mark.parametrize("exists", [True, False], ids=["folder", "moved-folder"])
def test_a_local_policy_is_named_by_its_folder_name_only(draft, tmp_path, exists):
    target = tmp_path / "runs" / "my-policy"
    if exists:
        target.mkdir(parents=True)
    card = _card(draft, str(target), final_policy=str(tmp_path / "runs" / "my-policy-grpo"))
    assert str(tmp_path) not in card
    assert "The run started from `my-policy` (a local model" in card and "no `base_model`" in card
    assert "vllm serve my-policy-grpo" in card and "`my-policy-grpo` (a local model" in card
    assert ModelCard(card).data.base_model is None


def test_a_hub_policy_is_the_base_model_and_the_final_policy_is_served(draft):
    card = _card(draft, "Qwen/Qwen3-0.6B", final_policy="me/qwen3-grpo")
    assert ModelCard(card).data.base_model == "Qwen/Qwen3-0.6B"
    assert "The run started from [`Qwen/Qwen3-0.6B`](https://huggingface.co/Qwen/Qwen3-0.6B)" in card
    assert "final policy of the same run**, [`me/qwen3-grpo`](https://huggingface.co/me/qwen3-grpo)" in card
    assert "vllm serve me/qwen3-grpo" in card and 'from_pretrained("me/qwen3-grpo"' in card
    assert "vllm serve Qwen/Qwen3-0.6B" not in card


def test_an_unnamed_final_policy_is_a_placeholder_the_card_explains(draft):
    card = _card(draft, "Qwen/Qwen3-0.6B")
    assert f"vllm serve {FINAL_POLICY_PLACEHOLDER}" in card and f"--model-path {FINAL_POLICY_PLACEHOLDER}" in card
    assert f"Replace `{FINAL_POLICY_PLACEHOLDER}` below by its Hub id or folder" in card
    assert "vllm serve Qwen/Qwen3-0.6B" not in card


def test_acceptance_is_summarised_in_a_short_table(draft):
    history = [(step, 1.5 + 0.01 * step) for step in range(1, 121)]
    history[37] = (38, 1.05)  # the lowest, between two rows of the table
    history[90] = (91, 3.25)  # the highest
    card = _card(draft, "Qwen/Qwen3-0.6B", history)
    rows = _acceptance_rows(card)
    assert len(rows) == ACCEPTANCE_TABLE_ROWS
    assert rows[0] == (1, 1.51) and rows[-1] == (120, 2.7)  # start and end
    steps = [step for step, _ in rows]
    assert max(steps[i + 1] - steps[i] for i in range(len(steps) - 1)) <= 14  # evenly spaced over the run
    assert "on 120 rollout batches" in card
    assert "- start 1.510 (step 1), end 2.700 (step 120)\n- lowest 1.050 (step 38), highest 3.250 (step 91)" in card
    assert "decoded without drafting" not in card


def test_steps_that_decoded_without_drafting_are_counted_apart(draft):
    """A turn that drafted nothing (K = 0) is NaN in the history: out of every figure, counted as a step only when no
    turn of that step drafted."""
    history = [(1, 2.0), (2, math.nan), (3, math.nan), (3, 3.0), (4, math.nan), (5, math.nan)]
    card = _card(draft, "Qwen/Qwen3-0.6B", history)
    assert _acceptance_rows(card) == [(1, 2.0), (3, 3.0)]
    assert "- start 2.000 (step 1), end 3.000 (step 3)" in card and "on 2 rollout batches" in card
    assert "3 steps decoded without drafting (K = 0" in card
    nothing = _card(draft, "Qwen/Qwen3-0.6B", [(1, math.nan)])
    assert "No rollout drafted during training" in nothing and "1 step decoded without drafting" in nothing
    assert _acceptance_rows(nothing) == []


def test_a_short_run_lists_every_acceptance(draft):
    history = [(1, 1.25), (2, 1.75)]
    assert _acceptance_rows(_card(draft, "Qwen/Qwen3-0.6B", history)) == history
    assert "No rollout drafted during training" in _card(draft, "Qwen/Qwen3-0.6B")


def test_a_model_built_in_memory_is_neither_on_the_hub_nor_asked_for_a_license(draft, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "README.md").write_text("---\nlicense: mit\n---\n")  # the working folder's card is not the model's
    assert model_license("") == {}
    card = _card(draft, "")
    assert ModelCard(card).data.base_model is None and "The run started from `model built in memory`" in card


def test_the_license_comes_from_the_policys_card(tmp_path, monkeypatch):
    local = tmp_path / "policy"
    local.mkdir()
    assert model_license(str(local)) == {}  # no README.md
    (local / "README.md").write_text("---\nlicense: other\nlicense_name: tiny\nlicense_link: LICENSE\n---\n# tiny\n")
    assert model_license(str(local)) == {"license": "other", "license_name": "tiny", "license_link": "LICENSE"}
    assert model_license(str(tmp_path / "no-such-folder")) == {}  # a path, not a repo id: nothing to ask the Hub

    asked = []

    def hub_card(name):
        asked.append(name)
        if name == "org/offline":
            raise OSError("We couldn't connect to 'https://huggingface.co'")
        return ModelCard("---\nlicense: mit\n---\n")

    monkeypatch.setattr("hf_spec_cotrain.draft.card.ModelCard.load", hub_card)
    assert model_license("org/model") == {"license": "mit"}
    assert model_license("org/offline") == {}  # no network: no license, no failure
    assert asked == ["org/model", "org/offline"]
