"""Blockwise (flash-attention style) branch attention in pure PyTorch, with linear memory in L.

Layout, following ring-flash-attention: the per-block pieces first (`block_forward` /
`block_backward` for one query block against one key block, `branch_forward` /
`branch_backward` for the position-private branch keys in closed form), then the drivers that
loop over blocks (`trunk_forward` / `trunk_backward` take global positions and document ids for
queries and keys separately, so a ring driver can call them on a key shard from another rank),
then the single-device forward/backward, an autograd `Function` that only delegates, and a `*_func` wrapper that
validates. A sliding window is part of the trunk mask (`masks.py`); attention sinks are merged into the final
result (`add_sinks`, `sink_grads`). The public `branch_attention` (`api.py`) dispatches to it or to a context-parallel strategy (`ring.py`).

Internal layout: queries are grouped by key/value head, `[B, Hkv, G, L, D]` with `G = Hq // Hkv`,
so GQA never repeats K/V; log-sum-exps are `[B, Hkv, G, L]`. Everything inside runs in the
compute dtype (float32 for half-precision inputs, float64 for float64).
"""

import torch

from ..validation import check_int
from . import kernels
from .masks import BlockSpan, Visibility, block_mask, block_spans, block_visibility, document_ids
from .merge import merge_attention_partials
from .validation import check_branch_attention_inputs


BLOCK_SIZE = 256
"""Default query/key block length. On CPU (one thread, Hq=8, Hkv=2, D=64, L=4K-8K) 256 was ~10% faster than 512
and ~1.5x faster than 1024: a [G * 256, 256] score block stays in cache while the matmuls stay efficient."""


