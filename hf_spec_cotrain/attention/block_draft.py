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

Under context parallelism the context is the zigzag-sharded trunk, and an anchor's block goes with its queries: to
the rank that holds ``anchor - 1`` (`anchor_query_positions`), whose causal balance then balances the anchors too.
The block's keys never travel; the context's travel around the ring, or, with few blocks against a long context, the
blocks' queries travel to the context instead (`cp_mode="gather_queries"`).
"""

import torch
import torch.distributed as dist

from ..parallel.comm import group_rank_and_size, is_context_parallel
from ..parallel.zigzag import zigzag_bounds, zigzag_owner
from .api import branch_attention
from .validation import check_block_draft_inputs


def anchor_query_positions(
    anchors: torch.Tensor,
    *,
    local_length: int,
    cu_seqlens: torch.Tensor | None = None,
    cp_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each anchor's queries sit in the context this rank holds: ``anchor - 1``, or under context parallelism
    that position's index in this rank's zigzag shard (``anchors`` global, ``cu_seqlens`` global, ``local_length`` =
    L / W). Returns ``(positions, held)``: ``held`` is False where another rank holds ``anchor - 1`` (its position
    is then 0)."""
    trunk = anchors - 1
    if not is_context_parallel(cp_group):
        return trunk, torch.ones_like(anchors, dtype=torch.bool)
    rank, world_size = group_rank_and_size(cp_group)
    bounds = zigzag_bounds(world_size, cu_seqlens=cu_seqlens, length=local_length * world_size)
    owner, local = zigzag_owner(trunk.clamp(0, local_length * world_size - 1).cpu(), world_size, bounds)
    held = (owner == rank).to(anchors.device)
    return torch.where(held, local.to(anchors.device), 0), held


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
    cp_group: dist.ProcessGroup | None = None,
    cp_mode: str = "ring",
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
        cp_group: context parallelism over a group of W > 1 ranks (every rank calls): ``context_k``/``context_v`` are
            this rank's zigzag shard ``[1, Hkv, L / W, D]``, ``cu_seqlens`` stays global, ``anchors`` are global
            positions and each is passed by the rank that holds ``anchor - 1`` (`anchor_query_positions`; none
            at all is fine), with its queries and block. The result is the single-device one at those anchors.
        cp_mode: as `branch_attention`'s: "gather_queries" suits blocks (few queries against a long context; what
            DFlash's objective uses), "ring" and "allgather" move the context K/V instead.

    Returns:
        ``[B, Hq, N, S, D]`` in q's dtype (zeros at masked anchors).
    """
    context_parallel = is_context_parallel(cp_group)
    world_size = dist.get_world_size(cp_group) if context_parallel else 1
    if context_parallel and q.shape[0] != 1:
        raise ValueError(
            f"Under context parallelism the rows must be packed into one (batch 1, `cu_seqlens`), got batch {q.shape[0]}."
        )
    anchor_mask, scale = check_block_draft_inputs(
        q,
        context_k,
        context_v,
        block_k,
        block_v,
        anchors,
        anchor_mask,
        cu_seqlens=cu_seqlens,
        scale=scale,
        length=context_k.shape[2] * world_size,
    )
    batch, num_q_heads, num_anchors, block_len, head_dim = q.shape
    num_kv_heads, length = context_k.shape[1:3]
    query_position, held = anchor_query_positions(
        anchors, local_length=length, cu_seqlens=cu_seqlens, cp_group=cp_group
    )
    foreign = anchors[anchor_mask & ~held]
    if foreign.numel():
        raise ValueError(
            f"Anchors {foreign.tolist()} have their position anchor - 1 on another rank of the context-parallel group: "
            "pass each anchor on the rank that holds anchor - 1 (`anchor_query_positions`)."
        )
    rows, slots = anchor_mask.nonzero(as_tuple=True)
    # The packed trunk position of each kept anchor's queries, sorted: query_index must increase.
    trunk_position = rows * length + query_position[rows, slots]
    trunk_position, order = trunk_position.sort()
    rows, slots = rows[order], slots[order]

    folded_q = q[rows, :, slots].flatten(1, 2).transpose(0, 1).unsqueeze(0)  # [1, Hq * S, M, D]
    branch_k = block_k[rows, :, slots].permute(2, 1, 0, 3).unsqueeze(1)  # [S, 1, Hkv, M, D]
    branch_v = block_v[rows, :, slots].permute(2, 1, 0, 3).unsqueeze(1)
    if cu_seqlens is None:
        cu_seqlens = torch.arange(0, (batch + 1) * length * world_size, length * world_size, device=q.device)
    out = branch_attention(
        folded_q,
        context_k.transpose(0, 1).reshape(1, num_kv_heads, batch * length, head_dim),
        context_v.transpose(0, 1).reshape(1, num_kv_heads, batch * length, head_dim),
        branch_k,
        branch_v,
        cu_seqlens=cu_seqlens,
        scale=scale,
        query_index=trunk_position,
        cp_group=cp_group,
        cp_mode=cp_mode,
    )
    per_anchor = out.squeeze(0).transpose(0, 1).unflatten(1, (num_q_heads, block_len))  # [M, Hq, S, D]
    result = q.new_zeros(batch, num_anchors, num_q_heads, block_len, head_dim)
    result = result.index_put((rows, slots), per_anchor)
    return result.transpose(1, 2)
