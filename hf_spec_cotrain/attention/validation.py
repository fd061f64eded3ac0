"""Input checks shared by the blockwise kernel and the dense reference, so both reject the same inputs."""

import math

import torch

from ..validation import check_cu_seqlens, check_int


def _shape(tensor: torch.Tensor) -> tuple[int, ...]:
    return tuple(tensor.shape)


def check_branch_attention_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    branch_k: torch.Tensor | None,
    branch_v: torch.Tensor | None,
    *,
    cu_seqlens: torch.Tensor | None,
    scale: float | None,
    query_index: torch.Tensor | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, float]:
    """Validate the inputs of `branch_attention` and return `(branch_k, branch_v, scale)` normalised.

    An empty branch (S == 0) is returned as None, and a missing scale as `D**-0.5`. With `query_index`, q (and
    the branch) cover only those positions of the L keys. `sinks` may have another floating dtype than q (a
    float32 parameter next to bf16 activations under autocast).
    """
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}.")
    if q.dim() != 4:
        raise ValueError(f"q must be 4-D [B, Hq, L, D], got shape {_shape(q)}.")
    if k.dim() != 4:
        raise ValueError(f"k must be 4-D [B, Hkv, L, D], got shape {_shape(k)}.")
    if v.shape != k.shape:
        raise ValueError(f"v must have the shape of k {_shape(k)}, got {_shape(v)}.")
    batch_size, num_q_heads, query_length, head_dim = q.shape
    length = k.shape[2]
    if query_index is None and length != query_length:
        raise ValueError(
            f"k and v must be [B={batch_size}, Hkv, L={query_length}, D={head_dim}] to match q {_shape(q)}, got "
            f"{_shape(k)} (queries at some positions only need `query_index`)."
        )
    if k.shape[0] != batch_size:
        raise ValueError(f"k and v must have q's batch size B={batch_size}, got {_shape(k)}.")
    if query_index is not None:
        _check_query_index(query_index, query_length=query_length, length=length)
    if k.shape[3] != head_dim:
        raise ValueError(f"q and k must have the same head dim D, got q D={head_dim} and k D={k.shape[3]}.")
    if head_dim == 0:
        raise ValueError(f"q, k and v must have a head dim D >= 1, got shape {_shape(q)}.")
    num_kv_heads = k.shape[1]
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"The number of query heads Hq={num_q_heads} must be a multiple of the number of key/value heads "
            f"Hkv={num_kv_heads} (grouped-query attention)."
        )

    if (branch_k is None) != (branch_v is None):
        given, missing = ("branch_k", "branch_v") if branch_v is None else ("branch_v", "branch_k")
        raise ValueError(f"{given} was given without {missing}: pass both or neither.")
    if branch_k is not None:
        branch_shape = (batch_size, num_kv_heads, query_length, head_dim)  # one entry per query
        expected = ("S", *branch_shape)
        for name, tensor in (("branch_k", branch_k), ("branch_v", branch_v)):
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}.")
            if tensor.dim() != 5 or tuple(tensor.shape[1:]) != branch_shape:
                raise ValueError(f"{name} must be [S, B, Hkv, Lq, D] = {expected}, got shape {_shape(tensor)}.")
        if branch_v.shape[0] != branch_k.shape[0]:
            raise ValueError(
                f"branch_k and branch_v must hold the same number of branch keys S, "
                f"got {branch_k.shape[0]} and {branch_v.shape[0]}."
            )
        if branch_k.shape[0] == 0:
            branch_k = branch_v = None

    tensors = {"q": q, "k": k, "v": v}
    if branch_k is not None:
        tensors.update(branch_k=branch_k, branch_v=branch_v)
    if not q.dtype.is_floating_point:
        raise ValueError(f"q must have a floating-point dtype, got {q.dtype}.")
    for name, tensor in tensors.items():
        if tensor.dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype {q.dtype}, got {tensor.dtype}.")
        if tensor.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {tensor.device}.")

    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, length=length, batch_size=batch_size)
    if sliding_window is not None:
        check_int(sliding_window, "sliding_window", hint=" (the query and the sliding_window - 1 keys before it)")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or sinks.shape != (num_q_heads,) or not sinks.dtype.is_floating_point:
            raise ValueError(
                f"sinks must be a floating-point tensor of one logit per query head [Hq={num_q_heads}], got "
                f"{_shape(sinks) if isinstance(sinks, torch.Tensor) else type(sinks).__name__}."
            )
        if sinks.device != q.device:
            raise ValueError(f"sinks must be on q's device {q.device}, got {sinks.device}.")

    return branch_k, branch_v, checked_scale(scale, head_dim)


def checked_scale(scale: float | None, head_dim: int) -> float:
    """The score scale: ``D ** -0.5`` when None, else a positive finite number."""
    if scale is None:
        return head_dim**-0.5
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite number (default D**-0.5), got {scale!r}.")
    return float(scale)


