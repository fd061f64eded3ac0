"""Attention for the speculative generator's forwards (the target's and the drafts'): causal by slot, with holes,
without copying shared heads.

A decoding cache never crops: rows accept different numbers of tokens, so a rejected slot becomes a *hole* in a
``[B, slots]`` slot mask, every forward attends through the causal-by-slot mask of that slot mask
(`causal_slot_mask`), and caches whose holes outnumber their kept slots are compacted (`compact_slots`).

Every forward of `speculative_generate` attends through an explicit mask (rejected slots are holes), so HF's SDPA
path copies each key/value head once per query head of its group (`repeat_kv`, since PyTorch's grouped SDPA
refuses a mask on the fast kernels) and, on CPU, runs the masked kernel. Folding the group's query heads and the
``K + 1`` verified tokens into one matmul's rows instead reads each key/value head once: on this repository's CPU
a verification forward of 4 tokens x 16 rows then costs 1.1 plain decoding steps instead of 1.9 (measured in
`scripts/bench_speculative.py`). On CUDA, SDPA's memory-efficient kernel takes masks and is kept; eager attention
is replaced on every device, since it adds a mask to the scores and so cannot take a bool one (gpt-oss, whose
attention sinks no SDPA kernel has, runs eager by default).

The kernel computes what eager attention does in the families it serves: gpt-oss's sinks, Gemma2's attention logit
soft-cap (in float32, before the mask, as the softmax), and values of another head dim than the queries and keys
(DeepSeek-V3's multi-head latent attention; the output takes the values' head dim). SDPA has neither sinks nor a
soft-cap, so a query of one token goes to SDPA only without them. transformers' own SDPA attention drops a soft-cap:
a soft-capped model loaded with SDPA is refused rather than decoded with a cap its own forwards lack.

`decoding_attention(model)` switches a model to that kernel for the duration of a generation (registered with
transformers' `AttentionInterface`) and restores its own implementation afterwards.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import DynamicLayer


__all__ = [
    "GROUPED_ATTENTION",
    "GROUPED_SDPA_ATTENTION",
    "causal_slot_mask",
    "compact_slots",
    "decoding_attention",
    "grouped_attention",
]

GROUPED_ATTENTION = "hf_spec_cotrain_grouped"
"""The kernel in place of eager attention: all that eager computes, sinks and logit soft-cap included."""
GROUPED_SDPA_ATTENTION = "hf_spec_cotrain_grouped_sdpa"
"""The kernel in place of transformers' SDPA attention, which drops a logit soft-cap: such a layer is refused."""


def grouped_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    *,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``softmax(q k^T * scale, masked) v``: query ``[B, Hq, Lq, D]``, key ``[B, Hkv, Lk, D]``, value
    ``[B, Hkv, Lk, Dv]`` (``Hq`` a multiple of ``Hkv``, query head ``h`` reading key/value head ``h // (Hq / Hkv)``;
    ``Dv`` may differ from ``D``, as in multi-head latent attention), ``mask`` bool ``[B, 1, Lq, Lk]`` (True:
    visible). ``sinks`` ``[Hq]``: gpt-oss's per-head sink logits, one more softmax entry that takes probability but
    carries no value. ``softcap``: Gemma2's logit soft-cap, scores ``softcap * tanh(scores / softcap)`` before the
    mask. Returns ``[B, Hq, Lq, Dv]``; soft-cap and softmax in at least float32."""
    batch, query_heads, query_length, head_dim = query.shape
    if query_length == 1 and sinks is None and softcap is None:  # nothing to fold, and SDPA is one call, not eleven
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=True)
    kv_heads, key_length = key.shape[1], key.shape[2]
    group = query_heads // kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    dtype = torch.promote_types(query.dtype, torch.float32)
    rows = query.reshape(batch, kv_heads, group * query_length, head_dim)  # a group's heads are consecutive
    scores = torch.matmul(rows, key.transpose(-1, -2)).view(batch, kv_heads, group, query_length, key_length)
    scores = scores * scale  # in the inputs' dtype, as transformers' attention scales them
    if softcap is not None:
        scores = softcap * torch.tanh(scores.to(dtype) / softcap)
    scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    if sinks is None:
        probs = scores.softmax(-1, dtype=dtype)
    else:
        probs = _softmax_with_sinks(scores.to(dtype), sinks.to(dtype).view(kv_heads, group, 1, 1))
    out = torch.matmul(probs.to(value.dtype).view(batch, kv_heads, group * query_length, key_length), value)
    return out.view(batch, query_heads, query_length, value.shape[-1])


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Softmax over the keys and a sink logit, sink entry dropped: the keys' softmax scaled by the share the keys
    keep, ``exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink)`` (stable for any magnitudes)."""
    lse = scores.logsumexp(-1, keepdim=True)
    return (scores - lse).exp() * torch.sigmoid(lse - sinks)


