"""Run by tests/distributed/test_trainer_pp.py: two GRPO steps with co-training, either under
`torchrun --nproc_per_node 2` with `pipeline_parallel_size=2` ("pp") or in one plain process on the same 8 rows
("single"); records what `cotrain_cases.record_training` records (see cotrain_cases.py for the runs), and the
completions each generation really produced. After training both modes save the policy to `<out_dir>/final` (under
pipeline parallelism: the stages streamed to rank 0, which writes them).

Rollouts really run (speculative: under pipeline parallelism the last stage drives them through the stages) but are
then replaced by the fixed completions, so both runs train on the same rows. Their random numbers do not depend on
the generating rank here, so both runs sample their first rollouts, from the same weights, alike.
"""

from pathlib import Path

from cotrain_cases import equality_run_config, equality_trainer, fixed_completions, main, record_training

from hf_spec_cotrain import SpecCoTrainGRPOTrainer
from hf_spec_cotrain.training import rollouts


_seeded_generator = rollouts.seeded_generator
# The rollouts' random numbers without the generating rank (the last stage under pipeline parallelism, 0 in one process).
rollouts.seeded_generator = lambda seed, step, rank, mode, device=None: _seeded_generator(
    seed, step, 0, mode, device=device
)


class FixedRolloutTrainer(SpecCoTrainGRPOTrainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.generated = []  # the completions of each generation, on the generating rank

    def _generate_on_this_process(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        generated, _ = super()._generate_on_this_process(prompt_ids, images, multimodal_fields, num_generations)
        assert len(generated) == len(prompt_ids)
        self.generated.append(generated)
        return fixed_completions(prompt_ids), None


def run(policy_dir: str, out_dir: str, mode: str) -> dict:
    """Train; return this rank's record. ``mode``: "pp" or "single", then optionally "-" and TRL's `loss_type`."""
    mode, _, loss_type = mode.partition("-")
    config = equality_run_config(
        out_dir,
        per_device_train_batch_size=4 if mode == "pp" else 8,
        num_speculative_tokens=2,
        draft_learning_rate=0.01,
        pipeline_parallel_size=2 if mode == "pp" else 1,
        pipeline_num_microbatches=4,
        loss_type=loss_type or "dapo",
    )
    trainer = equality_trainer(FixedRolloutTrainer, policy_dir, config)
    record = record_training(trainer, after_training=lambda: trainer.save_model(str(Path(out_dir, "final"))))
    return {**record, "generated": trainer.generated}


if __name__ == "__main__":
    main(run)
