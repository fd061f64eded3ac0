"""The draft's objective: soft cross-entropy to the policy, and top-1 agreement.

`soft_cross_entropy` is the eager reference on materialised logits. `head_soft_cross_entropy` is what training
runs: it applies the draft's head only to the positions that count, in chunks under activation checkpointing,
so no ``[L, draft_vocab]`` tensor outlives its chunk (a TTT step would otherwise keep logits, log-probabilities
and teacher probabilities for every position and step until backward). The two agree to rounding
(tests/test_losses.py).
"""

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


# Elements of one chunk's [rows, draft_vocab] logits: 16M floats, 64 MB in float32.
CHUNK_ELEMENTS = 2**24


def soft_cross_entropy(
    logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    counted: torch.Tensor,
    *,
    total_count: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean of ``-sum softmax(teacher) * log_softmax(logits)`` over counted positions, top-1 agreement, count.

    Zero counted positions give a zero loss (not NaN), so a batch of prompts only cannot poison a step.
    ``total_count`` replaces the denominator (under context parallelism: the count over all ranks, so that
    every rank returns its share of the global mean).
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)  # half precision computes in float32
    log_q = F.log_softmax(logits.to(dtype), dim=-1)
    p = F.softmax(teacher_logits.to(dtype), dim=-1)
    per_position = -(p * log_q).sum(-1)
    count = counted.sum()
    denominator = (count if total_count is None else total_count).clamp(min=1).to(per_position.dtype)
    loss = torch.where(counted, per_position, 0.0).sum() / denominator
    agree = (logits.detach().argmax(-1) == teacher_logits.argmax(-1)) & counted
    return loss, agree.sum() / denominator, count


def head_soft_cross_entropy(
    head,
    hidden: torch.Tensor,
    teacher_logits: torch.Tensor,
    counted: torch.Tensor,
    *,
    total_count: torch.Tensor | None = None,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`soft_cross_entropy(head(hidden), ...)` without keeping the logits: ``head`` maps ``[N, H]`` to logits
    (e.g. the draft's `compute_logits`) and is re-run in backward, chunk by chunk, on counted positions only."""
    index = counted.reshape(-1).nonzero().squeeze(1)
    count = counted.sum()
    selected = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)
    teacher = teacher_logits.reshape(-1, teacher_logits.shape[-1]).index_select(0, index)
    rows = max(1, chunk_elements // teacher.shape[-1])
    # Zero, but part of the graph: a batch with nothing counted still backpropagates (zeros).
    loss_sum = selected.sum().to(torch.promote_types(hidden.dtype, torch.float32)) * 0
    hits = torch.zeros((), dtype=torch.int64, device=hidden.device)
    for start in range(0, index.numel(), rows):
        chunk_loss, chunk_hits = checkpoint(
            _chunk_loss, head, selected[start : start + rows], teacher[start : start + rows], use_reentrant=False
        )
        loss_sum = loss_sum + chunk_loss
        hits = hits + chunk_hits
    denominator = (count if total_count is None else total_count).clamp(min=1).to(loss_sum.dtype)
    return loss_sum / denominator, hits / denominator, count


def _chunk_loss(head, hidden: torch.Tensor, teacher_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = head(hidden)
    dtype = torch.promote_types(logits.dtype, torch.float32)
    log_q = F.log_softmax(logits.to(dtype), dim=-1)
    p = F.softmax(teacher_logits.to(dtype), dim=-1)
    hits = (logits.detach().argmax(-1) == teacher_logits.argmax(-1)).sum()
    return -(p * log_q).sum(), hits
