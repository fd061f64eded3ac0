"""A short co-training run that SIGKILLs itself inside one of the draft's checkpoint writes (tests/training/test_checkpoints.py).

    python tests/kill_during_save.py POLICY_DIR OUTPUT_DIR {draft,draft_state}

The run saves every 2 steps and keeps one checkpoint (``save_total_limit=1``); the write named on the command line
is cut at the checkpoint of step 4, after part of its bytes reached the disk: ``draft`` once the draft's weights are
written (its model card and the rest not yet), ``draft_state`` halfway through the draft's optimizer state.
`build_trainer` is the run the test resumes and compares with.
"""

import io
import os
import signal
import sys

import torch
from datasets import Dataset
from tiny_policy import tiny_grpo_kwargs

from hf_spec_cotrain import Eagle3DraftModel, SpecCoTrainConfig, SpecCoTrainGRPOTrainer
from hf_spec_cotrain.testing import build_char_tokenizer


KILLED_AT_STEP = 4
PROMPTS = ["abc", "hello", "xyz!", "spec", "draft", "Q: 2+2?", "one two", "GRPO"]


def upper_reward(completions, **kwargs):
    return [sum(c.isupper() for c in text) / max(len(text), 1) for text in completions]


def build_trainer(policy_dir, output_dir, **overrides) -> SpecCoTrainGRPOTrainer:
    options = {"max_steps": KILLED_AT_STEP, "save_strategy": "steps", "save_steps": 2, "save_total_limit": 1}
    config = SpecCoTrainConfig(
        **tiny_grpo_kwargs(output_dir, **options | overrides), draft_learning_rate=1e-3, draft_warmup_steps=0
    )
    return SpecCoTrainGRPOTrainer(
        model=str(policy_dir),
        reward_funcs=upper_reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=build_char_tokenizer(),
    )


def _kill():
    os.kill(os.getpid(), signal.SIGKILL)


def main(policy_dir, output_dir, write):
    trainer = build_trainer(policy_dir, output_dir)
    if write == "draft":
        save_pretrained = Eagle3DraftModel.save_pretrained

        def save_and_die(self, *args, **kwargs):
            save_pretrained(self, *args, **kwargs)
            if trainer.state.global_step == KILLED_AT_STEP:
                _kill()

        Eagle3DraftModel.save_pretrained = save_and_die
    elif write == "draft_state":
        save = torch.save

        def save_half_and_die(obj, f, *args, **kwargs):
            if trainer.state.global_step != KILLED_AT_STEP or "draft_training_state" not in str(f):
                return save(obj, f, *args, **kwargs)
            buffer = io.BytesIO()
            save(obj, buffer, *args, **kwargs)
            with open(f, "wb") as file:
                file.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
            _kill()

        torch.save = save_half_and_die
    else:
        raise ValueError(f"write={write!r}: choose 'draft' or 'draft_state'.")
    trainer.train()


if __name__ == "__main__":
    main(*sys.argv[1:])
