"""Run by tests/distributed/test_trainer_ddp.py under `torchrun --nproc_per_node 2` (gloo, CPU).

Trains a tiny policy with co-training for a few steps and records, after every step, a checksum of the
draft on this rank, plus the local (pre-averaging) and averaged draft gradients of the first update.
"""

import json
import sys
from pathlib import Path

import torch
from datasets import Dataset
from transformers import TrainerCallback

from hf_spec_cotrain import SpecCoTrainConfig, SpecCoTrainGRPOTrainer
from hf_spec_cotrain.testing import build_char_tokenizer


class DraftRecorder(TrainerCallback):
    def __init__(self):
        self.trainer = None
        self.checksums = []

    def on_step_end(self, args, state, control, **kwargs):  # runs after the draft update callback
        params = [p.detach().double() for p in self.trainer.draft.parameters()]
        self.checksums.append([float(p.sum()) for p in params] + [float((p * p).sum()) for p in params])


def main(policy_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    config = SpecCoTrainConfig(
        output_dir=out_dir,
        use_cpu=True,
        bf16=False,
        report_to="none",
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=3,
        logging_steps=1,
        save_strategy="no",
        seed=3,
        draft_learning_rate=1e-3,
        draft_warmup_steps=0,
        disable_tqdm=True,
    )
    prompts = Dataset.from_dict({"prompt": ["abc", "hello", "xyz!", "spec", "draft", "Q: 2+2?", "one", "two"]})
    trainer = SpecCoTrainGRPOTrainer(
        model=policy_dir,
        reward_funcs=lambda completions, **kw: [c.count("a") / 8 for c in completions],
        args=config,
        train_dataset=prompts,
        processing_class=build_char_tokenizer(),
    )
    recorder = DraftRecorder()
    recorder.trainer = trainer
    trainer.add_callback(recorder)

    local_grads = {}
    update = trainer._draft_update

    def recording_update():
        if not local_grads:
            local_grads.update(
                {n: p.grad.double().sum().item() for n, p in trainer.draft.named_parameters() if p.grad is not None}
            )
        update()

    trainer._draft_update = recording_update
    trainer.train()
    rank = trainer.accelerator.process_index
    Path(out_dir, f"rank{rank}.json").write_text(
        json.dumps(
            {
                "world_size": trainer.accelerator.num_processes,
                "checksums": recorder.checksums,
                "local_grad_sums": local_grads,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
