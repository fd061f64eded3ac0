"""The draft's model card, rendered from ``model_cards/eagle3_draft.md``, and its push to the Hub."""

from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from huggingface_hub import HfApi, ModelCard, ModelCardData
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id


if TYPE_CHECKING:
    from .draft import Eagle3DraftModel


CARD_TEMPLATE = "eagle3_draft.md"
ACCEPTANCE_TABLE_ROWS = 10


def render_draft_card(
    draft: "Eagle3DraftModel",
    *,
    target_model: str,
    repo_id: str,
    training_steps: int,
    acceptance_history: Sequence[tuple[int, float]] = (),
    ttt_steps: int = 3,
    step_weight_decay: float = 0.8,
    num_speculative_tokens: int = 3,
    num_target_layers: int | None = None,
    skipped_steps: int = 0,
    restored_steps: int = 0,
) -> str:
    """The README.md of a co-trained draft: target, taps, vocabulary, TTT settings, training health (updates skipped,
    restores of the last good draft), acceptance (summarised), how to serve. A local target is named by its folder's
    name: the card is published, and the path is this machine's."""
    config = draft.config
    aux_ids = config.aux_layer_ids
    if aux_ids is None and num_target_layers is not None:
        aux_ids = draft.resolved_aux_layer_ids(num_target_layers)
    is_hub_target = _is_hub_id(target_model)
    target_name = target_model if is_hub_target else Path(target_model).name  # never a path of this machine
    card_data = ModelCardData(
        library_name="transformers",
        base_model=target_model if is_hub_target else None,
        tags=["eagle3", "speculative-decoding", "draft-model", "hf_spec_cotrain", "grpo"],
    )
    template = resources.files("hf_spec_cotrain.model_cards").joinpath(CARD_TEMPLATE)
    with resources.as_file(template) as template_path:
        card = ModelCard.from_template(
            card_data,
            template_path=str(template_path),
            model_name=repo_id.split("/")[-1],
            repo_id=repo_id,
            target_model=target_name,
            target_url=f"https://huggingface.co/{target_model}" if is_hub_target else None,
            aux_layer_ids=list(aux_ids) if aux_ids is not None else "EAGLE-3 defaults (2, L//2, L-3)",
            num_layers=config.num_hidden_layers,
            draft_vocab_size=config.draft_vocab_size,
            vocab_size=config.vocab_size,
            ttt_steps=ttt_steps,
            step_weight_decay=step_weight_decay,
            training_steps=training_steps,
            skipped_steps=skipped_steps,
            restored_steps=restored_steps,
            acceptance=_summarize_acceptance(acceptance_history),
            acceptance_table_rows=ACCEPTANCE_TABLE_ROWS,
            num_speculative_tokens=num_speculative_tokens,
        )
    return str(card)


def _is_hub_id(name: str) -> bool:
    """A Hub repo id, not a local folder (an existing one, or a path no repo id can be)."""
    if Path(name).exists():
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _summarize_acceptance(history: Sequence[tuple[int, float]]) -> dict | None:
    """Start, end, lowest and highest acceptance length of a run, and at most `ACCEPTANCE_TABLE_ROWS` (step, value)
    pairs evenly spaced over it, the first and last included: a card stays short however long the run."""
    if not history:
        return None
    history = list(history)
    count = min(ACCEPTANCE_TABLE_ROWS, len(history))
    picked = sorted({round(i * (len(history) - 1) / max(count - 1, 1)) for i in range(count)})
    return {
        "start": history[0],
        "end": history[-1],
        "lowest": min(history, key=lambda item: item[1]),
        "highest": max(history, key=lambda item: item[1]),
        "rollouts": len(history),
        "table": [history[i] for i in picked],
    }


def push_draft_folder(
    folder: str | Path,
    repo_id: str,
    *,
    token: str | bool | None = None,
    private: bool | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    commit_message: str = "Upload EAGLE-3 draft",
):
    """Upload a saved draft folder (checkpoint plus README.md) to ``repo_id``; returns the commit info."""
    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    return api.upload_folder(
        repo_id=repo_id, folder_path=str(folder), commit_message=commit_message, revision=revision, create_pr=create_pr
    )
