"""Co-training under context parallelism: two GRPO steps with `context_parallel_size=2` on 2 gloo processes
(torchrun) against the same steps in one plain process on the same rows (`cp_cotrain_script.py`)."""

from pathlib import Path

import pytest
from cotrain_cases import (
    DRAFT_METRICS,
    assert_same_step_logs,
    assert_same_tensors,
    assert_single_run_learned,
    run_parallel_and_single,
)
from cp_cotrain_script import run
from tiny_policy import save_tiny_policy


pytestmark = pytest.mark.distributed
SCRIPT = Path(__file__).with_name("cp_cotrain_script.py")


@pytest.mark.parametrize(
    "family, options, loosen",
    # Qwen3: the one trainer run of a family with q/k norms, under the ring attention. gpt-oss: experts, sinks and a
    # window of 4 on every other layer, shorter than the rows (slow: about as long as the Qwen3 run again). Its
    # gradients are more sensitive to rounding: scaling its float32 weights by 1 + 1e-7 N(0, 1) moved its one-process
    # policy gradients by 1.5e-5 of their largest entry and the draft's parameters by 1.6e-5; under CP the draft's
    # gradients differ by up to 3.2e-5 (its exactness is checked in float64, tests/distributed/test_policy_cp.py).
    [("qwen3", {}, 1.0), pytest.param("gpt_oss", {"sliding_window": 4}, 10.0, marks=pytest.mark.slow)],
)
def test_context_parallel_steps_equal_the_single_process_steps(tmp_path, family, options, loosen):
    policy_dir = save_tiny_policy(tmp_path / "policy", family=family, **options)
    cp, single = run_parallel_and_single(SCRIPT, run, policy_dir, tmp_path, "cp")

    assert_single_run_learned(cp, single)
    for record in cp:
        rank = record["rank"]
        # DDP's average of the shards' gradients is the gradient of one process over all 8 rows, and so is the
        # draft's after the draft co-trainer's average over the world.
        assert_same_tensors(
            record["policy_grads"],
            single["policy_grads"],
            f"rank {rank} policy grad",
            relative_to_max=True,
            loosen=loosen,
        )
        assert_same_tensors(
            record["draft_grads"],
            single["draft_grads"],
            f"rank {rank} draft grad",
            relative_to_max=True,
            loosen=loosen,
        )
        assert_same_tensors(
            record["policy_params"],
            single["policy_params"],
            f"rank {rank} policy",
            relative_to_max=False,
            loosen=loosen,
        )
        assert_same_tensors(
            record["draft_params"], single["draft_params"], f"rank {rank} draft", relative_to_max=False, loosen=loosen
        )
        # Every step logged the draft's metrics and the policy loss, equal to the single process's.
        assert_same_step_logs(record, single, [*DRAFT_METRICS, "loss", "entropy"])
