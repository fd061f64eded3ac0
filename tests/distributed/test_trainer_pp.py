"""Co-training under pipeline parallelism: two GRPO steps with `pipeline_parallel_size=2` on 2 gloo processes
(torchrun) against the same steps in one plain process on the same rows (`pp_cotrain_script.py`). The config's
checks of the pipeline options are in tests/test_config.py."""

from pathlib import Path

import pytest
import torch
from cotrain_cases import (
    DRAFT_METRICS,
    assert_same_step_logs,
    assert_same_tensors,
    assert_single_run_learned,
    run_parallel_and_single,
)
from pp_cotrain_script import run
from safetensors.torch import load_file


pytestmark = pytest.mark.distributed
SCRIPT = Path(__file__).with_name("pp_cotrain_script.py")


def only(tensors: dict, names) -> dict:
    """`tensors` restricted to `names` (each must be there)."""
    return {name: tensors[name] for name in names}


def test_pipeline_parallel_steps_equal_the_single_process_steps(tmp_path, tiny_policy_dir):
    pp, single = run_parallel_and_single(SCRIPT, run, tiny_policy_dir, tmp_path, "pp")

    assert_single_run_learned(pp, single)
    # Each stage holds its slice of the policy (layers 0-3 with the embedding, 4-7 with the norm and the head),
    # with the gradients and the update of the whole model's step.
    stage_names = [set(record["policy_params"]) for record in pp]
    assert not stage_names[0] & stage_names[1] and stage_names[0] | stage_names[1] == set(single["policy_params"])
    assert "model.embed_tokens.weight" in stage_names[0] and "lm_head.weight" in stage_names[1]
    for record, names in zip(pp, stage_names):
        rank = record["rank"]
        grads, params = only(single["policy_grads"], names), only(single["policy_params"], names)
        assert_same_tensors(record["policy_grads"], grads, f"rank {rank} policy grad", relative_to_max=True)
        assert_same_tensors(record["policy_params"], params, f"rank {rank} policy", relative_to_max=False)
    # The draft trains on the last stage only.
    assert not pp[0]["draft_grads"]
    assert_same_tensors(pp[1]["draft_grads"], single["draft_grads"], "draft grad", relative_to_max=True)
    assert_same_tensors(pp[1]["draft_params"], single["draft_params"], "draft", relative_to_max=False)

    # Rank 0 generated every rollout with the full policy and the draft streamed from the stages: at the second
    # step's generation, the weights the single process had after its first step.
    assert not pp[1]["rollout_weights"] and len(pp[0]["rollout_weights"]) == len(single["rollout_weights"]) == 2
    for (policy, draft), (policy_ref, draft_ref) in zip(pp[0]["rollout_weights"], single["rollout_weights"]):
        assert_same_tensors(policy, policy_ref, "rollout policy", relative_to_max=False)
        assert_same_tensors(draft, draft_ref, "rollout draft", relative_to_max=False)
    assert any(not torch.equal(p, single["policy_start"][n]) for n, p in pp[0]["rollout_weights"][1][0].items())
    # `save_model` writes the full policy, streamed to rank 0.
    saved = load_file(tmp_path / "pp" / "final" / "model.safetensors")
    assert_same_tensors(saved, single["policy_params"], "saved policy", relative_to_max=False)

    # Every step logged the policy loss, its gradient norm over all stages and the draft's metrics, equal to
    # the single process's, on every rank; rank 0 also logged its speculative rollouts.
    for record in pp:
        assert_same_step_logs(record, single, [*DRAFT_METRICS, "loss", "grad_norm"])
    assert all(entry["spec/acceptance_length"] >= 1 for entry in pp[0]["step_logs"])


# bnpo equals dapo in these steps (one generation batch per step, no accumulation): its whole-batch normaliser is
# tests/test_pipeline.py's, with accumulation.
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo"])
def test_pipeline_parallel_steps_equal_the_single_process_steps_for_each_loss_type(
    tmp_path, tiny_policy_dir, loss_type
):
    """TRL's other loss types average a batch's token losses differently (per row, per counted token, per fixed
    length): the pipelined step's whole-batch normaliser must give the single process's gradients and updates."""
    pp, single = run_parallel_and_single(SCRIPT, run, tiny_policy_dir, tmp_path, "pp", variant=loss_type)
    assert_single_run_learned(pp, single)
    for record in pp:
        names = set(record["policy_params"])
        grads, params = only(single["policy_grads"], names), only(single["policy_params"], names)
        assert_same_tensors(record["policy_grads"], grads, f"{loss_type} policy grad", relative_to_max=True)
        assert_same_tensors(record["policy_params"], params, f"{loss_type} policy", relative_to_max=False)
        assert_same_step_logs(record, single, ["loss", "grad_norm"])


def test_pipeline_parallel_steps_with_a_kl_term_equal_the_single_process_steps(tmp_path, tiny_policy_dir):
    """`beta` > 0: TRL's reference model is cut into the same stages and synced by TRL's callback; the stages compute
    its log-probs in the step and the last stage adds the KL term, as one process's `_compute_loss` does."""
    pp, single = run_parallel_and_single(SCRIPT, run, tiny_policy_dir, tmp_path, "pp", variant="beta")
    assert_single_run_learned(pp, single)
    assert single["step_logs"][1]["kl"] > 1e-6  # the second step's KL term weighs in
    for record in pp:
        names = set(record["policy_params"])
        grads, params = only(single["policy_grads"], names), only(single["policy_params"], names)
        assert_same_tensors(record["policy_grads"], grads, "beta policy grad", relative_to_max=True)
        assert_same_tensors(record["policy_params"], params, "beta policy", relative_to_max=False)
        assert_same_step_logs(record, single, ["loss", "grad_norm"])
