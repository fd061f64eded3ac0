"""The registry of drafter families: `SpecCoTrainConfig.drafter` names one, and the trainer, the warm start and the
rollouts build, load and check drafts through it. A new family is its module plus one entry in `DRAFTER_FAMILIES`."""

import json
from pathlib import Path

from transformers.utils import CONFIG_NAME, cached_file

from .base import DraftModel
from .dflash_modeling import DFlashDraftModel
from .modeling import Eagle3DraftModel


__all__ = [
    "DEFAULT_DRAFTER",
    "DRAFTER_FAMILIES",
    "check_draft_family",
    "checkpoint_drafter",
    "checkpoint_family",
    "drafter_family",
    "load_draft",
]

DRAFTER_FAMILIES: dict[str, type[DraftModel]] = {
    family.drafter_name: family for family in (Eagle3DraftModel, DFlashDraftModel)
}
DEFAULT_DRAFTER = Eagle3DraftModel.drafter_name


def drafter_family(drafter: str, *, field: str = "drafter") -> type[DraftModel]:
    """The draft class of a family name; a ValueError listing the registered ones for any other value."""
    if drafter not in DRAFTER_FAMILIES:
        raise ValueError(
            f"`{field}`={drafter!r} is not a drafter family: use one of {', '.join(map(repr, DRAFTER_FAMILIES))}."
        )
    return DRAFTER_FAMILIES[drafter]


def checkpoint_drafter(name_or_path, **hub_kwargs) -> str | None:
    """The family whose checkpoint ``name_or_path`` is, by the ``architectures`` its ``config.json`` names; None when
    none names it (a checkpoint from another tool: the family's own loader then decides) or the file cannot be
    read (the loader reports why)."""
    try:
        config_file = cached_file(name_or_path, CONFIG_NAME, _raise_exceptions_for_missing_entries=False, **hub_kwargs)
    except OSError:
        return None
    if config_file is None:
        return None
    architectures = json.loads(Path(config_file).read_text(encoding="utf-8")).get("architectures") or []
    for name, family in DRAFTER_FAMILIES.items():
        if set(architectures) & set(family.checkpoint_architectures()):
            return name
    return None


def checkpoint_family(name_or_path) -> type[DraftModel]:
    """The family of a saved draft, which vLLM is to serve (`checkpoint_drafter`); a ValueError when none of the
    registered families wrote it."""
    drafter = checkpoint_drafter(name_or_path)
    if drafter is None:
        raise ValueError(
            f"{name_or_path} is no draft checkpoint of a known family: its config.json names none of the "
            f"architectures {[a for family in DRAFTER_FAMILIES.values() for a in family.checkpoint_architectures()]}. "
            "Save the draft with `save_pretrained` (or `hf-spec-cotrain train-draft`)."
        )
    return DRAFTER_FAMILIES[drafter]


def load_draft(name_or_path, drafter: str, **kwargs) -> DraftModel:
    """`from_pretrained` of the family ``drafter``; a checkpoint of another registered family is refused, naming
    both."""
    family = drafter_family(drafter)
    found = checkpoint_drafter(name_or_path)
    if found is not None and found != drafter:
        raise ValueError(
            f"The draft checkpoint {name_or_path} is a {found!r} draft, but `drafter`={drafter!r}: set "
            f"`drafter`={found!r}, or load a {drafter!r} checkpoint."
        )
    return family.from_pretrained(name_or_path, **kwargs)


def check_draft_family(draft: DraftModel, drafter: str) -> None:
    """Refuse a draft of another family than ``drafter`` (a ValueError naming both)."""
    family = drafter_family(drafter)
    if draft.drafter_name != drafter:
        raise ValueError(
            f"`draft_model` is a {draft.drafter_name!r} draft ({type(draft).__name__}), but `drafter`={drafter!r}: "
            f"set `drafter`={draft.drafter_name!r}, or pass a {family.__name__}."
        )
