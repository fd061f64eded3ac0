"""Rewards that cannot train. TRL gives a completion that no reward function scored (all NaN or None) an advantage of
0, and one scored infinite the largest float as its advantage: a reward function that fails on every row trains on
silently with loss 0. The trainer counts such rows (`nonfinite_reward_rows`), says once when a whole step had none
finite (`no_finite_reward_warning`), and refuses a reward function that does not return one value per completion
(`checked_reward_function`), naming it, where TRL raises a bare TypeError or a shape error."""

import functools
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch
from trl.trainer.utils import is_async_callable


__all__ = ["check_reward_values", "checked_reward_function", "no_finite_reward_warning", "nonfinite_reward_rows"]


def nonfinite_reward_rows(rewards_per_func: torch.Tensor) -> int:
    """The rows of ``rewards_per_func`` (completions x reward functions) that cannot train: no function gave them a
    finite reward, or one gave them an infinity. A NaN beside a finite reward is TRL's "does not apply" and counts
    not."""
    finite = rewards_per_func.isfinite()
    return int((rewards_per_func.isinf().any(dim=1) | ~finite.any(dim=1)).sum())


def no_finite_reward_warning(reward_func_names: Sequence[str], num_rows: int, step: int) -> str:
    names = ", ".join(map(repr, reward_func_names))
    return (
        f"The reward functions ({names}) gave none of the {num_rows} completions of step {step} a finite reward: "
        "they returned NaN, inf or None for every row, so every advantage is 0 (or meaningless) and the policy does "
        "not learn from this step. Return a finite number for each completion (None only where a function does not "
        "apply and another scores the row); `rewards/nonfinite_rows` counts such rows at every step. Warned once."
    )


def checked_reward_function(func: Callable, name: str) -> Callable:
    """``func`` (sync or async, as TRL calls it) with its return checked by `check_reward_values`."""
    if is_async_callable(func):

        @functools.wraps(func)
        async def checked_async(*args, **kwargs):
            return check_reward_values(await func(*args, **kwargs), name=name, expected=len(kwargs["prompts"]))

        return checked_async

    @functools.wraps(func)
    def checked(*args, **kwargs):
        return check_reward_values(func(*args, **kwargs), name=name, expected=len(kwargs["prompts"]))

    return checked


def check_reward_values(values: Any, *, name: str, expected: int) -> Any:
    """``values`` unchanged when it holds one reward per completion, each a number (or a 0-d tensor or array) or None;
    else a ValueError naming the function, what it returned and the count expected."""
    if not hasattr(values, "__len__") or isinstance(values, str | bytes | dict):
        returned = f"a {type(values).__name__}, not a sequence of values"
    elif len(values) != expected or not all(map(_is_one_reward, values)):
        wrong = next((value for value in values if not _is_one_reward(value)), None)
        returned = f"{len(values)} values" + ("" if wrong is None else f", the first of them a {type(wrong).__name__}")
    else:
        return values
    raise ValueError(
        f"The reward function {name!r} returned {returned}, but {expected} were expected: one reward per completion "
        "(a number, or None where it does not apply), in the order of the `completions` it was given."
    )


def _is_one_reward(value: Any) -> bool:
    if isinstance(value, torch.Tensor) or hasattr(value, "ndim"):  # a tensor or a numpy array or scalar
        return value.ndim == 0
    return value is None or isinstance(value, numbers.Real)
