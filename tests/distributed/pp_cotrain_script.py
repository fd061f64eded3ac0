"""Run by tests/distributed/test_trainer_pp.py: two GRPO steps with co-training, either under
`torchrun --nproc_per_node 2` with `pipeline_parallel_size=2` ("pp"; 4 processes and stages for the "4stages"
variant) or in one plain process on the same 8 rows ("single"); records what `cotrain_cases.record_training`
records (see cotrain_cases.py for the runs), the completions each generation really produced, and the bytes of the
policy and its optimizer state held here. After training both modes save the policy to `<out_dir>/final` (under
pipeline parallelism: every stage writes its shard). Every run records the names of the checkpoint tensors it read,
and under pipeline parallelism the taps of each stage.

Rollouts really run (speculative: under pipeline parallelism the last stage drives them through the stages) but are
then replaced by the fixed completions, so both runs train on the same rows. Their random numbers do not depend on
the generating rank here, so both runs sample their first rollouts, from the same weights, alike.
"""

from contextlib import nullcontext
from pathlib import Path
from unittest.mock import patch

import torch
from cotrain_cases import equality_run_config, equality_trainer, fixed_completions, main, record_training
from trl.trainer import grpo_trainer

from hf_spec_cotrain import SpecCoTrainGRPOTrainer
from hf_spec_cotrain.testing import build_char_tokenizer, recorded_checkpoint_reads, storage_bytes
from hf_spec_cotrain.training import rollout_backends


_seeded_generator = rollout_backends.seeded_generator
# The rollouts' random numbers without the generating rank (the last stage under pipeline parallelism, 0 in one process).
rollout_backends.seeded_generator = lambda seed, step, rank, *call, device=None: _seeded_generator(
    seed, step, 0, *call, device=device
)


class FixedRolloutTrainer(SpecCoTrainGRPOTrainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.generated = []  # the completions of each generation, on the generating rank
        turn = self.rollouts.turn  # the generating rank's turn over every rank's rows

        def fixed_turn(prompt_ids, **kwargs):
            generated, _ = turn(prompt_ids, **kwargs)
            assert len(generated) == len(prompt_ids)
            self.generated.append(generated)
            return fixed_completions(prompt_ids), None

        self.rollouts.turn = fixed_turn


DFLASH = dict(
    drafter="dflash",
    dflash_block_size=4,
    dflash_mask_token_id=build_char_tokenizer().convert_tokens_to_ids("e"),
    dflash_target_layer_ids=[1, 3, 5],
)
VARIANTS = {
    # A KL term to TRL's reference model, which is synced towards the policy after the first step (so that the second
    # step's KL and its gradient are not zero, and the stages' cut reference takes TRL's sync).
    "beta": dict(beta=0.5, sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5),
    # 4 stages of 2 rows each (8 rows in all, as in one process), and an optimizer with a state (SGD's momentum: the
    # update stays linear in the gradients, comparable at float32 precision) for the memory check.
    "4stages": dict(optim_args="momentum=0.9"),
    # The draft's micro-step under bf16 autocast (float32 policy), on the last stage as in one process.
    "draft_bf16": dict(draft_bf16=True),
    # A DFlash draft whose target layers lie on several stages (taps 2, 4, 6: stages 0, 1, 1 of 2; 1, 2, 3 of 4), and
    # whose mask token is in the prompts, so that its embedding row, which the first stage sends every step, trains.
    "dflash": DFLASH,
    # On 4 stages, with the relay transport (the taps ride the activations; the channel carries the mask row alone)
    # and a reduced vocabulary (the draft's own lm_head, chosen from the prompts on the last stage).
    "dflash_4stages": dict(DFLASH, pipeline_tap_transport="relay", draft_vocab_size=40),
}
PIPELINE_STAGES = {"4stages": 4, "dflash_4stages": 4}


def held_bytes(trainer) -> int:
    """Bytes of the trained policy's parameters and optimizer state on this process (distinct storages): under
    pipeline parallelism, the stage's."""
    return storage_bytes(trainer.accelerator.unwrap_model(trainer.model).parameters(), trainer.optimizer)


def run_config(out_dir: str, stages: int, **options):
    """The equality runs' config for `stages` pipeline stages (1: one plain process) on the same 8 rows."""
    return equality_run_config(
        out_dir,
        per_device_train_batch_size=8 // stages,
        num_speculative_tokens=2,
        draft_learning_rate=0.01,
        pipeline_parallel_size=stages,
        pipeline_num_microbatches=4,
        # Not the default ("sdpa"): the stages must load with the config's `model_init_kwargs`, as TRL would.
        model_init_kwargs={"attn_implementation": "eager"},
        **options,
    )


def record_draft_training_dtypes(draft) -> set:
    """The dtypes the draft's training forwards compute in (filled in while the trainer trains; rollouts, which run
    the draft without gradient, are left out)."""
    dtypes = set()

    def record(module, args, output):
        if torch.is_grad_enabled():
            dtypes.add(output.dtype)

    next(m for n, m in draft.named_modules() if n.endswith("mlp.down_proj")).register_forward_hook(record)
    return dtypes


def rows_in_one_order(config):
    """While training: TRL's generation batch unshuffled for a DFlash run. DFlash draws its anchors per batch position
    (`sample_anchors`), and TRL shuffles the generation batch: one process its 8 rows at once, each stage its own 4
    before the stages concatenate them in rank order. The runs would train on the same rows in other orders, their
    anchors placed by other draws; unshuffled, both hold the rows in one order."""
    if config.drafter != "dflash":
        return nullcontext()
    return patch.object(grpo_trainer, "shuffle_sequence_dict", lambda batch: batch)


def run(policy_dir: str, out_dir: str, mode: str) -> dict:
    """Train; return this rank's record. ``mode``: "pp" or "single", then optionally "-" and TRL's `loss_type` or a
    name of `VARIANTS`."""
    mode, _, variant = mode.partition("-")
    options = VARIANTS.get(variant, {"loss_type": variant or "dapo"})
    stages = PIPELINE_STAGES.get(variant, 2) if mode == "pp" else 1
    config = run_config(out_dir, stages, **options)
    with recorded_checkpoint_reads() as tensors_read:
        trainer = equality_trainer(FixedRolloutTrainer, policy_dir, config)
    draft_dtypes = record_draft_training_dtypes(trainer.draft)
    with rows_in_one_order(config):
        record = record_training(trainer, after_training=lambda: trainer.save_model(str(Path(out_dir, "final"))))
    return {
        **record,
        "generated": trainer.generated,
        "held_bytes": held_bytes(trainer),
        "draft_dtypes": draft_dtypes,
        "tensors_read": tensors_read,
        "taps_of_stage": trainer.parallel.stage.taps_of_stage if mode == "pp" else None,
        "attn_implementations": [
            model.config._attn_implementation for model in (trainer.model, trainer.ref_model) if model is not None
        ],
    }


if __name__ == "__main__":
    main(run)
