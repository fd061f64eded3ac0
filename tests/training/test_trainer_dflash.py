"""The trainer with `drafter="dflash"` (HF-native rollouts): the DFlash draft is built from the policy, co-trained on
the taps of the policy's training forward, drafts every rollout round, and is saved as vLLM loads it; what it cannot
do is refused when the trainer is built."""

import json
import math

import pytest
import torch
from datasets import Dataset
from tiny_policy import tiny_grpo_kwargs

from hf_spec_cotrain import AdaptiveSpeculation, SpecCoTrainConfig, SpecCoTrainGRPOTrainer
from hf_spec_cotrain.draft import DFlashDraftModel
from hf_spec_cotrain.testing import build_char_tokenizer


PROMPTS = ["abc", "hello", "xyz!", "spec"]


def _trainer(policy_dir, tmp_path, **options):
    config = SpecCoTrainConfig(**tiny_grpo_kwargs(tmp_path, max_steps=2), drafter="dflash", **options)
    return SpecCoTrainGRPOTrainer(
        model=str(policy_dir),
        reward_funcs=lambda completions, **kwargs: [len(set(text)) / (1 + len(text)) for text in completions],
        args=config,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=build_char_tokenizer(),
    )


def test_dflash_draft_cotrains_speculates_every_round_and_saves_as_vllm_loads_it(tiny_policy_dir, tmp_path):
    pad = build_char_tokenizer().pad_token_id  # its characters fill the vocabulary: no unused row to choose
    trainer = _trainer(
        tiny_policy_dir,
        tmp_path,
        num_speculative_tokens=3,
        dflash_block_size=4,
        dflash_mask_token_id=pad,
        draft_warmup_steps=0,
    )
    draft = trainer.draft
    assert isinstance(draft, DFlashDraftModel) and draft.config.block_size == 4
    assert draft.config.dflash_config["mask_token_id"] == pad
    before = {name: p.detach().clone() for name, p in draft.named_parameters()}
    trainer.train()

    logged = [entry for entry in trainer.state.log_history if "draft/loss" in entry]
    assert len(logged) == 2 and all(math.isfinite(entry["draft/loss"]) for entry in logged)
    # the three block positions are trained and reported, as EAGLE-3's unrolled steps are
    assert all(f"draft/loss_step_{d}" in logged[0] for d in range(3))
    steps = [entry for entry in trainer.state.log_history if "spec/acceptance_length" in entry]
    assert len(steps) == 2 and all(entry["spec/acceptance_length"] >= 1.0 for entry in steps)
    assert not any(entry.get("spec/fallback") for entry in trainer.state.log_history)
    assert any(not torch.equal(before[name], p) for name, p in draft.named_parameters())

    folder = trainer.save_draft(tmp_path / "draft")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    loaded = DFlashDraftModel.from_pretrained(folder, target=trainer.accelerator.unwrap_model(trainer.model))
    for name, tensor in loaded.state_dict().items():
        torch.testing.assert_close(tensor, draft.state_dict()[name].to(tensor.dtype), rtol=0, atol=0)
    assert "DFlash" in (folder / "README.md").read_text()


def test_auto_prices_a_dflash_round_at_one_draft_forward(tiny_policy_dir, tmp_path):
    """The rollouts' cost model knows the block drafter: a round of K drafts runs the draft once, not K times."""
    trainer = _trainer(
        tiny_policy_dir,
        tmp_path,
        num_speculative_tokens="auto",
        dflash_mask_token_id=build_char_tokenizer().pad_token_id,
    )
    assert isinstance(trainer.rollouts.speculation, AdaptiveSpeculation)
    assert [trainer.rollouts.speculation.draft_forwards(k) for k in range(4)] == [0, 1, 1, 1]


def test_a_tokenizer_that_fills_the_vocabulary_needs_a_mask_token_and_says_so(tiny_policy_dir, tmp_path):
    with pytest.raises(ValueError, match="`dflash_mask_token_id`"):
        _trainer(tiny_policy_dir, tmp_path)


def test_more_tokens_per_round_than_the_block_is_refused_when_the_config_is_built(tmp_path):
    with pytest.raises(ValueError, match="at most 3 tokens per round, but up to 5 were asked"):
        SpecCoTrainConfig(
            **tiny_grpo_kwargs(tmp_path), drafter="dflash", dflash_block_size=4, num_speculative_tokens=5
        )
    # under "auto" the cap defaults to what the block trains
    config = SpecCoTrainConfig(
        **tiny_grpo_kwargs(tmp_path), drafter="dflash", dflash_block_size=6, num_speculative_tokens="auto"
    )
    assert config.max_speculative_tokens == 5
