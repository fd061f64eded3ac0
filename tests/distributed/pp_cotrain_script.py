"""Run by tests/distributed/test_trainer_pp.py: two GRPO steps with co-training, either under
`torchrun --nproc_per_node 2` with `pipeline_parallel_size=2` ("pp") or in one plain process on the same 8 rows
("single"). Records, per rank, the second step's policy gradients (before the optimizer step) and draft gradients
(at the draft optimizer's step), both models before and after training, each step's logged metrics, and the
weights the rollouts were generated with; under torchrun, writes them to `<out_dir>/<mode><rank>.pt`. After
training both modes save the policy to `<out_dir>/final` (under pipeline parallelism: the stages streamed to rank 0).

Rollouts really run (speculative, with the generating rank's full policy and draft) but are then replaced by a
fixed function of the prompt and of the copy's index among the prompt's generations, so both runs train on the
same rows: with 4 generations per prompt and 4 rows per rank, rank r holds prompt r's group, and the single process
holds both groups.
"""

import sys
from pathlib import Path

import torch
from cp_cotrain_script import PROMPTS, GradientRecorder, equality_run_config, fixed_completions, reward
from datasets import Dataset

from hf_spec_cotrain import SpecCoTrainGRPOTrainer
from hf_spec_cotrain.testing import build_char_tokenizer


class FixedRolloutTrainer(SpecCoTrainGRPOTrainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rollout_weights = []  # (policy, draft) state at each generation, on the generating rank

    def _generate_on_this_process(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        policy = self.accelerator.unwrap_model(self.model_wrapped)
        self.rollout_weights.append((_snapshot(policy), _snapshot(self.draft)))
        generated, _ = super()._generate_on_this_process(prompt_ids, images, multimodal_fields, num_generations)
        assert len(generated) == len(prompt_ids)
        return fixed_completions(prompt_ids), None


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def run(policy_dir: str, out_dir: str, mode: str) -> dict:
    """Train; return this rank's record (see the module docstring)."""
    config = equality_run_config(
        out_dir,
        per_device_train_batch_size=4 if mode == "pp" else 8,
        num_speculative_tokens=2,
        draft_learning_rate=0.01,
        pipeline_parallel_size=2 if mode == "pp" else 1,
        pipeline_num_microbatches=4,
    )
    trainer = FixedRolloutTrainer(
        model=policy_dir,
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=build_char_tokenizer(),
    )
    recorder = GradientRecorder(trainer)
    trainer.add_callback(recorder)
    policy = trainer.accelerator.unwrap_model(trainer.model)
    draft_start, policy_start = _snapshot(trainer.draft), _snapshot(policy)
    trainer.train()
    trainer.save_model(str(Path(out_dir, "final")))
    return {
        "world_size": trainer.accelerator.num_processes,
        "rank": trainer.accelerator.process_index,
        "policy_grads": recorder.policy_grads,
        "draft_grads": recorder.draft_grads,
        "policy_start": policy_start,
        "policy_params": _snapshot(policy),
        "draft_start": draft_start,
        "draft_params": _snapshot(trainer.draft),
        "rollout_weights": trainer.rollout_weights,
        "step_logs": [entry for entry in trainer.state.log_history if "draft/loss" in entry],
    }


if __name__ == "__main__":
    torch.set_num_threads(1)
    record = run(*sys.argv[1:4])
    torch.save(record, Path(sys.argv[2], f"{sys.argv[3]}{record['rank']}.pt"))
