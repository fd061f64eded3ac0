"""The policy's own attention under context parallelism, as a transformers attention implementation.

transformers' decoder layers call ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, query, key, value,
attention_mask, scaling=..., dropout=..., **kwargs)`` and pass the keyword arguments of the model's forward through
to it. `zigzag_ring_attention_forward` takes the context-parallel group and the packed documents from those keyword
arguments (``cp_group``, ``cu_seqlens``) rather than from global state: gradient checkpointing stores a layer's
keyword arguments with it, so the recomputation in the backward (possibly on another thread) sees the same ones.

The attention is `branch_attention` with no branch: causal within each packed document, every tensor this rank's
zigzag shard, exact (the same result as one device). The layout *is* the mask, so the implementation registers no
mask function and transformers builds no dense mask for it. Each layer passes its own `sliding_window` (None for
gpt-oss's and Gemma-style full-attention layers, the config's for Mistral's every layer) and gpt-oss its sinks
(`s_aux`), as they do to transformers' own implementations.

Under autocast (accelerate's `mixed_precision`) a layer hands over q and k in float32 (RoPE tables follow the float32
residual stream) and v in the autocast dtype. transformers' SDPA (an autocast op) and eager attention (autocast
matmuls) compute in the autocast dtype, so the implementation casts q, k and v to it as well; `branch_attention`
itself keeps refusing mixed dtypes.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers import AttentionInterface

from .api import branch_attention


ZIGZAG_RING_ATTENTION = "hf_spec_cotrain_zigzag_ring"
"""The `attn_implementation` name under which `zigzag_ring_attention_forward` is registered."""


def zigzag_ring_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    *,
    cu_seqlens: torch.Tensor | None = None,
    cp_group=None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal attention over packed documents on zigzag shards, in the calling convention of transformers.

    Args:
        query: `[1, Hq, n, D]`, key / value: `[1, Hkv, n, D]` (this rank's shard, `n = L / W`; RoPE already
            applied with the global within-document positions).
        attention_mask: ignored (the documents in `cu_seqlens` are the mask).
        cu_seqlens: global boundaries of the packed documents (each a multiple of `2 W` long).
        cp_group: the context-parallel group (every rank must call); None or a group of one: one device.
        sliding_window: this layer's window (transformers' semantics: the query and the `sliding_window - 1`
            positions before it), or None.
        s_aux: the layer's attention sinks `[Hq]` (gpt-oss), or None.
        softcap: must be None (a logit soft-cap is not in the ring kernel).

    Returns:
        `([1, n, Hq, D], None)`, like transformers' SDPA implementation.
    """
    if cu_seqlens is None:
        raise ValueError(
            f"The `{ZIGZAG_RING_ATTENTION}` attention needs the packed documents: call the model with `cu_seqlens` "
            "(and `cp_group`), as `hf_spec_cotrain.parallel.packed_rows` does."
        )
    if softcap is not None:
        raise ValueError(f"Context-parallel attention has no logit soft-cap; this layer asks for softcap={softcap}.")
    if dropout:
        raise ValueError(f"Context-parallel attention has no dropout; got dropout={dropout} (set it to 0).")
    query, key, value = (_as_autocast_would(tensor) for tensor in (query, key, value))
    out = branch_attention(
        query,
        key,
        value,
        cu_seqlens=cu_seqlens,
        cp_group=cp_group,
        scale=scaling,
        sliding_window=sliding_window,
        sinks=s_aux,
    )
    return out.transpose(1, 2).contiguous(), None


def _as_autocast_would(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in the enclosing autocast's dtype, as autocast casts the inputs of SDPA (float64 is left alone)."""
    device_type = tensor.device.type
    if not torch.is_autocast_enabled(device_type) or tensor.dtype == torch.float64:
        return tensor
    return tensor.to(torch.get_autocast_dtype(device_type))


def register_zigzag_ring_attention() -> str:
    """Register the implementation with transformers (idempotent); returns its name."""
    AttentionInterface.register(ZIGZAG_RING_ATTENTION, zigzag_ring_attention_forward)
    return ZIGZAG_RING_ATTENTION


@contextmanager
def zigzag_ring_attention(model: nn.Module) -> Iterator[None]:
    """Run `model`'s attention layers through `zigzag_ring_attention_forward` inside the block.

    Keep the block open over the backward as well when the model uses gradient checkpointing: the layers read
    the implementation again when they are recomputed. The previous implementation is restored on exit.
    """
    register_zigzag_ring_attention()
    config = model.config
    # The setter recurses into sub-configs; a dict restores each one to its own previous value.
    previous = {"": config._attn_implementation}
    for name in config.sub_configs:
        if getattr(config, name, None) is not None:
            previous[name] = getattr(config, name)._attn_implementation
    config._attn_implementation = ZIGZAG_RING_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = previous


__all__ = [
    "ZIGZAG_RING_ATTENTION",
    "register_zigzag_ring_attention",
    "zigzag_ring_attention",
    "zigzag_ring_attention_forward",
]
