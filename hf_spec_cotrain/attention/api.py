"""`branch_attention`, the public entry point: the single-device blockwise kernel, or with a context-parallel group
of more than one rank, one of the zigzag strategies of `ring.py` and `query_gather.py`."""

import torch
import torch.distributed as dist

from ..parallel.comm import is_context_parallel
from .blockwise import BLOCK_SIZE, blockwise_branch_attention_func
from .query_gather import gather_queries_backward, gather_queries_forward
from .ring import (
    allgather_branch_attention_backward,
    allgather_branch_attention_forward,
    ring_branch_attention_backward,
    ring_branch_attention_forward,
    sharded_branch_attention,
)


CONTEXT_PARALLEL_KERNELS = {
    "ring": (ring_branch_attention_forward, ring_branch_attention_backward),
    "allgather": (allgather_branch_attention_forward, allgather_branch_attention_backward),
    "gather_queries": (gather_queries_forward, gather_queries_backward),
}
"""The strategies `branch_attention(..., cp_mode=...)` runs (`sharded_branch_attention`) when the context-parallel group
has more than one rank: each one's forward and backward."""


CP_MODES = tuple(CONTEXT_PARALLEL_KERNELS)
"""Context-parallel strategies: the zigzag ring (trunk K/V travel between neighbours, O(L/W) memory per rank) and
the all-gather baseline (every rank gathers the whole trunk K/V, O(L) memory per rank)."""


def branch_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    branch_k: torch.Tensor | None = None,
    branch_v: torch.Tensor | None = None,
    *,
    cu_seqlens: torch.Tensor | None = None,
    cp_group: dist.ProcessGroup | None = None,
    scale: float | None = None,
    block_size: int = BLOCK_SIZE,
    cp_mode: str = "ring",
    query_index: torch.Tensor | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each query over its causal trunk and its own branch keys, in one softmax.

    Args:
        q: `[B, Hq, L, D]` queries (`[B, Hq, Lq, D]` with `query_index`).
        k, v: `[B, Hkv, L, D]` trunk keys/values, `Hq % Hkv == 0` (grouped-query attention).
        branch_k, branch_v: `[S, B, Hkv, L, D]` position-private keys/values (query i sees only
            `branch_*[:, :, :, i]`), or None (same as S == 0); `[S, B, Hkv, Lq, D]` with `query_index`.
        cu_seqlens: int `[0, ..., L]` boundaries of packed documents along L (then B must be 1);
            a query sees trunk keys of its own document only.
        cp_group: context-parallel group. With a world size W > 1 every tensor is this rank's zigzag
            shard (`hf_spec_cotrain.parallel.zigzag_shard`: each document, of a length divisible by 2W,
            cut into 2W chunks, rank r holding chunks r and 2W-1-r) while `cu_seqlens` stays global; the
            result is this rank's shard of the single-device result. Every rank of the group must call.
        scale: score scale, `D**-0.5` by default.
        block_size: query/key block length; memory grows as `block_size * L`, never `L * L`.
        cp_mode: with W > 1, "ring" (trunk K/V travel the ring, O(L/W) memory per rank), "allgather"
            (the all-gather-K/V baseline: the gathered K/V, O(L) per rank, are kept for the backward) or
            "gather_queries" (the group's queries travel and the K/V stay home: for queries at few positions,
            `query_index`, such as DFlash's blocks; O(L/W + queries of the group)); all exact.
        query_index: int64 `[Lq]`, strictly increasing: the positions the queries sit at, when only some
            positions need an output (the TTT's later steps). Same result as the full call at those rows, for
            the cost of Lq queries. With context parallelism: the local positions (in this rank's shard) of this
            rank's queries; each rank passes its own (an empty one included).
        sliding_window: a query sees the trunk keys of the last `sliding_window` positions of its document, itself
            included (transformers' sliding-window mask); None: its whole causal past. Key blocks, and with
            context parallelism ring steps, beyond every query's window are skipped.
        sinks: `[Hq]` attention sinks (gpt-oss): one more logit per query head in the softmax, with no value; it
            gets its gradient.

    Returns:
        `[B, Hq, L, D]` (`[B, Hq, Lq, D]` with `query_index`) in q's dtype.
    """
    if cp_mode not in CP_MODES:
        raise ValueError(f"cp_mode must be one of {CP_MODES}, got {cp_mode!r}.")
    if is_context_parallel(cp_group):
        return sharded_branch_attention(
            CONTEXT_PARALLEL_KERNELS[cp_mode],
            q,
            k,
            v,
            branch_k,
            branch_v,
            group=cp_group,
            cu_seqlens=cu_seqlens,
            scale=scale,
            block_size=block_size,
            query_index=query_index,
            sliding_window=sliding_window,
            sinks=sinks,
        )
    return blockwise_branch_attention_func(
        q,
        k,
        v,
        branch_k,
        branch_v,
        cu_seqlens=cu_seqlens,
        scale=scale,
        block_size=block_size,
        query_index=query_index,
        sliding_window=sliding_window,
        sinks=sinks,
    )
