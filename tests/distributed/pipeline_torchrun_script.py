"""Run by `test_pipeline_torchrun.py` under torchrun: a few optimizer steps of pipelined GRPO with the draft
co-trained on the last stage, on the launcher's process group; then the full policy and the draft stream to
rank 0 (the rollout rank), which saves them for the test to compare with the single-process run."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from pipeline_cases import AUX_LAYER_IDS, TEMPERATURE, build_draft, build_policy, make_batch
from safetensors.torch import save_file
from torchrun_launch import exit_without_teardown

from hf_spec_cotrain.parallel.pipeline import stream_pipeline_weights
from hf_spec_cotrain.training.pipeline_step import PipelineCoTrainStep


NUM_STEPS = 3
MAX_GRAD_NORM = 0.05  # small enough to clip: the clipping must see the norm over every stage


def main(out_dir: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out_dir.mkdir(parents=True, exist_ok=True)
    policy = build_policy("llama")
    draft = build_draft(policy) if rank == world_size - 1 else None
    step = PipelineCoTrainStep(
        policy, draft=draft, aux_layer_ids=AUX_LAYER_IDS, schedule="1F1B", num_microbatches=4, temperature=TEMPERATURE
    )
    optimizer = torch.optim.AdamW(step.parameters(), lr=1e-3)
    draft_optimizer = torch.optim.AdamW(draft.trainable_parameters(), lr=1e-3) if draft is not None else None
    log = []
    for index in range(NUM_STEPS):
        out = step.step(make_batch(index))
        norm = step.clip_grad_norm_(MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if draft_optimizer is not None:
            draft_optimizer.step()
            draft_optimizer.zero_grad(set_to_none=True)
            log.append({"loss": out.policy_loss.item(), "draft_loss": out.draft.loss.item(), "grad_norm": norm.item()})
    policy_weights = dict(stream_pipeline_weights(step.state_dict(), group=dist.group.WORLD, dst=0))
    draft_weights = dict(stream_pipeline_weights(draft.state_dict() if draft is not None else {}, dst=0))
    if rank == 0:
        save_file({k: v.contiguous() for k, v in policy_weights.items()}, out_dir / "policy.safetensors")
        save_file({k: v.contiguous() for k, v in draft_weights.items()}, out_dir / "draft.safetensors")
    if draft is not None:
        (out_dir / "log.json").write_text(json.dumps({"world_size": world_size, "steps": log}))
    dist.destroy_process_group()
    exit_without_teardown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
