"""Training-time test (TTT): the draft unrolled for K steps over a whole sequence at once (DESIGN.md section 4).

For anchor ``i`` and step ``d`` the draft reads ``embed(x_{i+1+d})`` and its own previous output (``g_i`` at
step 0), sits at RoPE position ``i + d``, attends to the step-0 keys of anchors ``j <= i`` of its document
(the trunk) plus its own keys of steps ``1..d`` (the branch), and learns the policy's distribution at
position ``i + 1 + d`` (its prediction of ``x_{i+2+d}``). This is exactly what the draft sees when it
proposes ``d + 1`` tokens after a verified prefix ending at ``x_{i+1}``.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention import branch_attention
from .attention.masks import document_ids, positions_in_document
from .draft import Eagle3DraftModel


DEFAULT_STEP_WEIGHT_DECAY = 0.8


@dataclass
class TTTOutput:
    """The weighted loss to backpropagate, and per-step metrics (detached, shape ``[K]``)."""

    loss: torch.Tensor
    step_losses: torch.Tensor
    step_accuracies: torch.Tensor
    step_counts: torch.Tensor


def ttt_loss(
    draft: Eagle3DraftModel,
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
) -> TTTOutput:
    r"""
    The K-step TTT loss: ``sum_d w_d * mean_{counted}(-sum p_teacher log q_draft)`` with ``w_d = decay**d``.

    Args:
        aux_hidden_states: the target's taps at every position, ``[B, L, n * target_hidden]`` or ``n`` tensors.
        teacher_logits: ``[B, L, draft_vocab_size]``; at position ``p`` the policy's prediction of ``x_{p+1}``
            restricted to the draft vocabulary.
        input_embeds / input_ids: the tokens ``x`` as target embeddings ``[B, L, hidden]`` (the trainer taps
            them from the policy's own forward) or as ids embedded through the draft's bound target.
        loss_mask: ``[B, L]``, True where *predicting* token ``x_t`` counts (e.g. completion tokens).
            Defaults to every token.
        attention_mask: ``[B, L]`` padding mask (left or right padded rows); the rows are packed into one
            sequence of documents. Exclusive with ``cu_seqlens``.
        cu_seqlens: packed document boundaries ``[0, ..., L]`` (B must be 1).
        position_ids: ``[B, L]`` RoPE positions of step 0; default: offsets within each document.
        ttt_steps: K, the number of unrolled steps (>= 1).
        step_weight_decay: ``w_d = step_weight_decay ** d``.
    """
    if isinstance(ttt_steps, bool) or not isinstance(ttt_steps, int) or ttt_steps < 1:
        raise ValueError(f"`ttt_steps`={ttt_steps!r} is not allowed: the draft is unrolled for an int >= 1 steps.")
    if not step_weight_decay > 0:
        raise ValueError(f"`step_weight_decay`={step_weight_decay!r} is not allowed: it must be > 0.")
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

    if attention_mask is not None:
        if cu_seqlens is not None:
            raise ValueError("Pass `attention_mask` (padded rows) or `cu_seqlens` (packed documents), not both.")
        (aux_hidden_states, input_embeds, teacher_logits, loss_mask, position_ids), cu_seqlens = pack_padded_rows(
            attention_mask, aux_hidden_states, input_embeds, teacher_logits, loss_mask, position_ids
        )
        batch, length = input_embeds.shape[:2]

    doc_end = _document_end(cu_seqlens, batch, length, input_embeds.device)
    if position_ids is None:
        base = positions_in_document(cu_seqlens) if cu_seqlens is not None else torch.arange(length)
        position_ids = base.to(input_embeds.device).expand(batch, length)

    counted_tokens = loss_mask.to(torch.bool)
    hidden = draft.project_hidden_states(aux_hidden_states)
    trunk: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    branch: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    step_losses, step_accuracies, step_counts = [], [], []
    total = hidden.new_zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32))
    for step in range(ttt_steps):

        def attend(layer, q, k, v, step=step):
            if step == 0:
                trunk[layer] = (k, v)
                return branch_attention(q, k, v, cu_seqlens=cu_seqlens)
            branch.setdefault(layer, []).append((k, v))
            branch_k = torch.stack([bk for bk, _ in branch[layer]])
            branch_v = torch.stack([bv for _, bv in branch[layer]])
            return branch_attention(q, *trunk[layer], branch_k, branch_v, cu_seqlens=cu_seqlens)

        embeds = _shift_within_documents(input_embeds, 1 + step, doc_end)
        hidden = draft.backbone(embeds, hidden, position_ids + step, attend)
        logits = draft.compute_logits(hidden)
        teacher = _shift_within_documents(teacher_logits, 1 + step, doc_end)
        counted = _shift_within_documents(counted_tokens, 2 + step, doc_end)
        loss, accuracy, count = soft_cross_entropy(logits, teacher, counted)
        total = total + (step_weight_decay**step) * loss
        step_losses.append(loss.detach())
        step_accuracies.append(accuracy)
        step_counts.append(count)
    return TTTOutput(
        loss=total,
        step_losses=torch.stack(step_losses),
        step_accuracies=torch.stack(step_accuracies),
        step_counts=torch.stack(step_counts),
    )


def soft_cross_entropy(
    logits: torch.Tensor, teacher_logits: torch.Tensor, counted: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean of ``-sum softmax(teacher) * log_softmax(logits)`` over counted positions, top-1 agreement, count.

    Zero counted positions give a zero loss (not NaN), so a batch of prompts only cannot poison a step.
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)  # half precision computes in float32
    log_q = F.log_softmax(logits.to(dtype), dim=-1)
    p = F.softmax(teacher_logits.to(dtype), dim=-1)
    per_position = -(p * log_q).sum(-1)
    count = counted.sum()
    denominator = count.clamp(min=1).to(per_position.dtype)
    loss = torch.where(counted, per_position, 0.0).sum() / denominator
    agree = (logits.detach().argmax(-1) == teacher_logits.argmax(-1)) & counted
    return loss, agree.sum() / denominator, count


def pack_padded_rows(
    attention_mask: torch.Tensor, *tensors: torch.Tensor | None
) -> tuple[list[torch.Tensor | None], torch.Tensor]:
    """Pack the real tokens of padded rows ``[B, L, ...]`` into one row ``[1, N, ...]`` of documents.

    Returns the packed tensors (None stays None) and ``cu_seqlens``. Works for left and right padding.
    """
    keep = attention_mask.to(torch.bool)
    lengths = keep.sum(-1)
    cu_seqlens = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    packed = [None if t is None else t[keep].unsqueeze(0) for t in tensors]
    return packed, cu_seqlens


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


def _shift_within_documents(x: torch.Tensor, shift: int, doc_end: torch.Tensor) -> torch.Tensor:
    """``out[:, i] = x[:, i + shift]`` inside the same document, zero (False) where that leaves it."""
    length = x.shape[1]
    shifted = torch.zeros_like(x)
    if shift < length:
        shifted[:, : length - shift] = x[:, shift:]
    inside = torch.arange(length, device=x.device) + shift < doc_end
    inside = inside.view(1, length, *([1] * (x.dim() - 2)))
    return torch.where(inside, shifted, torch.zeros((), dtype=x.dtype, device=x.device))
