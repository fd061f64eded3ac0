"""The draft's part of a checkpoint: what it holds, writes that a kill cannot leave half done, and the check that a
checkpoint is complete before a run resumes from it.

transformers writes a checkpoint as: the policy (``save_model``), the optimizer and scheduler, the RNG state, the
trainer state (``trainer_state.json``, last), then it deletes old checkpoints beyond ``save_total_limit``. The trainer
writes the draft and its training state inside ``save_model``, so a checkpoint with a trainer state holds them too, and
no old checkpoint is deleted before they are on disk.

Under pipeline parallelism no rank holds the whole policy: each stage writes its own shard of the policy (the files
of a HF sharded checkpoint, so that ``from_pretrained`` loads the whole model from them), of the optimizer and of the
scheduler, and restores them on resume; the last stage, which trains the draft, writes the draft and its state.

A checkpoint's draft resumes only into a run whose draft has its shape (`check_draft_shape`: depth, vocabulary, taps,
read from its ``config.json`` before any weight).
"""

import json
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import sort_checkpoints
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME

from ..draft import DraftModel, checkpoint_drafter


DRAFT_FOLDER = "draft"
DRAFT_STATE_FILE = "draft_training_state.pt"
PIPELINE_STAGE_KINDS = ("model", "optimizer", "scheduler")
"""What each pipeline stage writes to a checkpoint: its shard of the policy, its optimizer and its scheduler."""


def pipeline_stage_file(kind: str, stage: int, num_stages: int) -> str:
    """The checkpoint file of one stage's `kind` (one of `PIPELINE_STAGE_KINDS`): the policy's shard is named as
    transformers names the shards of a sharded checkpoint."""
    if kind == "model":
        return f"model-{stage + 1:05d}-of-{num_stages:05d}.safetensors"
    return f"{kind}-stage-{stage + 1:05d}-of-{num_stages:05d}.pt"


def save_pipeline_policy_shard(
    folder: str | os.PathLike, tensors: Mapping[str, torch.Tensor], *, group: dist.ProcessGroup | None = None
) -> None:
    """Write this stage's shard of the policy (every rank of the pipeline group calls it with its stage's
    ``state_dict()``); once every shard is on disk, stage 0 writes the index that makes the folder one sharded
    checkpoint of the whole model."""
    folder = Path(folder)
    stage, num_stages = dist.get_rank(group), dist.get_world_size(group)
    shard = {name: tensor.detach().contiguous().cpu() for name, tensor in tensors.items()}
    name = pipeline_stage_file("model", stage, num_stages)
    write_atomically(folder / name, lambda path: save_file(shard, path, metadata={"format": "pt"}))
    sizes = [None] * num_stages
    dist.all_gather_object(sizes, {key: t.numel() * t.element_size() for key, t in shard.items()}, group=group)
    if stage == 0:
        weight_map = {key: pipeline_stage_file("model", s, num_stages) for s, keys in enumerate(sizes) for key in keys}
        index = {"metadata": {"total_size": sum(sum(s.values()) for s in sizes)}, "weight_map": weight_map}
        write_atomically(folder / SAFE_WEIGHTS_INDEX_NAME, lambda path: path.write_text(json.dumps(index, indent=2)))


def save_pipeline_stage_states(folder: str | os.PathLike, optimizer, scheduler, *, group=None) -> None:
    """Write this stage's optimizer and scheduler states (every rank of the pipeline group calls it); returns once
    every stage's are on disk, so a trainer state written after marks a checkpoint whose stages are all there."""
    stage, num_stages = dist.get_rank(group), dist.get_world_size(group)
    for kind, state in (("optimizer", optimizer.state_dict()), ("scheduler", scheduler.state_dict())):
        path = Path(folder) / pipeline_stage_file(kind, stage, num_stages)
        write_atomically(path, lambda temporary, state=state: torch.save(state, temporary))
    dist.barrier(group=group)


def load_pipeline_stage_state(folder: str | os.PathLike, kind: str, *, group=None) -> dict:
    """This stage's optimizer or scheduler state (`kind`) from a checkpoint."""
    path = Path(folder) / pipeline_stage_file(kind, dist.get_rank(group), dist.get_world_size(group))
    return torch.load(path, map_location="cpu", weights_only=True)


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


