"""Rewards that cannot train: rows without a finite reward are counted (``rewards/nonfinite_rows``), a step without any
finite reward is warned about once, loudly, and a reward function that does not return one value per completion is
refused, naming it."""

import logging
import math

import numpy as np
import pytest
from datasets import Dataset
from tiny_policy import tiny_grpo_kwargs

from hf_spec_cotrain import SpecCoTrainConfig, SpecCoTrainGRPOTrainer
from hf_spec_cotrain.testing import build_char_tokenizer
from hf_spec_cotrain.training.rewards import nonfinite_reward_rows


PROMPTS = ["abc", "hello", "xyz!", "spec", "draft", "Q: 2+2?", "one two", "GRPO"]
ROWS_PER_STEP = 4  # 1 prompt of 4 generations per step (`tiny_grpo_kwargs`)


def length_reward(completions, **kwargs):
    return [len(text) / 12 for text in completions]


def _trainer(policy_dir, tmp_path, reward_funcs, **overrides) -> SpecCoTrainGRPOTrainer:
    config = SpecCoTrainConfig(
        **tiny_grpo_kwargs(tmp_path, **{"max_steps": 2, **overrides}), draft_learning_rate=1e-3, draft_warmup_steps=0
    )
    return SpecCoTrainGRPOTrainer(
        model=str(policy_dir),
        reward_funcs=reward_funcs,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=build_char_tokenizer(),
    )


def _logged(trainer, key: str) -> list:
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def test_nonfinite_reward_rows_are_those_that_cannot_train():
    """A row counts when no reward function gave it a finite value (TRL gives it advantage 0) or one gave it an
    infinity (TRL's advantage is then a float's largest value); a NaN beside a finite reward is "does not apply"."""
    import torch

    nan, inf = math.nan, math.inf
    rewards = torch.tensor([[1.0, 2.0], [nan, 0.5], [nan, nan], [inf, 1.0], [-inf, nan], [0.0, 0.0]])
    assert nonfinite_reward_rows(rewards) == 3
    assert nonfinite_reward_rows(rewards[[0, 1, 5]]) == 0
    assert nonfinite_reward_rows(torch.full((4, 1), nan)) == 4


@pytest.mark.parametrize("bad", [None, math.nan, math.inf])
def test_a_step_without_a_finite_reward_is_counted_and_warned_once(tiny_policy_dir, tmp_path, caplog, bad):
    def broken_reward(completions, **kwargs):
        return [bad] * len(completions)

    trainer = _trainer(tiny_policy_dir, tmp_path, [broken_reward])
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert _logged(trainer, "rewards/nonfinite_rows") == [ROWS_PER_STEP, ROWS_PER_STEP]
    warnings = [record.getMessage() for record in caplog.records if "a finite reward" in record.getMessage()]
    assert len(warnings) == 1, warnings  # once per run, not every step
    assert (
        f"none of the {ROWS_PER_STEP} completions of step 1 a finite reward" in warnings[0]
        and "'broken_reward'" in warnings[0]
    )
    assert "the policy does not learn" in warnings[0]


def test_finite_rewards_count_no_row_and_warn_nothing(tiny_policy_dir, tmp_path, caplog):
    def sometimes_none(completions, **kwargs):  # None where it does not apply, the other function scores the row
        return [None if index % 2 else 1.0 for index in range(len(completions))]

    trainer = _trainer(tiny_policy_dir, tmp_path, [length_reward, sometimes_none], max_steps=1)
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert _logged(trainer, "rewards/nonfinite_rows") == [0]
    assert "a finite reward" not in caplog.text


@pytest.mark.parametrize(
    ("returned", "what"),
    [
        (lambda n: [1.0] * (n - 1), rf"{ROWS_PER_STEP - 1} values"),
        (lambda n: [1.0] * (2 * n), rf"{2 * ROWS_PER_STEP} values"),
        (lambda n: 1.0, r"a float, not a sequence of values"),
        (lambda n: np.ones((n, 1)), rf"{ROWS_PER_STEP} values, the first of them a ndarray"),
        (lambda n: [[1.0]] * n, rf"{ROWS_PER_STEP} values, the first of them a list"),
    ],
)
def test_a_reward_function_returning_the_wrong_number_of_values_is_refused_by_name(
    tiny_policy_dir, tmp_path, returned, what
):
    def miscounted_reward(completions, **kwargs):
        return returned(len(completions))

    trainer = _trainer(tiny_policy_dir, tmp_path, [length_reward, miscounted_reward], max_steps=1)
    with pytest.raises(
        ValueError,
        match=rf"The reward function 'miscounted_reward' returned {what}, but {ROWS_PER_STEP} were expected: one "
        r"reward per completion \(a number, or None where it does not apply\)",
    ):
        trainer.train()
