"""Run by tests/distributed/test_trainer_ddp.py under `torchrun --nproc_per_node 2` (gloo, CPU).

Trains a tiny policy with co-training for a few steps and records, after every step, checksums of the
draft and the policy on this rank, plus the local (pre-averaging) draft gradients of the first update (the
recorders are cotrain_cases.py's).

Mode ``ddp`` runs accelerate's DDP. Mode ``fsdp2`` shards the policy with FSDP2 (``fully_shard`` per decoder
layer); accelerate only enables FSDP on accelerators, so this script switches its CPU state to FSDP2 itself,
which runs the very code path a GPU launch with `examples/accelerate_configs/fsdp2.yaml` runs.
"""

import json
import sys
from pathlib import Path

import torch
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from cotrain_cases import ChecksumRecorder, record_local_draft_gradients
from datasets import Dataset
from torchrun_launch import exit_without_teardown

from hf_spec_cotrain import SpecCoTrainConfig, SpecCoTrainGRPOTrainer
from hf_spec_cotrain.testing import build_char_tokenizer


def switch_accelerate_to_fsdp2_on_cpu() -> None:
    """accelerate drops FSDP on CPU: make its state FSDP2 in this process, as a GPU launch would have it."""
    init = AcceleratorState.__init__

    def init_with_fsdp2(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2)

    AcceleratorState.__init__ = init_with_fsdp2


def main(mode: str, policy_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    fsdp = {}
    if mode == "fsdp2":
        switch_accelerate_to_fsdp2_on_cpu()
        fsdp = {
            "fsdp": True,
            "fsdp_config": {"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
        }
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
        **fsdp,
    )
    prompts = Dataset.from_dict({"prompt": ["abc", "hello", "xyz!", "spec", "draft", "Q: 2+2?", "one", "two"]})
    trainer = SpecCoTrainGRPOTrainer(
        model=policy_dir,
        reward_funcs=lambda completions, **kw: [len(set(c)) / (1 + len(c)) for c in completions],
        args=config,
        train_dataset=prompts,
        processing_class=build_char_tokenizer(),
    )
    recorder = ChecksumRecorder(trainer)
    trainer.add_callback(recorder)
    local_grads = record_local_draft_gradients(trainer)
    trainer.train()
    rank = trainer.accelerator.process_index
    Path(out_dir, f"rank{rank}.json").write_text(
        json.dumps(
            {
                "world_size": trainer.accelerator.num_processes,
                "fsdp": trainer.is_fsdp_enabled,
                "policy_param_types": sorted({type(p).__name__ for p in trainer.model.parameters()}),
                "policy_checksums": recorder.policy_checksums,
                "draft_loss": [h["draft/loss"] for h in trainer.state.log_history if "draft/loss" in h],
                "checksums": recorder.checksums,
                "local_grad_sums": local_grads,
            }
        )
    )
    trainer.accelerator.end_training()
    exit_without_teardown()


if __name__ == "__main__":
    main(*sys.argv[1:4])
