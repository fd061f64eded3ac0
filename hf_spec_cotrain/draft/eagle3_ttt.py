"""Training-time test (TTT): the draft unrolled for K steps over a whole sequence at once (docs/design.md section 4).

For anchor ``i`` and step ``d`` the draft reads ``embed(x_{i+1+d})`` and its own previous output (``g_i`` at
step 0), sits at RoPE position ``i + d``, attends to the step-0 keys of anchors ``j <= i`` of its document
(the trunk) plus its own keys of steps ``1..d`` (the branch), and learns the policy's distribution at
position ``i + 1 + d`` (its prediction of ``x_{i+2+d}``). This is exactly what the draft sees when it
proposes ``d + 1`` tokens after a verified prefix ending at ``x_{i+1}``.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from ..attention import branch_attention
from ..attention.masks import document_ids, positions_in_document
from ..losses import head_soft_cross_entropy
from ..parallel.comm import is_context_parallel
from ..parallel.halo import ZigzagHalo
from ..validation import FloatRange, check_float, check_int, contiguous_row_spans
from .base import DraftLossOutput, DraftModel


DEFAULT_STEP_WEIGHT_DECAY = 0.8


@dataclass(frozen=True)
class Eagle3TrainingOptions:
    """EAGLE-3's objective settings: ``ttt_steps`` unrolled steps, step ``d``'s loss weighted
    ``step_weight_decay**d``."""

    ttt_steps: int = 3
    step_weight_decay: float = DEFAULT_STEP_WEIGHT_DECAY


def ttt_step_weights(ttt_steps: int, step_weight_decay: float, *, device=None) -> torch.Tensor:
    """``[K]``: ``w_d = step_weight_decay ** d``."""
    return step_weight_decay ** torch.arange(ttt_steps, device=device)


def ttt_loss(
    draft: DraftModel,
    *,
    aux_hidden_states: torch.Tensor | Sequence[torch.Tensor],
    teacher_logits: torch.Tensor,
    input_embeds: torch.Tensor | None = None,
    input_ids: torch.Tensor | None = None,
    loss_mask: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    ttt_steps: int = 3,
    step_weight_decay: float = DEFAULT_STEP_WEIGHT_DECAY,
    cp_group: dist.ProcessGroup | None = None,
    gradient_checkpointing: bool = False,
) -> DraftLossOutput:
    r"""
    The K-step TTT loss of an EAGLE-3 draft (`Eagle3DraftModel`): ``sum_d w_d * mean_{counted}(-sum p_teacher log
    q_draft)`` with ``w_d = decay**d``.

    Step 0 runs on every position (its keys are the trunk); steps 1.. run only on the positions whose outputs
    still reach a counted loss (a position's output feeds only its own next step), e.g. not on the prompt when
    only completions count. Without context parallelism; the result is the same.

    Args:
        aux_hidden_states: the target's taps at every position, ``[B, L, n * target_hidden]`` or ``n`` tensors.
        teacher_logits: ``[B, L, draft_vocab_size]``; at position ``p`` the policy's prediction of ``x_{p+1}``
            restricted to the draft vocabulary.
        input_embeds / input_ids: the tokens ``x`` as target embeddings ``[B, L, hidden]`` (the trainer taps
            them from the policy's own forward) or as ids embedded through the draft's bound target.
        loss_mask: ``[B, L]``, True where *predicting* token ``x_t`` counts (e.g. completion tokens).
            Defaults to every token.
        attention_mask: ``[B, L]`` padding mask of rows whose real tokens are contiguous (left and/or right
            padding, as TRL lays out prompt + completion). Each row is shifted so its tokens start at position
            0, which keeps rows apart without packing them (rows stay batched, which small models run faster
            than many short documents). Exclusive with ``cu_seqlens``.
        cu_seqlens: packed document boundaries ``[0, ..., L]`` (B must be 1).
        position_ids: ``[B, L]`` RoPE positions of step 0; default: offsets within each document.
        ttt_steps: K, the number of unrolled steps (>= 1).
        step_weight_decay: ``w_d = step_weight_decay ** d``.
        cp_group: context-parallel group. With a world size W > 1, every ``[B, L, ...]`` input is this rank's
            zigzag shard along L (``hf_spec_cotrain.parallel.zigzag_shard``; documents padded to multiples of 2W
            with ``pad_documents``), ``cu_seqlens`` stays global, default position ids follow the global
            layout, and the shifts fetch their few positions from neighbouring ranks. ``loss`` is then this
            rank's share of the single-device loss (normalised by the global number of counted positions):
            after ``loss.backward()`` on every rank, SUM the draft's gradients over the group
            (``hf_spec_cotrain.parallel.all_reduce_gradients``) to get the single-device gradient. The metrics
            are global.
        gradient_checkpointing: recompute each unrolled step's draft layers in the backward instead of keeping
            their activations (the MLP's dominate at long L); costs about one more draft forward.
    """
    check_int(ttt_steps, "ttt_steps", hint=" (the draft is unrolled at least once)")
    check_float(step_weight_decay, "step_weight_decay", FloatRange(0, low_open=True))
    if (input_embeds is None) == (input_ids is None):
        raise ValueError("Pass exactly one of `input_embeds` and `input_ids`.")
    if not isinstance(aux_hidden_states, torch.Tensor):
        aux_hidden_states = torch.cat(list(aux_hidden_states), dim=-1)
    if input_embeds is None:
        input_embeds = draft.embed_input_ids(input_ids)
    batch, length = input_embeds.shape[:2]
    if loss_mask is None:
        loss_mask = torch.ones(batch, length, dtype=torch.bool, device=input_embeds.device)
    for name, tensor in (("aux_hidden_states", aux_hidden_states), ("teacher_logits", teacher_logits)):
        if tuple(tensor.shape[:2]) != (batch, length):
            raise ValueError(f"`{name}` has leading shape {tuple(tensor.shape[:2])}; expected ({batch}, {length}).")
    if tuple(loss_mask.shape) != (batch, length):
        raise ValueError(f"`loss_mask` has shape {tuple(loss_mask.shape)}; expected ({batch}, {length}).")
    if teacher_logits.shape[-1] != draft.config.draft_vocab_size:
        raise ValueError(
            f"`teacher_logits` covers {teacher_logits.shape[-1]} tokens; the draft vocabulary has "
            f"{draft.config.draft_vocab_size} (restrict the teacher with the draft's `draft_to_target_ids`)."
        )

    context_parallel = is_context_parallel(cp_group)
    if context_parallel and attention_mask is not None:
        raise ValueError(
            "`attention_mask` is not supported with `cp_group`: pack the rows as documents (`cu_seqlens`), pad them "
            "with `hf_spec_cotrain.parallel.pad_documents` and shard them with `zigzag_shard` first."
        )
    if attention_mask is not None:
        if cu_seqlens is not None:
            raise ValueError("Pass `attention_mask` (padded rows) or `cu_seqlens` (packed documents), not both.")
        (aux_hidden_states, input_embeds, teacher_logits, loss_mask, position_ids), real = left_align_rows(
            attention_mask, aux_hidden_states, input_embeds, teacher_logits, loss_mask, position_ids
        )
        loss_mask = loss_mask & real
        batch, length = input_embeds.shape[:2]

    if context_parallel:
        if cu_seqlens is not None and batch != 1:
            raise ValueError(f"Packed documents (`cu_seqlens`) need batch size 1; got {batch}.")
        shifts = ZigzagHalo(
            group=cp_group, local_length=length, halo=ttt_steps + 1, cu_seqlens=cu_seqlens, device=input_embeds.device
        )
    else:
        shifts = _DocumentShifts(_document_end(cu_seqlens, batch, length, input_embeds.device))
    if position_ids is None:
        if context_parallel:
            base = shifts.position_ids
        else:
            base = positions_in_document(cu_seqlens) if cu_seqlens is not None else torch.arange(length)
        position_ids = base.to(input_embeds.device).expand(batch, length)

    embeds_source, teacher_source = shifts.extend(input_embeds), shifts.extend(teacher_logits)
    counted_source = shifts.extend(loss_mask.to(torch.bool))
    counted_steps = [shifts.shift(counted_source, 2 + step) for step in range(ttt_steps)]
    total_counts = None
    if context_parallel:
        total_counts = torch.stack([counted.sum() for counted in counted_steps])
        dist.all_reduce(total_counts, group=cp_group)
    hidden = draft.project_hidden_states(aux_hidden_states)
    trunk: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    # per layer, the branch K/V of steps 1.. at the positions of `query_index` (steps run on fewer positions)
    branch: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    step_losses, step_accuracies, step_counts = [], [], []
    total = hidden.new_zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32))
    query_index = None  # positions the current step runs on (None: all)
    for step in range(ttt_steps):
        previous_index = query_index
        if step > 0 and not context_parallel:
            query_index = _positions_still_counted(counted_steps[step:])
            hidden, branch = _select_positions(hidden, branch, previous_index, query_index)
        # `attend` reads the K/V of earlier steps from a snapshot and only records this step's, so that a
        # checkpointed step recomputes exactly what its forward computed.
        earlier, recorded = {layer: list(pairs) for layer, pairs in branch.items()}, {}

        def attend(layer, q, k, v, step=step, earlier=earlier, recorded=recorded, query_index=query_index):
            recorded[layer] = (k, v)
            if step == 0:
                return branch_attention(q, k, v, cu_seqlens=cu_seqlens, cp_group=cp_group)
            pairs = [*earlier.get(layer, []), (k, v)]
            branch_k = torch.stack([bk for bk, _ in pairs])
            branch_v = torch.stack([bv for _, bv in pairs])
            return branch_attention(
                q, *trunk[layer], branch_k, branch_v, cu_seqlens=cu_seqlens, cp_group=cp_group, query_index=query_index
            )

        embeds = _at(shifts.shift(embeds_source, 1 + step), query_index)
        positions = _at(position_ids, query_index) + step
        if gradient_checkpointing and torch.is_grad_enabled():
            hidden = checkpoint(draft.backbone, embeds, hidden, positions, attend, use_reentrant=False)
        else:
            hidden = draft.backbone(embeds, hidden, positions, attend)
        for layer, pair in recorded.items():
            if step == 0:
                trunk[layer] = pair
            else:
                branch.setdefault(layer, []).append(pair)
        teacher = _at(shifts.shift(teacher_source, 1 + step), query_index)
        loss, accuracy, count = head_soft_cross_entropy(
            draft.compute_logits,
            hidden,
            teacher,
            _at(counted_steps[step], query_index),
            total_count=None if total_counts is None else total_counts[step],
        )
        total = total + (step_weight_decay**step) * loss
        step_losses.append(loss.detach())
        step_accuracies.append(accuracy)
        step_counts.append(count)
    step_losses, step_accuracies, step_counts = map(torch.stack, (step_losses, step_accuracies, step_counts))
    if context_parallel:  # every rank holds its share of the metrics: sum them
        shares = torch.stack([step_losses, step_accuracies])
        dist.all_reduce(shares, group=cp_group)
        step_losses, step_accuracies, step_counts = shares[0], shares[1], total_counts
    return DraftLossOutput(
        loss=total,
        step_losses=step_losses,
        step_accuracies=step_accuracies,
        step_counts=step_counts,
        step_weights=ttt_step_weights(ttt_steps, step_weight_decay, device=step_losses.device),
    )


def left_align_rows(
    attention_mask: torch.Tensor, *tensors: torch.Tensor | None
) -> tuple[list[torch.Tensor | None], torch.Tensor]:
    """Shift each row of ``[B, L, ...]`` tensors so its real tokens start at column 0, and drop the columns
    no row uses. Returns the shifted tensors (None stays None) and the ``[B, L']`` mask of real tokens.

    Causal attention then never lets a real token see padding (which now trails every row).
    """
    first, lengths = contiguous_row_spans(
        attention_mask, fix="pack such rows of `attention_mask` as documents with `cu_seqlens` instead."
    )
    batch, length = attention_mask.shape
    columns = torch.arange(length, device=attention_mask.device)
    width = max(int(lengths.max()), 1) if batch else 0
    source = (first[:, None] + columns[None, :width]).clamp(max=length - 1)
    rows = torch.arange(batch, device=attention_mask.device)[:, None]
    shifted = [None if t is None else t[rows, source] for t in tensors]
    return shifted, columns[None, :width] < lengths[:, None]


def _positions_still_counted(counted_steps: Sequence[torch.Tensor]) -> torch.Tensor:
    """Positions (columns, over all rows) whose output at this step or a later one reaches a counted loss. A
    step's output at a position only feeds that position's next step (its branch is private), so the other
    positions can be skipped."""
    still_counted = torch.stack(list(counted_steps)).flatten(0, 1).any(0)
    return still_counted.nonzero().squeeze(1)


def _at(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """``x[:, index]`` (all positions when ``index`` is None)."""
    return x if index is None else x.index_select(1, index)


def _select_positions(hidden, branch, previous_index, index):
    """The previous step's hidden states and the branch K/V of earlier steps, narrowed to ``index`` (a subset of
    ``previous_index``; None means all positions)."""
    rows = index if previous_index is None else torch.searchsorted(previous_index, index)
    hidden = hidden.index_select(1, rows)
    branch = {
        layer: [(k.index_select(2, rows), v.index_select(2, rows)) for k, v in pairs]
        for layer, pairs in branch.items()
    }
    return hidden, branch


def _document_end(cu_seqlens: torch.Tensor | None, batch: int, length: int, device) -> torch.Tensor:
    """``[L]``: exclusive end of the document holding each position."""
    if cu_seqlens is None:
        return torch.full((length,), length, device=device)
    if batch != 1:
        raise ValueError(f"Packed documents (`cu_seqlens`) need batch size 1; got {batch}.")
    cu_seqlens = cu_seqlens.to(device=device, dtype=torch.int64)
    if cu_seqlens[0] != 0 or cu_seqlens[-1] != length:
        raise ValueError(f"`cu_seqlens` must start at 0 and end at L={length}; got {cu_seqlens.tolist()}.")
    return cu_seqlens[1:][document_ids(cu_seqlens)]


class _DocumentShifts:
    """Shifts within documents when the whole sequence is on this device; `ZigzagHalo` is the context-parallel twin."""

    def __init__(self, doc_end: torch.Tensor):
        self.doc_end = doc_end

    def extend(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def shift(self, x: torch.Tensor, shift: int) -> torch.Tensor:
        return _shift_within_documents(x, shift, self.doc_end)


def _shift_within_documents(x: torch.Tensor, shift: int, doc_end: torch.Tensor) -> torch.Tensor:
    """``out[:, i] = x[:, i + shift]`` inside the same document, zero (False) where that leaves it."""
    length = x.shape[1]
    shifted = torch.zeros_like(x)
    if shift < length:
        shifted[:, : length - shift] = x[:, shift:]
    inside = torch.arange(length, device=x.device) + shift < doc_end
    inside = inside.view(1, length, *([1] * (x.dim() - 2)))
    return torch.where(inside, shifted, torch.zeros((), dtype=x.dtype, device=x.device))
