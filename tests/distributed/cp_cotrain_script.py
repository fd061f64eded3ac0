"""Run by tests/distributed/test_trainer_cp.py: two GRPO steps with co-training, either under
`torchrun --nproc_per_node 2` with `context_parallel_size=2` ("cp") or in one plain process on the same 8 rows
("single"); records what `cotrain_cases.record_training` records (see cotrain_cases.py for the runs).
"""

from cotrain_cases import equality_run_config, equality_trainer, fixed_completions, main, record_training

from hf_spec_cotrain import SpecCoTrainGRPOTrainer


class FixedRolloutTrainer(SpecCoTrainGRPOTrainer):
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        return fixed_completions(prompt_ids), None


def run(policy_dir: str, out_dir: str, mode: str) -> dict:
    """Train; return this rank's record."""
    config = equality_run_config(
        out_dir,
        per_device_train_batch_size=4 if mode == "cp" else 8,
        speculative_decoding=False,
        context_parallel_size=2 if mode == "cp" else 1,
        router_aux_loss_coef=0.0,  # an MoE policy's (gpt-oss) auxiliary loss, which TRL adds by default, is refused
    )
    return record_training(equality_trainer(FixedRolloutTrainer, policy_dir, config))


if __name__ == "__main__":
    main(run)
