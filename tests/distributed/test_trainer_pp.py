"""Co-training under pipeline parallelism: two GRPO steps with `pipeline_parallel_size=2` on 2 gloo processes
(torchrun) against the same steps in one plain process on the same rows (`pp_cotrain_script.py`). The config's
checks of the pipeline options are in tests/test_config.py."""

from pathlib import Path

import pytest
import torch
from pp_cotrain_script import run
from safetensors.torch import load_file
from torchrun_launch import run_torchrun


SCRIPT = Path(__file__).with_name("pp_cotrain_script.py")
DRAFT_METRICS = ["draft/loss", "draft/loss_step_0", "draft/loss_step_1", "draft/accuracy_step_1", "draft/grad_norm"]


def run_pipeline_parallel(policy_dir: Path, out_dir: Path) -> list[dict]:
    run_torchrun(SCRIPT, policy_dir, out_dir, "pp", log=out_dir.with_suffix(".log"))
    return [torch.load(out_dir / f"pp{rank}.pt") for rank in range(2)]


def assert_close(actual: dict, expected: dict, what: str, *, relative_to_max: bool) -> None:
    """float32 tolerance: the micro-batches' partial sums round differently from one whole-batch forward."""
    assert actual, what
    for name, tensor in actual.items():
        reference = expected[name]
        atol = 1e-5 * float(reference.abs().max()) if relative_to_max else 1e-6
        torch.testing.assert_close(tensor, reference, rtol=1e-5, atol=atol, msg=f"{what} {name}")


@pytest.mark.distributed
def test_pipeline_parallel_steps_equal_the_single_process_steps(tmp_path, tiny_policy_dir):
    policy_dir = tiny_policy_dir
    pp = run_pipeline_parallel(policy_dir, tmp_path / "pp")
    threads = torch.get_num_threads()
    try:
        single = run(str(policy_dir), str(tmp_path / "single"), "single")
    finally:
        torch.set_num_threads(threads)

    assert [record["world_size"] for record in pp] == [2, 2] and single["world_size"] == 1
    assert all(grad.abs().max() > 0 for grad in [*single["policy_grads"].values(), *single["draft_grads"].values()])
    for moved in ("policy", "draft"):  # both models learned, so equal parameters below mean equal updates
        assert any(not torch.equal(single[f"{moved}_params"][n], p) for n, p in single[f"{moved}_start"].items())

    # Each stage holds its slice of the policy (layers 0-3 with the embedding, 4-7 with the norm and the head),
    # with the gradients and the update of the whole model's step.
    stage_names = [set(record["policy_params"]) for record in pp]
    assert not stage_names[0] & stage_names[1] and stage_names[0] | stage_names[1] == set(single["policy_params"])
    assert "model.embed_tokens.weight" in stage_names[0] and "lm_head.weight" in stage_names[1]
    for record in pp:
        rank = record["rank"]
        assert_close(record["policy_grads"], single["policy_grads"], f"rank {rank} policy grad", relative_to_max=True)
        assert_close(record["policy_params"], single["policy_params"], f"rank {rank} policy", relative_to_max=False)
    # The draft trains on the last stage only.
    assert not pp[0]["draft_grads"]
    assert_close(pp[1]["draft_grads"], single["draft_grads"], "draft grad", relative_to_max=True)
    assert set(pp[1]["draft_grads"]) == set(single["draft_grads"])
    assert_close(pp[1]["draft_params"], single["draft_params"], "draft", relative_to_max=False)

    # Rank 0 generated every rollout with the full policy and the draft streamed from the stages: at the second
    # step's generation, the weights the single process had after its first step.
    assert not pp[1]["rollout_weights"] and len(pp[0]["rollout_weights"]) == len(single["rollout_weights"]) == 2
    for (policy, draft), (policy_ref, draft_ref) in zip(pp[0]["rollout_weights"], single["rollout_weights"]):
        assert policy.keys() == policy_ref.keys() and draft.keys() == draft_ref.keys()
        assert_close(policy, policy_ref, "rollout policy", relative_to_max=False)
        assert_close(draft, draft_ref, "rollout draft", relative_to_max=False)
    assert any(not torch.equal(p, single["policy_start"][n]) for n, p in pp[0]["rollout_weights"][1][0].items())
    # `save_model` writes the full policy, streamed to rank 0.
    saved = load_file(tmp_path / "pp" / "final" / "model.safetensors")
    assert_close(saved, single["policy_params"], "saved policy", relative_to_max=False)

    # Every step logged the policy loss, its gradient norm over all stages and the draft's metrics, equal to
    # the single process's, on every rank; rank 0 also logged its speculative rollouts.
    for record in pp:
        assert len(record["step_logs"]) == len(single["step_logs"]) == 2
        for logged, expected in zip(record["step_logs"], single["step_logs"]):
            for key in [*DRAFT_METRICS, "loss", "grad_norm"]:
                assert logged[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
            assert logged["draft/loss"] > 0
    assert all(entry["spec/acceptance_length"] >= 1 for entry in pp[0]["step_logs"])
