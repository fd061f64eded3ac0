"""Sliding windows and attention sinks in the blockwise kernel: against the dense reference, and the reference against
transformers' own sliding-window mask and gpt-oss's eager attention (the semantics, off-by-one included)."""

import pytest
import torch
from test_attention import cu_seqlens_from_lengths, make_inputs
from transformers.masking_utils import (
    and_masks,
    packed_sequence_mask_function,
    sdpa_mask,
    sliding_window_causal_mask_function,
)
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from hf_spec_cotrain.attention import branch_attention, branch_attention_reference
from hf_spec_cotrain.attention.masks import Visibility, block_mask, block_spans, block_visibility, document_ids


def outputs_and_grads(fn, inputs: dict, sinks: torch.Tensor | None, **kwargs) -> dict[str, torch.Tensor | None]:
    """The output and the gradient of every input (`d<name>`), the sinks' included, for a fixed random upstream
    gradient."""
    leaves = {name: tensor.detach().clone().requires_grad_() for name, tensor in inputs.items()}
    sink_leaf = None if sinks is None else sinks.detach().clone().requires_grad_()
    out = fn(**leaves, sinks=sink_leaf, **kwargs)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1234), dtype=torch.float64)
    out.backward(upstream.to(out.dtype))
    grads = {f"d{name}": leaf.grad for name, leaf in leaves.items()}
    return {"out": out.detach(), **grads, "dsinks": None if sink_leaf is None else sink_leaf.grad}


# (B, Hq, Hkv, L, D, S, document lengths or None, block size, window, sinks)
CASES = [
    (1, 4, 2, 37, 8, 0, None, 8, 3, True),  # window < block
    (1, 4, 2, 37, 8, 0, None, 8, 8, True),  # window = block
    (2, 2, 1, 37, 8, 2, None, 8, 13, False),  # window > block, several blocks back
    (1, 2, 2, 23, 4, 1, None, 4, 1, True),  # a query sees itself only
    (1, 6, 3, 50, 8, 0, [7, 7, 1, 35], 6, 5, True),  # packed documents, some shorter than the window
    (1, 4, 1, 130, 8, 3, [1, 40, 1, 1, 57, 30], 16, 24, True),
    (1, 4, 4, 33, 16, 0, [5, 0, 28], 7, 100, True),  # window beyond every document: full causal plus sinks
    (3, 8, 2, 33, 8, 2, None, 256, None, True),  # sinks alone
    (1, 2, 1, 19, 4, 0, [19], 3, 6, False),  # window alone
]
CASE_IDS = [f"B{c[0]}-Hq{c[1]}-Hkv{c[2]}-L{c[3]}-S{c[5]}-docs{c[6]}-bs{c[7]}-w{c[8]}-sinks{c[9]}" for c in CASES]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_matches_dense_reference(case, dtype):
    batch_size, num_q_heads, num_kv_heads, length, head_dim, num_branch, doc_lengths, block_size, window, sinks = case
    inputs = make_inputs(
        batch_size=batch_size,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        length=length,
        head_dim=head_dim,
        num_branch=num_branch,
        dtype=dtype,
        seed=length * 17 + (window or 0),
    )
    # Sinks around the scores' scale, so that they take a real share of the softmax.
    sink_logits = (
        torch.randn(num_q_heads, generator=torch.Generator().manual_seed(3), dtype=dtype) * 2 if sinks else None
    )
    options = dict(cu_seqlens=None if doc_lengths is None else cu_seqlens_from_lengths(doc_lengths))
    options.update(sliding_window=window)
    actual = outputs_and_grads(branch_attention, inputs, sink_logits, block_size=block_size, **options)
    expected = outputs_and_grads(branch_attention_reference, inputs, sink_logits, **options)
    tolerance = {"rtol": 0, "atol": 1e-10} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
    for name, want in expected.items():
        got = actual[name]
        if want is None:  # no branch, no sinks: not part of the graph in either
            assert got is None, name
            continue
        assert got.dtype == dtype, name
        torch.testing.assert_close(got, want, **tolerance, msg=lambda m, name=name: f"{name}: {m}")
    # Positive control: the window and the sinks each change the result.
    full = branch_attention_reference(**inputs, cu_seqlens=options["cu_seqlens"], sinks=sink_logits)
    assert window is None or window >= max(doc_lengths or [length]) or not torch.allclose(actual["out"], full)
    assert not sinks or not torch.allclose(actual["out"], branch_attention_reference(**inputs, **options))


