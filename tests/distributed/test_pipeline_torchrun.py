"""Pipelined co-training under torchrun (the launcher's process group, gloo): optimizer steps equal the
single-process ones, and the rollout rank receives the full policy and the draft."""

import json
import os
from pathlib import Path

import pytest
import torch
from pipeline_cases import build_draft, build_policy, make_batch, reference_step
from pipeline_torchrun_script import MAX_GRAD_NORM, NUM_STEPS
from safetensors.torch import load_file
from torchrun_launch import run_torchrun


pytestmark = pytest.mark.distributed
SCRIPT = Path(__file__).with_name("pipeline_torchrun_script.py")


def _single_process_run():
    policy = build_policy("llama")
    draft = build_draft(policy)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    draft_optimizer = torch.optim.AdamW(draft.trainable_parameters(), lr=1e-3)
    log = []
    for index in range(NUM_STEPS):
        loss, draft_out = reference_step(policy, draft, make_batch(index))
        norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        draft_optimizer.step()
        draft_optimizer.zero_grad(set_to_none=True)
        log.append({"loss": loss.item(), "draft_loss": draft_out.loss.item(), "grad_norm": norm.item()})
    return policy, draft, log


@pytest.mark.parametrize("num_stages", [2])
def test_torchrun_pipeline_training_equals_single_process(tmp_path, num_stages):
    pythonpath = os.pathsep.join([str(SCRIPT.parent), os.environ.get("PYTHONPATH", "")])
    run_torchrun(
        SCRIPT, tmp_path / "out", nproc=num_stages, log=tmp_path / "torchrun.log", env={"PYTHONPATH": pythonpath}
    )

    policy, draft, log = _single_process_run()
    run = json.loads((tmp_path / "out" / "log.json").read_text())
    assert run["world_size"] == num_stages and len(run["steps"]) == NUM_STEPS
    for got, expected in zip(run["steps"], log):
        for key in ("loss", "draft_loss", "grad_norm"):
            assert got[key] == pytest.approx(expected[key], rel=1e-4), key
    assert all(entry["grad_norm"] > MAX_GRAD_NORM for entry in log)  # clipping was active
    streamed = load_file(tmp_path / "out" / "policy.safetensors")
    expected = policy.state_dict()
    assert streamed.keys() == expected.keys()
    initial = build_policy("llama").state_dict()
    for name, tensor in expected.items():
        torch.testing.assert_close(streamed[name], tensor, rtol=1e-4, atol=1e-5)
        assert not torch.equal(streamed[name], initial[name]), name  # every weight trained
    streamed_draft = load_file(tmp_path / "out" / "draft.safetensors")
    assert streamed_draft.keys() == draft.state_dict().keys()
    for name, tensor in draft.state_dict().items():
        torch.testing.assert_close(streamed_draft[name], tensor, rtol=1e-4, atol=1e-5)
