"""The per-block kernel choice (`attention/kernels.py`): the selection rules, and the fused-kernel glue (grouped
layout, causal blocks, log-sum-exp) through PyTorch's CPU flash kernel, which has the CUDA kernel's contract."""

import logging

import pytest
import torch

from hf_spec_cotrain.attention import branch_attention, branch_attention_reference, kernels
from hf_spec_cotrain.attention.blockwise import trunk_forward
from hf_spec_cotrain.attention.masks import BlockSpan, Visibility, document_ids
from hf_spec_cotrain.attention.merge import merge_attention_partials
from hf_spec_cotrain.parallel.zigzag import zigzag_indices


H200 = (9, 0)


@pytest.mark.parametrize(
    "device_type, dtype, mask_kind, head_dim, capability, flash_attn, expected",
    [
        ("cpu", torch.bfloat16, kernels.FULL, 64, None, False, (kernels.BLOCKWISE, None)),
        ("cpu", torch.bfloat16, kernels.EXPLICIT, 64, None, False, (kernels.BLOCKWISE, None)),
        ("cuda", torch.bfloat16, kernels.FULL, 64, H200, False, (kernels.SDPA_FLASH, None)),
        ("cuda", torch.float16, kernels.CAUSAL, 128, H200, False, (kernels.SDPA_FLASH, None)),
        ("cuda", torch.bfloat16, kernels.CAUSAL, 64, H200, True, (kernels.FLASH_ATTN, None)),
        ("cuda", torch.bfloat16, kernels.FULL, 64, (7, 5), False, (kernels.SDPA_EFFICIENT, None)),
        ("cuda", torch.bfloat16, kernels.FULL, 512, H200, True, (kernels.SDPA_EFFICIENT, None)),
        ("cuda", torch.float32, kernels.FULL, 64, H200, True, (kernels.SDPA_EFFICIENT, None)),
        (
            "cuda",
            torch.float64,
            kernels.FULL,
            64,
            H200,
            True,
            (kernels.BLOCKWISE, "no fused kernel takes torch.float64"),
        ),
        (
            "cuda",
            torch.bfloat16,
            kernels.FULL,
            12,
            H200,
            True,
            (kernels.BLOCKWISE, "head_dim=12 is not a multiple of 8"),
        ),
    ],
)
def test_backend_selection(device_type, dtype, mask_kind, head_dim, capability, flash_attn, expected):
    chosen = kernels.select_block_backend(
        device_type=device_type,
        dtype=dtype,
        mask_kind=mask_kind,
        head_dim=head_dim,
        cuda_capability=capability,
        flash_attn_available=flash_attn,
    )
    assert chosen == expected


def test_explicit_masks_stay_blockwise_and_say_why_on_cuda_only():
    common = dict(dtype=torch.bfloat16, mask_kind=kernels.EXPLICIT, head_dim=64, cuda_capability=H200)
    backend, reason = kernels.select_block_backend(device_type="cuda", forced=kernels.SDPA_FLASH, **common)
    assert backend == kernels.BLOCKWISE and "explicit mask" in reason
    assert kernels.select_block_backend(
        device_type="cuda", forced=kernels.SDPA_FLASH, **{**common, "mask_kind": "full"}
    ) == (
        kernels.SDPA_FLASH,
        None,
    )
    with pytest.raises(ValueError, match="mask_kind must be one of"):
        kernels.select_block_backend(device_type="cuda", **{**common, "mask_kind": "causal-ish"})
    with pytest.raises(ValueError, match="forced backend must be one of"):
        kernels.select_block_backend(device_type="cuda", forced="triton", **common)


def test_a_fallback_is_logged_once_per_reason(monkeypatch, caplog):
    monkeypatch.setattr(kernels, "_logged_fallbacks", set())
    monkeypatch.setattr(kernels, "select_block_backend", lambda **kw: (kernels.BLOCKWISE, f"reason {kw['head_dim']}"))
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        for head_dim in (4, 4, 8, 4):
            assert kernels.backend_for(torch.zeros(1, 1, 1, 2, head_dim), kernels.FULL) == kernels.BLOCKWISE
    assert [record.getMessage().rsplit(": ", 1)[-1] for record in caplog.records] == ["reason 4.", "reason 8."]


def span(start, end, pos_min, pos_max, doc_min=0, doc_max=0):
    return BlockSpan(start=start, end=end, pos_min=pos_min, pos_max=pos_max, doc_min=doc_min, doc_max=doc_max)


