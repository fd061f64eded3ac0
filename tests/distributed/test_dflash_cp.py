"""DFlash under context parallelism on gloo: the block attention through the ring and the all-gather, then the whole
objective (anchor sampling, halo, loss, metrics, gradients), each against the single-device call on the unsharded
inputs and the block attention also against the dense float64 reference."""

import pytest
import torch
import torch.distributed as dist
from process_pool import subgroup

from hf_spec_cotrain.attention import anchor_query_positions, block_draft_attention, block_draft_attention_reference
from hf_spec_cotrain.attention.api import CP_MODES
from hf_spec_cotrain.draft import DFlashDraftModel
from hf_spec_cotrain.draft.base import DraftTrainingBatch
from hf_spec_cotrain.draft.dflash_objective import DFlashTrainingOptions, dflash_loss, sample_anchors
from hf_spec_cotrain.parallel import all_reduce_gradients, pad_documents, zigzag_shard
from hf_spec_cotrain.testing import build_tiny_target


pytestmark = pytest.mark.distributed
POOL_WORLD_SIZE = 4
BLOCK_INPUTS = ("q", "context_k", "context_v", "block_k", "block_v")


def padded_documents(lengths: list[int], size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Documents of any length padded to multiples of 2W, as the trainer packs them: `(cu_seqlens, real)`, where
    `real [L]` is False on the padding."""
    padding = pad_documents(torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]), world_size=size)
    real = padding.pad(torch.ones(1, sum(lengths), dtype=torch.bool), value=False)[0]
    return padding.cu_seqlens, real


def tolerances(dtype: torch.dtype) -> dict:
    return {"rtol": 1e-10, "atol": 1e-10} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-5}


# ---------------------------------------------------------------------------------------------------- block attention


def block_case(case: dict, size: int, dtype: torch.dtype):
    """Inputs on the whole sequence, anchors (any order, some masked out), the upstream gradient."""
    generator = torch.Generator().manual_seed(case["seed"])
    cu_seqlens, real = padded_documents(case["doc_lengths"], size)
    length = int(cu_seqlens[-1])
    heads, kv_heads, num_anchors, block_len, dim = case["shape"]

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)

    inputs = {
        "q": randn(1, heads, num_anchors, block_len, dim),
        "context_k": randn(1, kv_heads, length, dim),
        "context_v": randn(1, kv_heads, length, dim),
        "block_k": randn(1, kv_heads, num_anchors, block_len, dim),
        "block_v": randn(1, kv_heads, num_anchors, block_len, dim),
    }
    starts = torch.zeros(length, dtype=torch.bool)
    starts[cu_seqlens[:-1]] = True
    candidates = (real & ~starts).nonzero().flatten()
    anchors = candidates[torch.randperm(candidates.numel(), generator=generator)[:num_anchors]][None]
    anchor_mask = torch.rand(1, num_anchors, generator=generator) < 0.85
    upstream = randn(1, heads, num_anchors, block_len, dim)
    return inputs, anchors, anchor_mask, cu_seqlens, upstream


def outputs_and_grads(fn, inputs: dict, upstream: torch.Tensor, **kwargs) -> list[torch.Tensor]:
    leaves = {name: tensor.detach().clone().requires_grad_() for name, tensor in inputs.items()}
    out = fn(**leaves, **kwargs)
    out.backward(upstream)
    return [out.detach(), *(leaves[name].grad for name in BLOCK_INPUTS)]


def check_block_attention(size: int, case: dict, dtype: torch.dtype, mode: str) -> int:
    """This rank's anchors (those whose `anchor - 1` it holds) through `block_draft_attention(..., cp_group=...)`
    against the single-device call; returns how many anchors this rank ran."""
    group = subgroup(size)
    rank = dist.get_rank(group)
    inputs, anchors, anchor_mask, cu_seqlens, upstream = block_case(case, size, dtype)
    expected = outputs_and_grads(
        block_draft_attention, inputs, upstream, anchors=anchors, anchor_mask=anchor_mask, cu_seqlens=cu_seqlens
    )
    if dtype == torch.float64:
        reference = outputs_and_grads(
            block_draft_attention_reference,
            inputs,
            upstream,
            anchors=anchors,
            anchor_mask=anchor_mask,
            cu_seqlens=cu_seqlens,
        )
        for got, want in zip(expected, reference):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)

    length = inputs["context_k"].shape[2]
    _, held = anchor_query_positions(anchors, local_length=length // size, cu_seqlens=cu_seqlens, cp_group=group)
    mine = held[0].nonzero().flatten()  # masked anchors held here come too: they must give zeros

    def local(tensor):
        return tensor[:, :, mine] if tensor.dim() == 5 else zigzag_shard(tensor, 2, rank, size, cu_seqlens)

    got = outputs_and_grads(
        block_draft_attention,
        {name: local(tensor) for name, tensor in inputs.items()},
        upstream[:, :, mine],
        anchors=anchors[:, mine],
        anchor_mask=anchor_mask[:, mine],
        cu_seqlens=cu_seqlens,
        cp_group=group,
        cp_mode=mode,
    )
    names = ["out", *BLOCK_INPUTS]
    for name, value, want in zip(names, got, expected):
        want = want[:, :, mine] if want.dim() == 5 else zigzag_shard(want, 2, rank, size, cu_seqlens)
        torch.testing.assert_close(value, want, **tolerances(dtype), msg=lambda m, n=name: f"{n}: {m}")
    return int(anchor_mask[:, mine].sum())


BLOCK_CASES = {
    # (Hq, Hkv, N, S, D); documents of odd lengths, padded to multiples of 2W (odd chunks too)
    2: [
        {"doc_lengths": [11, 3, 21], "shape": (4, 2, 9, 3, 8), "seed": 1},
        {"doc_lengths": [40], "shape": (2, 1, 12, 4, 16), "seed": 2},
    ],
    4: [
        {"doc_lengths": [23, 9, 41], "shape": (4, 2, 14, 3, 8), "seed": 3},
        {"doc_lengths": [5, 2, 1, 30], "shape": (2, 2, 6, 2, 4), "seed": 4},  # few anchors: some ranks get none
    ],
}


def check_block_cases(size: int, dtype: torch.dtype, mode: str) -> list[int]:
    return [check_block_attention(size, case, dtype, mode) for case in BLOCK_CASES[size]]


@pytest.mark.parametrize("mode", CP_MODES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("size", [2, 4])
def test_block_attention_equals_single_device(cp_pool, size, dtype, mode):
    counts = cp_pool.run(check_block_cases, size, dtype, mode)
    for case_index in range(len(BLOCK_CASES[size])):
        per_rank = [counts[rank][case_index] for rank in range(size)]
        assert sum(per_rank) > 0 and max(per_rank) < sum(per_rank)  # the anchors spread over the ranks


def foreign_anchor_is_refused() -> None:
    group = subgroup(2)
    inputs, anchors, _, cu_seqlens, _ = block_case(BLOCK_CASES[2][0], 2, torch.float64)
    length = inputs["context_k"].shape[2]
    _, held = anchor_query_positions(anchors, local_length=length // 2, cu_seqlens=cu_seqlens, cp_group=group)
    local = {
        name: tensor if tensor.dim() == 5 else zigzag_shard(tensor, 2, dist.get_rank(group), 2, cu_seqlens)
        for name, tensor in inputs.items()
    }
    with pytest.raises(ValueError, match="anchor - 1 on another rank"):
        block_draft_attention(**local, anchors=anchors, cu_seqlens=cu_seqlens, cp_group=group)
    assert not bool(held.all())


def test_an_anchor_passed_by_another_rank_is_refused(cp_pool):
    cp_pool.run(foreign_anchor_is_refused)


# ---------------------------------------------------------------------------------------------------- the objective

_DRAFTS: dict[tuple, DFlashDraftModel] = {}


def tiny_draft(dtype: torch.dtype, block_size: int) -> DFlashDraftModel:
    """The same draft on every rank (built once per worker), every weight moved away from its init."""
    key = (dtype, block_size)
    if key not in _DRAFTS:
        target = build_tiny_target(
            "qwen3", num_layers=6, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, seed=0, dtype=dtype
        )
        torch.manual_seed(0)
        draft = DFlashDraftModel.from_target(target, mask_token_id=3, num_layers=2, block_size=block_size)
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for parameter in draft.parameters():
                parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator, dtype=torch.float64).to(dtype))
        _DRAFTS[key] = draft
    return _DRAFTS[key]


def run_loss(draft, aux, embeds, teacher, loss_mask, cu_seqlens, options, **kwargs):
    """Loss output and the gradients of the draft's parameters, the taps and the embeddings."""
    draft.zero_grad(set_to_none=True)
    aux, embeds = aux.detach().clone().requires_grad_(), embeds.detach().clone().requires_grad_()
    batch = DraftTrainingBatch(aux, embeds, teacher, loss_mask, cu_seqlens=cu_seqlens)
    out = dflash_loss(draft, batch, options, generator=torch.Generator().manual_seed(7), **kwargs)
    out.loss.backward()
    return out, [p.grad.clone() for p in draft.parameters()], aux.grad, embeds.grad


def check_loss(size: int, case: dict, dtype: torch.dtype) -> tuple[float, int]:
    """Returns the loss summed over the group and this rank's anchor count."""
    group = subgroup(size)
    rank = dist.get_rank(group)
    draft = tiny_draft(dtype, case["block_size"])
    cu_seqlens, real = padded_documents(case["doc_lengths"], size)
    length = int(cu_seqlens[-1])
    generator = torch.Generator().manual_seed(case["seed"])
    config = draft.config

    def randn(*shape):
        return torch.randn(1, length, *shape, generator=generator, dtype=torch.float64).to(dtype)

    aux = randn(config.target_hidden_size * len(config.target_layer_ids))
    embeds, teacher = randn(config.hidden_size), 3 * randn(config.draft_vocab_size)
    loss_mask = (torch.rand(1, length, generator=generator) < 0.8) & real
    options = DFlashTrainingOptions(anchors_per_row=case["anchors"])
    reference, ref_param_grads, ref_aux_grad, ref_embeds_grad = run_loss(
        draft, aux, embeds, teacher, loss_mask, cu_seqlens, options
    )

    def shard(tensor):
        return zigzag_shard(tensor, 1, rank, size, cu_seqlens)

    out, param_grads, aux_grad, embeds_grad = run_loss(
        draft, *(shard(t) for t in (aux, embeds, teacher, loss_mask)), cu_seqlens, options, cp_group=group
    )
    for parameter, grad in zip(draft.parameters(), param_grads):
        parameter.grad = grad
    all_reduce_gradients(draft.parameters(), group)

    tol = tolerances(dtype)
    total = out.loss.detach().clone()
    dist.all_reduce(total, group=group)
    torch.testing.assert_close(total, reference.loss.detach(), **tol)
    torch.testing.assert_close(out.step_losses, reference.step_losses, **tol)
    torch.testing.assert_close(out.step_accuracies, reference.step_accuracies, **tol)
    assert torch.equal(out.step_counts, reference.step_counts)
    for (name, parameter), want in zip(draft.named_parameters(), ref_param_grads):
        torch.testing.assert_close(parameter.grad, want, **tol, msg=lambda m, n=name: f"{n}: {m}")
    torch.testing.assert_close(aux_grad, shard(ref_aux_grad), **tol)
    torch.testing.assert_close(embeds_grad, shard(ref_embeds_grad), **tol)

    anchors, anchor_mask = sample_anchors(
        loss_mask, case["anchors"], cu_seqlens=cu_seqlens, generator=torch.Generator().manual_seed(7)
    )
    _, held = anchor_query_positions(anchors, local_length=length // size, cu_seqlens=cu_seqlens, cp_group=group)
    return float(total), int((anchor_mask & held).sum())


LOSS_CASES = {
    2: [{"doc_lengths": [13, 6, 29], "block_size": 4, "anchors": 5, "seed": 1}],
    4: [{"doc_lengths": [31, 17, 9], "block_size": 5, "anchors": 6, "seed": 2}],
}


def check_loss_cases(size: int, dtype: torch.dtype) -> list[tuple[float, int]]:
    return [check_loss(size, case, dtype) for case in LOSS_CASES[size]]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("size", [2, 4])
def test_dflash_loss_and_gradients_equal_single_device(cp_pool, size, dtype):
    results = cp_pool.run(check_loss_cases, size, dtype)
    for case_index in range(len(LOSS_CASES[size])):
        totals = [results[rank][case_index][0] for rank in range(size)]
        anchors = [results[rank][case_index][1] for rank in range(size)]
        assert len(set(totals)) == 1 and totals[0] > 0  # the ranks agree on the loss, and it is not trivial
        assert max(anchors) < sum(anchors)  # the anchors spread over the ranks


def padded_rows_are_refused() -> None:
    group = subgroup(2)
    draft = tiny_draft(torch.float64, 4)
    config = draft.config
    rows = DraftTrainingBatch(
        torch.zeros(2, 8, config.target_hidden_size * len(config.target_layer_ids), dtype=torch.float64),
        torch.zeros(2, 8, config.hidden_size, dtype=torch.float64),
        torch.zeros(2, 8, config.draft_vocab_size, dtype=torch.float64),
        torch.ones(2, 8, dtype=torch.bool),
        attention_mask=torch.ones(2, 8, dtype=torch.bool),
    )
    with pytest.raises(ValueError, match="packed documents .*pad_documents"):
        dflash_loss(draft, rows, DFlashTrainingOptions(), cp_group=group)


def test_padded_rows_are_refused_under_context_parallelism(cp_pool):
    cp_pool.run(padded_rows_are_refused)
