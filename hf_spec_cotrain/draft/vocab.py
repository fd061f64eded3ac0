"""The draft vocabulary: the most frequent target tokens, and the maps between the two id spaces.

``d2t[draft_id] = target_id - draft_id`` (an offset, as EAGLE-3 checkpoints store it) and ``t2d[target_id]``
tells whether a target token is in the draft vocabulary.
"""

from collections.abc import Iterable, Sequence

import torch

from ..validation import check_int


def count_tokens(sequences: Iterable[Sequence[int]], vocab_size: int) -> torch.Tensor:
    """Token frequencies ``[vocab_size]`` (int64) over an iterable of token-id sequences."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for ids in sequences:
        ids = torch.as_tensor(ids, dtype=torch.int64).flatten()
        if ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"Token ids must be in [0, {vocab_size}); got min {ids.min()} / max {ids.max()}.")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def select_draft_vocab(
    vocab_size: int, draft_vocab_size: int | None = None, token_counts: torch.Tensor | None = None
) -> torch.Tensor:
    """Target ids of the draft vocabulary, ascending: the ``draft_vocab_size`` most frequent (ties: lower id)."""
    draft_vocab_size = vocab_size if draft_vocab_size is None else draft_vocab_size
    check_int(draft_vocab_size, "draft_vocab_size", below=vocab_size + 1, hint=" (at most the target's vocabulary)")
    if draft_vocab_size == vocab_size:
        return torch.arange(vocab_size)
    if token_counts is None:
        raise ValueError(
            f"A reduced draft vocabulary ({draft_vocab_size} < {vocab_size}) is chosen by token frequency: "
            "pass `token_counts` (see `count_tokens`)."
        )
    token_counts = torch.as_tensor(token_counts).flatten()
    if token_counts.numel() != vocab_size:
        raise ValueError(f"`token_counts` has {token_counts.numel()} entries; the target vocabulary has {vocab_size}.")
    order = torch.sort(token_counts, descending=True, stable=True).indices
    return order[:draft_vocab_size].sort().values


def vocab_maps(draft_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t, t2d)`` for the ascending target ids ``draft_ids`` of the draft vocabulary."""
    draft_ids = draft_ids.to(torch.int64)
    d2t = draft_ids - torch.arange(draft_ids.numel(), dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    return d2t, t2d
