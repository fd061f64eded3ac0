"""The draft's part of a checkpoint: what it holds, writes that a kill cannot leave half done, and the check that a
checkpoint is complete before a run resumes from it.

transformers writes a checkpoint as: the policy (``save_model``), the optimizer and scheduler, the RNG state, the
trainer state (``trainer_state.json``, last), then it deletes old checkpoints beyond ``save_total_limit``. The trainer
writes the draft and its training state inside ``save_model``, so a checkpoint with a trainer state holds them too, and
no old checkpoint is deleted before they are on disk.
"""

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import sort_checkpoints


DRAFT_FOLDER = "draft"
DRAFT_STATE_FILE = "draft_training_state.pt"


def write_atomically(path: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """Run ``write(temporary)``, which writes a file or a folder, then rename it to ``path``: a kill mid-write leaves a
    hidden temporary (removed by the next write), never a partial ``path``. An existing folder is first moved aside
    (a kill between the two renames leaves it there, and no ``path``)."""
    path = Path(path)
    temporary, old = path.with_name(f".{path.name}.tmp"), path.with_name(f".{path.name}.old")
    for leftover in (temporary, old):
        _remove(leftover)
    try:
        write(temporary)
    except BaseException:
        _remove(temporary)
        raise
    if temporary.is_dir() and path.exists():
        os.replace(path, old)
    os.replace(temporary, path)
    _remove(old)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def _missing_files(checkpoint: Path, *, draft: bool) -> list[str]:
    """What ``checkpoint`` lacks to resume from: the trainer state, and the draft and its state when ``draft``."""
    required = [DRAFT_FOLDER, DRAFT_STATE_FILE] if draft else []
    return [name for name in [*required, TRAINER_STATE_NAME] if not (checkpoint / name).exists()]


def check_resumable(checkpoint: str | os.PathLike, *, draft: bool) -> None:
    """Refuse to resume from a checkpoint that lacks a file the run needs, naming it and what to resume from instead
    (transformers would fail on a missing trainer state, and a missing draft would silently start afresh)."""
    checkpoint = Path(checkpoint)
    missing = _missing_files(checkpoint, draft=draft)
    if not missing:
        return
    complete = _latest_complete_checkpoint(checkpoint.parent, draft=draft)
    instead = (
        f"Resume from {complete}, the latest complete checkpoint in that folder, or delete {checkpoint.name} and "
        "resume with `resume_from_checkpoint=True`."
        if complete is not None
        else "No checkpoint in that folder is complete: train without `resume_from_checkpoint`."
    )
    why = (
        "the save was interrupted"
        if TRAINER_STATE_NAME in missing
        else "it was written with `save_draft=False`, or files were removed since; to resume from it with a fresh "
        "draft, set `save_draft=False` here too"
    )
    raise ValueError(
        f"`resume_from_checkpoint`: {checkpoint} is incomplete, it has no {', '.join(missing)} ({why}). {instead}"
    )


def _latest_complete_checkpoint(folder: Path, *, draft: bool) -> Path | None:
    """The checkpoint of ``folder`` with the highest step that `check_resumable` accepts."""
    newest_first = reversed(sort_checkpoints(str(folder)))
    return next((Path(path) for path in newest_first if not _missing_files(Path(path), draft=draft)), None)
