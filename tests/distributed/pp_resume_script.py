"""Run by tests/distributed/test_trainer_pp.py under `torchrun --nproc_per_node 2` with `pipeline_parallel_size=2`:
three GRPO steps uninterrupted, with a checkpoint after the second, then a second trainer that resumes from that
checkpoint and takes the third step. Records per rank, for both runs: this stage's policy parameters and optimizer
state, and the draft's parameters and optimizer state (trained on the last stage); and the stage's policy and the
draft as they were at the checkpoint.

AdamW and a linear learning-rate decay: a stage that lost its optimizer moments or its scheduler position would take a
different third step.
"""

from pathlib import Path

from cotrain_cases import equality_run_config, equality_trainer, main, snapshot
from pp_cotrain_script import FixedRolloutTrainer
from transformers import TrainerCallback

from hf_spec_cotrain.training.pipeline_parallel import PipelineParallel


class SnapshotAtStep(TrainerCallback):
    """The stage's policy and the draft right after step `step` (after the draft's update, which an earlier
    callback takes)."""

    def __init__(self, trainer, step: int):
        self.trainer, self.step, self.snapshot = trainer, step, None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.snapshot = {"policy": snapshot(self.trainer.model), "draft": snapshot(self.trainer.draft)}


def final_state(trainer) -> dict:
    assert isinstance(trainer.parallel, PipelineParallel)
    return {
        "policy": snapshot(trainer.model),
        "optimizer": trainer.optimizer.state_dict(),
        "draft": snapshot(trainer.draft),
        "draft_optimizer": trainer.draft_optimizer.state_dict(),
    }


def run(policy_dir: str, out_dir: str, mode: str) -> dict:
    def trainer(folder: str):
        config = equality_run_config(
            str(Path(out_dir, folder)),
            per_device_train_batch_size=4,
            num_speculative_tokens=2,
            draft_learning_rate=0.01,
            pipeline_parallel_size=2,
            pipeline_num_microbatches=4,
            max_steps=3,
            optim="adamw_torch",
            learning_rate=1e-3,
            lr_scheduler_type="linear",
            save_strategy="steps",
            save_steps=2,
            save_draft=True,
        )
        return equality_trainer(FixedRolloutTrainer, policy_dir, config)

    uninterrupted = trainer("uninterrupted")
    at_checkpoint = SnapshotAtStep(uninterrupted, 2)
    uninterrupted.add_callback(at_checkpoint)
    uninterrupted.train()
    resumed = trainer("resumed")
    resumed.train(resume_from_checkpoint=str(Path(out_dir, "uninterrupted", "checkpoint-2")))
    return {
        "rank": uninterrupted.accelerator.process_index,
        "at_checkpoint": at_checkpoint.snapshot,
        "uninterrupted": final_state(uninterrupted),
        "resumed": final_state(resumed),
    }


if __name__ == "__main__":
    main(run)