def _hf_grouped_attention(
    module: nn.Module,
    query,
    key,
    value,
    attention_mask,
    scaling=None,
    dropout=0.0,
    s_aux=None,
    softcap=None,
    **kwargs,
):
    """transformers' attention-function signature around `grouped_attention` (output ``[B, Lq, Hq, Dv]``); gpt-oss's
    ``s_aux`` are the sinks, Gemma2's ``softcap`` its logit soft-cap. A sliding window is already in the generator's
    mask."""
    if attention_mask is None or attention_mask.dtype != torch.bool:
        raise ValueError("The grouped decoding attention needs the generator's 4-D bool mask.")
    out = grouped_attention(
        query, key, value, attention_mask[..., -key.shape[2] :], scale=scaling, sinks=s_aux, softcap=softcap
    )
    return out.transpose(1, 2).contiguous(), None


def _hf_grouped_sdpa_attention(module: nn.Module, query, key, value, attention_mask, softcap=None, **kwargs):
    """`_hf_grouped_attention` in place of transformers' SDPA attention. That drops a logit soft-cap, so the model's
    own forwards (`generate`, a trainer's log-probs) run without it: applying it here would sample another model."""
    if softcap is not None:
        raise ValueError(
            f"This model asks for an attention logit soft-cap (softcap={softcap}) but runs transformers' SDPA "
            "attention, which drops it: its own forwards ignore the cap, and speculative decoding, which would apply "
            "it, would sample another model. Load it with attn_implementation='eager', which applies the cap."
        )
    return _hf_grouped_attention(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(GROUPED_ATTENTION, _hf_grouped_attention)
AttentionInterface.register(GROUPED_SDPA_ATTENTION, _hf_grouped_sdpa_attention)


@contextmanager
def decoding_attention(model: nn.Module) -> Iterator[None]:
    """Run ``model``'s attention through `grouped_attention` while generating: eager models on every device
    (`GROUPED_ATTENTION`), SDPA models on CPU (`GROUPED_SDPA_ATTENTION`); others, and SDPA on CUDA, keep their own.
    The implementation it had is restored afterwards."""
    config = model.config
    original = config._attn_implementation
    on_cpu = next(model.parameters()).device.type == "cpu"
    replacement = {"eager": GROUPED_ATTENTION, "sdpa": GROUPED_SDPA_ATTENTION if on_cpu else None}.get(original)
    if replacement is not None:
        config._attn_implementation = replacement
    try:
        yield
    finally:
        if replacement is not None:
            config._attn_implementation = original


def causal_slot_mask(slot_mask: torch.Tensor, length: int, *, window: int | None = None) -> torch.Tensor:
    """``[B, 1, L, slots]`` bool: the queries of the last ``L`` slots see the slots up to their own that hold real
    tokens (``slot_mask``, ``[B, slots]`` bool; slot order is time order, so a hole or padding is simply False).

    A ``window`` of ``W`` also hides keys ``W`` or more *real* tokens behind the query (HF's sliding window,
    ``key_position > query_position - W``): a row's real tokens sit at consecutive positions, so counting kept slots
    measures the distance and holes never count. A query always sees its own slot, so a padding query gets a finite
    (ignored) output rather than NaN.
    """
    slots = slot_mask.shape[1]
    key_slot = torch.arange(slots, device=slot_mask.device)
    query_slot = torch.arange(slots - length, slots, device=slot_mask.device)[:, None]
    visible = (key_slot <= query_slot) & slot_mask[:, None, :]
    if window is not None:
        real_tokens = slot_mask.long().cumsum(1)  # a real slot's position + 1
        visible &= real_tokens[:, None, :] > real_tokens[:, -length:, None] - window
    return (visible | (key_slot == query_slot))[:, None]


def compact_slots(cache: DynamicCache, slot_mask: torch.Tensor) -> torch.Tensor:
    """Drop holes in place once they outnumber the kept slots of the fullest row; return the new slot mask. Kept
    slots keep their order, left-padded (every attention layer keeps all its slots: see
    `hf_spec_cotrain.generation.decoder` on sliding windows); linear-attention layers have no slots, and a pipeline
    stage's cache has no entries for other stages' layers."""
    slots = slot_mask.shape[1]
    width = int(slot_mask.sum(1).max())
    if slots - width <= width:
        return slot_mask
    slot = torch.arange(slots, device=slot_mask.device)
    order = torch.argsort(torch.where(slot_mask, slot + slots, slot), dim=1, stable=True)[:, slots - width :]

    def gather(states: torch.Tensor) -> torch.Tensor:
        return states.gather(2, order[:, None, :, None].expand(-1, states.shape[1], -1, states.shape[3]))

    for layer in cache.layers:
        if isinstance(layer, DynamicLayer) and layer.is_initialized:
            layer.keys, layer.values = gather(layer.keys), gather(layer.values)
    return slot_mask.gather(1, order)
