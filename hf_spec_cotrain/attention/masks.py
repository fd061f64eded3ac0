"""Pure helpers for the branch-attention trunk mask: document ids, block summaries, block visibility.

The trunk mask is "key position <= query position, and same packed document", and with a sliding window of `w`
also "key position > query position - w" (transformers' `sliding_window_overlay`: the query and the w - 1 keys
before it). It is never built
at L x L: a block of queries and a block of keys are first classified from their position and
document ranges, and only blocks that straddle a boundary get an explicit (block x block) mask.
Positions are global (for context parallelism a rank passes the global positions of its shard),
so the same tests serve the single-device and the ring drivers.
"""

import enum
from dataclasses import dataclass

import torch


def document_ids(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Index of the packed document that holds each position; int64 of length `cu_seqlens[-1]`."""
    length = int(cu_seqlens[-1])
    positions = torch.arange(length, device=cu_seqlens.device)
    # right=True so that an empty document (a repeated boundary) owns no position.
    return torch.searchsorted(cu_seqlens.to(torch.int64), positions, right=True) - 1


def positions_in_document(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Offset of each position from the start of its own document (the per-document RoPE position)."""
    starts = cu_seqlens.to(torch.int64)[document_ids(cu_seqlens)]
    return torch.arange(starts.numel(), device=cu_seqlens.device) - starts


@dataclass(frozen=True)
class BlockSpan:
    """A contiguous slice `[start, end)` of a local sequence and the ranges of its global positions and documents."""

    start: int
    end: int
    pos_min: int
    pos_max: int
    doc_min: int
    doc_max: int


def block_spans(positions: torch.Tensor, doc_ids: torch.Tensor, block_size: int) -> list[BlockSpan]:
    """Cut a local sequence into blocks of at most `block_size` and summarise each.

    Runs of consecutive positions within one document (a packed document, a zigzag chunk, the queries kept at
    consecutive positions) are cut every `block_size`, and consecutive short pieces are merged up to
    `block_size`: a run that does not fit in what is left of the current block starts a new one. Long runs thus
    get blocks of their own (pairs from different documents or hidden chunks are skipped whole), while many
    short documents still make few blocks (the masks handle mixed blocks).
    """
    length = positions.numel()
    if length == 0:
        return []
    run_ends = (torch.diff(positions) != 1) | (torch.diff(doc_ids) != 0)
    breaks = (torch.nonzero(run_ends).flatten() + 1).tolist()
    pieces = []
    for run_start, run_end in zip([0, *breaks], [*breaks, length]):
        pieces += [(start, min(start + block_size, run_end)) for start in range(run_start, run_end, block_size)]
    blocks = [pieces[0]]
    for start, end in pieces[1:]:
        if end - blocks[-1][0] <= block_size:
            blocks[-1] = (blocks[-1][0], end)
        else:
            blocks.append((start, end))
    starts = torch.tensor([start for start, _ in blocks], device=positions.device)
    lasts = torch.tensor([end - 1 for _, end in blocks], device=positions.device)
    # positions increase within a block; document ids are non-decreasing
    columns = zip(
        positions[starts].tolist(), positions[lasts].tolist(), doc_ids[starts].tolist(), doc_ids[lasts].tolist()
    )
    return [
        BlockSpan(start=start, end=end, pos_min=pos_min, pos_max=pos_max, doc_min=doc_min, doc_max=doc_max)
        for (start, end), (pos_min, pos_max, doc_min, doc_max) in zip(blocks, columns)
    ]


class Visibility(enum.Enum):
    """How a key block is seen by a query block."""

    SKIP = "skip"  # no query sees any key: causal future, other documents or beyond the window only
    FULL = "full"  # every query sees every key: no mask needed
    PARTIAL = "partial"  # needs an explicit block mask


def block_visibility(query: BlockSpan, key: BlockSpan, window: int | None = None) -> Visibility:
    """Classify a (query block, key block) pair from their ranges alone (conservative: SKIP and FULL are exact).

    `window`: the sliding window in positions, None for full causal attention.
    """
    if key.pos_min > query.pos_max or key.doc_max < query.doc_min or key.doc_min > query.doc_max:
        return Visibility.SKIP
    if window is not None and key.pos_max <= query.pos_min - window:
        return Visibility.SKIP  # every key is out of the window of the block's first query, hence of all
    single_document = key.doc_min == key.doc_max == query.doc_min == query.doc_max
    within_window = window is None or key.pos_min > query.pos_max - window
    if single_document and key.pos_max <= query.pos_min and within_window:
        return Visibility.FULL
    return Visibility.PARTIAL


def block_mask(
    query_positions: torch.Tensor,
    query_doc_ids: torch.Tensor,
    key_positions: torch.Tensor,
    key_doc_ids: torch.Tensor,
    window: int | None = None,
) -> torch.Tensor:
    """Boolean `[num_queries, num_keys]` trunk mask: True where the key is visible to the query."""
    offsets = query_positions.unsqueeze(1) - key_positions.unsqueeze(0)
    visible = offsets >= 0
    if window is not None:
        visible &= offsets < window
    return visible & (key_doc_ids.unsqueeze(0) == query_doc_ids.unsqueeze(1))
