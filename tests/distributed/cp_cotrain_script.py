"""Run by tests/distributed/test_trainer_cp.py: two GRPO steps with co-training, either under
`torchrun --nproc_per_node 2` with `context_parallel_size=2` ("cp") or in one plain process on the same 8 rows
("single"). Records, per rank, the second step's policy gradients (after DDP's sync, before the optimizer step) and draft
gradients (after `_draft_update`'s average, at the draft optimizer's step), both models before and after training,
and each step's logged metrics; under torchrun, writes them to `<out_dir>/<mode><rank>.pt`.

Rollouts are a fixed function of the prompt and of the copy's index among the prompt's generations, so both runs
train on the same rows: with 4 generations per prompt and 4 rows per rank, rank r holds prompt r's group, and the
single process holds both groups. Completion lengths depend on the copy index only, so both ranks count the same
number of draft-loss positions (data parallelism averages the ranks' draft losses; one process averages over all
positions: the two agree when the counts do).
"""

import sys
from collections import Counter
from pathlib import Path

import torch
from datasets import Dataset
from transformers import TrainerCallback

from hf_spec_cotrain import SpecCoTrainConfig, SpecCoTrainGRPOTrainer
from hf_spec_cotrain.testing import build_char_tokenizer


PROMPTS = ["hello there", "Q: 2+2? A:"]
NUM_GENERATIONS = 4
FIRST_CHARACTER_ID = 4  # ids 0-3 are the special tokens of the character tokenizer


def fixed_completions(prompt_ids: list[list[int]]) -> list[list[int]]:
    """A fixed function of each prompt and of the copy's index among the prompt's generations."""
    copies = Counter()
    completions = []
    for ids in prompt_ids:
        copy = copies[tuple(ids)]
        copies[tuple(ids)] += 1
        generator = torch.Generator().manual_seed(1000 * sum(ids) + copy)
        length = 3 + 2 * copy
        completions.append(torch.randint(FIRST_CHARACTER_ID, 60, (length,), generator=generator).tolist())
    return completions


class FixedRolloutTrainer(SpecCoTrainGRPOTrainer):
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        return fixed_completions(prompt_ids), None


def reward(completions, **kwargs):
    return [text.count("a") + 0.1 * len(text) + 0.01 * sum(map(ord, text)) for text in completions]


class GradientRecorder(TrainerCallback):
    def __init__(self, trainer):
        self.trainer = trainer
        self.policy_grads = {}
        self.draft_grads = {}
        trainer.draft_optimizer.register_step_pre_hook(self._record_draft)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        self.policy_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    def _record_draft(self, optimizer, args, kwargs):
        draft = self.trainer.draft
        self.draft_grads = {n: p.grad.detach().clone() for n, p in draft.named_parameters() if p.grad is not None}


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def equality_run_config(out_dir: str, *, per_device_train_batch_size: int, **options) -> SpecCoTrainConfig:
    """Two steps whose updates compare at float32 precision between a parallel run and one process."""
    return SpecCoTrainConfig(
        output_dir=out_dir,
        use_cpu=True,
        bf16=False,
        report_to="none",
        per_device_train_batch_size=per_device_train_batch_size,
        num_generations=NUM_GENERATIONS,
        max_completion_length=10,
        max_steps=2,
        optim="sgd",  # the policy's update is then proportional to its gradient: comparable at float32 precision
        learning_rate=0.05,
        logging_steps=1,
        save_strategy="no",
        save_draft=False,
        seed=5,
        shuffle_dataset=False,
        max_grad_norm=0.0,
        draft_max_grad_norm=0.0,
        draft_warmup_steps=0,
        ttt_steps=2,
        disable_tqdm=True,
        **options,
    )


def run(policy_dir: str, out_dir: str, mode: str) -> dict:
    """Train; return this rank's record (see the module docstring)."""
    config = equality_run_config(
        out_dir,
        per_device_train_batch_size=4 if mode == "cp" else 8,
        speculative_decoding=False,
        context_parallel_size=2 if mode == "cp" else 1,
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
    return {
        "world_size": trainer.accelerator.num_processes,
        "rank": trainer.accelerator.process_index,
        "policy_grads": recorder.policy_grads,
        "draft_grads": recorder.draft_grads,
        "policy_start": policy_start,
        "policy_params": _snapshot(policy),
        "draft_start": draft_start,
        "draft_params": _snapshot(trainer.draft),
        "step_logs": [entry for entry in trainer.state.log_history if "draft/loss" in entry],
    }


if __name__ == "__main__":
    torch.set_num_threads(1)
    record = run(*sys.argv[1:4])
    torch.save(record, Path(sys.argv[2], f"{sys.argv[3]}{record['rank']}.pt"))
