"""Co-training under pipeline parallelism: two GRPO steps with `pipeline_parallel_size=2` on 2 gloo processes
(torchrun) against the same steps in one plain process on the same rows (`pp_cotrain_script.py`). The config's
checks of the pipeline options are in tests/test_config.py."""

from pathlib import Path

import pytest
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

    # The last stage generated every rollout through the stages, with the draft it trains: from the same weights
    # (before any update) and the same random numbers, the completions of the single process.
    assert not pp[0]["generated"] and len(pp[1]["generated"]) == len(single["generated"]) == 2
    assert pp[1]["generated"][0] == single["generated"][0]
    # `save_model` writes the full policy from rank 0, the stages streamed to it.
    saved = load_file(tmp_path / "pp" / "final" / "model.safetensors")
    assert_same_tensors(saved, single["policy_params"], "saved policy", relative_to_max=False)

    # Every step logged the policy loss, its gradient norm over all stages and the draft's metrics, equal to
    # the single process's, and the speculative rollouts' metrics of the last stage, on every rank.
    for record in pp:
        assert_same_step_logs(record, single, [*DRAFT_METRICS, "loss", "grad_norm"])
        assert all(entry["spec/acceptance_length"] >= 1 for entry in record["step_logs"])
    assert [entry["spec/acceptance_length"] for entry in pp[0]["step_logs"]] == [
        entry["spec/acceptance_length"] for entry in pp[1]["step_logs"]
    ]


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
