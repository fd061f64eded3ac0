"""Context-parallel branch attention on zigzag shards (docs/design.md section 5): the ring, and an all-gather baseline.

Every tensor is this rank's zigzag shard (`hf_spec_cotrain.parallel.zigzag`); `cu_seqlens` stays global.
Only the trunk keys/values ever leave their rank; the branch keys/values of a position live with its query,
so they join the softmax locally in closed form (`branch_forward` / `branch_backward`).

* Ring (default): the trunk K/V travel the ring in W - 1 steps, the next shard in flight (`RingComm`) while
  the current one is computed on; each step's partial `(out, lse)` is merged into the running result. K/V
  travel in their input dtype (half the bytes for bf16) and are upcast per step. The backward runs the ring
  again and sends the accumulated dK/dV (compute dtype: float32, or float64 for float64 inputs) on with the
  K/V they belong to, so that after the last step they reach their owners. Per rank: O(L / W) memory.
* All-gather baseline: every rank gathers the whole trunk K/V, keeps it for the backward, and reduce-scatters
  dK/dV, as earlier draft context-parallel code does. O(L) per rank.

Masks compare global indices and document ids, so blocks never cross a zigzag chunk (`block_spans`):
the chunks that the causal structure makes invisible from a query chunk are skipped whole (in a ring step
from an earlier rank the second half of the keys, from a later rank the first half of the queries), by position,
so the same holds for queries at some local positions only (`query_index`).
Each step's blocks run on the per-block kernel that `kernels.py` chooses (a fused CUDA kernel that returns the
log-sum-exp where one takes the block, else pure PyTorch); the backward is pure PyTorch.
A sliding window also skips whole ring steps (`ring_steps`): the K/V then hop over the ranks that no query
needs (`RingComm` offsets), so a window shorter than a chunk costs 2 hops instead of W - 1. Attention sinks
(one logit per query head, with no value) are merged once, after the last key (`add_sinks`).

Layout, following ring-flash-attention: for each variant the forward and the backward, side by side; one autograd
`Function` that only delegates and one entry point that validates (`sharded_branch_attention`).
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..parallel.comm import RingComm, all_gather_stacked, group_rank_and_size, reduce_scatter_stacked
from ..parallel.zigzag import ring_steps, zigzag_bounds, zigzag_indices
from ..validation import check_cu_seqlens, check_int
from .blockwise import (
    BLOCK_SIZE,
    add_branch_grads,
    add_branch_partial,
    add_sinks,
    at_queries,
    autocast_off,
    compute_dtype,
    empty_partial,
    grouped_backward_inputs,
    grouped_by_kv_head,
    sink_grads,
    trunk_backward,
    trunk_forward,
)
from .masks import BlockSpan, block_spans
from .validation import check_branch_attention_inputs


@dataclass(frozen=True)
class ZigzagLayout:
    """Global indices, document ids and blocks of every rank's shard (the keys) and of this rank's queries, the
    sliding window and the ring steps that it leaves; all but the queries are alike on every rank."""

    group: dist.ProcessGroup
    rank: int
    world_size: int
    positions: list[torch.Tensor]
    doc_ids: list[torch.Tensor]
    spans: list[list[BlockSpan]]
    query_positions: torch.Tensor
    query_doc_ids: torch.Tensor
    query_spans: list[BlockSpan]
    window: int | None
    steps: list[int]

    @classmethod
    def build(
        cls,
        *,
        group: dist.ProcessGroup,
        local_length: int,
        cu_seqlens: torch.Tensor | None,
        block_size: int,
        device: torch.device,
        window: int | None,
        query_index: torch.Tensor | None = None,
    ) -> "ZigzagLayout":
        """`query_index`: the local positions of this rank's queries (None: all of its shard)."""
        rank, world_size = group_rank_and_size(group)
        bounds = zigzag_bounds(world_size, cu_seqlens=cu_seqlens, length=local_length * world_size)
        positions, doc_ids, spans = [], [], []
        for owner in range(world_size):
            indices = zigzag_indices(owner, world_size, cu_seqlens=bounds)
            documents = torch.searchsorted(bounds, indices, right=True) - 1
            spans.append(block_spans(indices, documents, block_size))
            positions.append(indices.to(device))
            doc_ids.append(documents.to(device))
        if query_index is None:
            query_positions, query_doc_ids, query_spans = positions[rank], doc_ids[rank], spans[rank]
        else:
            query_positions, query_doc_ids = at_queries(positions[rank], doc_ids[rank], query_index.to(device))
            query_spans = block_spans(query_positions, query_doc_ids, block_size)
        # The steps stay those of the whole shards: every rank must take part in each hop, whatever its queries.
        steps = ring_steps(world_size, window, cu_seqlens=bounds)
        return cls(
            group,
            rank,
            world_size,
            positions,
            doc_ids,
            spans,
            query_positions,
            query_doc_ids,
            query_spans,
            window,
            steps,
        )

    def source(self, step: int) -> int:
        """The rank whose trunk K/V this rank holds at ring step `step`."""
        return (self.rank - step) % self.world_size

    def hop(self, index: int) -> int:
        """How far the K/V (and their dK/dV) travel after the `index`-th of the steps: to the next step, and after
        the last one home to their owner."""
        following = self.steps[index + 1] if index + 1 < len(self.steps) else self.world_size
        return following - self.steps[index]

    def trunk_kwargs(self, source: int, block_size: int) -> dict:
        """`trunk_forward` / `trunk_backward` keyword arguments for this rank's queries against `source`'s keys."""
        return {
            "query_positions": self.query_positions,
            "query_doc_ids": self.query_doc_ids,
            "key_positions": self.positions[source],
            "key_doc_ids": self.doc_ids[source],
            "query_spans": self.query_spans,
            "key_spans": self.spans[source],
            "block_size": block_size,
            "window": self.window,
        }


