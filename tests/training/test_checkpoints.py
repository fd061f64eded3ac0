"""Crash-safe checkpoints: the draft and its training state are written before transformers writes the trainer state
and rotates old checkpoints, each under a temporary name renamed into place; a kill inside either write leaves the
previous checkpoint complete, and resuming from an incomplete checkpoint is an error that names what it lacks."""

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kill_during_save import KILLED_AT_STEP, build_trainer

from hf_spec_cotrain.draft import DRAFTER_FAMILIES
from hf_spec_cotrain.testing import build_tiny_target
from hf_spec_cotrain.training.checkpoints import (
    PIPELINE_STAGE_KINDS,
    check_resumable,
    draft_shape_differences,
    pipeline_stage_file,
    write_atomically,
)


ROOT = Path(__file__).resolve().parents[2]
COMPLETE = ("draft/model.safetensors", "draft/config.json", "draft/README.md", "draft_training_state.pt")


@pytest.fixture(scope="module")
def uninterrupted(tiny_policy_dir, tmp_path_factory):
    """The run the kill interrupts, to its end without a kill or a checkpoint."""
    trainer = build_trainer(tiny_policy_dir, tmp_path_factory.mktemp("uninterrupted"), save_strategy="no")
    trainer.train()
    return trainer


def _killed_run(policy_dir, output_dir: Path, write: str) -> None:
    script = ROOT / "tests" / "kill_during_save.py"  # the installed package, as the run under test would use
    completed = subprocess.run(
        [sys.executable, str(script), str(policy_dir), str(output_dir), write],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert completed.returncode == -signal.SIGKILL, completed.stderr[-3000:]


def _assert_equal_states(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(actual[name], tensor, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("write", ["draft", "draft_state"])
def test_a_kill_inside_a_draft_write_leaves_a_complete_checkpoint_to_resume(
    tiny_policy_dir, tmp_path, uninterrupted, write
):
    _killed_run(tiny_policy_dir, tmp_path, write)
    previous, interrupted = tmp_path / "checkpoint-2", tmp_path / f"checkpoint-{KILLED_AT_STEP}"
    for name in (*COMPLETE, "trainer_state.json"):  # not rotated away: the new checkpoint never completed
        assert (previous / name).is_file(), name
    lacking = "draft" if write == "draft" else "draft_training_state.pt"
    assert not (interrupted / lacking).exists()  # no half-written file under the name that resuming reads
    assert not (interrupted / "trainer_state.json").exists()

    with pytest.raises(ValueError, match=rf"checkpoint-{KILLED_AT_STEP}.*{lacking}(.|\n)*Resume from .*checkpoint-2"):
        build_trainer(tiny_policy_dir, tmp_path).train(resume_from_checkpoint=True)

    resumed = build_trainer(tiny_policy_dir, tmp_path)
    resumed.train(resume_from_checkpoint=str(previous))
    _assert_equal_states(resumed.model.state_dict(), uninterrupted.model.state_dict())
    _assert_equal_states(resumed.draft.state_dict(), uninterrupted.draft.state_dict())
    for actual, expected in zip(
        resumed.draft_optimizer.state_dict()["state"].values(),
        uninterrupted.draft_optimizer.state_dict()["state"].values(),
        strict=True,
    ):
        _assert_equal_states(actual, expected)
    for name in (*COMPLETE, "trainer_state.json"):  # the resumed run wrote the interrupted checkpoint whole
        assert (interrupted / name).is_file(), name


def test_resume_from_a_checkpoint_without_a_draft_is_an_error(tiny_policy_dir, tmp_path, caplog):
    build_trainer(tiny_policy_dir, tmp_path, max_steps=2, save_draft=False, hub_token="hf_SeCrEt").train()
    checkpoint = tmp_path / "checkpoint-2"
    assert (checkpoint / "trainer_state.json").is_file() and not (checkpoint / "draft").exists()
    assert b"hf_SeCrEt" not in (checkpoint / "training_args.bin").read_bytes()  # the config masks it when pickled
    with pytest.raises(ValueError, match=r"checkpoint-2 .*has no draft, draft_training_state\.pt(.|\n)*save_draft"):
        build_trainer(tiny_policy_dir, tmp_path).train(resume_from_checkpoint=str(checkpoint))
    # A run that does not save its draft resumes with a fresh one, and says so.
    resumed = build_trainer(tiny_policy_dir, tmp_path, max_steps=3, save_draft=False)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert "starts from a fresh draft" in caplog.text and str(checkpoint) in caplog.text
    assert resumed.draft_cotrainer.scheduler.last_epoch == 1  # one draft update since the resume


def test_resume_with_another_draft_shape_names_the_options_and_the_ways_on(tiny_policy_dir, tmp_path, caplog):
    """A checkpoint's draft of another depth, vocabulary or taps than the run's is refused before any weight is read
    (was: torch's raw `load_state_dict` error, or for taps of the same count weights trained on other layers loaded
    without a word), naming each option with both values, the checkpoint's values and `save_draft=False`; with
    `save_draft=False` the run resumes the policy with a fresh draft of its own shape, and says so."""
    written = build_trainer(tiny_policy_dir, tmp_path, max_steps=2)
    written.train()
    checkpoint = tmp_path / "checkpoint-2"
    vocab_size = written.draft.config.draft_vocab_size
    assert written.draft.config.aux_layer_ids == (2, 4, 5)  # the tiny policy's default taps
    for changed, differences, saved_values in [
        (
            {"draft_num_layers": 2, "draft_vocab_size": 16},
            rf"`draft_num_layers`: 1 in the checkpoint, 2 in this run; `draft_vocab_size`: {vocab_size} in the "
            r"checkpoint, 16 in this run",
            rf"draft_num_layers=1, draft_vocab_size={vocab_size}",
        ),
        (
            {"aux_layer_ids": [1, 3, 6]},  # the same shapes: torch would load it
            r"`aux_layer_ids`: \[2, 4, 5\] in the checkpoint, \[1, 3, 6\] in this run",
            r"aux_layer_ids=\[2, 4, 5\]",
        ),
    ]:
        with pytest.raises(
            ValueError,
            match=rf"the draft in .*checkpoint-2 has another shape than this run's \({differences}\), so it cannot be "
            rf"resumed. Either resume with the checkpoint's values \({saved_values}\) .* or set `save_draft=False`",
        ):
            build_trainer(tiny_policy_dir, tmp_path, **changed).train(resume_from_checkpoint=str(checkpoint))
    resumed = build_trainer(tiny_policy_dir, tmp_path, max_steps=3, save_draft=False, draft_vocab_size=16)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert "has another shape than this run's" in caplog.text and "starts from a fresh draft" in caplog.text
    assert resumed.state.global_step == 3 and resumed.draft.config.draft_vocab_size == 16
    assert resumed.draft_cotrainer.scheduler.last_epoch == 1  # one draft update since the resume


@pytest.mark.parametrize(
    ("drafter", "changed", "names"),
    [
        ("eagle3", {"num_layers": 2, "aux_layer_ids": [1, 3, 6]}, ["draft_num_layers", "aux_layer_ids"]),
        (
            "dflash",
            {"num_layers": 2, "target_layer_ids": [2, 6], "block_size": 4, "mask_token_id": 5},
            ["draft_num_layers", "dflash_target_layer_ids", "dflash_block_size", "dflash_mask_token_id"],
        ),
    ],
)
def test_every_familys_draft_shape_is_read_back_from_its_saved_config(tmp_path, drafter, changed, names):
    """The options that shape a family's drafts read the same from a saved draft's config.json as from the draft, and
    a draft built with other values differs in exactly those options, named as `SpecCoTrainConfig` names them."""
    family = DRAFTER_FAMILIES[drafter]
    target = build_tiny_target("llama", num_layers=8)
    fixed = {"mask_token_id": 3} if drafter == "dflash" else {}
    saved = family.from_target(target, **fixed)
    saved.save_pretrained(tmp_path / "draft", on_this_rank=True)
    assert draft_shape_differences(tmp_path, saved) == {}
    other = family.from_target(target, **{**fixed, **changed})
    differences = draft_shape_differences(tmp_path, other)
    assert list(differences) == names
    ours = family.shape_options(other.config)
    assert all(differences[name] == (family.shape_options(saved.config)[name], ours[name]) for name in names)


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_write_atomically_keeps_the_old_version_when_the_write_fails(tmp_path, kind):
    path = tmp_path / "target"

    def write(content: str, *, fail: bool = False):
        def into(temporary: Path):
            file = temporary / "weights" if kind == "folder" else temporary
            file.parent.mkdir(exist_ok=True)
            file.write_text(content[:2] if fail else content)
            if fail:
                raise OSError("disk full")

        return into

    def read():
        return (path / "weights" if kind == "folder" else path).read_text()

    write_atomically(path, write("old"))
    with pytest.raises(OSError, match="disk full"):
        write_atomically(path, write("new", fail=True))
    assert read() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]  # the failed write's temporary is removed
    (tmp_path / ".target.tmp").mkdir()  # what a kill mid-write leaves: the next write removes it
    write_atomically(path, write("new"))
    assert read() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]


def test_resuming_under_pipeline_parallelism_needs_every_stage_files(tmp_path):
    """A pipelined checkpoint is complete with each stage's shard of the policy, optimizer and scheduler; one written
    by another number of stages, or missing a stage's file, is refused, naming the file and the latest complete
    checkpoint."""
    for step in (2, 4):
        checkpoint = tmp_path / f"checkpoint-{step}"
        checkpoint.mkdir()
        for name in [
            "trainer_state.json",
            *[pipeline_stage_file(k, s, 2) for s in range(2) for k in PIPELINE_STAGE_KINDS],
        ]:
            (checkpoint / name).write_text("{}")
    check_resumable(checkpoint, draft=False, pipeline_stages=2)
    (checkpoint / "optimizer-stage-00002-of-00002.pt").unlink()
    with pytest.raises(
        ValueError, match=r"no optimizer-stage-00002-of-00002.pt \(it was not written by 2 pipeline .*checkpoint-2"
    ):
        check_resumable(checkpoint, draft=False, pipeline_stages=2)
    with pytest.raises(ValueError, match=r"no model-00001-of-00004.safetensors, .*written by 4 pipeline stages"):
        check_resumable(tmp_path / "checkpoint-2", draft=False, pipeline_stages=4)
