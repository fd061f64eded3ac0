"""DFlash's training objective on one policy forward's taps (docs/design.md section 4b).

Anchors are sampled inside the completions; every row's anchors run in ONE batched draft forward (each anchor's block
sees the context before it through `block_draft_attention`), and block position ``i >= 1`` learns the policy's
distribution of the token at ``a + i`` with weight ``exp(-(i - 1) / gamma)``.
"""

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from ..attention import anchor_query_positions
from ..attention.masks import document_ids, positions_in_document
from ..losses import head_soft_cross_entropy
from ..parallel.comm import all_gather_stacked, is_context_parallel
from ..parallel.halo import ZigzagHalo
from ..parallel.zigzag import zigzag_unshard
from ..validation import FloatRange, check_float, check_int
from .base import DraftLossOutput, DraftModel, DraftTrainingBatch
from .eagle3_ttt import left_align_rows


DEFAULT_ANCHORS_PER_ROW = 8
DEFAULT_LOSS_DECAY_GAMMA = 4.0
"""DFlash's published decay for its block of 8 (Chen et al. 2026, "DFlash: Block Diffusion for Flash Speculative
Decoding", training setup: gamma 7 for blocks of 16, 5 for 10, 4 for 8; SpecForge's DFlash recipe uses the same)."""


@dataclass(frozen=True)
class DFlashTrainingOptions:
    """``anchors_per_row``: blocks sampled per row (per document when packed) and step; ``loss_decay_gamma``: the
    weight of block position ``i`` is ``exp(-(i - 1) / gamma)``, so later positions, which a round only reaches after
    its earlier ones were accepted, count less."""

    anchors_per_row: int = DEFAULT_ANCHORS_PER_ROW
    loss_decay_gamma: float = DEFAULT_LOSS_DECAY_GAMMA

    def __post_init__(self):
        check_int(self.anchors_per_row, "dflash_anchors_per_row", hint=" (blocks trained per row and step)")
        hint = (
            f" (block position i weighs exp(-(i - 1) / gamma); DFlash uses {DEFAULT_LOSS_DECAY_GAMMA} for blocks of 8)"
        )
        check_float(self.loss_decay_gamma, "dflash_loss_decay_gamma", FloatRange(0, low_open=True, hint=hint))

    @classmethod
    def from_args(cls, args: Any) -> "DFlashTrainingOptions":
        """From a `SpecCoTrainConfig` or `DraftTrainingConfig` (`dflash_anchors_per_row`, `dflash_loss_decay_gamma`;
        the defaults where the config has no such field)."""
        return cls(
            anchors_per_row=getattr(args, "dflash_anchors_per_row", DEFAULT_ANCHORS_PER_ROW),
            loss_decay_gamma=getattr(args, "dflash_loss_decay_gamma", DEFAULT_LOSS_DECAY_GAMMA),
        )


def block_position_weights(block_size: int, gamma: float, *, device=None) -> torch.Tensor:
    """``[block_size - 1]``: ``exp(-(i - 1) / gamma)`` for block positions ``i = 1 .. block_size - 1``."""
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float64, device=device) / gamma)


def document_bounds(cu_seqlens: torch.Tensor | None, batch: int, length: int, device) -> tuple[torch.Tensor, ...]:
    """``(segment, offset, end)``, each ``[B, L]``: a segment id unique over the batch (a row, or a packed
    document), the offset in it (the RoPE position) and its exclusive end column."""
    if cu_seqlens is None:
        columns = torch.arange(length, device=device)
        rows = torch.arange(batch, device=device)[:, None]
        return (
            rows.expand(batch, length),
            columns.expand(batch, length),
            torch.full((batch, length), length, device=device),
        )
    cu_seqlens = cu_seqlens.to(device=device, dtype=torch.int64)
    docs = document_ids(cu_seqlens)
    return docs[None], positions_in_document(cu_seqlens)[None], cu_seqlens[1:][docs][None]