def test_block_mask_kinds():
    diagonal = span(0, 4, 8, 11)
    assert kernels.block_mask_kind(diagonal, span(4, 8, 0, 3), Visibility.FULL) == kernels.FULL
    assert kernels.block_mask_kind(diagonal, diagonal, Visibility.PARTIAL) == kernels.CAUSAL
    # Two documents in the block, positions with a gap (zigzag chunks), or keys shifted: an explicit mask.
    assert kernels.block_mask_kind(span(0, 4, 0, 3, 0, 1), span(0, 4, 0, 3, 0, 1), Visibility.PARTIAL) == "explicit"
    assert kernels.block_mask_kind(span(0, 4, 0, 5), span(0, 4, 0, 5), Visibility.PARTIAL) == kernels.EXPLICIT
    assert kernels.block_mask_kind(span(0, 4, 4, 7), span(0, 4, 2, 5), Visibility.PARTIAL) == kernels.EXPLICIT
    # A sliding window that cuts into a diagonal block (distances up to 3 here) needs the band as an explicit mask.
    assert kernels.block_mask_kind(diagonal, diagonal, Visibility.PARTIAL, window=4) == kernels.CAUSAL
    assert kernels.block_mask_kind(diagonal, diagonal, Visibility.PARTIAL, window=3) == kernels.EXPLICIT


def _inputs(dtype, *, seed=3, length=70, q_heads=4, kv_heads=2, head_dim=16, branches=2):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype).requires_grad_()

    kv = (1, kv_heads, length, head_dim)
    return {
        "q": randn(1, q_heads, length, head_dim),
        "k": randn(*kv),
        "v": randn(*kv),
        "branch_k": randn(branches, *kv),
        "branch_v": randn(branches, *kv),
    }


def _output_and_grads(fn, inputs, **kwargs):
    leaves = {name: tensor.detach().clone().requires_grad_() for name, tensor in inputs.items()}
    out = fn(**leaves, **kwargs)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    out.backward(upstream.to(out.dtype))
    return [out.detach(), *(leaves[name].grad for name in ("q", "k", "v", "branch_k", "branch_v"))]


@pytest.mark.parametrize("window", [None, 5, 8])
@pytest.mark.parametrize("dtype, tolerance", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
def test_forced_fused_kernel_matches_the_dense_reference(monkeypatch, dtype, tolerance, window):
    """Packed documents and GQA with the fused path forced: full blocks (G folded into the queries), causal diagonal
    blocks (K/V repeated per query head) and explicit-mask blocks (blockwise) all run, and the result is the
    reference's; with a sliding window too, shorter than a block (5) or as long (8)."""
    calls = []
    fused = kernels.fused_block_forward
    monkeypatch.setattr(kernels, "fused_block_forward", lambda *a, **kw: calls.append(kw["causal"]) or fused(*a, **kw))
    inputs = _inputs(dtype)
    cu_seqlens = torch.tensor([0, 40, 41, 70])
    with kernels.forced_block_backend(kernels.SDPA_FLASH):
        actual = _output_and_grads(
            branch_attention, inputs, cu_seqlens=cu_seqlens, block_size=8, sliding_window=window
        )
    assert set(calls) == {True, False}  # full (False) and causal diagonal (True) blocks both took the fused kernel
    exact = {name: tensor.detach().double() for name, tensor in inputs.items()}
    expected = _output_and_grads(branch_attention_reference, exact, cu_seqlens=cu_seqlens, sliding_window=window)
    for name, got, want in zip(("out", "dq", "dk", "dv", "dbranch_k", "dbranch_v"), actual, expected):
        assert got.dtype == dtype, name
        relative_error = (got.double() - want).norm() / want.norm()
        assert relative_error < tolerance, f"{name}: relative error {relative_error:.3g}"


def test_forced_fused_kernel_on_zigzag_shards_matches_the_full_trunk(monkeypatch):
    """The ring's steps (query and key shards with global positions, merged over key shards) on the fused kernel."""
    generator = torch.Generator().manual_seed(17)
    length, world_size = 32, 2
    q = torch.randn(1, 2, 2, length, 8, generator=generator)
    k, v = (torch.randn(1, 2, length, 8, generator=generator) for _ in range(2))
    doc_ids = document_ids(torch.tensor([0, 24, 32]))
    calls = []
    fused = kernels.fused_block_forward
    monkeypatch.setattr(kernels, "fused_block_forward", lambda *a, **kw: calls.append(kw["causal"]) or fused(*a, **kw))

    def trunk(rows, cols):
        query = {"query_positions": rows, "query_doc_ids": doc_ids[rows]}
        key = {"key_positions": cols, "key_doc_ids": doc_ids[cols]}
        return trunk_forward(q[:, :, :, rows], k[:, :, cols], v[:, :, cols], **query, **key, scale=0.5, block_size=4)

    everything = torch.arange(length)
    full_out, full_lse = trunk(everything, everything)
    cu_seqlens = torch.tensor([0, 24, 32])
    shards = [zigzag_indices(rank, world_size, cu_seqlens=cu_seqlens) for rank in range(world_size)]
    with kernels.forced_block_backend(kernels.SDPA_FLASH):
        for rows in shards:
            out = lse = None
            for cols in shards:
                part = trunk(rows, cols)
                out, lse = part if out is None else merge_attention_partials(out, lse, *part)
            torch.testing.assert_close(out, full_out[:, :, :, rows], rtol=0, atol=1e-5)
            torch.testing.assert_close(lse, full_lse[:, :, :, rows], rtol=0, atol=1e-5)
    assert True in calls and False in calls