def hf_gpt_oss_attention(q, k, v, sinks, *, doc_ids, window, scale):
    """gpt-oss's eager attention (sinks) under transformers' sliding-window mask on packed documents."""
    length = q.shape[2]
    mask_function = and_masks(
        sliding_window_causal_mask_function(window), packed_sequence_mask_function(doc_ids[None])
    )
    mask = sdpa_mask(
        batch_size=1, q_length=length, kv_length=length, mask_function=mask_function, allow_is_causal_skip=False
    )
    additive = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, float("-inf"))
    module = torch.nn.Module()
    module.sinks, module.num_key_value_groups = sinks, q.shape[1] // k.shape[1]
    out, _ = eager_attention_forward(module, q, k, v, additive, scaling=scale)
    return out.transpose(1, 2)  # [B, L, Hq, D] -> [B, Hq, L, D]


@pytest.mark.parametrize("window", [1, 4, 9])
def test_reference_is_transformers_sliding_window_with_gpt_oss_sinks(window):
    """Key j visible to query i iff `i - window < j <= i` in the same document, and one sink logit per head."""
    inputs = make_inputs(
        batch_size=1, num_q_heads=4, num_kv_heads=2, length=26, head_dim=8, num_branch=0, dtype=torch.float64, seed=4
    )
    del inputs["branch_k"], inputs["branch_v"]
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    cu_seqlens = cu_seqlens_from_lengths([11, 3, 12])
    expected = outputs_and_grads(
        hf_gpt_oss_attention, inputs, sinks, doc_ids=document_ids(cu_seqlens), window=window, scale=0.4
    )
    ours = dict(cu_seqlens=cu_seqlens, sliding_window=window, scale=0.4)
    for fn, kwargs in ((branch_attention_reference, ours), (branch_attention, {**ours, "block_size": 4})):
        actual = outputs_and_grads(fn, inputs, sinks, **kwargs)
        assert actual.keys() == expected.keys() == {"out", "dq", "dk", "dv", "dsinks"}
        for name, want in expected.items():
            torch.testing.assert_close(actual[name], want, rtol=0, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


def test_block_visibility_is_exact_for_skip_and_full_with_a_window():
    """Against the dense windowed mask, on strictly increasing but non-contiguous (zigzag-like) positions; the
    window must also skip blocks that causality alone would compute."""
    generator = torch.Generator().manual_seed(19)
    skipped_by_window = 0
    for _ in range(200):
        length = 40
        positions = torch.randperm(3 * length, generator=generator)[:length].sort().values
        doc_ids = torch.randint(0, 3, (length,), generator=generator).sort().values
        block_size = int(torch.randint(1, 12, (), generator=generator))
        window = int(torch.randint(1, 30, (), generator=generator))
        spans = block_spans(positions, doc_ids, block_size)
        for query in spans:
            for key in spans:
                rows, cols = slice(query.start, query.end), slice(key.start, key.end)
                dense = block_mask(positions[rows], doc_ids[rows], positions[cols], doc_ids[cols], window)
                visibility = block_visibility(query, key, window)
                if visibility is Visibility.SKIP:
                    assert not dense.any()
                    skipped_by_window += block_visibility(query, key) is not Visibility.SKIP
                elif visibility is Visibility.FULL:
                    assert dense.all()
    assert skipped_by_window > 100
