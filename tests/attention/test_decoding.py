"""The generator's grouped decoding attention against a dense float64 reference, with and without gpt-oss's sinks,
and the model-level swap that routes transformers' attention through it."""

import pytest
import torch
from transformers import AttentionInterface

from hf_spec_cotrain.attention.decoding import (
    GROUPED_ATTENTION,
    causal_slot_mask,
    decoding_attention,
    grouped_attention,
)
from hf_spec_cotrain.testing import build_tiny_target


def dense_attention_reference(query, key, value, mask, *, scale, sinks=None):
    """Every query head against its own copy of its key/value head; a sink is one more softmax column, dropped."""
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    scores = (query @ key.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], dim=-1)
    probs = scores.softmax(-1)[..., : key.shape[2]]
    return probs @ value


def _random_case(*, batch, query_heads, kv_heads, query_length, key_length, head_dim, seed, dtype):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    query = randn(batch, query_heads, query_length, head_dim)
    key, value = randn(batch, kv_heads, key_length, head_dim), randn(batch, kv_heads, key_length, head_dim)
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


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype, atol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_grouped_attention_equals_dense_reference(shape, with_sinks, dtype, atol):
    batch, query_heads, kv_heads, query_length, key_length, head_dim = shape
    (query, key, value, sinks), mask = _random_case(
        batch=batch,
        query_heads=query_heads,
        kv_heads=kv_heads,
        query_length=query_length,
        key_length=key_length,
        head_dim=head_dim,
        seed=sum(shape),
        dtype=dtype,
    )
    sinks = sinks if with_sinks else None
    scale = head_dim**-0.5
    out = grouped_attention(query, key, value, mask, scale=scale, sinks=sinks)
    want = dense_attention_reference(
        *(t.double() for t in (query, key, value)), mask, scale=scale, sinks=None if sinks is None else sinks.double()
    )
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), want, rtol=0, atol=atol)


def test_sinks_take_probability_away_from_the_keys():
    (query, key, value, sinks), mask = _random_case(
        batch=2, query_heads=4, kv_heads=2, query_length=3, key_length=8, head_dim=32, seed=0, dtype=torch.float64
    )
    plain = grouped_attention(query, key, value, mask)
    drowned = grouped_attention(query, key, value, mask, sinks=torch.full_like(sinks, 1e4))
    assert plain.abs().min() > 0 and drowned.abs().max() == 0


def test_refuses_what_it_would_otherwise_ignore():
    attend = AttentionInterface()[GROUPED_ATTENTION]
    query, key = torch.randn(1, 2, 3, 32), torch.randn(1, 2, 3, 32)
    mask = causal_slot_mask(torch.ones(1, 3, dtype=torch.bool), 3)
    with pytest.raises(ValueError, match="bool mask"):
        attend(None, query, key, key, mask.float())
    with pytest.raises(ValueError, match="soft-cap .*softcap=50.0"):
        attend(None, query, key, key, mask, softcap=50.0)


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
