"""SpecCoTrainGRPOTrainer with speculative vLLM rollouts (colocated engine), on tiny CPU models."""

import pytest
import torch
from datasets import Dataset
from tiny_policy import save_tiny_policy_of_type, tiny_grpo_kwargs
from vllm_test_utils import hf_greedy

from hf_spec_cotrain import SpecCoTrainConfig, SpecCoTrainGRPOTrainer, speculative_generate
from hf_spec_cotrain.generation import vllm_engine, vllm_layout
from hf_spec_cotrain.testing import build_char_tokenizer, save_tiny_target


pytestmark = pytest.mark.vllm
PROMPTS = ["abc", "hello", "xyz!", "spec", "draft", "Q: 2+2?", "one two", "GRPO"]


def _trainer(policy_dir, tmp_path, **overrides) -> SpecCoTrainGRPOTrainer:
    """A 2-step GRPO run on the tiny policy with colocated speculative vLLM rollouts (``overrides``: config fields)."""
    colocated = dict(max_steps=2, seed=5, use_vllm=True, vllm_mode="colocate", vllm_max_model_length=128)
    settings = tiny_grpo_kwargs(tmp_path / "out", **colocated | overrides)
    return SpecCoTrainGRPOTrainer(
        model=str(policy_dir),
        reward_funcs=lambda completions, **kw: [c.count("e") / 12 for c in completions],
        args=SpecCoTrainConfig(**settings),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=build_char_tokenizer(),
    )


def _sync_and_verify(trainer: SpecCoTrainGRPOTrainer) -> list[list[int]]:
    """A rollout after the last updates syncs them; the engine then holds exactly the trainer's weights. Returns the
    rollout's prompts."""
    tokenizer = trainer.processing_class
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS[:4]]
    trainer.state.global_step += 1
    trainer.rollouts.backend.generate(prompt_ids, step=trainer.state.global_step, training=trainer.model.training)
    with trainer.rollouts.policy_weights() as weights:
        trainer.rollout_engine.verify_weights("policy", weights)
    trainer.rollout_engine.verify_weights("draft", trainer.draft.state_dict().items())
    return prompt_ids


