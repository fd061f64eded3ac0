"""The draft sharded with FSDP2 (`shard_draft=True`) over the policy's ranks: 4 gloo processes (torchrun, accelerate's
FSDP2 switched on on CPU) against one process on the same rows (`sharded_draft_script.py`); save and resume; the
refusal without FSDP2."""

from pathlib import Path

import pytest
import torch
from cotrain_cases import assert_equal_runs, assert_same_tensors, run_parallel_and_single
from sharded_draft_script import run
from torchrun_launch import run_torchrun

from hf_spec_cotrain import SpecCoTrainConfig


pytestmark = pytest.mark.distributed
SCRIPT = Path(__file__).with_name("sharded_draft_script.py")
NPROC = 4


def assert_sharded_run_equals_one_process(sharded: list[dict], single: dict, *, loosen: float) -> None:
    """Both models' gradients and parameters after two steps, and the step logs, equal one process's; each rank
    holds at most 1/N (+ 5%) of the replicated draft's state, which is one process's."""
    assert_equal_runs(sharded, single, ["loss"], loosen=loosen)
    for record in sharded:
        rank = record["rank"]
        assert record["draft_param_types"] == ["DTensor"], f"rank {rank}: the draft is not sharded"
        replicated = single["draft_state_bytes"]
        assert record["draft_state_bytes"] <= replicated * (1 / NPROC + 0.05), (
            f"rank {rank} holds {record['draft_state_bytes']} bytes of draft state; a replica is {replicated}"
        )


@pytest.mark.slow  # 4 processes and one: 85 s on 2 shared cores, past the ~60 s CI share of this change
def test_a_sharded_eagle3_draft_trains_as_in_one_process(tmp_path, tiny_policy_dir):
    sharded, single = run_parallel_and_single(SCRIPT, run, tiny_policy_dir, tmp_path, "fsdp", nproc=NPROC)

    assert_sharded_run_equals_one_process(sharded, single, loosen=1.0)


@pytest.mark.slow
def test_a_sharded_dflash_draft_trains_as_in_one_process(tmp_path, tiny_policy_dir):
    """DFlash's full-vocabulary head is the policy's (FSDP2-sharded, gathered once per loss), its mask token's
    embedding looked up in the policy's sharded table. The tolerance is the DFlash CP run's (test_trainer_cp.py:
    AdamW's first step moves near-zero entries by the learning rate whatever the sign that rounding gave them)."""
    sharded, single = run_parallel_and_single(
        SCRIPT, run, tiny_policy_dir, tmp_path, "fsdp", variant="dflash", nproc=NPROC
    )

    assert_sharded_run_equals_one_process(sharded, single, loosen=25.0)
    assert single["step_logs"][0]["draft/loss_step_2"] > 0


@pytest.mark.slow
def test_a_sharded_run_resumed_from_a_checkpoint_equals_the_uninterrupted_run(tmp_path, tiny_policy_dir):
    """Checkpoints gather the draft and its optimizer state whole on rank 0 (safetensors, by parameter name); the
    resumed run shards them again and trains on to the same draft and policy."""
    out_dir = tmp_path / "out"
    run_torchrun(SCRIPT, tiny_policy_dir, out_dir, "fsdp-resume", log=tmp_path / "resume.log", nproc=2)
    records = [torch.load(out_dir / f"fsdp-resume{rank}.pt") for rank in range(2)]
    for record in records:
        assert record["world_size"] == 2 and record["sharded"]
        assert record["steps"] == [1, 2, 3]
        for model in ("draft", "policy"):
            assert_same_tensors(
                record["resumed"][model],
                record["uninterrupted"][model],
                f"rank {record['rank']} {model}",
                relative_to_max=False,
            )
    saved = records[0]["saved_draft"]
    assert saved.keys() == records[0]["uninterrupted"]["draft"].keys()
    for name, tensor in saved.items():
        torch.testing.assert_close(tensor, records[0]["uninterrupted"]["draft"][name], rtol=0, atol=0, msg=name)


def test_sharding_the_draft_without_fsdp2_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"`shard_draft=True` needs FSDP2, but this run uses no FSDP"):
        SpecCoTrainConfig(output_dir=str(tmp_path), use_cpu=True, shard_draft=True)
    with pytest.raises(ValueError, match=r"`shard_draft=True` needs FSDP2, but this run uses FSDP version 1"):
        SpecCoTrainConfig(output_dir=str(tmp_path), use_cpu=True, shard_draft=True, fsdp=True)
    with pytest.raises(ValueError, match=r"`shard_draft=True` cannot be combined with `pipeline_parallel_size`=2"):
        SpecCoTrainConfig(output_dir=str(tmp_path), use_cpu=True, shard_draft=True, pipeline_parallel_size=2)