def sample_anchors(
    loss_mask: torch.Tensor,
    anchors_per_row: int,
    *,
    cu_seqlens: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``anchors_per_row`` anchors per row (per document when packed), uniformly without replacement among the
    positions ``a`` that can anchor a trained block: ``a >= 1`` in its document (some context), ``a + 1`` in the same
    document and counted (``loss_mask [B, L]``). Returns ``anchors [B, N]`` (int64, ascending per row) and
    ``anchor_mask [B, N]``; masked slots hold 1 (a valid position, never read)."""
    batch, length = loss_mask.shape
    device = loss_mask.device
    segment, offset, end = document_bounds(cu_seqlens, batch, length, device)
    next_counted = torch.zeros_like(loss_mask, dtype=torch.bool)
    next_counted[:, :-1] = loss_mask[:, 1:].to(torch.bool)
    columns = torch.arange(length, device=device)
    candidate = next_counted & (offset >= 1) & (columns + 1 < end)
    scores = torch.rand(batch, length, generator=generator, device=generator.device if generator else device)
    scores = torch.where(candidate, scores.to(device), -1.0)
    # Rank the candidates of each segment by score: sort by (segment, -score), then count from the segment's start.
    key = segment * 4.0 + (1.0 - scores)  # scores in [0, 1): each segment's keys stay inside [4s, 4s + 2]
    order = key.argsort(dim=1)
    sorted_segment = segment.expand(batch, length).gather(1, order)
    start_of_segment = torch.ones_like(sorted_segment, dtype=torch.bool)
    start_of_segment[:, 1:] = sorted_segment[:, 1:] != sorted_segment[:, :-1]
    first = torch.where(start_of_segment, columns, 0).cummax(dim=1).values
    rank = torch.empty_like(order).scatter_(1, order, columns - first)
    chosen = candidate & (rank < anchors_per_row)
    width = max(int(chosen.sum(1).max()), 1) if batch else 1
    # Chosen columns first (ascending), then filler.
    ranked = torch.where(chosen, columns, length + columns).sort(dim=1).values[:, :width]
    anchor_mask = ranked < length
    return torch.where(anchor_mask, ranked, 1), anchor_mask


def dflash_loss(
    draft: DraftModel,
    batch: DraftTrainingBatch,
    options: DFlashTrainingOptions,
    *,
    cp_group: dist.ProcessGroup | None = None,
    generator: torch.Generator | None = None,
    gradient_checkpointing: bool = False,
) -> DraftLossOutput:
    """``sum_i w_i * mean_{counted}(-sum p_teacher log q_draft)`` over block positions ``i = 1 .. S - 1``.

    Block position ``i`` of the anchor at ``a`` predicts ``x_{a+i}`` against the policy's distribution at ``a + i -
    1`` (``teacher_logits``); it counts where ``a + i`` lies in the anchor's document and ``loss_mask`` holds there.
    Each position's mean is over its counted pairs (zero when none), as the EAGLE-3 objective normalises.

    Under context parallelism (``cp_group`` of W > 1 ranks) every ``[1, L/W, ...]`` input is this rank's zigzag shard
    of packed documents (``cu_seqlens`` global): the anchors are sampled over the whole sequence alike on every rank
    (the same ``generator`` state; the loss mask is gathered, one bool per position), each rank runs the blocks whose
    ``anchor - 1`` it holds (its queries gathered to every rank's context, `cp_mode="gather_queries"`; the anchor's
    embedding and teacher rows from its neighbours, `ZigzagHalo`), and ``loss`` is its share of the single-device
    loss: SUM the draft's gradients over the group, as for `ttt_loss`. The metrics are global.
    """
    context_parallel = is_context_parallel(cp_group)
    aux_hidden_states, input_embeds = batch.aux_hidden_states, batch.input_embeds
    teacher_logits, loss_mask = batch.teacher_logits, batch.loss_mask.to(torch.bool)
    rows, length = input_embeds.shape[:2]
    for name, tensor in (
        ("aux_hidden_states", aux_hidden_states),
        ("teacher_logits", teacher_logits),
        ("loss_mask", loss_mask),
    ):
        if tuple(tensor.shape[:2]) != (rows, length):
            raise ValueError(f"`{name}` has leading shape {tuple(tensor.shape[:2])}; expected ({rows}, {length}).")
    if teacher_logits.shape[-1] != draft.config.draft_vocab_size:
        raise ValueError(
            f"`teacher_logits` covers {teacher_logits.shape[-1]} tokens; the draft vocabulary has "
            f"{draft.config.draft_vocab_size} (the draft's `teacher_logits` restricts the policy's)."
        )
    cu_seqlens = batch.cu_seqlens
    if context_parallel and (batch.attention_mask is not None or rows != 1):
        raise ValueError(
            "Under context parallelism the DFlash objective takes packed documents (batch 1, `cu_seqlens`), not padded "
            "rows: pack them, pad them with `hf_spec_cotrain.parallel.pad_documents` and shard them with "
            "`zigzag_shard` first."
        )
    if batch.attention_mask is not None:
        if cu_seqlens is not None:
            raise ValueError("Pass `attention_mask` (padded rows) or `cu_seqlens` (packed documents), not both.")
        (aux_hidden_states, input_embeds, teacher_logits, loss_mask), real = left_align_rows(
            batch.attention_mask, aux_hidden_states, input_embeds, teacher_logits, loss_mask
        )
        loss_mask = loss_mask & real
        length = input_embeds.shape[1]
    elif cu_seqlens is not None and rows != 1:
        raise ValueError(f"Packed documents (`cu_seqlens`) need batch size 1; got {rows}.")

    block_size = draft.config.block_size
    device = input_embeds.device
    if context_parallel:
        halo = ZigzagHalo(
            group=cp_group, local_length=length, halo=block_size - 1, cu_seqlens=cu_seqlens, device=device
        )
        whole_mask = zigzag_unshard(list(all_gather_stacked(loss_mask, cp_group)), dim=1, cu_seqlens=cu_seqlens)
    else:
        whole_mask = loss_mask
    whole_length = whole_mask.shape[1]
    anchors, anchor_mask = sample_anchors(
        whole_mask, options.anchors_per_row, cu_seqlens=cu_seqlens, generator=generator
    )
    _, offset, end = document_bounds(cu_seqlens, rows, whole_length, device)
    anchor_end = end.expand(rows, whole_length).gather(1, anchors)
    # Where block position i's prediction (of the token at anchor + i) counts, over every anchor of the sequence.
    counted = [
        anchor_mask & (anchors + i < anchor_end) & whole_mask.gather(1, (anchors + i).clamp(max=whole_length - 1))
        for i in range(1, block_size)
    ]
    if context_parallel:
        total_counts = torch.stack([mask.sum() for mask in counted])
        query, held = anchor_query_positions(anchors, local_length=length, cu_seqlens=cu_seqlens, cp_group=cp_group)
        mine = (anchor_mask & held)[0].nonzero().flatten()  # this rank's anchors, still ascending
        anchors, query, counted = anchors[:, mine], query[:, mine], [mask[:, mine] for mask in counted]
        anchor_mask = torch.ones_like(anchors, dtype=torch.bool)
        anchor_embeds = halo.shift(halo.extend(input_embeds), 1, query[0])
        teacher_source = halo.extend(teacher_logits)

        def teacher_at(position):  # the policy's distribution of the token at anchor + position
            return halo.shift(teacher_source, position, query[0])

        position_ids = halo.position_ids[None]
    else:
        total_counts = None
        anchor_embeds = input_embeds.gather(1, anchors[..., None].expand(-1, -1, input_embeds.shape[-1]))

        def teacher_at(position):
            column = (anchors + position - 1).clamp(max=length - 1)
            return teacher_logits.gather(1, column[..., None].expand(-1, -1, teacher_logits.shape[-1]))

        position_ids = offset.expand(rows, length)
    forward_args = (aux_hidden_states, anchor_embeds, anchors)
    forward_kwargs = dict(anchor_mask=anchor_mask, position_ids=position_ids, cu_seqlens=cu_seqlens, cp_group=cp_group)
    if gradient_checkpointing and torch.is_grad_enabled():
        hidden = checkpoint(draft.block_logits, *forward_args, use_reentrant=False, **forward_kwargs)
    else:
        hidden = draft.block_logits(*forward_args, **forward_kwargs)

    weights = block_position_weights(block_size, options.loss_decay_gamma, device=hidden.device)
    # Read once, the same number of times on every rank: the logits are computed per chunk of counted positions,
    # which differ between ranks, and the target's head may be FSDP2-sharded (gathering it is a collective).
    head = partial(draft.compute_logits, output_weight=draft.output_weight)
    total = hidden.new_zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32))
    losses, accuracies, counts = [], [], []
    for position in range(1, block_size):
        loss, accuracy, count = head_soft_cross_entropy(
            head,
            hidden[:, :, position],
            teacher_at(position),
            counted[position - 1],
            total_count=None if total_counts is None else total_counts[position - 1],
        )
        total = total + weights[position - 1].to(total.dtype) * loss
        losses.append(loss.detach())
        accuracies.append(accuracy)
        counts.append(count)
    losses, accuracies, counts = map(torch.stack, (losses, accuracies, counts))
    if context_parallel:  # every rank holds its share of the metrics: sum them
        shares = torch.stack([losses, accuracies])
        dist.all_reduce(shares, group=cp_group)
        losses, accuracies, counts = shares[0], shares[1], total_counts
    return DraftLossOutput(
        loss=total,
        step_losses=losses,
        step_accuracies=accuracies,
        step_counts=counts,
        step_weights=weights.to(total.dtype),
    )
