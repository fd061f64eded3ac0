"""Input checks that several layers share, written once so that every caller accepts and rejects the same values
with the same message. A leaf module: it imports nothing from the package."""

import dataclasses
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass

import torch


ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
"""The decoder layer types that attend over a KV cache (a window or not), as transformers' `layer_types` name them."""


def check_int(value, name: str, *, minimum: int = 1, below: int | None = None, hint: str = "") -> int:
    """`value` if it is an int (a bool is not) in `[minimum, below)`; else a ValueError naming `name` and the range.

    `hint` follows the range in the message (what the value means, or how to choose it).
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < minimum
        or (below is not None and value >= below)
    ):
        raise ValueError(
            f"`{name}`={value!r} is not allowed: {name} must be {_int_range(minimum, below)}{hint}, got {value!r}."
        )
    return value


def _int_range(minimum: int, below: int | None) -> str:
    if below is not None:
        return f"an int in [{minimum}, {below})"
    return {0: "a non-negative int", 1: "a positive int"}.get(minimum, f"an int >= {minimum}")


@dataclass(frozen=True)
class FloatRange:
    """The finite numbers an option may take: from `low` to `high`, each end included unless `low_open` /
    `high_open`; `hint` follows the range in the error (what the value means, or its "off" value)."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    hint: str = ""

    def __contains__(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return math.isfinite(value) and above and below

    def __str__(self) -> str:
        if self.high == math.inf:
            if self.low == -math.inf:
                return "a finite number"
            return f"a finite number {'>' if self.low_open else '>='} {self.low:g}"
        return (
            f"a number in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        )


def check_float(value, name: str, allowed: FloatRange = FloatRange()) -> float:
    """`value` if it is a number (a bool is not) in `allowed`, which holds finite numbers only; else a ValueError
    naming `name`, the value and the range. NaN and infinities never pass: a NaN compares false with everything, so
    a check such as `max_norm > 0` would silently take it for "off"."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value not in allowed:
        raise ValueError(f"`{name}`={value!r} is not allowed: {name} must be {allowed}{allowed.hint}, got {value!r}.")
    return value


def check_float_fields(config, ranges: Mapping[str, FloatRange]) -> None:
    """Check every float field of the dataclass `config` (`float`, or `float | None` when set) with `check_float`: in
    its range in `ranges`, finite at least. Once, when the config is built, so that no step pays for it."""
    for config_field in dataclasses.fields(config):
        value = getattr(config, config_field.name, None)
        if is_float_field(config_field) and value is not None:
            check_float(value, config_field.name, ranges.get(config_field.name, FloatRange()))


def is_float_field(config_field: dataclasses.Field) -> bool:
    """Whether a dataclass field holds a float: typed `float`, or `float | None`."""
    return config_field.type is float or set(typing.get_args(config_field.type)) == {float, type(None)}


def check_cu_seqlens(cu_seqlens: torch.Tensor, *, length: int, batch_size: int) -> None:
    """`cu_seqlens` must be a 1-D integer tensor `[0, ..., length]`, non-decreasing, with batch size 1."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"cu_seqlens must be a torch.Tensor of int type, got {type(cu_seqlens).__name__}.")
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"cu_seqlens must have an integer dtype (e.g. torch.int32), got {cu_seqlens.dtype}.")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens must be 1-D with at least 2 entries [0, ..., L], got shape {tuple(cu_seqlens.shape)}."
        )
    first, last = int(cu_seqlens[0]), int(cu_seqlens[-1])
    if first != 0 or last != length:
        raise ValueError(
            f"cu_seqlens must start at 0 and end at the sequence length L={length}, got first={first} and last={last}."
        )
    steps = torch.diff(cu_seqlens.to(torch.int64))
    if bool((steps < 0).any()):
        bad = int(torch.nonzero(steps < 0)[0, 0])
        raise ValueError(
            f"cu_seqlens must be non-decreasing, got {int(cu_seqlens[bad])} followed by {int(cu_seqlens[bad + 1])} "
            f"at index {bad}."
        )
    if batch_size != 1:
        raise ValueError(
            f"Packed documents (cu_seqlens given) need batch size B=1, got B={batch_size}; "
            "concatenate the batch along L instead."
        )


def contiguous_row_spans(mask: torch.Tensor, *, fix: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The first column and the number of real tokens of each row of `mask` `[B, L]` (nonzero: real), whose real
    tokens must be contiguous, as in TRL's rows (left-padded prompt, right-padded completion); `fix` ends the
    error otherwise."""
    real = mask.to(torch.bool)
    columns = torch.arange(real.shape[1], device=real.device)
    lengths = real.sum(-1)
    first = torch.where(lengths > 0, real.int().argmax(-1), 0)
    contiguous = (columns >= first[:, None]) & (columns < (first + lengths)[:, None])
    if not torch.equal(contiguous, real):
        raise ValueError(
            f"Some rows have real tokens that are not contiguous (a masked token between two real ones); {fix}"
        )
    return first, lengths


def layer_types(text_config) -> list[str]:
    """Each decoder layer's type (`"full_attention"`, `"sliding_attention"`, `"linear_attention"`, ...); a window
    without layer types is every layer's (Mistral's configs)."""
    types = getattr(text_config, "layer_types", None)
    if types is not None:
        return list(types)
    default = "sliding_attention" if getattr(text_config, "sliding_window", None) is not None else "full_attention"
    return [default] * text_config.num_hidden_layers
