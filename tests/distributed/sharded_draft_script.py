"""Run by tests/distributed/test_sharded_draft.py: co-training under accelerate's FSDP2 (switched on on CPU as
ddp_cotrain_script.py does) with the draft sharded over the same ranks (`shard_draft=True`), under torchrun, or in
one plain process on the same rows ("single"). Records what `cotrain_cases.record_training` records, plus this
rank's draft state (`storage_bytes` of the draft and its optimizer) and the draft's parameter types.

Modes: "fsdp" (4 processes, 16 rows of 4 prompts: a group of 4 generations per rank) or "single", each optionally
"-dflash" (a DFlash draft instead of EAGLE-3's); "fsdp-resume" (2 processes on 8 rows): three steps with a checkpoint
after every one, then a second trainer resumes from the first checkpoint and trains to the same step; both runs'
draft and policy after the last step are recorded, and what rank 0 wrote as the draft.
"""

from pathlib import Path

from cotrain_cases import (
    PROMPTS,
    equality_run_config,
    equality_trainer,
    fixed_completions,
    main,
    record_training,
    snapshot,
)
from ddp_cotrain_script import switch_accelerate_to_fsdp2_on_cpu
from torch.distributed.tensor import DTensor

from hf_spec_cotrain import SpecCoTrainGRPOTrainer
from hf_spec_cotrain.draft import load_draft
from hf_spec_cotrain.testing import storage_bytes


DFLASH_OPTIONS = {"drafter": "dflash", "dflash_block_size": 4, "dflash_anchors_per_row": 64, "dflash_mask_token_id": 3}
FSDP2 = {"fsdp": True, "fsdp_config": {"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}}


class FixedRolloutTrainer(SpecCoTrainGRPOTrainer):
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        return fixed_completions(prompt_ids), None


def run(policy_dir: str, out_dir: str, mode: str) -> dict:
    """Train; return this rank's record."""
    mode, _, variant = mode.partition("-")
    if variant == "resume":
        return run_resumed(policy_dir, out_dir)
    options = DFLASH_OPTIONS if variant == "dflash" else {}
    if mode == "fsdp":
        switch_accelerate_to_fsdp2_on_cpu()
        options = {**options, **FSDP2, "shard_draft": True}
    prompts = [*PROMPTS, "abc", "xyz!"]
    # speculative_decoding: the trainer's probe drafts through the draft gathered for generation when it is built
    config = equality_run_config(
        out_dir, per_device_train_batch_size=4 if mode == "fsdp" else 16, speculative_decoding=True, **options
    )
    trainer = equality_trainer(FixedRolloutTrainer, policy_dir, config, prompts=prompts)
    record = record_training(trainer)
    return {
        **record,
        "draft_state_bytes": storage_bytes(trainer.draft, trainer.draft_optimizer),
        "draft_param_types": sorted({type(p).__name__ for p in trainer.draft.parameters()}),
    }


def run_resumed(policy_dir: str, out_dir: str) -> dict:
    switch_accelerate_to_fsdp2_on_cpu()

    def trained(folder: str, resume_from_checkpoint=None):
        config = equality_run_config(
            folder,
            per_device_train_batch_size=4,
            speculative_decoding=False,
            max_steps=3,
            save_strategy="steps",
            save_steps=1,
            save_draft=True,
            shard_draft=True,
            **FSDP2,
        )
        trainer = equality_trainer(FixedRolloutTrainer, policy_dir, config)
        trainer.train(resume_from_checkpoint=resume_from_checkpoint)
        policy = trainer.accelerator.unwrap_model(trainer.model)
        return trainer, {"draft": snapshot(trainer.draft), "policy": snapshot(policy)}

    trainer, uninterrupted = trained(f"{out_dir}/uninterrupted")
    _, resumed = trained(f"{out_dir}/resumed", resume_from_checkpoint=f"{out_dir}/uninterrupted/checkpoint-1")
    saved = None
    if trainer.accelerator.is_main_process:  # the final draft, gathered whole and written by rank 0
        saved = snapshot(load_draft(Path(out_dir, "uninterrupted", "draft"), "eagle3"))
    return {
        "world_size": trainer.accelerator.num_processes,
        "rank": trainer.accelerator.process_index,
        "uninterrupted": uninterrupted,
        "resumed": resumed,
        "saved_draft": saved,
        "sharded": all(isinstance(p, DTensor) for p in trainer.draft.parameters()),
        "steps": [entry["step"] for entry in trainer.state.log_history if "draft/loss" in entry],
    }


if __name__ == "__main__":
    main(run)