def _missing_files(checkpoint: Path, *, draft: bool, pipeline_stages: int = 1) -> list[str]:
    """What ``checkpoint`` lacks to resume from: the trainer state, the draft and its state when ``draft``, and every
    stage's files when ``pipeline_stages`` > 1."""
    required = [DRAFT_FOLDER, DRAFT_STATE_FILE] if draft else []
    if pipeline_stages > 1:
        stages = range(pipeline_stages)
        required += [pipeline_stage_file(kind, s, pipeline_stages) for s in stages for kind in PIPELINE_STAGE_KINDS]
    return [name for name in [*required, TRAINER_STATE_NAME] if not (checkpoint / name).exists()]


def check_resumable(checkpoint: str | os.PathLike, *, draft: bool, pipeline_stages: int = 1) -> None:
    """Refuse to resume from a checkpoint that lacks a file the run needs, naming it and what to resume from instead
    (transformers would fail on a missing trainer state, and a missing draft would silently start afresh)."""
    checkpoint = Path(checkpoint)
    missing = _missing_files(checkpoint, draft=draft, pipeline_stages=pipeline_stages)
    if not missing:
        return
    complete = _latest_complete_checkpoint(checkpoint.parent, draft=draft, pipeline_stages=pipeline_stages)
    instead = (
        f"Resume from {complete}, the latest complete checkpoint in that folder, or delete {checkpoint.name} and "
        "resume with `resume_from_checkpoint=True`."
        if complete is not None
        else "No checkpoint in that folder is complete: train without `resume_from_checkpoint`."
    )
    if TRAINER_STATE_NAME in missing:
        why = "the save was interrupted"
    elif any(name.endswith((f"-of-{pipeline_stages:05d}.pt", ".safetensors")) for name in missing):
        why = (
            f"it was not written by {pipeline_stages} pipeline stages with their optimizer states; resume with the "
            "`pipeline_parallel_size` it was written with"
        )
    else:
        why = (
            "it was written with `save_draft=False`, or files were removed since; to resume from it with a fresh "
            "draft, set `save_draft=False` here too"
        )
    raise ValueError(
        f"`resume_from_checkpoint`: {checkpoint} is incomplete, it has no {', '.join(missing)} ({why}). {instead}"
    )


def _latest_complete_checkpoint(folder: Path, *, draft: bool, pipeline_stages: int) -> Path | None:
    """The checkpoint of ``folder`` with the highest step that `check_resumable` accepts."""
    newest_first = [Path(path) for path in reversed(sort_checkpoints(str(folder)))]
    complete = (
        path for path in newest_first if not _missing_files(path, draft=draft, pipeline_stages=pipeline_stages)
    )
    return next(complete, None)


def draft_shape_differences(checkpoint: str | os.PathLike, draft: DraftModel) -> dict[str, tuple[Any, Any]]:
    """The options that shape a draft (the family's `shape_options`, by their `SpecCoTrainConfig` names) whose values
    differ between the draft saved in ``checkpoint`` and ``draft``, this run's: ``{name: (saved, this run's)}``. Read
    from the saved ``config.json`` alone, before any weight; empty when the checkpoint holds no draft of this family
    (loading it then says why)."""
    folder = Path(checkpoint) / DRAFT_FOLDER
    family = type(draft)
    if not folder.is_dir() or checkpoint_drafter(folder) != draft.drafter_name:
        return {}
    saved = family.shape_options(family.config_class.from_pretrained(folder))
    ours = family.shape_options(draft.config)
    return {name: (saved[name], value) for name, value in ours.items() if saved[name] != value}


def describe_draft_shape_differences(differences: Mapping[str, tuple[Any, Any]]) -> str:
    """`draft_shape_differences` as the refusal and the warning of a fresh draft name them."""
    return "; ".join(
        f"`{name}`: {saved} in the checkpoint, {ours} in this run" for name, (saved, ours) in differences.items()
    )


def check_draft_shape(checkpoint: str | os.PathLike, draft: DraftModel) -> None:
    """Refuse to resume, under ``save_draft=True``, from a checkpoint whose draft has another shape than this run's
    (torch's `load_state_dict` would fail after the models are built, or, for taps of the same count, load weights
    trained on other layers): the ValueError names each option that differs and the two ways on."""
    differences = draft_shape_differences(checkpoint, draft)
    if not differences:
        return
    saved_values = ", ".join(f"{name}={saved!r}" for name, (saved, _) in differences.items())
    raise ValueError(
        f"`resume_from_checkpoint`: the draft in {checkpoint} has another shape than this run's "
        f"({describe_draft_shape_differences(differences)}), so it cannot be resumed. Either resume with the "
        f"checkpoint's values ({saved_values}) to go on training its draft, or set `save_draft=False` to resume the "
        "policy with a fresh draft of this run's shape, as from a checkpoint written without a draft (the run then "
        "saves no draft)."
    )
