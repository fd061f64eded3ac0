"""Run by tests/test_launch_configs.py under `accelerate launch`: runs the GRPO entry point module as `accelerate
launch -m` runs it, and writes what each rank's co-training trainer saw to ``<record_dir>/rank<r>.json``.

    accelerate launch --config_file <config> launch_recorder.py <record_dir> <module> [its arguments]

Recorded, with no collectives (the test compares the ranks): the launch (world size, accelerate's distributed type
and mixed precision, whether transformers reads weights on local rank 0 only, the trainer's parallel sizes); per-tensor
sums (float64) of the policy, the reference model and the draft on this rank when training begins (the models as
prepared, a sharded tensor's local shard); the steps trained, and the draft's sums when training ends.
"""

import json
import runpy
import sys
from pathlib import Path

import torch
from transformers import TrainerCallback
from transformers.integrations import is_fsdp_enabled as fsdp_loads_on_rank_zero_only

from hf_spec_cotrain import SpecCoTrainGRPOTrainer


def tensor_sums(module: torch.nn.Module | None) -> dict[str, dict] | None:
    """`{name: {"sum": float, "sharded": bool}}` over the parameters and buffers of `module` on this rank."""
    if module is None:
        return None
    sums = {}
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        sharded = hasattr(tensor, "to_local")  # a DTensor (FSDP2)
        local = tensor.to_local() if sharded else tensor
        sums[name] = {"sum": float(local.detach().double().sum()), "sharded": sharded}
    return sums


class LaunchRecorder(TrainerCallback):
    def __init__(self, trainer: SpecCoTrainGRPOTrainer, record_dir: Path):
        self.trainer, self.record_dir, self.record = trainer, record_dir, {}

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self.trainer
        accelerator, dims = trainer.accelerator, trainer.parallel_dims
        self.record.update(
            rank=accelerator.process_index,
            world_size=accelerator.num_processes,
            distributed_type=str(accelerator.distributed_type),
            mixed_precision=accelerator.mixed_precision,
            loads_on_rank_zero_only=fsdp_loads_on_rank_zero_only(),
            policy_sharded=dims.fsdp,
            context_parallel_size=dims.context_parallel_size,
            pipeline_parallel_size=dims.pipeline_parallel_size,
            policy=tensor_sums(trainer.unwrapped(trainer.model)),
            reference=None if trainer.ref_model is None else tensor_sums(trainer.unwrapped(trainer.ref_model)),
            draft_begin=tensor_sums(trainer.draft),
        )

    def on_train_end(self, args, state, control, **kwargs):
        self.record.update(global_step=state.global_step, draft_end=tensor_sums(self.trainer.draft))
        self.record_dir.mkdir(parents=True, exist_ok=True)
        (self.record_dir / f"rank{self.record['rank']}.json").write_text(json.dumps(self.record))


def main(record_dir: str, module: str, argv: list[str]) -> None:
    train = SpecCoTrainGRPOTrainer.train

    def recorded_train(trainer, *args, **kwargs):
        trainer.add_callback(LaunchRecorder(trainer, Path(record_dir)))
        return train(trainer, *args, **kwargs)

    SpecCoTrainGRPOTrainer.train = recorded_train
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
