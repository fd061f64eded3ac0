"""Context-parallel branch attention for few queries: the queries travel, the trunk K/V stay home.

When a rank's queries are a small set of its positions (DFlash's blocks: a few anchors x S positions, against a
context of L / W), moving the queries is far cheaper than moving the K/V: every rank gathers the group's queries
(with their global positions and document ids), attends them to its own trunk shard, and the partial results go back
to each query's owner, which merges them with its branch and sinks. The backward gathers each query's output
gradient, `lse` and `delta` the same way; every rank then has every query that sees its keys, so its dK/dV are
complete where they are (nothing travels back but the queries' dq). Per rank: the K/V shard and its gradients,
plus O(queries of the group).

The partials are merged by a sum: with `m` the group's largest `lse` of a query (an all-reduce), each rank sends
`exp(lse_s - m) * out_s` and `exp(lse_s - m)`, and the owner's reduce-scatter sums them, exactly as the softmax over
the union of the key shards.
"""

import torch
import torch.distributed as dist

from ..parallel.comm import all_gather_stacked, reduce_scatter_stacked
from .blockwise import (
    add_branch_grads,
    add_branch_partial,
    add_sinks,
    compute_dtype,
    empty_partial,
    grouped_backward_inputs,
    grouped_by_kv_head,
    sink_grads,
    trunk_backward,
    trunk_forward,
)
from .masks import block_spans


def _gathered(tensor: torch.Tensor, counts: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """`[W, ..., max count, ...]`: every rank's `tensor` along its query axis (`_query_dim`), padded with zeros to
    the largest count (the padding is never read)."""
    dim = _query_dim(tensor)
    padding = max(counts) - tensor.shape[dim]
    shape = list(tensor.shape)
    shape[dim] = padding
    padded = torch.cat([tensor, tensor.new_zeros(shape)], dim=dim)
    return all_gather_stacked(padded, group)


def _query_dim(tensor: torch.Tensor) -> int:
    """The query axis: `[B, Hkv, G, Lq, D]` (queries, outputs) or `[B, Hkv, G, Lq]` / `[Lq]` (lse, positions)."""
    return tensor.dim() - 2 if tensor.dim() == 5 else tensor.dim() - 1


def _query_counts(layout, device) -> list[int]:
    """How many queries each rank of the group has."""
    count = torch.tensor([layout.query_positions.numel()], device=device)
    return all_gather_stacked(count, layout.group).flatten().tolist()


def _against_own_keys(layout, positions: torch.Tensor, doc_ids: torch.Tensor, block_size: int) -> dict:
    """`trunk_forward` / `trunk_backward` keyword arguments for queries at `positions` against this rank's shard."""
    return {
        "query_positions": positions,
        "query_doc_ids": doc_ids,
        "query_spans": block_spans(positions, doc_ids, block_size),
        "key_positions": layout.positions[layout.rank],
        "key_doc_ids": layout.doc_ids[layout.rank],
        "key_spans": layout.spans[layout.rank],
        "block_size": block_size,
        "window": layout.window,
    }


def _attend_to_own_keys(queries, positions, doc_ids, counts, k, v, *, layout, scale, block_size, kernel_dtype):
    """Every rank's queries against this rank's trunk shard: partial `(out, lse)` stacked `[W, ...]`, padded."""
    outs, lses = empty_partial(queries)
    for source, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(0, count)
        out, lse = trunk_forward(
            queries[source][..., rows, :],
            k,
            v,
            scale=scale,
            kernel_dtype=kernel_dtype,
            **_against_own_keys(layout, positions[source][rows], doc_ids[source][rows], block_size),
        )
        outs[source][..., rows, :], lses[source][..., rows] = out, lse
    return outs, lses


def gather_queries_forward(q, k, v, branch_k, branch_v, sinks, *, layout, scale, block_size):
    """Forward on public layouts; returns this rank's `out [B, Hq, Lq, D]`, `lse [B, Hkv, G, Lq]` and its own trunk
    K/V for the backward (they never leave the rank)."""
    dtype = compute_dtype(q.dtype)
    q_grouped = grouped_by_kv_head(q, k.shape[1], dtype)
    counts = _query_counts(layout, q.device)
    group = layout.group
    queries = _gathered(q_grouped, counts, group)
    positions = _gathered(layout.query_positions, counts, group)
    doc_ids = _gathered(layout.query_doc_ids, counts, group)
    outs, lses = _attend_to_own_keys(
        queries, positions, doc_ids, counts, k.to(dtype), v.to(dtype),
        layout=layout, scale=scale, block_size=block_size, kernel_dtype=q.dtype,
    )  # fmt: skip
    # The softmax over the union of the shards, as sums: scaled by the group's largest lse of each query.
    largest = lses.clone()  # [W, ...]: every rank's queries, their largest lse over the group's shards
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
    largest = torch.where(torch.isfinite(largest), largest, 0.0)
    weights = torch.exp(lses - largest)  # 0 where a shard shows a query no key
    sums = reduce_scatter_stacked(torch.cat([outs * weights.unsqueeze(-1), weights.unsqueeze(-1)], dim=-1), group)
    rows = slice(0, counts[layout.rank])
    numerator, total = sums[..., rows, :-1], sums[..., rows, -1]
    out = torch.where(total.unsqueeze(-1) > 0, numerator / total.clamp(min=torch.finfo(dtype).tiny).unsqueeze(-1), 0)
    lse = largest[layout.rank][..., rows] + torch.log(total)  # -inf where no shard shows a key
    out, lse = add_branch_partial(q_grouped, branch_k, branch_v, out, lse, scale=scale)
    out, lse = add_sinks(out, lse, sinks)
    return out.flatten(1, 2).to(q.dtype), lse, (k, v)


def gather_queries_backward(dout, q, k, v, branch_k, branch_v, sinks, out, lse, *, layout, scale, block_size):
    """Backward: every rank's queries, output gradients, `lse` and `delta` gathered; dK/dV complete on their own
    rank, each query's dq reduce-scattered to its owner."""
    q_grouped, dout_grouped, delta = grouped_backward_inputs(dout, q, out, k.shape[1])
    dtype = q_grouped.dtype
    counts = _query_counts(layout, q.device)
    group = layout.group
    queries, douts = _gathered(q_grouped, counts, group), _gathered(dout_grouped, counts, group)
    lses, deltas = _gathered(lse, counts, group), _gathered(delta, counts, group)
    positions = _gathered(layout.query_positions, counts, group)
    doc_ids = _gathered(layout.query_doc_ids, counts, group)
    k_dtype, v_dtype = k.dtype, v.dtype
    k, v = k.to(dtype), v.to(dtype)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    dqs = torch.zeros_like(queries)
    for source, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(0, count)
        trunk_backward(
            douts[source][..., rows, :],
            queries[source][..., rows, :],
            k,
            v,
            lses[source][..., rows],
            deltas[source][..., rows],
            scale=scale,
            dq=dqs[source][..., rows, :],
            dk=dk,
            dv=dv,
            **_against_own_keys(layout, positions[source][rows], doc_ids[source][rows], block_size),
        )
    dq = reduce_scatter_stacked(dqs, group)[..., : counts[layout.rank], :].contiguous()
    dbranch_k, dbranch_v = add_branch_grads(dout_grouped, q_grouped, branch_k, branch_v, lse, delta, dq, scale=scale)
    dsinks = sink_grads(sinks, lse, delta)
    return dq.flatten(1, 2).to(q.dtype), dk.to(k_dtype), dv.to(v_dtype), dbranch_k, dbranch_v, dsinks
