"""Co-training under context parallelism: two GRPO steps with `context_parallel_size=2` on 2 gloo processes
(torchrun) against the same steps in one plain process on the same rows (`cp_cotrain_script.py`)."""

from pathlib import Path

import pytest
import torch
from cotrain_cases import assert_equal_runs, run_parallel_and_single
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

    assert_equal_runs(cp, single, ["loss", "entropy"], loosen=loosen)


def test_a_dflash_draft_under_context_parallelism_trains_as_in_one_process(tmp_path, tiny_policy_dir):
    """DFlash's blocks through the ring: its anchors' blocks run on the rank holding `anchor - 1`, the context
    passes around the ring, and both models' two steps equal one process's.

    The draft's first-step gradients agree to 6e-7 of their largest entry (measured with `max_steps=1`), but AdamW's
    first step moves every entry by the learning rate whatever its gradient's size, so rounding that flips the sign
    of a near-zero entry moves it by twice that: the second step's attention gradients then differ by up to 1.8e-4
    of their largest entry (2026-12-06). Exactness itself is checked in float64 in test_dflash_cp.py."""
    cp, single = run_parallel_and_single(SCRIPT, run, tiny_policy_dir, tmp_path, "cp", variant="dflash")

    assert_equal_runs(cp, single, ["loss", "entropy"], loosen=25.0)
    assert single["step_logs"][0]["draft/loss_step_2"] > 0  # DFlash's block of 4: three positions learn


def test_scoring_passes_run_sharded_and_equal_the_single_process_steps(tmp_path, tiny_policy_dir):
    """`beta > 0` and `num_iterations > 1`: the reference model's and the old policy's log-prob passes run on zigzag
    shards of packed rows (batch 1, never a whole row) and give the single process's KL, loss and updates."""
    cp, single = run_parallel_and_single(SCRIPT, run, tiny_policy_dir, tmp_path, "cp", variant="kl")

    # Two more sharded passes (reference, old policy) round in the loss: measured 1.3e-5 of the largest entry of a
    # layer norm's gradient (2026-12-04, 2 threads, AVX-512), past the 1e-5 that one pass needs.
    assert_equal_runs(cp, single, ["loss", "entropy", "kl"], loosen=2.0)
    assert single["step_logs"][1]["kl"] > 0  # the second step's policy has moved from the reference
    for record in cp:
        no_grad = [shape for grad, shape in record["policy_shapes"] if not grad]
        assert no_grad and record["reference_shapes"]  # the old policy's and the reference's passes ran...
        for shape in [*no_grad, *(shape for _, shape in record["reference_shapes"])]:
            assert shape[0] == 1, f"rank {record['rank']}: a scoring pass saw {shape}, not a shard of packed rows"
    assert {shape[0] for _, shape in single["reference_shapes"]} == {8}  # ...where one process scores its 8 rows


def test_fsdp2_and_context_parallel_on_a_2d_mesh_equal_the_single_process_steps(tmp_path, tiny_policy_dir):
    """4 processes, accelerate's `ParallelismConfig(dp_shard_size=2, cp_size=2)`: the policy sharded with FSDP2 over
    the mesh (the package shards it on CPU, where accelerate drops FSDP), the ring over groups of 2 consecutive
    ranks, the draft replicated; two steps equal one process's on the same 16 rows."""
    fsdp, single = run_parallel_and_single(SCRIPT, run, tiny_policy_dir, tmp_path, "cp", variant="fsdp", nproc=4)

    assert_equal_runs(fsdp, single, ["loss", "entropy"], loosen=1.0)
    for record in fsdp:
        rank = record["rank"]
        assert record["cp_group"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert record["policy_param_types"] == ["DTensor"]  # really sharded
        # each rank would checkpoint its own shard of the optimizer state: refused at construction, with the way out
        assert "`save_strategy`='steps' with FSDP2 that the trainer applies itself" in record["checkpoints_refused"]
    # the final save gathers the whole policy: what rank 0 wrote is every parameter as trained
    saved = fsdp[0]["saved_policy"]
    assert saved.keys() >= fsdp[0]["policy_params"].keys() - {"lm_head.weight"}
    for name, tensor in saved.items():
        torch.testing.assert_close(tensor, fsdp[0]["policy_params"][name], rtol=0, atol=0, msg=name)


@pytest.mark.slow
def test_fsdp2_and_context_parallel_with_a_dflash_draft_equal_the_single_process_steps(tmp_path, tiny_policy_dir):
    """The 2-D mesh of FSDP2 x CP (4 processes) with DFlash's blocks through the ring."""
    fsdp, single = run_parallel_and_single(
        SCRIPT, run, tiny_policy_dir, tmp_path, "cp", variant="fsdp+dflash", nproc=4
    )

    assert_equal_runs(fsdp, single, ["loss", "entropy"], loosen=25.0)  # as the 2-process DFlash run's
