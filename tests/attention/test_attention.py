"""Blockwise branch attention against the dense reference, plus its helpers and input validation."""

import functools
import math

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from hf_spec_cotrain import parallel
from hf_spec_cotrain.attention import BLOCK_SIZE, branch_attention, branch_attention_reference
from hf_spec_cotrain.attention.blockwise import block_forward, trunk_backward, trunk_forward
from hf_spec_cotrain.attention.masks import (
    BlockSpan,
    Visibility,
    block_mask,
    block_spans,
    block_visibility,
    document_ids,
    positions_in_document,
)
from hf_spec_cotrain.attention.merge import merge_attention_partials


def make_inputs(
    *,
    batch_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    length: int,
    head_dim: int,
    num_branch: int,
    dtype: torch.dtype,
    seed: int,
) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype).requires_grad_()

    kv_shape = (batch_size, num_kv_heads, length, head_dim)
    return {
        "q": randn(batch_size, num_q_heads, length, head_dim),
        "k": randn(*kv_shape),
        "v": randn(*kv_shape),
        "branch_k": randn(num_branch, *kv_shape),
        "branch_v": randn(num_branch, *kv_shape),
    }


def cu_seqlens_from_lengths(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def outputs_and_grads(fn, inputs: dict[str, torch.Tensor], **kwargs) -> list[torch.Tensor]:
    """The output and the gradients of all inputs for a fixed random upstream gradient."""
    leaves = {name: tensor.detach().clone().requires_grad_() for name, tensor in inputs.items()}
    out = fn(**leaves, **kwargs)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1234), dtype=torch.float64)
    out.backward(upstream.to(out.dtype))
    return [out.detach(), *(leaves[name].grad for name in ("q", "k", "v", "branch_k", "branch_v"))]


# (B, Hq, Hkv, L, D, S, document lengths or None, block size)
CASES = [
    (1, 4, 4, 1, 8, 0, None, 4),
    (1, 2, 1, 1, 4, 2, [1], 1),
    (2, 4, 2, 7, 16, 1, None, 3),
    (3, 8, 2, 33, 8, 2, None, 8),
    (2, 2, 1, 7, 8, 3, None, BLOCK_SIZE),
    (1, 4, 1, 130, 8, 3, [1, 40, 1, 1, 57, 30], 16),
    (1, 2, 2, 33, 4, 3, [5, 1, 27], 7),
    (1, 6, 3, 64, 8, 2, [64], 64),
    (1, 4, 2, 9, 8, 1, [3, 0, 6], 2),
    (1, 8, 2, 50, 8, 0, [7, 7, 1, 35], 6),
    (1, 4, 4, 130, 16, 2, [2, 63, 1, 64], 32),
]
CASE_IDS = [f"B{c[0]}-Hq{c[1]}-Hkv{c[2]}-L{c[3]}-D{c[4]}-S{c[5]}-docs{c[6]}-bs{c[7]}" for c in CASES]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_matches_dense_reference(case, dtype):
    batch_size, num_q_heads, num_kv_heads, length, head_dim, num_branch, doc_lengths, block_size = case
    inputs = make_inputs(
        batch_size=batch_size,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        length=length,
        head_dim=head_dim,
        num_branch=num_branch,
        dtype=dtype,
        seed=length * 31 + num_branch,
    )
    cu_seqlens = None if doc_lengths is None else cu_seqlens_from_lengths(doc_lengths)
    actual = outputs_and_grads(branch_attention, inputs, cu_seqlens=cu_seqlens, block_size=block_size)
    expected = outputs_and_grads(branch_attention_reference, inputs, cu_seqlens=cu_seqlens)
    tolerance = {"rtol": 0, "atol": 1e-10} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
    if num_branch == 0:  # an empty branch is not part of the graph, as in the reference
        assert actual[4:] == expected[4:] == [None, None]
        actual, expected = actual[:4], expected[:4]
    for name, got, want in zip(("out", "dq", "dk", "dv", "dbranch_k", "dbranch_v"), actual, expected):
        assert got.dtype == dtype, name
        torch.testing.assert_close(got, want, **tolerance, msg=lambda m, name=name: f"{name}: {m}")