def _assert_same_acceptance_as_hf_native(trainer: SpecCoTrainGRPOTrainer, prompt_ids: list[list[int]]) -> None:
    """Same draft, same prompts, greedy: vLLM accepts exactly what the HF-native generator accepts."""
    tokenizer = trainer.processing_class
    vllm_out = trainer.rollout_engine.generate(prompt_ids, max_tokens=12, temperature=0.0)
    policy = trainer.accelerator.unwrap_model(trainer.model).eval()
    hf_drafts = hf_accepted = 0
    for ids, completion in zip(prompt_ids, vllm_out.completion_ids):
        out = speculative_generate(
            policy,
            trainer.draft,
            torch.tensor([ids]),
            max_new_tokens=12,
            num_speculative_tokens=trainer.args.num_speculative_tokens,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        assert out.sequences[0, len(ids) :].tolist()[: len(completion)] == completion
        hf_drafts += out.num_drafts
        hf_accepted += out.num_accepted_tokens
    assert (vllm_out.spec_decode.num_drafts, vllm_out.spec_decode.num_accepted_tokens) == (hf_drafts, hf_accepted)
    assert hf_drafts > 0


def test_vllm_rollouts_use_the_synced_policy_and_draft(tmp_path, vllm_engine_pool, tiny_policy_dir):
    vllm_engine_pool.close()  # one engine at a time: the trainer builds its own
    trainer = _trainer(tiny_policy_dir, tmp_path, draft_learning_rate=1e-3, draft_warmup_steps=0, learning_rate=1e-3)
    engine = trainer.rollout_engine
    try:
        assert engine is not None and engine.has_draft
        trainer.train()
        logs = [entry for entry in trainer.state.log_history if "spec/acceptance_length" in entry]
        assert len(logs) == 2 and not any("spec/fallback" in entry for entry in trainer.state.log_history)

        prompt_ids = _sync_and_verify(trainer)
        _assert_same_acceptance_as_hf_native(trainer, prompt_ids)
    finally:
        engine.close()


def test_vllm_rollouts_choose_k_per_call_under_auto(tmp_path, vllm_engine_pool, tiny_policy_dir):
    """`num_speculative_tokens="auto"`: the colocated engine is built with K_max and the cost model sets K before
    every call: K_max on the engine's first call (set-up, not measured) and again, then 0 and 1 (the ends and the
    first step measured), then its best."""
    vllm_engine_pool.close()
    trainer = _trainer(tiny_policy_dir, tmp_path, max_steps=5, num_speculative_tokens="auto", max_speculative_tokens=3)
    engine = trainer.rollout_engine
    try:
        assert engine.adaptive_speculation and engine.max_speculative_tokens == 3
        trainer.train()
        logs = [entry for entry in trainer.state.log_history if "spec/num_speculative_tokens" in entry]
        assert [entry["spec/num_speculative_tokens"] for entry in logs][:4] == [3, 3, 0, 1]
        assert not any("spec/fallback" in entry for entry in trainer.state.log_history)
        assert logs[-1]["spec/predicted_speedup"] > 0
        assert logs[2]["spec/measured_speedup"] == 1  # the plain call, once both ends were measured
        assert "spec/accepted_per_position_2" in logs[0]
    finally:
        engine.close()


def test_a_dflash_draft_is_synced_every_step_and_accepts_in_vllm_what_it_accepts_in_hf(
    tmp_path, vllm_engine_pool, tiny_policy_dir
):
    """`drafter="dflash"` with colocated vLLM rollouts: the draft co-trained by the step is synced into the running
    engine, context K/V projections included, so every step speculates and vLLM's acceptance equals the HF-native
    proposer's for the same draft after training."""
    vllm_engine_pool.close()
    pad = build_char_tokenizer().pad_token_id  # the character tokenizer leaves no unused row for the mask
    trainer = _trainer(
        tiny_policy_dir,
        tmp_path,
        drafter="dflash",
        dflash_block_size=4,
        dflash_mask_token_id=pad,
        num_speculative_tokens=3,
        draft_learning_rate=1e-3,
        draft_warmup_steps=0,
    )
    engine = trainer.rollout_engine
    try:
        before = {name: p.detach().clone() for name, p in trainer.draft.named_parameters()}
        trainer.train()
        logs = [entry for entry in trainer.state.log_history if "spec/acceptance_length" in entry]
        assert len(logs) == 2 and not any("spec/fallback" in entry for entry in trainer.state.log_history)
        assert any(not torch.equal(before[name], p) for name, p in trainer.draft.named_parameters())

        prompt_ids = _sync_and_verify(trainer)
        _assert_same_acceptance_as_hf_native(trainer, prompt_ids)
    finally:
        engine.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_moe_policies_train_with_speculative_vllm_rollouts(family, tmp_path, vllm_engine_pool):
    """Qwen3-MoE and gpt-oss: the experts (and gpt-oss's attention sinks) are synced and read back at every step, so
    every step rolls out speculatively, greedy rollouts after training are the trained policy's own, and vLLM accepts
    what the HF-native generator accepts (gpt-oss: through its sliding windows and sinks)."""
    vllm_engine_pool.close()
    policy_dir = save_tiny_target(tmp_path / family, family, num_layers=8)
    trainer = _trainer(policy_dir, tmp_path, learning_rate=1e-2)
    engine = trainer.rollout_engine
    try:
        initial = {name: tensor.clone() for name, tensor in trainer.model.state_dict().items()}
        trainer.train()
        logs = [entry for entry in trainer.state.log_history if "spec/acceptance_length" in entry]
        assert len(logs) == 2 and not any("spec/fallback" in entry for entry in trainer.state.log_history)
        gate_up = "model.layers.0.mlp.experts.gate_up_proj"
        assert not torch.equal(trainer.model.state_dict()[gate_up], initial[gate_up])

        prompt_ids = _sync_and_verify(trainer)
        vllm_out = engine.generate(prompt_ids, max_tokens=12, temperature=0.0, ignore_eos=True)
        policy = trainer.accelerator.unwrap_model(trainer.model).eval()
        assert vllm_out.completion_ids == hf_greedy(policy, prompt_ids, 12)
        _assert_same_acceptance_as_hf_native(trainer, prompt_ids)
    finally:
        engine.close()


def test_a_policy_the_engine_cannot_take_is_refused_at_start(tmp_path, vllm_engine_pool, monkeypatch):
    """A family whose names the sync does not map (here gpt-oss with its renames forgotten) is refused when the
    trainer is built, naming the tensors and what works instead, not at every step's sync."""
    vllm_engine_pool.close()
    monkeypatch.setattr(vllm_layout, "_FAMILIES", {})
    policy_dir = save_tiny_target(tmp_path / "gpt-oss", "gpt_oss", num_layers=8)
    with pytest.raises(
        ValueError,
        match=r"engine cannot take this gpt_oss policy's weights.*model\.embed_tokens\.weight.*use_vllm=False \(the HF-native generator\) serves it",
    ):
        _trainer(policy_dir, tmp_path)


@pytest.mark.parametrize("drafter", ["eagle3", "dflash"])
@pytest.mark.parametrize(
    "family, reason",
    [
        pytest.param(
            "olmo2",
            "in the trainer's process on vLLM .*: it would run it through vLLM's Transformers backend",
            id="olmo2",
        ),
        pytest.param(
            "granitemoe",
            "with its {drafter} draft on vLLM .*: vLLM's GraniteMoeForCausalLM does not implement SupportsEagle3",
            id="granitemoe",
        ),
    ],
)
def test_a_policy_vllm_cannot_serve_with_the_drafts_taps_is_refused_before_any_engine(
    family, reason, drafter, tmp_path, monkeypatch
):
    """Olmo2 (vLLM's Transformers backend, which would break the trainer's own policy after the first rollouts) and
    Granite-MoE (no hidden states for the draft: vLLM's raw RuntimeError at start) are refused when the trainer is
    built, before an engine starts; the HF-native generator the refusal points to serves them."""

    def engine_started(*args, **kwargs):
        raise AssertionError("a vLLM engine was started for a policy that vLLM cannot serve")

    monkeypatch.setattr(vllm_engine.VLLMRolloutEngine, "__init__", engine_started)
    policy_dir = save_tiny_policy_of_type(tmp_path / family, family)
    options = {"drafter": drafter}
    if family == "granitemoe":  # TRL's load-balancing loss cannot read its config: refused first otherwise
        options["router_aux_loss_coef"] = 0.0
    if drafter == "dflash":
        pad = build_char_tokenizer().pad_token_id  # the character tokenizer leaves no unused row for the mask
        options.update(dflash_block_size=4, dflash_mask_token_id=pad, num_speculative_tokens=3)
    instead = r"Instead, use_vllm=False \(the HF-native generator serves it\)"
    message = f"vLLM cannot serve this {family} policy .*{reason.format(drafter=drafter)}.*{instead}"
    with pytest.raises(ValueError, match=message):
        _trainer(policy_dir, tmp_path, **options)
    assert _trainer(policy_dir, tmp_path, use_vllm=False, **options).rollout_engine is None