# ---------------------------------------------------------------------------------------------------- ring


def ring_branch_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    branch_k: torch.Tensor | None,
    branch_v: torch.Tensor | None,
    sinks: torch.Tensor | None,
    *,
    layout: ZigzagLayout,
    scale: float,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Ring forward on public layouts; returns this rank's `out [B, Hq, Lq, D]`, `lse [B, Hkv, G, Lq]` (Lq = L/W
    without `query_index`) and the trunk K/V the backward needs: only this rank's shard (the backward runs the ring
    again)."""
    dtype = compute_dtype(q.dtype)
    q_grouped = grouped_by_kv_head(q, k.shape[1], dtype)
    out, lse = empty_partial(q_grouped)
    key, value = k.contiguous(), v.contiguous()  # travel in the input dtype, computed on in the compute dtype
    comm = RingComm(layout.group)
    for index, step in enumerate(layout.steps):
        more = index + 1 < len(layout.steps)
        if more:
            hop = layout.hop(index)
            next_key, next_value = comm.send_recv(key, offset=hop), comm.send_recv(value, offset=hop)
            comm.commit()
        trunk_forward(
            q_grouped,
            key.to(dtype),
            value.to(dtype),
            scale=scale,
            out=out,
            lse=lse,
            kernel_dtype=q.dtype,
            **layout.trunk_kwargs(layout.source(step), block_size),
        )
        if more:
            comm.wait()
            key, value = next_key, next_value
    out, lse = add_branch_partial(q_grouped, branch_k, branch_v, out, lse, scale=scale)
    out, lse = add_sinks(out, lse, sinks)
    return out.flatten(1, 2).to(q.dtype), lse, (k, v)


def ring_branch_attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    branch_k: torch.Tensor | None,
    branch_v: torch.Tensor | None,
    sinks: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    layout: ZigzagLayout,
    scale: float,
    block_size: int,
) -> tuple[torch.Tensor, ...]:
    """Ring backward: `dq, dk, dv, dbranch_k, dbranch_v, dsinks` of this rank's shard (None without branch, without
    sinks; `dsinks` is this rank's share, summed over the group with the other parameters' gradients).

    At step s this rank holds the K/V of rank r - s together with the dK/dV that the ranks of the earlier steps have
    accumulated for them; it adds its own and passes both on, so the sums arrive home after the last step.
    """
    q_grouped, dout_grouped, delta = grouped_backward_inputs(dout, q, out, k.shape[1])
    dtype = q_grouped.dtype
    dq = torch.zeros_like(q_grouped)
    key, value = k.contiguous(), v.contiguous()
    travels = len(layout.steps) > 1
    kv_comm, dkv_comm = RingComm(layout.group, tag=0), RingComm(layout.group, tag=1)
    dk_arriving = dv_arriving = None  # the dK/dV accumulated upstream for the K/V this rank holds
    for index, step in enumerate(layout.steps):
        more = index + 1 < len(layout.steps)
        hop = layout.hop(index)
        if more:
            next_key, next_value = kv_comm.send_recv(key, offset=hop), kv_comm.send_recv(value, offset=hop)
            kv_comm.commit()
        _, dk, dv = trunk_backward(
            dout_grouped,
            q_grouped,
            key.to(dtype),
            value.to(dtype),
            lse,
            delta,
            scale=scale,
            dq=dq,
            **layout.trunk_kwargs(layout.source(step), block_size),
        )
        if index > 0:
            dkv_comm.wait()
            dk.add_(dk_arriving)
            dv.add_(dv_arriving)
        if more:
            kv_comm.wait()
            key, value = next_key, next_value
        if travels:
            dk_arriving, dv_arriving = dkv_comm.send_recv(dk, offset=hop), dkv_comm.send_recv(dv, offset=hop)
            dkv_comm.commit()
    if travels:
        dkv_comm.wait()
        dk, dv = dk_arriving, dv_arriving
    dbranch_k, dbranch_v = add_branch_grads(dout_grouped, q_grouped, branch_k, branch_v, lse, delta, dq, scale=scale)
    dsinks = sink_grads(sinks, lse, delta)
    return dq.flatten(1, 2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbranch_k, dbranch_v, dsinks


# ---------------------------------------------------------------------------------------------------- all-gather


def allgather_branch_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    branch_k: torch.Tensor | None,
    branch_v: torch.Tensor | None,
    sinks: torch.Tensor | None,
    *,
    layout: ZigzagLayout,
    scale: float,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """All-gather forward: gather every rank's trunk K/V, then attend to each shard in turn.

    Returns the gathered K/V for the backward, which keeps them alive until then, as earlier draft CP
    implementations do (autograd saves the gathered tensors): W times the ring's K/V memory per call.
    """
    dtype = compute_dtype(q.dtype)
    q_grouped = grouped_by_kv_head(q, k.shape[1], dtype)
    out, lse = empty_partial(q_grouped)
    keys, values = all_gather_stacked(k, layout.group), all_gather_stacked(v, layout.group)
    for source in map(layout.source, layout.steps):
        trunk_forward(
            q_grouped,
            keys[source].to(dtype),
            values[source].to(dtype),
            scale=scale,
            out=out,
            lse=lse,
            kernel_dtype=q.dtype,
            **layout.trunk_kwargs(source, block_size),
        )
    out, lse = add_branch_partial(q_grouped, branch_k, branch_v, out, lse, scale=scale)
    out, lse = add_sinks(out, lse, sinks)
    return out.flatten(1, 2).to(q.dtype), lse, (keys, values)


def allgather_branch_attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    branch_k: torch.Tensor | None,
    branch_v: torch.Tensor | None,
    sinks: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    layout: ZigzagLayout,
    scale: float,
    block_size: int,
) -> tuple[torch.Tensor, ...]:
    """All-gather backward on the K/V the forward gathered (`[W, B, Hkv, L/W, D]`): dK/dV for every shard,
    reduce-scattered to their owners."""
    q_grouped, dout_grouped, delta = grouped_backward_inputs(dout, q, out, keys.shape[2])
    dtype = q_grouped.dtype
    dq = torch.zeros_like(q_grouped)
    dkeys = keys.new_zeros(keys.shape, dtype=dtype)  # zero for the ranks that a window skips
    dvalues = values.new_zeros(values.shape, dtype=dtype)
    for source in map(layout.source, layout.steps):
        _, dkeys[source], dvalues[source] = trunk_backward(
            dout_grouped,
            q_grouped,
            keys[source].to(dtype),
            values[source].to(dtype),
            lse,
            delta,
            scale=scale,
            dq=dq,
            **layout.trunk_kwargs(source, block_size),
        )
    dk, dv = reduce_scatter_stacked(dkeys, layout.group), reduce_scatter_stacked(dvalues, layout.group)
    dbranch_k, dbranch_v = add_branch_grads(dout_grouped, q_grouped, branch_k, branch_v, lse, delta, dq, scale=scale)
    dsinks = sink_grads(sinks, lse, delta)
    return dq.flatten(1, 2).to(q.dtype), dk.to(keys.dtype), dv.to(values.dtype), dbranch_k, dbranch_v, dsinks


class ShardedBranchAttentionFunction(torch.autograd.Function):
    """Saves this rank's query, branch, output and log-sum-exp, and the trunk K/V that the strategy's forward
    hands over (`kernels`: the strategy's forward and backward, ring or all-gather)."""

    @staticmethod
    def forward(ctx, q, k, v, branch_k, branch_v, sinks, layout, scale, block_size, kernels):
        forward, _ = kernels
        with autocast_off(q):
            out, lse, (trunk_k, trunk_v) = forward(
                q, k, v, branch_k, branch_v, sinks, layout=layout, scale=scale, block_size=block_size
            )
        ctx.save_for_backward(q, trunk_k, trunk_v, branch_k, branch_v, sinks, out, lse)
        ctx.layout, ctx.scale, ctx.block_size, ctx.kernels = layout, scale, block_size, kernels
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        _, backward = ctx.kernels
        with autocast_off(dout):
            grads = backward(dout, *ctx.saved_tensors, layout=ctx.layout, scale=ctx.scale, block_size=ctx.block_size)
        return *grads, None, None, None, None


# ---------------------------------------------------------------------------------------------------- wrappers


def sharded_branch_attention(
    kernels: tuple,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    branch_k: torch.Tensor | None = None,
    branch_v: torch.Tensor | None = None,
    *,
    group: dist.ProcessGroup,
    cu_seqlens: torch.Tensor | None = None,
    scale: float | None = None,
    block_size: int = BLOCK_SIZE,
    query_index: torch.Tensor | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`branch_attention` on zigzag shards with a strategy's `kernels` (its forward and backward: the ring's, the
    all-gather's, `query_gather`'s), for any world size, 1 included; every rank must call, each with the local
    positions of its own queries as `query_index` (an empty one included) if any. Validates the inputs (`cu_seqlens`
    global, `query_index` local) and builds the layout."""
    branch_k, branch_v, scale = check_branch_attention_inputs(
        q,
        k,
        v,
        branch_k,
        branch_v,
        cu_seqlens=None,
        scale=scale,
        query_index=query_index,
        sliding_window=sliding_window,
        sinks=sinks,
    )
    check_int(block_size, "block_size")
    if group is None:
        raise ValueError("group must be a torch.distributed process group (the context-parallel group), got None.")
    _, world_size = group_rank_and_size(group)
    if cu_seqlens is not None:
        # cu_seqlens spans the global sequence: W times this rank's shard.
        check_cu_seqlens(cu_seqlens, length=k.shape[2] * world_size, batch_size=q.shape[0])
    layout = ZigzagLayout.build(
        group=group,
        local_length=k.shape[2],
        cu_seqlens=cu_seqlens,
        block_size=block_size,
        device=q.device,
        window=sliding_window,
        query_index=query_index,
    )
    return ShardedBranchAttentionFunction.apply(q, k, v, branch_k, branch_v, sinks, layout, scale, block_size, kernels)
