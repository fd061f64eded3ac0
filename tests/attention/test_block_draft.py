"""Block-draft attention (DFlash's anchor blocks) on the branch kernel against its dense reference, and the reference
against a plain per-anchor loop."""

import pytest
import torch

from hf_spec_cotrain.attention import block_draft_attention, block_draft_attention_reference


INPUT_NAMES = ("q", "context_k", "context_v", "block_k", "block_v")


def random_anchors(
    lengths: list[int], anchors_per_row: list[int], num_anchors: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, ``anchors_per_row[b]`` distinct positions that are not a document's first, shuffled, padded to
    ``num_anchors`` with masked garbage (0, a document start, which a kept anchor may not be)."""
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()[:-1]])
    total = sum(lengths)
    allowed = torch.ones(total, dtype=torch.bool)
    allowed[starts[starts < total]] = False
    candidates = allowed.nonzero().squeeze(1)
    anchors = torch.zeros(len(anchors_per_row), num_anchors, dtype=torch.int64)
    mask = torch.zeros(len(anchors_per_row), num_anchors, dtype=torch.bool)
    for row, count in enumerate(anchors_per_row):
        chosen = candidates[torch.randperm(candidates.numel(), generator=generator)[:count]]
        slots = torch.randperm(num_anchors, generator=generator)[:count]
        anchors[row, slots] = chosen
        mask[row, slots] = True
    return anchors, mask


def make_case(*, batch, num_q_heads, num_kv_heads, length, head_dim, num_anchors, block_len, dtype, seed):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)

    return {
        "q": randn(batch, num_q_heads, num_anchors, block_len, head_dim),
        "context_k": randn(batch, num_kv_heads, length, head_dim),
        "context_v": randn(batch, num_kv_heads, length, head_dim),
        "block_k": randn(batch, num_kv_heads, num_anchors, block_len, head_dim),
        "block_v": randn(batch, num_kv_heads, num_anchors, block_len, head_dim),
    }, generator


def outputs_and_grads(fn, inputs, **kwargs) -> list[torch.Tensor]:
    leaves = {name: tensor.detach().clone().requires_grad_() for name, tensor in inputs.items()}
    out = fn(**leaves, **kwargs)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(99), dtype=torch.float64)
    out.backward(upstream.to(out.dtype))
    return [out.detach(), *(leaves[name].grad for name in INPUT_NAMES)]


# (B, Hq, Hkv, L, D, N, S, document lengths (B = 1) or None, anchors per row)
CASES = [
    (1, 2, 1, 2, 4, 1, 1, None, [1]),
    (2, 4, 2, 13, 8, 3, 5, None, [3, 1]),
    (3, 6, 2, 9, 4, 4, 3, None, [0, 4, 2]),
    (2, 3, 3, 33, 16, 5, 7, None, [5, 5]),
    (1, 8, 2, 41, 8, 6, 4, [2, 17, 1, 3, 18], [6]),
    (1, 4, 1, 300, 8, 9, 8, [100, 1, 150, 49], [7]),
    (2, 2, 1, 270, 4, 4, 2, None, [4, 3]),
]
CASE_IDS = [f"B{c[0]}-Hq{c[1]}-Hkv{c[2]}-L{c[3]}-D{c[4]}-N{c[5]}-S{c[6]}-docs{c[7]}" for c in CASES]


def build(case, dtype, seed):
    batch, num_q_heads, num_kv_heads, length, head_dim, num_anchors, block_len, docs, per_row = case
    inputs, generator = make_case(
        batch=batch,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        length=length,
        head_dim=head_dim,
        num_anchors=num_anchors,
        block_len=block_len,
        dtype=dtype,
        seed=seed,
    )
    lengths = docs or [length]
    anchors, mask = random_anchors(lengths, per_row, num_anchors, generator)
    cu_seqlens = None if docs is None else torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()], dtype=torch.int32)
    return inputs, dict(anchors=anchors, anchor_mask=mask, cu_seqlens=cu_seqlens)


def per_anchor_loop(q, context_k, context_v, block_k, block_v, anchors, anchor_mask, cu_seqlens=None):
    """The definition, one anchor at a time: softmax over [context of the anchor's document before it; its block]."""
    group = q.shape[1] // context_k.shape[1]
    out = torch.zeros_like(q)
    starts = [0] if cu_seqlens is None else cu_seqlens.tolist()
    for row in range(q.shape[0]):
        for slot in range(q.shape[2]):
            if not anchor_mask[row, slot]:
                continue
            anchor = int(anchors[row, slot])
            start = max(s for s in starts if s <= anchor)
            keys = torch.cat([context_k[row, :, start:anchor], block_k[row, :, slot]], dim=1)
            values = torch.cat([context_v[row, :, start:anchor], block_v[row, :, slot]], dim=1)
            keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
            scores = q[row, :, slot] @ keys.transpose(-1, -2) * q.shape[-1] ** -0.5
            out[row, :, slot] = torch.softmax(scores, -1) @ values
    return out


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_reference_is_the_per_anchor_definition(case):
    inputs, kwargs = build(case, torch.float64, seed=3)
    expected = per_anchor_loop(**inputs, **kwargs)
    torch.testing.assert_close(block_draft_attention_reference(**inputs, **kwargs), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_float64_forward_and_backward_match_the_reference(case):
    inputs, kwargs = build(case, torch.float64, seed=5)
    got = outputs_and_grads(block_draft_attention, inputs, **kwargs)
    expected = outputs_and_grads(block_draft_attention_reference, inputs, **kwargs)
    for name, a, b in zip(("out", *INPUT_NAMES), got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_float32_forward_and_backward_match_the_float64_reference(case):
    inputs, kwargs = build(case, torch.float32, seed=7)
    got = outputs_and_grads(block_draft_attention, inputs, **kwargs)
    expected = outputs_and_grads(block_draft_attention_reference, {n: t.double() for n, t in inputs.items()}, **kwargs)
    for name, a, b in zip(("out", *INPUT_NAMES), got, expected, strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_masked_anchors_give_zeros_and_no_gradient():
    inputs, kwargs = build(CASES[1], torch.float64, seed=11)
    kwargs["anchor_mask"] = torch.zeros_like(kwargs["anchor_mask"])
    out, *grads = outputs_and_grads(block_draft_attention, inputs, **kwargs)
    assert not out.any()
    assert all(grad is None or not grad.any() for grad in grads)


def test_anchors_right_after_a_document_start_see_one_context_key():
    """A block one token into a document sees that token's key and nothing of the previous document."""
    inputs, _ = make_case(
        batch=1,
        num_q_heads=2,
        num_kv_heads=1,
        length=8,
        head_dim=4,
        num_anchors=2,
        block_len=3,
        dtype=torch.float64,
        seed=13,
    )
    cu_seqlens = torch.tensor([0, 4, 8])
    anchors = torch.tensor([[5, 1]])
    got = block_draft_attention(**inputs, anchors=anchors, cu_seqlens=cu_seqlens)
    expected = per_anchor_loop(
        **inputs, anchors=anchors, anchor_mask=torch.ones(1, 2, dtype=torch.bool), cu_seqlens=cu_seqlens
    )
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    # Changing the other document's context changes nothing.
    inputs["context_k"][:, :, :4] += 1.0
    inputs["context_v"][:, :, :4] -= 1.0
    torch.testing.assert_close(
        block_draft_attention(**inputs, anchors=torch.tensor([[5, 7]]), cu_seqlens=cu_seqlens)[:, :, 0],
        got[:, :, 0],
        rtol=0,
        atol=1e-12,
    )


@pytest.mark.parametrize(
    ("anchors", "cu_seqlens", "message"),
    [
        ([[0, 3]], None, r"first position of a document"),
        ([[2, 4]], [0, 4, 9], r"Anchors \[4\] sit at the first position"),
        ([[9, 3]], None, r"in \[1, L=9\)"),
        ([[3, 3]], None, r"distinct"),
    ],
)
def test_refuses_anchors_without_context_or_out_of_range(anchors, cu_seqlens, message):
    inputs, _ = make_case(
        batch=1,
        num_q_heads=2,
        num_kv_heads=1,
        length=9,
        head_dim=4,
        num_anchors=2,
        block_len=2,
        dtype=torch.float64,
        seed=17,
    )
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens)
    for fn in (block_draft_attention, block_draft_attention_reference):
        with pytest.raises(ValueError, match=message):
            fn(**inputs, anchors=torch.tensor(anchors), cu_seqlens=cu)


def test_refuses_mismatched_shapes_and_dtypes():
    inputs, _ = make_case(
        batch=2,
        num_q_heads=3,
        num_kv_heads=2,
        length=5,
        head_dim=4,
        num_anchors=1,
        block_len=2,
        dtype=torch.float64,
        seed=19,
    )
    anchors = torch.tensor([[1], [2]])
    with pytest.raises(ValueError, match="multiple of the number of key/value heads"):
        block_draft_attention(**inputs, anchors=anchors)
    inputs["q"] = inputs["q"][:, :2]
    with pytest.raises(ValueError, match="block_k must be"):
        block_draft_attention(**{**inputs, "block_k": inputs["block_k"][:, :, :, :1]}, anchors=anchors)
    with pytest.raises(ValueError, match="context_v must have q's dtype"):
        block_draft_attention(**{**inputs, "context_v": inputs["context_v"].float()}, anchors=anchors)
    with pytest.raises(ValueError, match="anchors must be an int64"):
        block_draft_attention(**inputs, anchors=anchors.int())
