"""The draft's model card, rendered from ``model_cards/eagle3_draft.md``, and its push to the Hub."""

from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from huggingface_hub import HfApi, ModelCard, ModelCardData


if TYPE_CHECKING:
    from .draft import Eagle3DraftModel


CARD_TEMPLATE = "eagle3_draft.md"


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
    restores of the last good draft), acceptance, how to serve."""
    config = draft.config
    aux_ids = config.aux_layer_ids
    if aux_ids is None and num_target_layers is not None:
        aux_ids = draft.resolved_aux_layer_ids(num_target_layers)
    is_hub_target = not Path(target_model).exists()
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
            target_model=target_model,
            target_url=f"https://huggingface.co/{target_model}" if is_hub_target else target_model,
            aux_layer_ids=list(aux_ids) if aux_ids is not None else "EAGLE-3 defaults (2, L//2, L-3)",
            num_layers=config.num_hidden_layers,
            draft_vocab_size=config.draft_vocab_size,
            vocab_size=config.vocab_size,
            ttt_steps=ttt_steps,
            step_weight_decay=step_weight_decay,
            training_steps=training_steps,
            skipped_steps=skipped_steps,
            restored_steps=restored_steps,
            acceptance_history=list(acceptance_history),
            num_speculative_tokens=num_speculative_tokens,
        )
    return str(card)


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
