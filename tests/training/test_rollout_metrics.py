"""The rollouts' ``spec/*`` metrics (`SpeculativeRollouts.generation_batch`): one value per batch of rollouts, its turns
weighted by what they measured; acceptance over the decoding rounds that drafted only, rounds of K = 0 counted apart,
and the acceptance history numbered by the optimizer step the rollouts feed, as TRL logs it, one entry per step."""

import math

import pytest
import torch
from datasets import Dataset
from tiny_policy import tiny_grpo_kwargs

from hf_spec_cotrain import SpecCoTrainConfig, SpecCoTrainGRPOTrainer
from hf_spec_cotrain.generation import SpecDecodeStats
from hf_spec_cotrain.generation.speculative import SpeculativeOutput
from hf_spec_cotrain.testing import build_char_tokenizer


PER_POSITION = ("spec/accepted_per_position_0", "spec/accepted_per_position_1")


def _trainer(policy_dir, tmp_path, **spec):
    config = SpecCoTrainConfig(**tiny_grpo_kwargs(tmp_path), draft_warmup_steps=0, **spec)
    return SpecCoTrainGRPOTrainer(
        model=str(policy_dir),
        reward_funcs=lambda completions, **kwargs: [float(len(text)) for text in completions],
        args=config,
        train_dataset=Dataset.from_dict({"prompt": ["abc", "hello", "xyz!", "spec"]}),
        processing_class=build_char_tokenizer(),
    )


def _hf_native_output(rounds, *, num_drafts, num_accepted, accepted_per_position) -> SpeculativeOutput:
    return SpeculativeOutput(
        sequences=torch.zeros(1, 1, dtype=torch.long),
        num_drafts=num_drafts,
        num_draft_tokens=2 * num_drafts,
        num_accepted_tokens=num_accepted,
        accepted_per_position=accepted_per_position,
        num_drafts_per_row=torch.zeros(1, dtype=torch.long),
        num_accepted_per_row=torch.zeros(1, dtype=torch.long),
        num_target_forwards=len(rounds) + 1,
        rounds=rounds,
    )


def _batch(rollouts, turns, *, step=4, training=True):
    """Count `turns` ((counters, tokens, seconds, engine_call)) as one batch of rollouts."""
    with rollouts.generation_batch(step=step, training=training):
        for counters, num_tokens, seconds, engine_call in turns:
            rollouts._count(counters, num_tokens, seconds, engine_call=engine_call)


def test_acceptance_averages_the_rounds_that_drafted_and_plain_rounds_count_apart(tiny_policy_dir, tmp_path):
    trainer = _trainer(tiny_policy_dir, tmp_path, num_speculative_tokens="auto", max_speculative_tokens=2)
    rollouts = trainer.rollouts
    # An HF-native turn whose rounds drafted (K = 2) and decoded plainly (K = 0): 4 row-drafts, 6 tokens accepted.
    mixed = _hf_native_output([(4, 0), (4, 2), (2, 0)], num_drafts=4, num_accepted=6, accepted_per_position=[4, 2])
    _batch(rollouts, [(mixed, 20, 1.0, None)])
    # A whole batch of TRL's plain generation (adaptive speculation chose it): no acceptance at all.
    _batch(rollouts, [(SpecDecodeStats(), 24, 1.0, (4, 0))], step=5)
    metrics = trainer._metrics["train"]
    assert metrics["spec/acceptance_length"] == [2.5]  # 1 + 6 / 4, never 1.0 for the plain batch
    assert [metrics[name] for name in PER_POSITION] == [[1.0], [0.5]]
    assert metrics["spec/plain_round_share"] == [pytest.approx(6 / 10), 1.0]  # row-weighted rounds of K = 0
    assert metrics["spec/num_speculative_tokens"] == [pytest.approx(8 / 10), 0.0]
    # The history: the step these rollouts feed (TRL's global_step + 1), NaN for the batch that drafted nothing.
    assert rollouts.acceptance_history[0] == (5, 2.5)
    assert rollouts.acceptance_history[1][0] == 6 and math.isnan(rollouts.acceptance_history[1][1])

    trainer.model.train()  # TRL's `log` reads the mode from the policy
    trainer.log({})  # TRL's averaging over the batches of the logging window
    logged = trainer.state.log_history[-1]
    assert logged["spec/acceptance_length"] == 2.5
    assert logged["spec/plain_round_share"] == pytest.approx(0.8)


def test_a_batch_of_turns_logs_once_weighted_by_tokens_and_verifications(tiny_policy_dir, tmp_path):
    """A multi-turn batch (a 204-token turn, then a 20-token tool turn): one value per metric, acceptance over all
    verifications and throughput over all tokens and seconds, not plain means over the turns; one history entry."""
    trainer = _trainer(tiny_policy_dir, tmp_path)
    rollouts = trainer.rollouts
    long_turn = _hf_native_output([(4, 2)] * 10, num_drafts=40, num_accepted=60, accepted_per_position=[35, 25])
    tool_turn = _hf_native_output([(1, 2)] * 10, num_drafts=10, num_accepted=2, accepted_per_position=[2, 0])
    _batch(rollouts, [(long_turn, 204, 10.0, None), (tool_turn, 20, 2.2, None)])
    metrics = trainer._metrics["train"]
    assert metrics["spec/acceptance_length"] == [pytest.approx(1 + 62 / 50)]
    assert metrics["spec/tokens_per_second"] == [pytest.approx(224 / 12.2)]
    assert [metrics[name] for name in PER_POSITION] == [[pytest.approx(37 / 50)], [pytest.approx(25 / 50)]]
    assert rollouts.acceptance_history == [(5, pytest.approx(1 + 62 / 50))]
    # A later batch feeding the same optimizer step (fewer generation steps than accumulation steps) merges into
    # that step's history entry.
    _batch(rollouts, [(tool_turn, 20, 2.2, None)])
    assert rollouts.acceptance_history == [(5, pytest.approx(1 + 64 / 60))]


def test_fixed_k_history_steps_are_the_logged_steps(tiny_policy_dir, tmp_path):
    trainer = _trainer(tiny_policy_dir, tmp_path)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "spec/acceptance_length" in entry]
    assert [step for step, _ in trainer.rollouts.acceptance_history] == [entry["step"] for entry in logs] == [1, 2, 3]
    assert [value for _, value in trainer.rollouts.acceptance_history] == [
        entry["spec/acceptance_length"] for entry in logs
    ]
    assert all(entry["spec/plain_round_share"] == 0.0 for entry in logs)