def _reference_at_rows(q, k, v, branch_k, branch_v, *, query_index, **kwargs):
    """The dense reference for queries at `query_index` only: the full call with zero queries and branch keys
    elsewhere, its output read at those rows (so the other rows get no upstream gradient)."""
    length = k.shape[2]
    full_q = q.new_zeros(*q.shape[:2], length, q.shape[3]).index_copy(2, query_index, q)
    full_branch = [
        b.new_zeros(*b.shape[:3], length, b.shape[4]).index_copy(3, query_index, b) for b in (branch_k, branch_v)
    ]
    return branch_attention_reference(full_q, k, v, *full_branch, **kwargs).index_select(2, query_index)


# (B, Hq, Hkv, L, D, S, document lengths or None, block size, query positions)
QUERY_INDEX_CASES = [
    (2, 4, 2, 9, 8, 2, None, 3, [4, 5, 8]),
    (1, 4, 1, 40, 8, 1, [11, 1, 28], 4, [0, 9, 10, 11, 20, 21, 22, 23, 39]),
    (1, 2, 2, 17, 4, 3, [5, 12], 16, [16]),
    (1, 6, 3, 33, 8, 0, [3, 30], 5, list(range(3, 33, 2))),
    (2, 2, 1, 6, 4, 2, None, 2, []),
]


