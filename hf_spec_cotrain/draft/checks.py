"""Checks that a draft's tensors can serve rollouts, shared by the loader, the trainer's syncs and the server's commit.

A draft with a NaN weight, an integer weight or a ``d2t`` id outside the target vocabulary loads and syncs without a
word, then drafts garbage or fails inside the engine at the first rollout (an out-of-range ``d2t`` is an
``IndexError`` in vLLM's proposer). These checks refuse such a draft before it is used or sent.
"""

from collections.abc import Mapping

import torch


__all__ = ["VOCAB_MAPS", "check_draft_tensors", "draft_tensor_problems", "weight_problems"]

VOCAB_MAPS = ("d2t", "t2d")


def check_draft_tensors(
    tensors: Mapping[str, torch.Tensor], *, vocab_size: int, dtype: torch.dtype | None = None, what: str = "The draft"
) -> None:
    """Raise a ValueError naming every tensor of ``tensors`` (EAGLE-3 checkpoint names) that makes the draft unusable
    for a target of ``vocab_size`` tokens; ``dtype`` is the declared dtype of the floating weights (None: any)."""
    problems = draft_tensor_problems(tensors, vocab_size=vocab_size, dtype=dtype)
    if problems:
        raise ValueError(
            f"{what} is not usable: {'; '.join(problems)}. Use a draft whose weights are finite and in the declared "
            "floating dtype, and whose `d2t` maps every draft id into the target vocabulary (`vocab_maps`)."
        )


def draft_tensor_problems(
    tensors: Mapping[str, torch.Tensor], *, vocab_size: int, dtype: torch.dtype | None = None
) -> list[str]:
    """What `check_draft_tensors` refuses, one line per problem."""
    problems = [
        problem
        for name, tensor in tensors.items()
        if name not in VOCAB_MAPS
        for problem in weight_problems(name, tensor, dtype=dtype)
    ]
    return problems + _vocab_map_problems(tensors.get("d2t"), tensors.get("t2d"), vocab_size)


def weight_problems(name: str, tensor: torch.Tensor, *, dtype: torch.dtype | None = None) -> list[str]:
    """A weight must be floating (an integer copy truncates every value), in ``dtype`` if given, and finite."""
    if not tensor.is_floating_point():
        return [f"`{name}` has dtype {tensor.dtype}, not a floating-point dtype"]
    if dtype is not None and tensor.dtype != dtype:
        return [f"`{name}` has dtype {tensor.dtype}, but the declared dtype is {dtype}"]
    num_bad = tensor.numel() - int(torch.isfinite(tensor).sum())
    return [f"`{name}` holds {num_bad} non-finite values (of {tensor.numel()})"] if num_bad else []


def _vocab_map_problems(d2t: torch.Tensor | None, t2d: torch.Tensor | None, vocab_size: int) -> list[str]:
    """``d2t`` (integer offsets) must map the draft ids to distinct target ids; ``t2d`` must mark exactly those."""
    problems, target_ids = [], None
    if d2t is not None:
        if d2t.is_floating_point() or d2t.is_complex() or d2t.dtype == torch.bool:
            return [f"`d2t` has dtype {d2t.dtype}; it holds id offsets, an integer dtype"]
        target_ids = torch.arange(d2t.numel(), device=d2t.device) + d2t.flatten().long()
        outside = target_ids[(target_ids < 0) | (target_ids >= vocab_size)]
        if outside.numel():
            problems.append(
                f"`d2t` maps {outside.numel()} draft ids outside the target vocabulary [0, {vocab_size}) "
                f"(e.g. to {int(outside[0])})"
            )
        elif target_ids.unique().numel() != target_ids.numel():
            problems.append("`d2t` maps several draft ids to the same target id")
    if t2d is not None:
        if t2d.dtype != torch.bool or tuple(t2d.shape) != (vocab_size,):
            problems.append(f"`t2d` is {t2d.dtype} {list(t2d.shape)}; expected torch.bool [{vocab_size}]")
        elif target_ids is not None and not problems:
            if int(t2d.sum()) != target_ids.numel() or not bool(t2d[target_ids.to(t2d.device)].all()):
                problems.append("`t2d` does not mark exactly the target ids that `d2t` maps to")
    return problems
