"""The generator's grouped decoding attention against a dense float64 reference, with and without gpt-oss's sinks,
Gemma2's logit soft-cap and a value head dim other than the query's (multi-head latent attention), and the
model-level swap that routes transformers' attention through it."""

import pytest
import torch
from attention_variant_targets import ATTENTION_VARIANT_FAMILIES, GEMMA2_SLIDING_WINDOW, build_attention_variant_target
from transformers import AttentionInterface

from hf_spec_cotrain.attention.decoding import (
    GROUPED_ATTENTION,
    GROUPED_SDPA_ATTENTION,
    causal_slot_mask,
    decoding_attention,
    grouped_attention,
)
from hf_spec_cotrain.generation.decoder import layer_windows, target_attention_mask
from hf_spec_cotrain.testing import build_tiny_target


def dense_attention_reference(query, key, value, mask, *, scale, sinks=None, softcap=None):
    """Every query head against its own copy of its key/value head; a soft-cap squashes the scores before the mask;
    a sink is one more softmax column, dropped."""
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    scores = query @ key.transpose(-1, -2) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], dim=-1)
    probs = scores.softmax(-1)[..., : key.shape[2]]
    return probs @ value


def _random_case(
    *, batch, query_heads, kv_heads, query_length, key_length, head_dim, seed, dtype, value_head_dim=None
):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    query = randn(batch, query_heads, query_length, head_dim)
    key = randn(batch, kv_heads, key_length, head_dim)
    value = randn(batch, kv_heads, key_length, head_dim if value_head_dim is None else value_head_dim)
    slot_mask = torch.rand(batch, key_length, generator=generator) < 0.7  # holes and padding
    mask = causal_slot_mask(slot_mask, query_length, window=key_length // 2)
    sinks = 2 * randn(query_heads)
    return [t.to(dtype) for t in (query, key, value, sinks)], mask


SHAPES = [
    # batch, query heads, key/value heads, query length, key length, head dim
    (3, 6, 2, 5, 13, 32),
    (1, 3, 3, 1, 7, 40),
    (2, 4, 1, 1, 11, 32),
    (5, 10, 5, 3, 9, 33),
]
# Small enough to change the scores (of about unit size) markedly: tanh(1 / 1.5) is 12 % below 1 / 1.5.
SOFTCAP = 1.5


@pytest.mark.parametrize("softcap", [None, SOFTCAP], ids=["no-softcap", "softcap"])
@pytest.mark.parametrize("value_head_dim_delta", [0, -7, 9], ids=["same-value-dim", "narrow-values", "wide-values"])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype, atol", [(torch.float64, 1e-10), (torch.float32, 1e-5)], ids=["float64", "float32"])
def test_grouped_attention_equals_dense_reference(shape, with_sinks, value_head_dim_delta, softcap, dtype, atol):
    batch, query_heads, kv_heads, query_length, key_length, head_dim = shape
    (query, key, value, sinks), mask = _random_case(
        batch=batch,
        query_heads=query_heads,
        kv_heads=kv_heads,
        query_length=query_length,
        key_length=key_length,
        head_dim=head_dim,
        value_head_dim=head_dim + value_head_dim_delta,
        seed=sum(shape),
        dtype=dtype,
    )
    sinks = sinks if with_sinks else None
    scale = head_dim**-0.5
    out = grouped_attention(query, key, value, mask, scale=scale, sinks=sinks, softcap=softcap)
    want = dense_attention_reference(
        *(t.double() for t in (query, key, value)),
        mask,
        scale=scale,
        sinks=None if sinks is None else sinks.double(),
        softcap=softcap,
    )
    assert out.dtype == dtype and out.shape == (batch, query_heads, query_length, value.shape[-1])
    torch.testing.assert_close(out.double(), want, rtol=0, atol=atol)


def test_sinks_take_probability_away_from_the_keys():
    (query, key, value, sinks), mask = _random_case(
        batch=2, query_heads=4, kv_heads=2, query_length=3, key_length=8, head_dim=32, seed=0, dtype=torch.float64
    )
    plain = grouped_attention(query, key, value, mask)
    drowned = grouped_attention(query, key, value, mask, sinks=torch.full_like(sinks, 1e4))
    assert plain.abs().min() > 0 and drowned.abs().max() == 0


def test_refuses_a_mask_it_cannot_take():
    attend = AttentionInterface()[GROUPED_ATTENTION]
    query, key = torch.randn(1, 2, 3, 32), torch.randn(1, 2, 3, 32)
    mask = causal_slot_mask(torch.ones(1, 3, dtype=torch.bool), 3)
    with pytest.raises(ValueError, match="bool mask"):
        attend(None, query, key, key, mask.float())


@pytest.mark.parametrize("query_length", [1, 4])
def test_transformers_signature_passes_the_softcap_and_the_value_head_dim_through(query_length):
    """transformers' attention functions take a soft-cap (Gemma2) and values narrower than the queries (MLA), and
    return ``[B, Lq, Hq, Dv]``; the generator's mask covers every cached slot, of which the keys are the last."""
    (query, key, value, _), mask = _random_case(
        batch=2,
        query_heads=4,
        kv_heads=2,
        query_length=query_length,
        key_length=9,
        head_dim=48,
        value_head_dim=32,
        seed=3,
        dtype=torch.float64,
    )
    wide_mask = torch.cat([torch.zeros(*mask.shape[:-1], 2, dtype=torch.bool), mask], dim=-1)
    out, weights = AttentionInterface()[GROUPED_ATTENTION](
        None, query, key, value, wide_mask, scaling=0.3, softcap=SOFTCAP
    )
    want = dense_attention_reference(query, key, value, mask, scale=0.3, softcap=SOFTCAP)
    assert weights is None
    torch.testing.assert_close(out, want.transpose(1, 2), rtol=0, atol=1e-10)


def test_gpt_oss_attends_through_it_with_its_sinks():
    """A tiny gpt-oss (eager attention with sinks, alternating sliding and full layers) gives the same logits
    through the grouped kernel, fed the generator's bool masks, as through its own attention."""
    model = build_tiny_target("gpt_oss", num_layers=2, hidden_size=64, num_attention_heads=4, sliding_window=4)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0, generator=torch.Generator().manual_seed(0))
    input_ids = torch.randint(4, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    slot_mask = torch.ones_like(input_ids, dtype=torch.bool)
    masks = {
        "full_attention": causal_slot_mask(slot_mask, 9),
        "sliding_attention": causal_slot_mask(slot_mask, 9, window=4),
    }
    with torch.no_grad():
        want = model(input_ids).logits
        with decoding_attention(model):
            assert model.config._attn_implementation == GROUPED_ATTENTION
            out = model(input_ids, attention_mask=masks).logits
    assert model.config._attn_implementation == "eager"
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ATTENTION_VARIANT_FAMILIES)
def test_attention_variants_attend_through_it(family):
    """Gemma2 (logit soft-cap, alternating sliding windows) and DeepSeek-V3 (multi-head latent attention: values
    narrower than queries and keys) give the same logits through the grouped kernel, fed the generator's bool masks,
    as through their own attention."""
    model = build_attention_variant_target(family)
    length = GEMMA2_SLIDING_WINDOW + 5
    input_ids = torch.randint(4, model.config.vocab_size, (3, length), generator=torch.Generator().manual_seed(1))
    masks = target_attention_mask(torch.ones_like(input_ids, dtype=torch.bool), length, layer_windows(model.config))
    original = model.config._attn_implementation  # Gemma2's eager, DeepSeek-V3's SDPA
    with torch.no_grad():
        want = model(input_ids).logits
        with decoding_attention(model):
            replacement = {"eager": GROUPED_ATTENTION, "sdpa": GROUPED_SDPA_ATTENTION}[original]
            assert model.config._attn_implementation == replacement
            out = model(input_ids, attention_mask=masks).logits
    assert model.config._attn_implementation == original
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_a_soft_capped_model_on_sdpa_is_refused():
    """transformers' SDPA attention drops Gemma2's soft-cap, so the model's own forwards run without it: decoding it
    with the cap would sample another model than the one trained, and decoding it without would drop the cap
    silently. (transformers 5.25 refuses SDPA for Gemma2 itself: nothing to guard there.)"""
    model = build_attention_variant_target("gemma2")
    try:
        model.set_attn_implementation("sdpa")
    except ValueError as error:
        pytest.skip(f"this transformers does not run Gemma2 on SDPA: {error}")
    input_ids = torch.randint(4, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    masks = target_attention_mask(torch.ones_like(input_ids, dtype=torch.bool), 5, layer_windows(model.config))
    with torch.no_grad(), decoding_attention(model), pytest.raises(ValueError, match=r"softcap=2\.0.*'eager'"):
        model(input_ids, attention_mask=masks)