@pytest.mark.parametrize("case", QUERY_INDEX_CASES, ids=[f"L{c[3]}-Lq{len(c[8])}" for c in QUERY_INDEX_CASES])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_query_index_equals_those_rows_of_the_reference(case, dtype):
    """Queries at some positions only (the TTT's later steps): the output and every gradient equal the dense
    reference restricted to those rows."""
    batch_size, num_q_heads, num_kv_heads, length, head_dim, num_branch, doc_lengths, block_size, rows = case
    inputs = make_inputs(
        batch_size=batch_size,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        length=length,
        head_dim=head_dim,
        num_branch=num_branch,
        dtype=dtype,
        seed=length + len(rows),
    )
    query_index = torch.tensor(rows, dtype=torch.int64)
    subset = {
        name: tensor.detach().index_select(3 if name.startswith("branch") else 2, query_index)
        for name, tensor in inputs.items()
        if name in ("q", "branch_k", "branch_v")
    }
    inputs = {**{name: tensor.detach() for name, tensor in inputs.items()}, **subset}
    cu_seqlens = None if doc_lengths is None else cu_seqlens_from_lengths(doc_lengths)
    actual = outputs_and_grads(
        branch_attention, inputs, cu_seqlens=cu_seqlens, block_size=block_size, query_index=query_index
    )
    expected = outputs_and_grads(_reference_at_rows, inputs, query_index=query_index, cu_seqlens=cu_seqlens)
    tolerance = {"rtol": 0, "atol": 1e-10} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
    if num_branch == 0:
        assert actual[4:] == [None, None]
        actual, expected = actual[:4], expected[:4]
    for name, got, want in zip(("out", "dq", "dk", "dv", "dbranch_k", "dbranch_v"), actual, expected):
        torch.testing.assert_close(got, want, **tolerance, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize(
    "query_index, message",
    [
        (torch.tensor([1, 1, 2, 3, 4, 5]), "strictly increasing"),
        (torch.tensor([0, 1, 2, 3, 4, 6]), r"strictly increasing positions in \[0, 6\)"),
        (torch.tensor([0, 1, 2]), "query_index has 3 positions; q has 6 queries"),
        (torch.arange(6, dtype=torch.int32), "1-D int64"),
    ],
)
def test_invalid_query_index(query_index, message):
    with pytest.raises(ValueError, match=message):
        branch_attention(**_drop_grad(_valid()), query_index=query_index)


@pytest.mark.parametrize("seed", range(4))
def test_random_packing_and_scale(seed):
    generator = torch.Generator().manual_seed(seed)
    length = int(torch.randint(20, 90, (), generator=generator))
    cuts = torch.randint(0, length + 1, (int(torch.randint(1, 6, (), generator=generator)),), generator=generator)
    cu_seqlens = torch.cat([torch.tensor([0]), cuts.sort().values, torch.tensor([length])])
    num_kv_heads = int(torch.randint(1, 3, (), generator=generator))
    group_size = int(torch.randint(1, 4, (), generator=generator))
    inputs = make_inputs(
        batch_size=1,
        num_q_heads=num_kv_heads * group_size,
        num_kv_heads=num_kv_heads,
        length=length,
        head_dim=8,
        num_branch=int(torch.randint(0, 4, (), generator=generator)),
        dtype=torch.float64,
        seed=seed,
    )
    block_size = int(torch.randint(1, 20, (), generator=generator))
    actual = outputs_and_grads(branch_attention, inputs, cu_seqlens=cu_seqlens, scale=0.7, block_size=block_size)
    expected = outputs_and_grads(branch_attention_reference, inputs, cu_seqlens=cu_seqlens, scale=0.7)
    for got, want in zip(actual, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_scale_changes_the_result():
    inputs = make_inputs(
        batch_size=1, num_q_heads=2, num_kv_heads=1, length=12, head_dim=4, num_branch=1, dtype=torch.float64, seed=3
    )
    default = branch_attention(**inputs)
    explicit = branch_attention(**inputs, scale=4**-0.5)
    other = branch_attention(**inputs, scale=1.3)
    torch.testing.assert_close(default, explicit, rtol=0, atol=0)
    assert not torch.allclose(default, other)


def test_no_branch_equals_empty_branch():
    inputs = make_inputs(
        batch_size=2, num_q_heads=4, num_kv_heads=2, length=21, head_dim=8, num_branch=0, dtype=torch.float64, seed=5
    )
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    empty = outputs_and_grads(branch_attention, inputs, block_size=5)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = branch_attention(*leaves, block_size=5)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1234), dtype=torch.float64)
    out.backward(upstream)
    none = [out.detach(), *(leaf.grad for leaf in leaves)]
    for got, want in zip(none, empty[:4]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert inputs["branch_k"].shape == (0, 2, 2, 21, 8)


def test_bfloat16_close_to_float64():
    inputs = make_inputs(
        batch_size=1, num_q_heads=4, num_kv_heads=2, length=70, head_dim=16, num_branch=2, dtype=torch.bfloat16, seed=7
    )
    cu_seqlens = cu_seqlens_from_lengths([30, 1, 39])
    actual = outputs_and_grads(branch_attention, inputs, cu_seqlens=cu_seqlens, block_size=16)
    exact_inputs = {name: tensor.detach().double() for name, tensor in inputs.items()}
    expected = outputs_and_grads(branch_attention_reference, exact_inputs, cu_seqlens=cu_seqlens)
    for name, got, want in zip(("out", "dq", "dk", "dv", "dbranch_k", "dbranch_v"), actual, expected):
        assert got.dtype == torch.bfloat16, name
        relative_error = (got.double() - want).norm() / want.norm()
        assert relative_error < 1e-2, f"{name}: relative error {relative_error:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_autocast_does_not_change_the_kernel(dtype):
    """Under an enclosing bf16 autocast (mixed-precision training) the kernel still computes in its own dtype:
    the same output and gradients as without autocast, for float32 and for bf16 inputs."""
    inputs = make_inputs(
        batch_size=1, num_q_heads=4, num_kv_heads=2, length=45, head_dim=16, num_branch=2, dtype=dtype, seed=11
    )
    cu_seqlens = cu_seqlens_from_lengths([20, 1, 24])
    expected = outputs_and_grads(branch_attention, inputs, cu_seqlens=cu_seqlens, block_size=8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        actual = outputs_and_grads(branch_attention, inputs, cu_seqlens=cu_seqlens, block_size=8)
    for name, got, want in zip(("out", "dq", "dk", "dv", "dbranch_k", "dbranch_v"), actual, expected):
        assert got.dtype == dtype, name
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)


def test_non_contiguous_inputs():
    """Projections usually arrive as [B, L, H, D] transposed to [B, H, L, D]."""
    inputs = make_inputs(
        batch_size=2, num_q_heads=4, num_kv_heads=2, length=19, head_dim=8, num_branch=2, dtype=torch.float64, seed=8
    )
    transposed = {
        "q": inputs["q"].detach().transpose(1, 2).contiguous().transpose(1, 2),
        "k": inputs["k"].detach().transpose(1, 2).contiguous().transpose(1, 2),
        "v": inputs["v"].detach().transpose(1, 2).contiguous().transpose(1, 2),
        "branch_k": inputs["branch_k"].detach().transpose(2, 3).contiguous().transpose(2, 3),
        "branch_v": inputs["branch_v"].detach().transpose(2, 3).contiguous().transpose(2, 3),
    }
    assert not transposed["q"].is_contiguous()
    actual = outputs_and_grads(branch_attention, transposed, block_size=4)
    expected = outputs_and_grads(branch_attention_reference, inputs)
    for got, want in zip(actual, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_gradient_only_where_required():
    inputs = make_inputs(
        batch_size=1, num_q_heads=2, num_kv_heads=1, length=10, head_dim=4, num_branch=1, dtype=torch.float64, seed=9
    )
    q = inputs["q"].detach().requires_grad_()
    frozen = {name: inputs[name].detach() for name in ("k", "v", "branch_k", "branch_v")}
    branch_attention(q, **frozen, block_size=3).square().sum().backward()
    q_ref = inputs["q"].detach().requires_grad_()
    branch_attention_reference(q_ref, **frozen).square().sum().backward()
    torch.testing.assert_close(q.grad, q_ref.grad, rtol=0, atol=1e-10)
    assert all(tensor.grad is None for tensor in frozen.values())


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any operator returns while active, backward included.

    A dispatch mode (not a TorchFunctionMode) because the autograd engine runs the backward below
    the Python function layer.
    """

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for value in result if isinstance(result, tuple | list) else (result,):
            if isinstance(value, torch.Tensor):
                self.largest = max(self.largest, value.numel())
        return result


def largest_tensors(fn, length: int) -> tuple[int, int]:
    """Largest tensor saved for backward and largest tensor created, over one forward+backward."""
    inputs = make_inputs(
        batch_size=1,
        num_q_heads=2,
        num_kv_heads=1,
        length=length,
        head_dim=4,
        num_branch=2,
        dtype=torch.float32,
        seed=10,
    )
    cu_seqlens = cu_seqlens_from_lengths([length // 3, 1, length - length // 3 - 1])
    saved_numels = []

    def pack(tensor):
        saved_numels.append(tensor.numel())
        return tensor

    tracker = LargestTensor()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), tracker:
        fn(**inputs, cu_seqlens=cu_seqlens).square().sum().backward()
    return max(saved_numels), tracker.largest


def test_memory_is_linear_in_length():
    """No L x L tensor is saved or created, and the largest ones grow linearly with L (deterministic, no timing)."""
    blockwise = functools.partial(branch_attention, block_size=16)
    short_saved, short_created = largest_tensors(blockwise, 150)
    long_saved, long_created = largest_tensors(blockwise, 300)
    assert long_saved < 300 * 300 and long_created < 300 * 300
    assert long_saved <= 2 * short_saved and long_created <= 2 * short_created
    # Positive control: the dense reference saves and creates tensors that grow quadratically.
    short_saved, short_created = largest_tensors(branch_attention_reference, 150)
    long_saved, long_created = largest_tensors(branch_attention_reference, 300)
    assert long_saved >= 300 * 300 and long_created >= 300 * 300
    assert long_saved >= 4 * short_saved and long_created >= 4 * short_created


def test_cp_group_of_size_one_is_single_device():
    inputs = make_inputs(
        batch_size=1, num_q_heads=2, num_kv_heads=1, length=11, head_dim=4, num_branch=1, dtype=torch.float64, seed=11
    )
    started_here = not dist.is_initialized()
    if started_here:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with_group = branch_attention(**inputs, cp_group=dist.group.WORLD, block_size=4)
    finally:
        if started_here:
            dist.destroy_process_group()
    torch.testing.assert_close(with_group, branch_attention(**inputs, block_size=4), rtol=0, atol=0)


def _valid():
    return make_inputs(
        batch_size=1, num_q_heads=4, num_kv_heads=2, length=6, head_dim=4, num_branch=2, dtype=torch.float32, seed=0
    )


def _drop_grad(inputs):
    return {name: tensor.detach() for name, tensor in inputs.items()}


INVALID = {
    "q_rank": (lambda x: x | {"q": x["q"][0]}, {}, r"q must be 4-D \[B, Hq, L, D\], got shape \(4, 6, 4\)"),
    "k_rank": (lambda x: x | {"k": x["k"][0]}, {}, r"k must be 4-D"),
    "v_shape": (lambda x: x | {"v": x["v"][:, :, :5]}, {}, r"v must have the shape of k"),
    "length_mismatch": (
        lambda x: x | {"k": x["k"][:, :, :5], "v": x["v"][:, :, :5]},
        {},
        r"k and v must be \[B=1, Hkv, L=6, D=4\]",
    ),
    "batch_mismatch": (
        lambda x: x | {"k": x["k"].expand(2, -1, -1, -1), "v": x["v"].expand(2, -1, -1, -1)},
        {},
        "B=1",
    ),
    "head_dim_mismatch": (
        lambda x: x | {"k": x["k"][..., :3], "v": x["v"][..., :3]},
        {},
        r"same head dim D, got q D=4 and k D=3",
    ),
    "gqa": (lambda x: x | {"q": x["q"][:, :3]}, {}, r"Hq=3 must be a multiple of .* Hkv=2"),
    "branch_k_alone": (lambda x: x | {"branch_v": None}, {}, "branch_k was given without branch_v"),
    "branch_v_alone": (lambda x: x | {"branch_k": None}, {}, "branch_v was given without branch_k"),
    "branch_rank": (lambda x: x | {"branch_k": x["branch_k"][0]}, {}, r"branch_k must be \[S, B, Hkv, Lq, D\]"),
    "branch_heads": (
        lambda x: x | {"branch_v": x["branch_v"][:, :, :1]},
        {},
        r"branch_v must be \[S, B, Hkv, Lq, D\]",
    ),
    "branch_count": (lambda x: x | {"branch_v": x["branch_v"][:1]}, {}, r"same number of branch keys S, got 2 and 1"),
    "dtype": (lambda x: x | {"k": x["k"].double()}, {}, r"k must have q's dtype torch.float32, got torch.float64"),
    "integer_q": (
        lambda x: {name: t.to(torch.int64) for name, t in x.items()},
        {},
        "q must have a floating-point dtype",
    ),
    "cu_float": (lambda x: x, {"cu_seqlens": torch.tensor([0.0, 6.0])}, "integer dtype"),
    "cu_2d": (lambda x: x, {"cu_seqlens": torch.tensor([[0, 6]])}, r"1-D with at least 2 entries"),
    "cu_short": (lambda x: x, {"cu_seqlens": torch.tensor([6])}, r"1-D with at least 2 entries"),
    "cu_start": (lambda x: x, {"cu_seqlens": torch.tensor([1, 6])}, r"start at 0 .* L=6, got first=1 and last=6"),
    "cu_end": (lambda x: x, {"cu_seqlens": torch.tensor([0, 3, 7])}, r"got first=0 and last=7"),
    "cu_decreasing": (lambda x: x, {"cu_seqlens": torch.tensor([0, 4, 2, 6])}, r"non-decreasing, got 4 followed by 2"),
    "cu_list": (lambda x: x, {"cu_seqlens": [0, 6]}, r"cu_seqlens must be a torch.Tensor"),
    "packed_batch": (
        lambda x: {name: torch.cat([t, t], dim=1 if name.startswith("branch") else 0) for name, t in x.items()},
        {"cu_seqlens": torch.tensor([0, 6])},
        r"need batch size B=1, got B=2",
    ),
    "scale": (lambda x: x, {"scale": -1.0}, r"scale must be a positive finite number .* got -1.0"),
    "scale_nan": (lambda x: x, {"scale": math.nan}, r"scale must be a positive finite number"),
    "window_zero": (lambda x: x, {"sliding_window": 0}, r"sliding_window must be a positive int"),
    "window_float": (lambda x: x, {"sliding_window": 4.0}, r"sliding_window must be a positive int"),
    "sinks_shape": (lambda x: x, {"sinks": torch.zeros(2)}, r"one logit per query head \[Hq=4\], got \(2,\)"),
    "sinks_integer": (lambda x: x, {"sinks": torch.zeros(4, dtype=torch.int64)}, r"sinks must be a floating-point"),
    "sinks_list": (lambda x: x, {"sinks": [0.0] * 4}, r"sinks must be a floating-point tensor .* got list"),
}


@pytest.mark.parametrize("fn", [branch_attention, branch_attention_reference], ids=["blockwise", "reference"])
@pytest.mark.parametrize("name", list(INVALID))
def test_invalid_inputs(fn, name):
    corrupt, kwargs, message = INVALID[name]
    inputs = corrupt(_drop_grad(_valid()))
    with pytest.raises(ValueError, match=message):
        fn(**inputs, **kwargs)


@pytest.mark.parametrize("block_size", [0, -3, 2.5, True])
def test_invalid_block_size(block_size):
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        branch_attention(**_drop_grad(_valid()), block_size=block_size)


def test_invalid_cp_mode():
    q = torch.randn(1, 2, 4, 4)
    k = torch.randn(1, 1, 4, 4)
    with pytest.raises(
        ValueError, match=r"cp_mode must be one of \('ring', 'allgather', 'gather_queries'\), got 'ulysses'"
    ):
        branch_attention(q, k, k, cp_mode="ulysses")


def test_document_ids_and_positions():
    cu_seqlens = torch.tensor([0, 2, 2, 5, 6], dtype=torch.int32)
    assert document_ids(cu_seqlens).tolist() == [0, 0, 2, 2, 2, 3]
    assert positions_in_document(cu_seqlens).tolist() == [0, 1, 0, 1, 2, 0]


def test_block_visibility_is_exact_for_skip_and_full():
    """Against the dense block mask, on strictly increasing but non-contiguous (zigzag-like) positions."""
    generator = torch.Generator().manual_seed(13)
    for _ in range(200):
        length = 40
        positions = torch.randperm(3 * length, generator=generator)[:length].sort().values
        doc_ids = torch.randint(0, 4, (length,), generator=generator).sort().values
        block_size = int(torch.randint(1, 12, (), generator=generator))
        spans = block_spans(positions, doc_ids, block_size)
        assert [span.start for span in spans] == [0, *(span.end for span in spans[:-1])]
        assert spans[-1].end == length
        assert all(1 <= span.end - span.start <= block_size for span in spans)
        for query in spans:
            for key in spans:
                rows, cols = slice(query.start, query.end), slice(key.start, key.end)
                dense = block_mask(positions[rows], doc_ids[rows], positions[cols], doc_ids[cols])
                visibility = block_visibility(query, key)
                if visibility is Visibility.SKIP:
                    assert not dense.any()
                elif visibility is Visibility.FULL:
                    assert dense.all()


@pytest.mark.parametrize(
    "doc_lengths, block_size, starts",
    [
        ([168, 168, 168], 256, [0, 168, 336]),  # a document that does not fit starts a new block
        ([600, 50], 256, [0, 256, 512]),  # long documents are cut every block; a short one joins the last
        ([3, 4, 5, 1], 16, [0]),  # short documents share a block
        ([10, 10, 10], 16, [0, 10, 20]),
    ],
)
def test_block_spans_start_documents_that_do_not_fit_on_a_new_block(doc_lengths, block_size, starts):
    """Packed documents get blocks of their own, so that pairs of blocks from different documents are skipped."""
    cu_seqlens = cu_seqlens_from_lengths(doc_lengths)
    doc_ids = document_ids(cu_seqlens)
    spans = block_spans(torch.arange(doc_ids.numel()), doc_ids, block_size)
    assert [span.start for span in spans] == starts


def test_block_spans_of_zigzag_shards_cut_at_chunks_and_merge_short_pieces():
    generator = torch.Generator().manual_seed(0)

    def randint(low, high):  # inclusive
        return int(torch.randint(low, high + 1, (), generator=generator))

    for trial in range(200):
        world_size, block_size = randint(1, 4), randint(1, 9)
        # Half the trials: chunks are whole numbers of blocks, so no block may mix two chunks.
        aligned = trial % 2 == 0
        unit = 2 * world_size * (block_size if aligned else 1)
        lengths = [unit * randint(0, 11) for _ in range(randint(1, 5))]
        cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        positions = parallel.zigzag_indices(randint(0, world_size - 1), world_size, cu_seqlens=cu_seqlens)
        doc_ids = torch.searchsorted(cu_seqlens, positions, right=True) - 1
        spans = block_spans(positions, doc_ids, block_size)
        assert [span.start for span in spans] == [0, *(span.end for span in spans[:-1])][: len(spans)]
        assert (spans[-1].end if spans else 0) == positions.numel()
        for index, span in enumerate(spans):
            block = slice(span.start, span.end)
            assert 1 <= span.end - span.start <= block_size
            assert (span.pos_min, span.pos_max) == (int(positions[block].min()), int(positions[block].max()))
            assert (span.doc_min, span.doc_max) == (int(doc_ids[block].min()), int(doc_ids[block].max()))
            if aligned:
                assert bool((positions[block].diff() == 1).all()), "a block mixes two zigzag chunks"
            if index + 1 < len(spans):  # greedy: a block is closed only when the next piece does not fit
                assert spans[index + 1].end - span.start > block_size


def test_block_visibility_skips_other_documents_and_future():
    query = BlockSpan(start=0, end=4, pos_min=10, pos_max=13, doc_min=2, doc_max=2)
    assert block_visibility(query, BlockSpan(0, 4, 14, 17, 2, 2)) is Visibility.SKIP  # causal future
    assert block_visibility(query, BlockSpan(0, 4, 0, 3, 1, 1)) is Visibility.SKIP  # earlier document
    assert block_visibility(query, BlockSpan(0, 4, 6, 9, 2, 2)) is Visibility.FULL
    assert block_visibility(query, BlockSpan(0, 4, 8, 11, 2, 2)) is Visibility.PARTIAL  # diagonal
    assert block_visibility(query, BlockSpan(0, 4, 6, 9, 1, 2)) is Visibility.PARTIAL  # straddles a boundary


def test_merge_equals_softmax_over_union():
    generator = torch.Generator().manual_seed(14)
    scores = torch.randn(3, 5, 9, generator=generator, dtype=torch.float64) * 4
    values = torch.randn(3, 9, 6, generator=generator, dtype=torch.float64)

    def partial(cols):
        weights = torch.softmax(scores[..., cols], dim=-1)
        return weights @ values[:, cols], torch.logsumexp(scores[..., cols], dim=-1)

    out, lse = merge_attention_partials(*partial(slice(0, 4)), *partial(slice(4, 9)))
    full_out, full_lse = partial(slice(0, 9))
    torch.testing.assert_close(out, full_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, full_lse, rtol=0, atol=1e-12)


def test_merge_with_empty_partials():
    generator = torch.Generator().manual_seed(15)
    out = torch.randn(4, 3, generator=generator)
    lse = torch.randn(4, generator=generator)
    empty_out, empty_lse = torch.zeros(4, 3), torch.full((4,), -math.inf)
    merged_out, merged_lse = merge_attention_partials(out, lse, empty_out, empty_lse)
    torch.testing.assert_close(merged_out, out, rtol=0, atol=0)
    torch.testing.assert_close(merged_lse, lse, rtol=0, atol=0)
    merged_out, merged_lse = merge_attention_partials(empty_out, empty_lse, out, lse)
    torch.testing.assert_close(merged_out, out, rtol=0, atol=0)
    torch.testing.assert_close(merged_lse, lse, rtol=0, atol=0)
    merged_out, merged_lse = merge_attention_partials(empty_out, empty_lse, empty_out, empty_lse)
    assert not merged_out.isnan().any() and (merged_out == 0).all()
    assert (merged_lse == -math.inf).all()


def test_block_forward_rows_without_visible_keys():
    generator = torch.Generator().manual_seed(16)
    q = torch.randn(1, 1, 2, 3, 4, generator=generator, dtype=torch.float64)
    k = torch.randn(1, 1, 5, 4, generator=generator, dtype=torch.float64)
    v = torch.randn(1, 1, 5, 4, generator=generator, dtype=torch.float64)
    mask = torch.tensor([[True, False, True, False, False], [False] * 5, [True] * 5])
    out, lse = block_forward(q, k, v, scale=0.5, mask=mask)
    assert (out[:, :, :, 1] == 0).all() and (lse[:, :, :, 1] == -math.inf).all()
    scores = (q @ k.transpose(-1, -2)).squeeze(1) * 0.5
    for row in (0, 2):
        weights = torch.softmax(scores[..., row, mask[row]], dim=-1)
        torch.testing.assert_close(out[0, 0, :, row], weights[0] @ v[0, 0, mask[row]], rtol=0, atol=1e-12)
        torch.testing.assert_close(lse[0, 0, :, row], torch.logsumexp(scores[0, :, row, mask[row]], -1))


def zigzag_indices(doc_lengths: list[int], *, rank: int, world_size: int) -> torch.Tensor:
    """Global positions held by `rank` in the zigzag layout of docs/design.md section 5."""
    held, start = [], 0
    for length in doc_lengths:
        chunk = length // (2 * world_size)
        for index in (rank, 2 * world_size - 1 - rank):
            held.append(torch.arange(start + index * chunk, start + (index + 1) * chunk))
        start += length
    return torch.cat(held)


def test_trunk_over_zigzag_shards_matches_the_full_trunk():
    """What the ring driver relies on: query and key shards with global positions, merged over key shards,
    give the trunk over all keys, and the per-pair backward sums to the full gradients."""
    generator = torch.Generator().manual_seed(17)
    length, world_size = 24, 2
    q = torch.randn(1, 2, 2, length, 4, generator=generator, dtype=torch.float64)
    k = torch.randn(1, 2, length, 4, generator=generator, dtype=torch.float64)
    v = torch.randn(1, 2, length, 4, generator=generator, dtype=torch.float64)
    dout = torch.randn(q.shape, generator=generator, dtype=torch.float64)
    doc_ids = document_ids(torch.tensor([0, 16, 24]))

    def trunk(backward_inputs=None, *, rows, cols):
        query = {"query_positions": rows, "query_doc_ids": doc_ids[rows]}
        key = {"key_positions": cols, "key_doc_ids": doc_ids[cols]}
        args = (q[:, :, :, rows], k[:, :, cols], v[:, :, cols])
        if backward_inputs is None:
            return trunk_forward(*args, **query, **key, scale=0.5, block_size=3)
        lse, delta = backward_inputs
        return trunk_backward(dout[:, :, :, rows], *args, lse, delta, **query, **key, scale=0.5, block_size=3)

    everything = torch.arange(length)
    full_out, full_lse = trunk(rows=everything, cols=everything)
    full_delta = (dout * full_out).sum(-1)
    full_dq, full_dk, full_dv = trunk((full_lse, full_delta), rows=everything, cols=everything)

    shards = [zigzag_indices([16, 8], rank=rank, world_size=world_size) for rank in range(world_size)]
    assert torch.cat(shards).sort().values.tolist() == everything.tolist()
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for rows in shards:
        out = lse = None
        for cols in shards:
            part = trunk(rows=rows, cols=cols)
            out, lse = part if out is None else merge_attention_partials(out, lse, *part)
        torch.testing.assert_close(out, full_out[:, :, :, rows], rtol=0, atol=1e-12)
        torch.testing.assert_close(lse, full_lse[:, :, :, rows], rtol=0, atol=1e-12)
        dq = torch.zeros_like(q[:, :, :, rows])
        for cols in shards:
            pair_dq, pair_dk, pair_dv = trunk((lse, full_delta[:, :, :, rows]), rows=rows, cols=cols)
            dq += pair_dq
            dk[:, :, cols] += pair_dk
            dv[:, :, cols] += pair_dv
        torch.testing.assert_close(dq, full_dq[:, :, :, rows], rtol=0, atol=1e-12)
    torch.testing.assert_close(dk, full_dk, rtol=0, atol=1e-12)
    torch.testing.assert_close(dv, full_dv, rtol=0, atol=1e-12)
