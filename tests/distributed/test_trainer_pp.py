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
    snapshot,
)
from pp_cotrain_script import DFLASH, run
from torchrun_launch import run_torchrun
from transformers import AutoModelForCausalLM

from hf_spec_cotrain import Eagle3DraftModel
from hf_spec_cotrain.training.checkpoints import PIPELINE_STAGE_KINDS, pipeline_stage_file


pytestmark = pytest.mark.distributed
SCRIPT = Path(__file__).with_name("pp_cotrain_script.py")
RESUME_SCRIPT = Path(__file__).with_name("pp_resume_script.py")


def only(tensors: dict, names) -> dict:
    """`tensors` restricted to `names` (each must be there)."""
    return {name: tensors[name] for name in names}


def assert_each_stage_read_its_own_tensors(pp: list[dict], single: dict, *, models: int = 1) -> None:
    """Each rank read the checkpoint tensors of its stage alone, each once per model loaded (the policy, and the
    reference with `beta` > 0), with the config's `model_init_kwargs`; the single process read every tensor once per
    model."""
    assert sorted(single["tensors_read"]) == sorted(list(single["policy_params"]) * models)
    for record in pp:
        assert sorted(record["tensors_read"]) == sorted(list(record["policy_params"]) * models), record["rank"]
        assert record["attn_implementations"] == ["eager"] * models  # loaded with the config's model_init_kwargs


def assert_stages_equal_the_single_process(pp: list[dict], single: dict, saved_policy: Path) -> None:
    """What every pipelined trainer run must reproduce of the single process's steps."""
    assert_single_run_learned(pp, single)
    # Each stage holds its slice of the policy (the first with the embedding, the last with the norm and the head),
    # with the gradients and the update of the whole model's step.
    stage_names = [set(record["policy_params"]) for record in pp]
    assert sum(map(len, stage_names)) == len(set().union(*stage_names)) == len(single["policy_params"])
    assert set().union(*stage_names) == set(single["policy_params"])
    assert "model.embed_tokens.weight" in stage_names[0] and "lm_head.weight" in stage_names[-1]
    assert_each_stage_read_its_own_tensors(pp, single)
    for record, names in zip(pp, stage_names):
        rank = record["rank"]
        grads, params = only(single["policy_grads"], names), only(single["policy_params"], names)
        assert_same_tensors(record["policy_grads"], grads, f"rank {rank} policy grad", relative_to_max=True)
        assert_same_tensors(record["policy_params"], params, f"rank {rank} policy", relative_to_max=False)
    # The draft trains on the last stage only.
    assert not any(record["draft_grads"] for record in pp[:-1])
    assert_same_tensors(pp[-1]["draft_grads"], single["draft_grads"], "draft grad", relative_to_max=True)
    assert_same_tensors(pp[-1]["draft_params"], single["draft_params"], "draft", relative_to_max=False)

    # The last stage generated every rollout through the stages, with the draft it trains: from the same weights
    # (before any update) and the same random numbers, the completions of the single process.
    assert not any(record["generated"] for record in pp[:-1])
    assert len(pp[-1]["generated"]) == len(single["generated"]) == 2
    assert pp[-1]["generated"][0] == single["generated"][0]
    # `save_model` writes each stage's shard of the policy: together one HF sharded checkpoint of the whole policy.
    saved = AutoModelForCausalLM.from_pretrained(saved_policy)
    assert_same_tensors(snapshot(saved), single["policy_params"], "saved policy", relative_to_max=False)

    # Every step logged the policy loss, its gradient norm over all stages and the draft's metrics, equal to
    # the single process's, and the speculative rollouts' metrics of the last stage, on every rank.
    for record in pp:
        assert_same_step_logs(record, single, [*DRAFT_METRICS, "loss", "grad_norm"])
        assert all(entry["spec/acceptance_length"] >= 1 for entry in record["step_logs"])
    for record in pp[:-1]:
        assert [entry["spec/acceptance_length"] for entry in record["step_logs"]] == [
            entry["spec/acceptance_length"] for entry in pp[-1]["step_logs"]
        ]


def test_pipeline_parallel_steps_equal_the_single_process_steps(tmp_path, tiny_policy_dir):
    pp, single = run_parallel_and_single(SCRIPT, run, tiny_policy_dir, tmp_path, "pp")
    assert_stages_equal_the_single_process(pp, single, tmp_path / "pp" / "final")


