"""Block-draft attention (DFlash): each anchor's block of queries attends to the context before its anchor and,
without a causal mask, to its own block's keys, in one softmax.

It runs on the branch-attention kernel (`blockwise.py`) rather than a kernel of its own, so it inherits its linear
memory in the context length, its tested backward, grouped-query heads and packed documents. The mapping:

* the ``S`` block positions of an anchor are folded into the query-head axis (head ``h * S + s``; it still belongs
  to key/value head ``h // (Hq / Hkv)``, since ``(h * S + s) // (G * S) = h // G``);
* the anchor's queries sit at trunk position ``anchor - 1`` (`query_index`), whose causal trunk is exactly the
  context before the anchor, in the anchor's own document;
* the block's ``S`` keys are ``S`` position-private branch keys of that query position, seen by all its heads;
* the ``B`` rows are packed into one row (`cu_seqlens`), so that the queries of every row form one strictly
  increasing `query_index`.
"""

import torch

from .api import branch_attention
from .validation import check_block_draft_inputs


def block_draft_attention(
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
    """Attention of each anchor's block over the context before the anchor and over the whole block.

    Args:
        q: ``[B, Hq, N, S, D]`` queries: N anchors per row, S block positions per anchor.
        context_k, context_v: ``[B, Hkv, L, D]`` keys/values of the context (``Hq % Hkv == 0``).
        block_k, block_v: ``[B, Hkv, N, S, D]`` keys/values of each anchor's block.
        anchors: ``[B, N]`` int64 context positions in ``[1, L)``; the block of anchor ``a`` sees the context keys
            at positions ``< a`` of ``a``'s document. Distinct within a row (any order).
        anchor_mask: ``[B, N]`` bool, False for padding anchors (their output is zero and their values unchecked);
            None: every anchor counts.
        cu_seqlens: packed document boundaries ``[0, ..., L]`` along L (then B must be 1). An anchor at the first
            position of a document has no context and is refused.
        scale: score scale, ``D ** -0.5`` by default.

    Returns:
        ``[B, Hq, N, S, D]`` in q's dtype (zeros at masked anchors).
    """
    anchor_mask, scale = check_block_draft_inputs(
        q, context_k, context_v, block_k, block_v, anchors, anchor_mask, cu_seqlens=cu_seqlens, scale=scale
    )
    batch, num_q_heads, num_anchors, block_len, head_dim = q.shape
    num_kv_heads, length = context_k.shape[1:3]
    rows, slots = anchor_mask.nonzero(as_tuple=True)
    # The packed trunk position of each kept anchor's queries, sorted: query_index must increase.
    trunk_position = rows * length + anchors[rows, slots] - 1
    trunk_position, order = trunk_position.sort()
    rows, slots = rows[order], slots[order]

    folded_q = q[rows, :, slots].flatten(1, 2).transpose(0, 1).unsqueeze(0)  # [1, Hq * S, M, D]
    branch_k = block_k[rows, :, slots].permute(2, 1, 0, 3).unsqueeze(1)  # [S, 1, Hkv, M, D]
    branch_v = block_v[rows, :, slots].permute(2, 1, 0, 3).unsqueeze(1)
    if cu_seqlens is None:
        cu_seqlens = torch.arange(0, (batch + 1) * length, length, device=q.device)
    out = branch_attention(
        folded_q,
        context_k.transpose(0, 1).reshape(1, num_kv_heads, batch * length, head_dim),
        context_v.transpose(0, 1).reshape(1, num_kv_heads, batch * length, head_dim),
        branch_k,
        branch_v,
        cu_seqlens=cu_seqlens,
        scale=scale,
        query_index=trunk_position,
    )
    per_anchor = out.squeeze(0).transpose(0, 1).unflatten(1, (num_q_heads, block_len))  # [M, Hq, S, D]
    result = q.new_zeros(batch, num_anchors, num_q_heads, block_len, head_dim)
    result = result.index_put((rows, slots), per_anchor)
    return result.transpose(1, 2)