def check_block_draft_inputs(
    q: torch.Tensor,
    context_k: torch.Tensor,
    context_v: torch.Tensor,
    block_k: torch.Tensor,
    block_v: torch.Tensor,
    anchors: torch.Tensor,
    anchor_mask: torch.Tensor | None,
    *,
    cu_seqlens: torch.Tensor | None,
    scale: float | None,
    length: int | None = None,
) -> tuple[torch.Tensor, float]:
    """Validate the inputs of `block_draft_attention`; return the anchor mask (all True when None) and the scale.
    ``length``: the whole sequence's (default: the context's; W times it under context parallelism).

    Kept anchors must be distinct positions of their row with some context before them in their document: an
    anchor at a document's first position would attend to its block alone, which no drafting round ever does.
    """
    tensors = {"q": q, "context_k": context_k, "context_v": context_v, "block_k": block_k, "block_v": block_v}
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}.")
    if q.dim() != 5:
        raise ValueError(f"q must be 5-D [B, Hq, N, S, D], got shape {_shape(q)}.")
    batch_size, num_q_heads, num_anchors, block_len, head_dim = q.shape
    if context_k.dim() != 4 or context_k.shape[0] != batch_size or context_k.shape[3] != head_dim:
        raise ValueError(
            f"context_k must be [B={batch_size}, Hkv, L, D={head_dim}] to match q {_shape(q)}, got {_shape(context_k)}."
        )
    if context_v.shape != context_k.shape:
        raise ValueError(f"context_v must have the shape of context_k {_shape(context_k)}, got {_shape(context_v)}.")
    num_kv_heads = context_k.shape[1]
    length = context_k.shape[2] if length is None else length
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"The number of query heads Hq={num_q_heads} must be a multiple of the number of key/value heads "
            f"Hkv={num_kv_heads} (grouped-query attention)."
        )
    block_shape = (batch_size, num_kv_heads, num_anchors, block_len, head_dim)
    for name in ("block_k", "block_v"):
        if tuple(tensors[name].shape) != block_shape:
            raise ValueError(f"{name} must be [B, Hkv, N, S, D] = {block_shape}, got {_shape(tensors[name])}.")
    if not q.dtype.is_floating_point:
        raise ValueError(f"q must have a floating-point dtype, got {q.dtype}.")
    for name, tensor in tensors.items():
        if tensor.dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype {q.dtype}, got {tensor.dtype}.")
        if tensor.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {tensor.device}.")
    if (
        not isinstance(anchors, torch.Tensor)
        or anchors.dtype != torch.int64
        or _shape(anchors) != (batch_size, num_anchors)
    ):
        raise ValueError(f"anchors must be an int64 tensor [B, N] = [{batch_size}, {num_anchors}], got {anchors!r}.")
    if anchors.device != q.device:
        raise ValueError(f"anchors must be on q's device {q.device}, got {anchors.device}.")
    if anchor_mask is None:
        anchor_mask = torch.ones(batch_size, num_anchors, dtype=torch.bool, device=anchors.device)
    elif (
        not isinstance(anchor_mask, torch.Tensor)
        or anchor_mask.dtype != torch.bool
        or _shape(anchor_mask) != (batch_size, num_anchors)
    ):
        raise ValueError(f"anchor_mask must be a bool tensor [B, N] = [{batch_size}, {num_anchors}] or None.")
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, length=length, batch_size=batch_size)
    kept = anchors[anchor_mask]
    if bool(((kept < 0) | (kept >= length)).any()):
        raise ValueError(f"anchors must be context positions in [1, L={length}), got {kept.tolist()}.")
    document_start = torch.zeros(length, dtype=torch.bool, device=anchors.device)
    if cu_seqlens is None:
        document_start[0] = True
    else:
        starts = cu_seqlens[:-1].to(device=anchors.device, dtype=torch.int64)
        document_start[starts[starts < length]] = True
    at_start = kept[document_start[kept]]
    if at_start.numel():
        raise ValueError(
            f"Anchors {sorted(set(at_start.tolist()))} sit at the first position of a document: their block would see "
            "no context. Anchor blocks at least one token into a document (a >= 1 from its start)."
        )
    ordered = torch.where(anchor_mask, anchors, -1 - torch.arange(num_anchors, device=anchors.device)).sort(-1).values
    if bool((ordered.diff(dim=-1) == 0).any()):
        raise ValueError("anchors must be distinct within a row (a repeated kept anchor); mask repeats out.")
    return anchor_mask.to(q.device), checked_scale(scale, head_dim)


def _check_query_index(query_index: torch.Tensor, *, query_length: int, length: int) -> None:
    if not isinstance(query_index, torch.Tensor) or query_index.dtype != torch.int64 or query_index.dim() != 1:
        raise ValueError(f"query_index must be a 1-D int64 tensor of key positions, got {query_index!r}.")
    if query_index.numel() != query_length:
        raise ValueError(f"query_index has {query_index.numel()} positions; q has {query_length} queries.")
    if query_length and (query_index[0] < 0 or query_index[-1] >= length or (query_index.diff() <= 0).any()):
        raise ValueError(f"query_index must be strictly increasing positions in [0, {length}), got {query_index}.")