@pytest.mark.slow
def test_four_pipeline_stages_equal_the_single_process_and_each_holds_its_share(tmp_path, tiny_policy_dir):
    """4 stages of 2 layers each. Memory: each rank holds at most 1/4 + 0.15 of the single process's policy
    parameters and optimizer state (bytes of the tensors' storages after training, a size fixed from the first
    optimizer step on; not the RSS, which counts the libraries and the activations of the moment). At start each
    rank read its stage's tensors alone (`assert_each_stage_read_its_own_tensors`)."""
    pp, single = run_parallel_and_single(SCRIPT, run, tiny_policy_dir, tmp_path, "pp", variant="4stages", nproc=4)
    assert_stages_equal_the_single_process(pp, single, tmp_path / "pp-4stages" / "final")
    whole = single["held_bytes"]
    assert whole == 2 * 4 * sum(p.numel() for p in single["policy_params"].values())  # float32 parameters, momenta
    for record in pp:
        assert record["held_bytes"] <= (1 / 4 + 0.15) * whole, (record["rank"], record["held_bytes"], whole)


def assert_dflash_stages_equal_the_single_process(pp: list[dict], single: dict, saved_policy: Path) -> None:
    """A DFlash run's stages reproduce the single process's steps (`assert_stages_equal_the_single_process`: policy,
    draft, first rollouts drafted by the DFlash draft through the stages, saved policy), every draft metric DFlash
    logs included; its tapped layers lie on several stages, so the channel carried taps of more than one."""
    draft_taps = {layer_id + 1 for layer_id in DFLASH["dflash_target_layer_ids"]}  # vLLM's ids are outputs
    stages_with_taps = [stage for stage, taps in enumerate(pp[0]["taps_of_stage"]) if draft_taps & set(taps)]
    assert len(stages_with_taps) > 1 and stages_with_taps[0] < len(pp) - 1, pp[0]["taps_of_stage"]
    assert_stages_equal_the_single_process(pp, single, saved_policy)
    draft_metrics = [key for key in single["step_logs"][0] if key.startswith("draft/")]
    assert {f"draft/loss_step_{d}" for d in range(3)} <= set(draft_metrics)  # the block's three mask positions
    for record in pp:
        assert_same_step_logs(record, single, draft_metrics)
    # The mask token's embedding row trains with the policy: a row the first stage sent once would be stale later.
    embedding, mask = "model.embed_tokens.weight", DFLASH["dflash_mask_token_id"]
    assert not torch.equal(single["policy_start"][embedding][mask], single["policy_params"][embedding][mask])


def test_pipeline_parallel_steps_with_a_dflash_draft_equal_the_single_process_steps(tmp_path, tiny_policy_dir):
    """`drafter="dflash"` on 2 stages: taps of both stages reach the draft's; its blocks embed the mask token, whose
    row the first stage sends every step; it draws its anchors as one process does, and drafts the rollouts."""
    pp, single = run_parallel_and_single(SCRIPT, run, tiny_policy_dir, tmp_path, "pp", variant="dflash")
    assert_dflash_stages_equal_the_single_process(pp, single, tmp_path / "pp-dflash" / "final")


def test_four_pipeline_stages_with_a_dflash_draft_equal_the_single_process(tmp_path, tiny_policy_dir):
    """4 stages: the draft's taps come from stages 1, 2 and 3 (the embedding's and the mask row from stage 0), under
    the relay transport (the channel carries the mask row alone), with a reduced draft vocabulary (its own lm_head,
    built on the last stage and sent to the others)."""
    pp, single = run_parallel_and_single(
        SCRIPT, run, tiny_policy_dir, tmp_path, "pp", variant="dflash_4stages", nproc=4
    )
    assert single["draft_params"]["lm_head.weight"].shape[0] == 40  # a reduced vocabulary
    assert_dflash_stages_equal_the_single_process(pp, single, tmp_path / "pp-dflash_4stages" / "final")


# bnpo equals dapo in these steps (one generation batch per step, no accumulation): its whole-batch normaliser is
# tests/test_losses.py's, with accumulation.
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
    """`beta` > 0: each rank loads its stage of the reference model, synced by TRL's callback; the stages compute
    its log-probs in the step and the last stage adds the KL term, as one process's `_compute_loss` does."""
    pp, single = run_parallel_and_single(SCRIPT, run, tiny_policy_dir, tmp_path, "pp", variant="beta")
    assert_single_run_learned(pp, single)
    assert single["step_logs"][1]["kl"] > 1e-6  # the second step's KL term weighs in
    assert_each_stage_read_its_own_tensors(pp, single, models=2)
    for record in pp:
        names = set(record["policy_params"])
        grads, params = only(single["policy_grads"], names), only(single["policy_params"], names)
        assert_same_tensors(record["policy_grads"], grads, "beta policy grad", relative_to_max=True)
        assert_same_tensors(record["policy_params"], params, "beta policy", relative_to_max=False)
        assert_same_step_logs(record, single, ["loss", "grad_norm"])