def block_forward(
    q_block: torch.Tensor,
    k_block: torch.Tensor,
    v_block: torch.Tensor,
    *,
    scale: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query block over one key block.

    `q_block [B, Hkv, G, Nq, D]` (contiguous avoids a copy), `k_block, v_block [B, Hkv, Nk, D]`,
    `mask [Nq, Nk]` (True = visible) or None for a fully visible block. Returns the normalised output
    `[B, Hkv, G, Nq, D]` and log-sum-exp `[B, Hkv, G, Nq]`; a query with no visible key gets a zero
    output and `lse = -inf`.
    """
    group_size, num_queries = q_block.shape[2:4]
    scores = torch.matmul(q_block.flatten(2, 3), k_block.transpose(-1, -2)).unflatten(2, (group_size, num_queries))
    scores.mul_(scale)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    if mask is not None:
        # Fully masked rows: subtract 0 instead of -inf so that their probabilities are exp(-inf) = 0.
        row_max.masked_fill_(row_max == float("-inf"), 0.0)
    probs = scores.sub_(row_max).exp_()
    row_sum = probs.sum(dim=-1)
    out = torch.matmul(probs.flatten(2, 3), v_block).unflatten(2, (group_size, num_queries))
    # A row with a visible key sums to >= 1 (its maximum contributes exp(0)); an empty row sums to 0.
    out.div_(row_sum.clamp_min(1.0).unsqueeze(-1))
    return out, row_max.squeeze(-1) + row_sum.log()


def block_backward(
    dout_block: torch.Tensor,
    q_block: torch.Tensor,
    k_block: torch.Tensor,
    v_block: torch.Tensor,
    lse_block: torch.Tensor,
    delta_block: torch.Tensor,
    *,
    scale: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one (query block, key block) pair, recomputing the probabilities from the final `lse`.

    `dout_block, q_block [B, Hkv, G, Nq, D]`, `lse_block, delta_block [B, Hkv, G, Nq]` where `lse` is the
    log-sum-exp over *all* keys of the query and `delta = rowsum(dout * out)`. Returns
    `dq [B, Hkv, G, Nq, D]` and `dk, dv [B, Hkv, Nk, D]` (summed over the G query heads of a group).
    """
    group_size, num_queries = q_block.shape[2:4]
    q_flat, dout_flat = q_block.flatten(2, 3), dout_block.flatten(2, 3)
    scores = torch.matmul(q_flat, k_block.transpose(-1, -2))
    scores.mul_(scale)
    if mask is not None:
        scores.unflatten(2, (group_size, num_queries)).masked_fill_(~mask, float("-inf"))
    probs = scores.sub_(lse_block.flatten(2, 3).unsqueeze(-1)).exp_()
    dv = torch.matmul(probs.transpose(-1, -2), dout_flat)
    dscores = torch.matmul(dout_flat, v_block.transpose(-1, -2))
    dscores.sub_(delta_block.flatten(2, 3).unsqueeze(-1)).mul_(probs).mul_(scale)
    dq = torch.matmul(dscores, k_block).unflatten(2, (group_size, num_queries))
    dk = torch.matmul(dscores.transpose(-1, -2), q_flat)
    return dq, dk, dv


def branch_forward(
    q: torch.Tensor, branch_k: torch.Tensor, branch_v: torch.Tensor, *, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every query over its own S branch keys, in closed form (each query has exactly S keys).

    `q [B, Hkv, G, L, D]`, `branch_k, branch_v [S, B, Hkv, L, D]` with S >= 1. Returns `(out, lse)` like
    `block_forward`. Local to a rank: the branch keys of a position live where its query lives.
    """
    scores = torch.einsum("bhgld,sbhld->sbhgl", q, branch_k).mul_(scale)
    lse = torch.logsumexp(scores, dim=0)
    probs = scores.sub_(lse).exp_()
    return torch.einsum("sbhgl,sbhld->bhgld", probs, branch_v), lse


def branch_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    branch_k: torch.Tensor,
    branch_v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    *,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Closed-form gradients of the branch keys, given the final `lse` and `delta = rowsum(dout * out)`.

    With `p_t` the weight of branch key t: `ds_t = p_t (<dout, bv_t> - delta)`, `dq = scale sum_t ds_t bk_t`,
    `dbk_t = scale ds_t q` and `dbv_t = p_t dout`, both summed over the query heads of a group.
    """
    probs = torch.einsum("bhgld,sbhld->sbhgl", q, branch_k).mul_(scale).sub_(lse).exp_()
    dscores = torch.einsum("bhgld,sbhld->sbhgl", dout, branch_v).sub_(delta).mul_(probs).mul_(scale)
    dq = torch.einsum("sbhgl,sbhld->bhgld", dscores, branch_k)
    dbranch_k = torch.einsum("sbhgl,bhgld->sbhld", dscores, q)
    dbranch_v = torch.einsum("sbhgl,bhgld->sbhld", probs, dout)
    return dq, dbranch_k, dbranch_v


def empty_partial(q_grouped: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The result over no key yet: a zero output and `lse = -inf` for every query, ready to merge partials into."""
    lse = torch.full(q_grouped.shape[:-1], float("-inf"), dtype=q_grouped.dtype, device=q_grouped.device)
    return torch.zeros_like(q_grouped), lse


def trunk_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    query_positions: torch.Tensor,
    query_doc_ids: torch.Tensor,
    key_positions: torch.Tensor,
    key_doc_ids: torch.Tensor,
    scale: float,
    block_size: int,
    query_spans: list[BlockSpan] | None = None,
    key_spans: list[BlockSpan] | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    kernel_dtype: torch.dtype | None = None,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal, document-masked attention of `q [B, Hkv, G, Lq, D]` over `k, v [B, Hkv, Lk, D]`, block by block.

    Positions and document ids are global (`[Lq]` and `[Lk]`); `window` is the sliding window (None: full
    causal). Key blocks that no query of a block can see are skipped. Queries that see no key here get a zero output and `lse = -inf`.
    `query_spans`/`key_spans` replace the fixed-size blocks (the ring cuts them at zigzag chunk
    boundaries, so that whole invisible chunks are skipped). Given a running `(out, lse)`, this key
    shard's result is merged into it in place (one ring step), and the same tensors are returned.
    `kernel_dtype` is the dtype the caller's inputs came in (q, k, v were upcast from it, so casting back is exact):
    a fused kernel (`kernels.py`) runs the blocks it can take in it; None means q's dtype.
    """
    merge_into = out is not None
    kernel_q, kernel_k, kernel_v = (tensor.to(kernel_dtype or q.dtype) for tensor in (q, k, v))
    if not merge_into:
        out, lse = empty_partial(q)
    if key_spans is None:
        key_spans = block_spans(key_positions, key_doc_ids, block_size)
    if query_spans is None:
        query_spans = block_spans(query_positions, query_doc_ids, block_size)
    for query_span in query_spans:
        rows = slice(query_span.start, query_span.end)
        q_block = q[:, :, :, rows].contiguous()
        block_out = block_lse = None
        for key_span in key_spans:
            visibility = block_visibility(query_span, key_span, window)
            if visibility is Visibility.SKIP:
                continue
            cols = slice(key_span.start, key_span.end)
            mask_kind = kernels.block_mask_kind(query_span, key_span, visibility, window)
            backend = kernels.backend_for(kernel_q, mask_kind)
            if backend != kernels.BLOCKWISE:
                pair_out, pair_lse = kernels.fused_block_forward(
                    backend,
                    kernel_q[:, :, :, rows],
                    kernel_k[:, :, cols],
                    kernel_v[:, :, cols],
                    scale=scale,
                    causal=mask_kind == kernels.CAUSAL,
                )
                pair_out, pair_lse = pair_out.to(q.dtype), pair_lse.to(q.dtype)
            else:
                mask = None
                if visibility is Visibility.PARTIAL:
                    mask = block_mask(
                        query_positions[rows], query_doc_ids[rows], key_positions[cols], key_doc_ids[cols], window
                    )
                pair_out, pair_lse = block_forward(q_block, k[:, :, cols], v[:, :, cols], scale=scale, mask=mask)
            if block_out is None:
                block_out, block_lse = pair_out, pair_lse
            else:
                block_out, block_lse = merge_attention_partials(block_out, block_lse, pair_out, pair_lse)
        if block_out is None:
            continue
        if merge_into:
            block_out, block_lse = merge_attention_partials(
                out[:, :, :, rows], lse[:, :, :, rows], block_out, block_lse
            )
        out[:, :, :, rows] = block_out
        lse[:, :, :, rows] = block_lse
    return out, lse


def trunk_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    *,
    query_positions: torch.Tensor,
    query_doc_ids: torch.Tensor,
    key_positions: torch.Tensor,
    key_doc_ids: torch.Tensor,
    scale: float,
    block_size: int,
    query_spans: list[BlockSpan] | None = None,
    key_spans: list[BlockSpan] | None = None,
    dq: torch.Tensor | None = None,
    dk: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `trunk_forward` given the final `lse` and `delta`; returns `dq` and the `dk, dv` of this key shard.

    Spans and window as in `trunk_forward`; a given `dq` is accumulated into in place (the ring sums over key shards),
    and so are given `dk, dv` (the gathered queries' sum over query sets).
    """
    if dq is None:
        dq = torch.zeros_like(q)
    if dk is None:
        dk = torch.zeros_like(k)
    if dv is None:
        dv = torch.zeros_like(v)
    if key_spans is None:
        key_spans = block_spans(key_positions, key_doc_ids, block_size)
    if query_spans is None:
        query_spans = block_spans(query_positions, query_doc_ids, block_size)
    for query_span in query_spans:
        rows = slice(query_span.start, query_span.end)
        q_block = q[:, :, :, rows].contiguous()
        dout_block = dout[:, :, :, rows].contiguous()
        lse_block, delta_block = lse[:, :, :, rows].contiguous(), delta[:, :, :, rows].contiguous()
        dq_block = dq[:, :, :, rows]
        for key_span in key_spans:
            visibility = block_visibility(query_span, key_span, window)
            if visibility is Visibility.SKIP:
                continue
            cols = slice(key_span.start, key_span.end)
            mask = None
            if visibility is Visibility.PARTIAL:
                mask = block_mask(
                    query_positions[rows], query_doc_ids[rows], key_positions[cols], key_doc_ids[cols], window
                )
            pair_dq, pair_dk, pair_dv = block_backward(
                dout_block, q_block, k[:, :, cols], v[:, :, cols], lse_block, delta_block, scale=scale, mask=mask
            )
            dq_block.add_(pair_dq)
            dk[:, :, cols].add_(pair_dk)
            dv[:, :, cols].add_(pair_dv)
    return dq, dk, dv


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half precision, the input dtype otherwise (float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32)


def grouped_by_kv_head(q: torch.Tensor, num_kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """`[B, Hq, L, D]` -> `[B, Hkv, G, L, D]`; query head h belongs to key/value head h // G (as HF's repeat_kv)."""
    return q.unflatten(1, (num_kv_heads, q.shape[1] // num_kv_heads)).to(dtype)


def grouped_backward_inputs(
    dout: torch.Tensor, q: torch.Tensor, out: torch.Tensor, num_kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`q` and `dout` grouped by key/value head in the compute dtype, and `delta = rowsum(dout * out)`: what every
    backward driver starts from."""
    dtype = compute_dtype(q.dtype)
    dout_grouped = grouped_by_kv_head(dout, num_kv_heads, dtype)
    delta = (dout_grouped * grouped_by_kv_head(out, num_kv_heads, dtype)).sum(dim=-1)
    return grouped_by_kv_head(q, num_kv_heads, dtype), dout_grouped, delta


def add_branch_partial(q_grouped, branch_k, branch_v, out, lse, *, scale):
    """Merge the branch keys' partial result into the trunk's `(out, lse)` (nothing to do without a branch)."""
    if branch_k is None:
        return out, lse
    dtype = q_grouped.dtype
    branch_out, branch_lse = branch_forward(q_grouped, branch_k.to(dtype), branch_v.to(dtype), scale=scale)
    return merge_attention_partials(out, lse, branch_out, branch_lse)


def add_branch_grads(dout_grouped, q_grouped, branch_k, branch_v, lse, delta, dq, *, scale):
    """The branch keys' gradients in their own dtype (None, None without a branch); their share of dq is added to
    `dq` in place."""
    if branch_k is None:
        return None, None
    dtype = q_grouped.dtype
    branch_dq, dbranch_k, dbranch_v = branch_backward(
        dout_grouped, q_grouped, branch_k.to(dtype), branch_v.to(dtype), lse, delta, scale=scale
    )
    dq.add_(branch_dq)
    return dbranch_k.to(branch_k.dtype), dbranch_v.to(branch_v.dtype)


def _grouped_sinks(sinks: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """`[Hq]` -> `[Hkv, G, 1]` in the compute dtype, to broadcast against `lse [B, Hkv, G, L]`."""
    return sinks.to(lse.dtype).view(*lse.shape[1:3], 1)


def add_sinks(out, lse, sinks):
    """Merge the attention sinks (gpt-oss: one learnt logit per query head, with no value) into the final result.

    A sink is one more partial with a zero output and `lse = sink`, merged once after every key:
    `out * sigmoid(lse - sink)` and `logaddexp(lse, sink)`. The backward then needs nothing else but `sink_grads`:
    with this `lse` and `delta = rowsum(dout * out)` of the final output, the per-block gradients already see the
    sink in the softmax. Nothing to do without sinks.
    """
    if sinks is None:
        return out, lse
    sink = _grouped_sinks(sinks, lse)
    return out * torch.sigmoid(lse - sink).unsqueeze(-1), torch.logaddexp(lse, sink)


def sink_grads(sinks, lse, delta):
    """d loss / d sinks `[Hq]` in the sinks' dtype (None without sinks): `-sum p_sink * delta` over batch and
    queries, with `p_sink = exp(sink - lse)` the sink's softmax weight under the final `lse`."""
    if sinks is None:
        return None
    weight = torch.exp(_grouped_sinks(sinks, lse) - lse)
    return -(weight * delta).sum(dim=(0, 3)).flatten().to(sinks.dtype)


def branch_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    branch_k: torch.Tensor | None,
    branch_v: torch.Tensor | None,
    sinks: torch.Tensor | None,
    *,
    positions: torch.Tensor,
    doc_ids: torch.Tensor,
    query_index: torch.Tensor | None,
    scale: float,
    block_size: int,
    window: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Single-device forward on public layouts; returns `out [B, Hq, Lq, D]` in q's dtype and `lse [B, Hkv, G, Lq]`."""
    dtype = compute_dtype(q.dtype)
    q_grouped = grouped_by_kv_head(q, k.shape[1], dtype)
    query_positions, query_doc_ids = at_queries(positions, doc_ids, query_index)
    out, lse = trunk_forward(
        q_grouped,
        k.to(dtype),
        v.to(dtype),
        query_positions=query_positions,
        query_doc_ids=query_doc_ids,
        key_positions=positions,
        key_doc_ids=doc_ids,
        scale=scale,
        block_size=block_size,
        kernel_dtype=q.dtype,
        window=window,
    )
    out, lse = add_branch_partial(q_grouped, branch_k, branch_v, out, lse, scale=scale)
    out, lse = add_sinks(out, lse, sinks)
    return out.flatten(1, 2).to(q.dtype), lse


def branch_attention_backward(
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
    positions: torch.Tensor,
    doc_ids: torch.Tensor,
    query_index: torch.Tensor | None,
    scale: float,
    block_size: int,
    window: int | None,
) -> tuple[torch.Tensor, ...]:
    """Single-device backward; returns `dq, dk, dv, dbranch_k, dbranch_v, dsinks` in the inputs' dtypes (None without
    branch, without sinks)."""
    q_grouped, dout_grouped, delta = grouped_backward_inputs(dout, q, out, k.shape[1])
    dtype = q_grouped.dtype
    query_positions, query_doc_ids = at_queries(positions, doc_ids, query_index)
    dq, dk, dv = trunk_backward(
        dout_grouped,
        q_grouped,
        k.to(dtype),
        v.to(dtype),
        lse,
        delta,
        query_positions=query_positions,
        query_doc_ids=query_doc_ids,
        key_positions=positions,
        key_doc_ids=doc_ids,
        scale=scale,
        block_size=block_size,
        window=window,
    )
    dbranch_k, dbranch_v = add_branch_grads(dout_grouped, q_grouped, branch_k, branch_v, lse, delta, dq, scale=scale)
    dsinks = sink_grads(sinks, lse, delta)
    return dq.flatten(1, 2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbranch_k, dbranch_v, dsinks


def autocast_off(tensor: torch.Tensor):
    """The kernels choose their own compute dtype (float32 for half precision); an enclosing autocast would run
    their matmuls in half precision next to float32 partials, so the custom autograd functions turn it off."""
    return torch.autocast(tensor.device.type, enabled=False)


def at_queries(positions, doc_ids, query_index):
    """Positions and document ids of the queries: all L, or those at `query_index`."""
    if query_index is None:
        return positions, doc_ids
    return positions[query_index], doc_ids[query_index]


class BranchAttentionFunction(torch.autograd.Function):
    """Saves only the inputs, the output and the log-sum-exp (linear in L); the backward recomputes per block."""

    @staticmethod
    def forward(ctx, q, k, v, branch_k, branch_v, sinks, positions, doc_ids, query_index, scale, block_size, window):
        options = dict(query_index=query_index, scale=scale, block_size=block_size, window=window)
        with autocast_off(q):
            out, lse = branch_attention_forward(
                q, k, v, branch_k, branch_v, sinks, positions=positions, doc_ids=doc_ids, **options
            )
        ctx.save_for_backward(q, k, v, branch_k, branch_v, sinks, out, lse, positions, doc_ids, query_index)
        ctx.scale, ctx.block_size, ctx.window = scale, block_size, window
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, branch_k, branch_v, sinks, out, lse, positions, doc_ids, query_index = ctx.saved_tensors
        with autocast_off(q):
            grads = branch_attention_backward(
                dout,
                q,
                k,
                v,
                branch_k,
                branch_v,
                sinks,
                out,
                lse,
                positions=positions,
                doc_ids=doc_ids,
                query_index=query_index,
                scale=ctx.scale,
                block_size=ctx.block_size,
                window=ctx.window,
            )
        return *grads, None, None, None, None, None, None


def blockwise_branch_attention_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    branch_k: torch.Tensor | None = None,
    branch_v: torch.Tensor | None = None,
    *,
    cu_seqlens: torch.Tensor | None = None,
    scale: float | None = None,
    block_size: int = BLOCK_SIZE,
    query_index: torch.Tensor | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`branch_attention` on one device (the whole sequence here), after validating its inputs."""
    check_int(block_size, "block_size")
    branch_k, branch_v, scale = check_branch_attention_inputs(
        q,
        k,
        v,
        branch_k,
        branch_v,
        cu_seqlens=cu_seqlens,
        scale=scale,
        query_index=query_index,
        sliding_window=sliding_window,
        sinks=sinks,
    )
    length = k.shape[2]
    positions = torch.arange(length, device=q.device)
    if cu_seqlens is None:
        doc_ids = torch.zeros(length, dtype=torch.int64, device=q.device)
    else:
        doc_ids = document_ids(cu_seqlens.to(q.device))
    return BranchAttentionFunction.apply(
        q, k, v, branch_k, branch_v, sinks, positions, doc_ids, query_index, scale, block_size, sliding_window
    )
