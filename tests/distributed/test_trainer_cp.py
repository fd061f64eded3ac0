"""Co-training under context parallelism: two GRPO steps with `context_parallel_size=2` on 2 gloo processes
(torchrun) against the same steps in one plain process on the same rows (`cp_cotrain_script.py`)."""

from pathlib import Path

import pytest
import torch
from cp_cotrain_script import run
from tiny_policy import save_tiny_policy
from torchrun_launch import run_torchrun


pytestmark = pytest.mark.distributed
SCRIPT = Path(__file__).with_name("cp_cotrain_script.py")
DRAFT_METRICS = ["draft/loss", "draft/loss_step_0", "draft/loss_step_1", "draft/accuracy_step_1", "draft/grad_norm"]


def run_context_parallel(policy_dir: Path, out_dir: Path) -> list[dict]:
    run_torchrun(SCRIPT, policy_dir, out_dir, "cp", log=out_dir.with_suffix(".log"))
    return [torch.load(out_dir / f"cp{rank}.pt") for rank in range(2)]


def assert_close(actual: dict, expected: dict, what: str, *, relative_to_max: bool) -> None:
    """float32 tolerance: the ring's blockwise softmax and the shards' partial sums round differently from one
    device (measured: <= 5e-6 of a gradient's largest entry, <= 3e-7 on a parameter)."""
    assert actual.keys() == expected.keys() and actual, what
    for name, tensor in expected.items():
        atol = 1e-5 * float(tensor.abs().max()) if relative_to_max else 1e-6
        torch.testing.assert_close(actual[name], tensor, rtol=1e-5, atol=atol, msg=f"{what} {name}")


def test_context_parallel_steps_equal_the_single_process_steps(tmp_path):
    # Qwen3: the one trainer run of a family with q/k norms, under the ring attention.
    policy_dir = save_tiny_policy(tmp_path / "policy", family="qwen3")
    cp = run_context_parallel(policy_dir, tmp_path / "cp")
    threads = torch.get_num_threads()
    try:
        single = run(str(policy_dir), str(tmp_path / "single"), "single")
    finally:
        torch.set_num_threads(threads)

    assert [record["world_size"] for record in cp] == [2, 2] and single["world_size"] == 1
    assert all(grad.abs().max() > 0 for grad in [*single["policy_grads"].values(), *single["draft_grads"].values()])
    for moved in ("policy", "draft"):  # both models learned, so equal parameters below mean equal updates
        assert any(not torch.equal(single[f"{moved}_params"][n], p) for n, p in single[f"{moved}_start"].items())
    for record in cp:
        rank = record["rank"]
        # DDP's average of the shards' gradients is the gradient of one process over all 8 rows, and so is the
        # draft's after `_draft_update`'s average over the world.
        assert_close(record["policy_grads"], single["policy_grads"], f"rank {rank} policy grad", relative_to_max=True)
        assert_close(record["draft_grads"], single["draft_grads"], f"rank {rank} draft grad", relative_to_max=True)
        assert_close(record["policy_params"], single["policy_params"], f"rank {rank} policy", relative_to_max=False)
        assert_close(record["draft_params"], single["draft_params"], f"rank {rank} draft", relative_to_max=False)
        # Every step logged the draft's metrics and the policy loss, equal to the single process's.
        assert len(record["step_logs"]) == len(single["step_logs"]) == 2
        for logged, expected in zip(record["step_logs"], single["step_logs"]):
            for key in [*DRAFT_METRICS, "loss", "entropy"]:
                assert logged[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
            assert logged["draft/loss"] > 0