# bf16 keeps 8 significant bits (steps of 2^-8, 0.4%): the last stage and the single process compute the draft's
# forward alike (equal losses), but their bf16 matmuls' backward sums round a bf16 step apart on some entries
# (measured: 0.5% of a gradient's largest entry, 0.2% of a parameter's). These widen the float32 tolerances of
# `assert_same_tensors` to 2% of the largest gradient entry and 0.6% of the largest parameter entry; a lost or doubled
# row would move gradients by about 1/8 and parameters by about the learning rate (10%).
BF16_DRAFT_GRADS_LOOSEN, BF16_DRAFT_PARAMS_LOOSEN = 2000, 30


def test_pipeline_parallel_steps_with_a_bf16_draft_equal_the_single_process_steps(tmp_path, tiny_policy_dir):
    """`draft_bf16=True`: the last stage runs the draft's micro-step under bf16 autocast, as one process does (the
    same `DraftCoTrainer.ttt_micro_step`), with the same draft gradients and updates (to bf16 precision) and metrics."""
    pp, single = run_parallel_and_single(SCRIPT, run, tiny_policy_dir, tmp_path, "pp", variant="draft_bf16")
    assert_single_run_learned(pp, single)
    assert pp[-1]["draft_dtypes"] == single["draft_dtypes"] == {torch.bfloat16}
    assert not any(record["draft_grads"] for record in pp[:-1])
    assert_same_tensors(
        pp[-1]["draft_grads"],
        single["draft_grads"],
        "bf16 draft grad",
        relative_to_max=True,
        loosen=BF16_DRAFT_GRADS_LOOSEN,
    )
    assert_same_tensors(
        pp[-1]["draft_params"],
        single["draft_params"],
        "bf16 draft",
        relative_to_max=False,
        loosen=BF16_DRAFT_PARAMS_LOOSEN,
    )
    for record in pp:  # the policy, in float32, is the single process's at float32 precision
        names = set(record["policy_params"])
        grads, params = only(single["policy_grads"], names), only(single["policy_params"], names)
        assert_same_tensors(record["policy_grads"], grads, "policy grad", relative_to_max=True)
        assert_same_tensors(record["policy_params"], params, "policy", relative_to_max=False)
        assert_same_step_logs(record, single, [*DRAFT_METRICS, "loss", "grad_norm"])


def test_pipeline_parallel_resume_equals_the_uninterrupted_run(tmp_path, tiny_policy_dir):
    """Each stage checkpoints its own shard of the policy, optimizer and scheduler, the last stage the draft and its
    optimizer; a run resumed from the checkpoint takes the same third step as the uninterrupted run."""
    out_dir = tmp_path / "resume"
    run_torchrun(RESUME_SCRIPT, tiny_policy_dir, out_dir, "pp", log=tmp_path / "resume.log")
    records = [torch.load(out_dir / f"pp{rank}.pt", weights_only=False) for rank in range(2)]

    checkpoint = out_dir / "uninterrupted" / "checkpoint-2"
    for stage in range(2):
        for kind in PIPELINE_STAGE_KINDS:
            assert (checkpoint / pipeline_stage_file(kind, stage, 2)).is_file(), (kind, stage)
    assert not (checkpoint / "model.safetensors").exists()  # no rank wrote the whole policy
    # The stages' shards are one HF sharded checkpoint of the policy; the draft is the last stage's.
    saved = snapshot(AutoModelForCausalLM.from_pretrained(checkpoint))
    at_checkpoint = {**records[0]["at_checkpoint"]["policy"], **records[1]["at_checkpoint"]["policy"]}
    assert_same_tensors(saved, at_checkpoint, "checkpointed policy", relative_to_max=False)
    saved_draft = snapshot(Eagle3DraftModel.from_pretrained(checkpoint / "draft"))
    assert_same_tensors(saved_draft, records[1]["at_checkpoint"]["draft"], "checkpointed draft", relative_to_max=False)

    for record in records:
        uninterrupted, resumed = record["uninterrupted"], record["resumed"]
        assert any(not torch.equal(p, record["at_checkpoint"]["policy"][n]) for n, p in resumed["policy"].items())
        torch.testing.assert_close(resumed["policy"], uninterrupted["policy"], rtol=0, atol=0)
        torch.testing.assert_close(resumed["optimizer"], uninterrupted["optimizer"], rtol=0, atol=0)
    last = records[1]
    assert last["uninterrupted"]["draft_optimizer"]["state"]  # the last stage's draft optimizer has moments
    assert any(not torch.equal(p, last["at_checkpoint"]["draft"][n]) for n, p in last["resumed"]["draft"].items())
    torch.testing.assert_close(last["resumed"]["draft"], last["uninterrupted"]["draft"], rtol=0, atol=0)
    torch.testing.assert_close(
        last["resumed"]["draft_optimizer"], last["uninterrupted"]["draft_optimizer"], rtol=0, atol=0
    )
