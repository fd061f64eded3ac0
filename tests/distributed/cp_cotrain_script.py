"""Run by tests/distributed/test_trainer_cp.py: two GRPO steps with co-training, either under torchrun with context
parallelism or in one plain process on the same rows ("single"); records what `cotrain_cases.record_training` records
(see cotrain_cases.py for the runs), and the input shape of every forward of the policy and of the reference model.

Modes: "cp" (2 processes, `context_parallel_size=2`, DDP) or "single", on 8 rows; then optionally "-kl": `beta=0.1` (a
reference model) and `num_iterations=2` (the second step reuses the first step's rollouts, weighted by the old
policy's log-probs), so that both scoring passes run; or "-fsdp": 16 rows of 4 prompts, and "cp-fsdp" runs 4
processes under accelerate's `ParallelismConfig(dp_shard_size=2, cp_size=2)`: FSDP2 x CP on a 2-D mesh; "-dflash"
(alone or as "-fsdp+dflash") co-trains a DFlash draft instead of EAGLE-3's, anchored at every candidate position (so
that one process's padded rows and the group's packed documents train the same blocks; which anchors a sample picks
under CP is checked against one device in tests/distributed/test_dflash_cp.py).
"""

from pathlib import Path

import torch
from accelerate.parallelism_config import ParallelismConfig
from cotrain_cases import PROMPTS, equality_run_config, equality_trainer, fixed_completions, main, record_training
from safetensors.torch import load_file

from hf_spec_cotrain import SpecCoTrainGRPOTrainer
from hf_spec_cotrain.training.context_parallel import ContextParallel


class FixedRolloutTrainer(SpecCoTrainGRPOTrainer):
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        return fixed_completions(prompt_ids), None


def record_forward_shapes(model) -> list[tuple[bool, tuple[int, ...]]]:
    """(grad enabled, input ids shape) of every forward of `model`'s embedding, filled in as it runs."""
    shapes = []
    model.get_input_embeddings().register_forward_pre_hook(
        lambda module, args: shapes.append((torch.is_grad_enabled(), tuple(args[0].shape)))
    )
    return shapes


def run(policy_dir: str, out_dir: str, mode: str) -> dict:
    """Train; return this rank's record."""
    mode, _, variant = mode.partition("-")
    variants = set(variant.split("+"))
    options = {"per_device_train_batch_size": 8}
    if "dflash" in variants:
        options |= {
            "drafter": "dflash",
            "dflash_block_size": 4,
            "dflash_anchors_per_row": 64,
            "dflash_mask_token_id": 3,
        }
    if "kl" in variants:  # a smaller step keeps the second step's KL moderate (its exp amplifies float32 rounding)
        options |= {"beta": 0.1, "num_iterations": 2, "learning_rate": 0.005}
    prompts = PROMPTS
    if "fsdp" in variants:  # a group of 4 generations per rank, as in the 2-process runs
        prompts = [*PROMPTS, "abc", "xyz!"]
        options["per_device_train_batch_size"] = 16
    if mode == "cp":
        options["per_device_train_batch_size"] //= 4 if "fsdp" in variants else 2
        options["context_parallel_size"] = 2
    if mode == "cp" and "fsdp" in variants:  # the sizes as accelerate's config: the trainer takes cp_size from it
        options |= {"context_parallel_size": 1, "parallelism_config": ParallelismConfig(dp_shard_size=2, cp_size=2)}

    def run_config(**more):
        return equality_run_config(
            out_dir,
            speculative_decoding=False,
            router_aux_loss_coef=0.0,  # an MoE policy's (gpt-oss) auxiliary loss, which TRL adds by default, is refused
            **options,
            **more,
        )

    config = run_config()
    checkpoints_refused = None
    if mode == "cp" and "fsdp" in variants:  # the trainer shards the policy itself here: checkpoints are refused
        try:
            equality_trainer(FixedRolloutTrainer, policy_dir, run_config(save_strategy="steps"), prompts=prompts)
        except ValueError as error:
            checkpoints_refused = str(error)
    trainer = equality_trainer(FixedRolloutTrainer, policy_dir, config, prompts=prompts)
    policy_shapes = record_forward_shapes(trainer._policy())
    reference_shapes = [] if trainer.ref_model is None else record_forward_shapes(trainer.unwrapped(trainer.ref_model))
    record = record_training(trainer)
    saved = None
    if "fsdp" in variants:  # the final save gathers the sharded policy whole (on rank 0)
        trainer.save_model(f"{out_dir}/final")
        if trainer.accelerator.is_main_process:
            saved = {
                name: tensor
                for file in Path(out_dir, "final").glob("*.safetensors")
                for name, tensor in load_file(file).items()
            }
    return {
        **record,
        "checkpoints_refused": checkpoints_refused,
        "saved_policy": saved,
        "policy_shapes": policy_shapes,
        "reference_shapes": reference_shapes,
        "cp_group": torch.distributed.get_process_group_ranks(trainer.parallel.group)
        if isinstance(trainer.parallel, ContextParallel)
        else [],
        "policy_param_types": sorted({type(p).__name__ for p in trainer._policy().parameters()}),
    }


if __name__ == "__main__":
    main(run)
