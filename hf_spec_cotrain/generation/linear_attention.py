"""Linear-attention (Gated DeltaNet) layers in speculative verification: states per verified token, kept per row.

A linear-attention layer (Qwen3.5, Qwen3-Next) keeps no per-token cache entries that a mask could hide: it folds every
token it reads into a recurrent state and into its causal convolution's window of recent inputs, so a rejected draft
cannot become a hole. While `LinearAttentionStates` is entered, a cached forward of several tokens (the verification
of ``[x_n, d_1 .. d_K]``) runs each such layer one token at a time, through the layer's own single-token decoding
path (`generate`'s arithmetic; its multi-token kernel returns the final states only), and keeps both states after
every token. Once each row has accepted ``a`` drafts, `LinearAttentionStates.keep` sets its states to those after
verified token ``a``: ``x_n, d_1 .. d_a`` are folded in, the correction or bonus token, which the next round feeds
first, is not. A prefill runs the layer whole, as HF does (padding zeroed by the 2-D mask, as in `generate`).

The snapshots hold ``K + 1`` copies of each linear layer's states for the duration of a round.
"""

from functools import partial

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from ..taps import decoder_layers
from ..validation import layer_types


__all__ = ["GATED_DELTANET_MODEL_TYPES", "LINEAR_ATTENTION", "LinearAttentionStates", "new_cache", "select_rows"]

LINEAR_ATTENTION = "linear_attention"
# Model types whose linear-attention layers are transformers' Gated DeltaNet (`linear_attn`, states in
# `cache.layers[i].conv_states[0]` / `.recurrent_states[0]`, a single-token path that updates them in place).
GATED_DELTANET_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")


class LinearAttentionStates:
    """While entered, a cached forward of several tokens runs ``model``'s linear-attention layers token by token and
    records their states after each token; `keep` then gives every row the states after its last accepted token.
    A model without linear-attention layers is left as it is."""

    def __init__(self, model: nn.Module):
        kinds = layer_types(model.config.get_text_config())
        layers = decoder_layers(model)
        self.mixers = [layers[index].linear_attn for index, kind in enumerate(kinds) if kind == LINEAR_ATTENTION]
        self.snapshots: list[tuple[LinearAttentionCacheLayerMixin, torch.Tensor, torch.Tensor]] = []
        self._own_forwards: list[tuple[nn.Module, object]] = []

    def __enter__(self) -> "LinearAttentionStates":
        for mixer in self.mixers:
            self._own_forwards.append((mixer, mixer.__dict__.get("forward")))  # e.g. accelerate's hook
            mixer.forward = partial(self._token_by_token, mixer, mixer.forward)
        return self

    def __exit__(self, *exc_info) -> None:
        for mixer, forward in self._own_forwards:
            if forward is None:
                del mixer.forward
            else:
                mixer.forward = forward
        self._own_forwards.clear()
        self.snapshots.clear()

    def _token_by_token(self, mixer, forward, hidden_states, attention_mask=None, **kwargs):
        """``mixer``'s forward; with a cache that already has its states, one call per token, states recorded.
        ``attention_mask``: the 2-D padding mask of the new tokens, sliced per token (HF zeroes padded inputs).
        The decoder layer passes the cache as ``cache`` (transformers >= 5.24) or ``cache_params`` (before; that name
        is deprecated until 5.40); it goes on to ``forward`` under the name it came with."""
        cache = kwargs.get("cache", kwargs.get("cache_params"))
        length = hidden_states.shape[1]
        if cache is None or length == 1 or not cache.has_previous_state(mixer.layer_idx):
            return forward(hidden_states, attention_mask=attention_mask, **kwargs)
        layer = cache.layers[mixer.layer_idx]
        conv = layer.conv_states[0].new_empty((length, *layer.conv_states[0].shape))
        recurrent = layer.recurrent_states[0].new_empty((length, *layer.recurrent_states[0].shape))
        outputs = []
        for token in range(length):
            mask = None if attention_mask is None else attention_mask[:, token : token + 1]
            outputs.append(forward(hidden_states[:, token : token + 1], attention_mask=mask, **kwargs))
            conv[token].copy_(layer.conv_states[0])
            recurrent[token].copy_(layer.recurrent_states[0])
        self.snapshots.append((layer, conv, recurrent))
        return torch.cat(outputs, dim=1)

    def keep(self, num_accepted: torch.Tensor) -> None:
        """Set row ``b``'s states to those after token ``num_accepted[b]`` of the last cached forward (0: its
        first); the states of a single-token forward are already those."""
        if not self.snapshots:  # no linear-attention layer, or a single-token forward: nothing to roll back
            return
        rows = torch.arange(num_accepted.shape[0], device=num_accepted.device)
        for layer, conv, recurrent in self.snapshots:
            layer.conv_states[0].copy_(conv[num_accepted, rows])
            layer.recurrent_states[0].copy_(recurrent[num_accepted, rows])
        self.snapshots.clear()


def new_cache(text_config) -> DynamicCache:
    """An empty target cache: HF's state layer for each linear-attention layer, else one that keeps every slot
    (a plain `DynamicCache`, sliding-window layers included: holes must not count towards a window)."""
    if LINEAR_ATTENTION in layer_types(text_config):
        return DynamicCache(config=text_config)  # the Gated DeltaNet families' other layers are full attention
    return DynamicCache()


def select_rows(cache: DynamicCache, rows: torch.Tensor) -> None:
    """Keep the batch rows ``rows`` of every layer: `batch_select_indices`, which HF's linear-attention layers lack
    (their `reorder_cache` selects rows)."""
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            layer.reorder_cache(rows)
        else:
            layer.batch_select_indices(rows)
