"""The draft's model card (hf_spec_cotrain/hub.py): how it names the target, and the run's acceptance in short."""

import re

import pytest

from hf_spec_cotrain import Eagle3DraftModel
from hf_spec_cotrain.hub import ACCEPTANCE_TABLE_ROWS, render_draft_card
from hf_spec_cotrain.testing import build_tiny_target


@pytest.fixture(scope="module")
def draft():
    return Eagle3DraftModel.from_target(build_tiny_target("llama", num_layers=8, hidden_size=32))


def _card(draft, target_model: str, acceptance_history=()) -> str:
    return render_draft_card(
        draft,
        target_model=target_model,
        repo_id="me/run-eagle3",
        training_steps=len(acceptance_history),
        acceptance_history=acceptance_history,
    )


def _acceptance_rows(card: str) -> list[tuple[int, float]]:
    section = card.split("## Acceptance during RL", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d+) \| (\d+\.\d{3}) \|$", section, flags=re.MULTILINE)
    return [(int(step), float(value)) for step, value in rows]


@pytest.mark.parametrize("exists", [True, False], ids=["folder", "moved-folder"])
def test_a_local_target_is_named_by_its_folder_name_only(draft, tmp_path, exists):
    target = tmp_path / "runs" / "my-policy"
    if exists:
        target.mkdir(parents=True)
    card = _card(draft, str(target))
    assert str(tmp_path) not in card and "huggingface.co/" + str(tmp_path).lstrip("/") not in card
    assert "`my-policy` (a local model)" in card and "vllm serve my-policy" in card
    assert "base_model" not in card


def test_a_hub_target_is_linked(draft):
    card = _card(draft, "Qwen/Qwen3-0.6B")
    assert "[`Qwen/Qwen3-0.6B`](https://huggingface.co/Qwen/Qwen3-0.6B)" in card
    assert "base_model: Qwen/Qwen3-0.6B" in card and "vllm serve Qwen/Qwen3-0.6B" in card


def test_acceptance_is_summarised_in_a_short_table(draft):
    history = [(step, 1.5 + 0.01 * step) for step in range(120)]
    history[37] = (37, 1.05)  # the lowest, between two rows of the table
    history[90] = (90, 3.25)  # the highest
    card = _card(draft, "Qwen/Qwen3-0.6B", history)
    rows = _acceptance_rows(card)
    assert len(rows) == ACCEPTANCE_TABLE_ROWS
    assert rows[0] == (0, 1.5) and rows[-1] == (119, 2.69)  # start and end
    steps = [step for step, _ in rows]
    assert max(steps[i + 1] - steps[i] for i in range(len(steps) - 1)) <= 14  # evenly spaced over the run
    assert "measured on\n120 rollout batches" in card
    assert "- start 1.500 (step 0), end 2.690 (step 119)\n- lowest 1.050 (step 37), highest 3.250 (step 90)" in card


def test_a_short_run_lists_every_acceptance(draft):
    history = [(0, 1.25), (1, 1.75)]
    assert _acceptance_rows(_card(draft, "Qwen/Qwen3-0.6B", history)) == history
    assert "No acceptance length was recorded" in _card(draft, "Qwen/Qwen3-0.6B")
