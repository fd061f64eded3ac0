"""Dense branch attention: the test oracle. Obviously correct, O(L^2) memory, autograd backward."""

import torch

from .masks import document_ids
from .validation import check_block_draft_inputs, check_branch_attention_inputs


def branch_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    branch_k: torch.Tensor | None = None,
    branch_v: torch.Tensor | None = None,
    *,
    cu_seqlens: torch.Tensor | None = None,
    scale: float | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as `branch_attention`, computed with one explicit mask over `[trunk keys; branch keys]`, and
    the sinks as one more score column that is dropped after the softmax.

    Half-precision inputs are computed in float32; the result is returned in q's dtype.
    """
    branch_k, branch_v, scale = check_branch_attention_inputs(
        q, k, v, branch_k, branch_v, cu_seqlens=cu_seqlens, scale=scale, sliding_window=sliding_window, sinks=sinks
    )
    compute_dtype = torch.promote_types(q.dtype, torch.float32)
    length = q.shape[2]
    group_size = q.shape[1] // k.shape[1]

    keys, values = [k], [v]
    if branch_k is not None:
        keys.extend(branch_k.unbind(0))
        values.extend(branch_v.unbind(0))
    # Key axis: [trunk positions 0..L-1, branch 0 positions 0..L-1, branch 1 positions 0..L-1, ...].
    keys = torch.cat(keys, dim=2).repeat_interleave(group_size, dim=1).to(compute_dtype)
    values = torch.cat(values, dim=2).repeat_interleave(group_size, dim=1).to(compute_dtype)

    positions = torch.arange(length, device=q.device)
    if cu_seqlens is None:
        doc_ids = torch.zeros(length, dtype=torch.int64, device=q.device)
    else:
        doc_ids = document_ids(cu_seqlens.to(q.device))
    trunk_mask = (positions[None, :] <= positions[:, None]) & (doc_ids[None, :] == doc_ids[:, None])
    if sliding_window is not None:
        trunk_mask &= positions[None, :] > positions[:, None] - sliding_window
    branch_mask = positions[None, :] == positions[:, None]
    num_branch = 0 if branch_k is None else branch_k.shape[0]
    mask = torch.cat([trunk_mask] + [branch_mask] * num_branch, dim=1)

    scores = torch.matmul(q.to(compute_dtype), keys.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink_column = sinks.to(compute_dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink_column], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., : keys.shape[2]]
    return torch.matmul(probs, values).to(q.dtype)


def block_draft_attention_reference(
    q: torch.Tensor,
    context_k: torch.Tensor,
    context_v: torch.Tensor,
    block_k: torch.Tensor,
    block_v: torch.Tensor,
    anchors: torch.Tensor,
    anchor_mask: torch.Tensor | None = None,
    *,
    cu_seqlens: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Same contract as `block_draft_attention`, computed per anchor with one explicit mask over
    ``[context keys; block keys]``; masked anchors give zeros."""
    anchor_mask, scale = check_block_draft_inputs(
        q, context_k, context_v, block_k, block_v, anchors, anchor_mask, cu_seqlens=cu_seqlens, scale=scale
    )
    out_dtype, compute_dtype = q.dtype, torch.promote_types(q.dtype, torch.float32)
    group_size = q.shape[1] // context_k.shape[1]
    length = context_k.shape[2]

    def per_query_head(x: torch.Tensor) -> torch.Tensor:
        return x.repeat_interleave(group_size, dim=1).to(compute_dtype)

    q, context_k, context_v, block_k, block_v = (
        q.to(compute_dtype),
        *map(per_query_head, (context_k, context_v, block_k, block_v)),
    )
    positions = torch.arange(length, device=q.device)
    if cu_seqlens is None:
        doc_ids = torch.zeros(length, dtype=torch.int64, device=q.device)
    else:
        doc_ids = document_ids(cu_seqlens.to(q.device))
    anchor_doc = doc_ids[anchors.clamp(0, length - 1)]  # [B, N]
    context_visible = (positions < anchors[..., None]) & (doc_ids == anchor_doc[..., None])  # [B, N, L]
    context_scores = torch.einsum("bhnsd,bhld->bhnsl", q, context_k)
    block_scores = torch.einsum("bhnsd,bhntd->bhnst", q, block_k)
    context_scores = context_scores.masked_fill(~context_visible[:, None, :, None, :], float("-inf"))
    probs = torch.softmax(torch.cat([context_scores, block_scores], dim=-1) * scale, dim=-1)
    out = torch.einsum("bhnsl,bhld->bhnsd", probs[..., :length], context_v)
    out = out + torch.einsum("bhnst,bhntd->bhnsd", probs[..., length:], block_v)
    return torch.where(anchor_mask[:, None, :, None, None], out, 0.0).to(out_dtype)
