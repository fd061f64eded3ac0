"""Run by tests/distributed/test_trainer_cp.py: two GRPO steps with co-training, either under
`torchrun --nproc_per_node 2` with `context_parallel_size=2` ("cp") or in one plain process on the same 8 rows
("single"); records what `cotrain_cases.record_training` records (see cotrain_cases.py for the runs), and the input
shape of every forward of the policy and of the reference model.

A mode may end in "-kl": `beta=0.1` (a reference model) and `num_iterations=2` (the second step reuses the first
step's rollouts, weighted by the old policy's log-probs), so that both scoring passes run.
"""

import torch
from cotrain_cases import equality_run_config, equality_trainer, fixed_completions, main, record_training

from hf_spec_cotrain import SpecCoTrainGRPOTrainer


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
    # a smaller step keeps the second step's KL moderate (its exp amplifies float32 rounding)
    scoring = {"beta": 0.1, "num_iterations": 2, "learning_rate": 0.005} if variant == "kl" else {}
    config = equality_run_config(
        out_dir,
        per_device_train_batch_size=4 if mode == "cp" else 8,
        speculative_decoding=False,
        context_parallel_size=2 if mode == "cp" else 1,
        router_aux_loss_coef=0.0,  # an MoE policy's (gpt-oss) auxiliary loss, which TRL adds by default, is refused
        **scoring,
    )
    trainer = equality_trainer(FixedRolloutTrainer, policy_dir, config)
    policy_shapes = record_forward_shapes(trainer._policy())
    reference_shapes = [] if trainer.ref_model is None else record_forward_shapes(trainer.unwrapped(trainer.ref_model))
    record = record_training(trainer)
    return {**record, "policy_shapes": policy_shapes, "reference_shapes": reference_shapes}


if __name__ == "__main__":
    main(run)
