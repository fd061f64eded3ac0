"""The TTT loss under context parallelism on gloo: the halo shifts, then loss, metrics and gradients against the
single-device `ttt_loss` on the unsharded inputs."""

import pytest
import torch
import torch.distributed as dist
from process_pool import subgroup

from hf_spec_cotrain import Eagle3DraftModel, ttt_loss
from hf_spec_cotrain.draft import count_tokens
from hf_spec_cotrain.draft.eagle3_ttt import _document_end, _shift_within_documents
from hf_spec_cotrain.parallel import ZigzagHalo, all_reduce_gradients, pad_documents, zigzag_shard
from hf_spec_cotrain.testing import build_tiny_target


POOL_WORLD_SIZE = 4
_DRAFTS: dict[tuple, Eagle3DraftModel] = {}


def tiny_draft(num_layers: int, dtype: torch.dtype) -> Eagle3DraftModel:
    """The same draft on every rank (built once per worker), every weight moved away from its init."""
    key = (num_layers, dtype)
    if key not in _DRAFTS:
        target = build_tiny_target(
            "llama",
            num_layers=8,
            hidden_size=64,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            intermediate_size=96,
            seed=0,
        )
        counts = count_tokens(
            [torch.randint(0, target.config.vocab_size, (4000,), generator=torch.Generator().manual_seed(0))],
            target.config.vocab_size,
        )
        torch.manual_seed(0)  # the draft's initialisation draws from the global generator
        draft = Eagle3DraftModel.from_target(target, num_layers=num_layers, draft_vocab_size=40, token_counts=counts)
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for parameter in draft.parameters():
                parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))
        _DRAFTS[key] = draft.to(dtype)
    return _DRAFTS[key]


def cu_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


# ---------------------------------------------------------------------------------------------------- halo


def check_halo_shifts(size: int, doc_lengths: list[int], halo: int) -> int:
    group = subgroup(size)
    rank = dist.get_rank(group)
    cu_seqlens = cu_of(doc_lengths)
    length = sum(doc_lengths)
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(2, length, 3, generator=generator, dtype=torch.float64)
    flags = torch.rand(1, length, generator=generator) < 0.5
    weights = torch.randn(halo + 1, 2, length, 3, generator=generator, dtype=torch.float64)
    plan = ZigzagHalo(group=group, local_length=length // size, halo=halo, cu_seqlens=cu_seqlens)
    doc_end = _document_end(cu_seqlens, 1, length, x.device)

    def shard(tensor, dim=1):
        return zigzag_shard(tensor, dim, rank, size, cu_seqlens)

    x_full = x.clone().requires_grad_()
    x_shard = shard(x).requires_grad_()
    extended, extended_flags = plan.extend(x_shard), plan.extend(shard(flags))
    full_loss = shard_loss = 0
    for shift in range(halo + 1):
        expected = _shift_within_documents(x_full, shift, doc_end)
        got = plan.shift(extended, shift)
        torch.testing.assert_close(got, shard(expected), rtol=0, atol=0)
        assert torch.equal(plan.shift(extended_flags, shift), shard(_shift_within_documents(flags, shift, doc_end)))
        full_loss = full_loss + (expected * weights[shift]).sum()
        shard_loss = shard_loss + (got * shard(weights[shift])).sum()
    full_loss.backward()
    shard_loss.backward()  # the halo's gradients travel back to their owners
    torch.testing.assert_close(x_shard.grad, shard(x_full.grad), rtol=0, atol=1e-12)
    assert plan.position_ids.tolist() == shard(torch.cat([torch.arange(n) for n in doc_lengths]), 0).tolist()
    return sum(plan.recv_counts.values())


@pytest.mark.distributed
@pytest.mark.parametrize(
    "size, doc_lengths, halo",
    [
        (2, [8, 4, 20], 3),  # chunks of 2, 1 and 5: the halo reaches over several chunks and ranks
        (4, [40, 8, 16], 4),
        (4, [24], 1),
    ],
)
def test_halo_shifts_equal_single_device(cp_pool, size, doc_lengths, halo):
    received = cp_pool.run(check_halo_shifts, size, doc_lengths, halo)
    # Never an all-gather: a rank receives at most `halo` positions per chunk it holds.
    assert max(received) <= 2 * len(doc_lengths) * halo
    assert max(received) > 0


# ---------------------------------------------------------------------------------------------------- TTT loss


def make_inputs(draft, batch: int, length: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    config, dtype = draft.config, draft.fc.weight.dtype
    width = config.target_hidden_size * config.num_aux_hidden_states
    aux = torch.randn(batch, length, width, generator=generator, dtype=torch.float64).to(dtype)
    embeds = torch.randn(batch, length, config.hidden_size, generator=generator, dtype=torch.float64).to(dtype)
    teacher = 3 * torch.randn(batch, length, config.draft_vocab_size, generator=generator, dtype=torch.float64)
    loss_mask = torch.rand(batch, length, generator=generator) < 0.8
    return aux, embeds, teacher.to(dtype), loss_mask


def run_ttt(draft, aux, embeds, teacher, loss_mask, **kwargs):
    """Loss output and the gradients of the draft's parameters, the taps and the embeddings."""
    draft.zero_grad(set_to_none=True)
    aux, embeds = aux.detach().clone().requires_grad_(), embeds.detach().clone().requires_grad_()
    out = ttt_loss(
        draft, aux_hidden_states=aux, input_embeds=embeds, teacher_logits=teacher, loss_mask=loss_mask, **kwargs
    )
    out.loss.backward()
    return out, [p.grad.clone() for p in draft.parameters()], aux.grad, embeds.grad


def check_ttt(size: int, case: dict, dtype: torch.dtype) -> float:
    """Returns the CP loss summed over the group (the single-device loss)."""
    group = subgroup(size)
    rank = dist.get_rank(group)
    draft = tiny_draft(case["num_layers"], dtype)
    doc_lengths, batch = case["doc_lengths"], case["batch"]
    length = sum(doc_lengths) if doc_lengths else case["length"]
    aux, embeds, teacher, loss_mask = make_inputs(draft, batch, length, case["seed"])
    cu_seqlens = cu_of(doc_lengths) if doc_lengths else None
    steps = case["ttt_steps"]
    reference, ref_param_grads, ref_aux_grad, ref_embeds_grad = run_ttt(
        draft, aux, embeds, teacher, loss_mask, cu_seqlens=cu_seqlens, ttt_steps=steps
    )

    padding = None
    if case.get("pad"):  # documents of any length: pad them to multiples of 2W, mask the padding out of the loss
        padding = pad_documents(cu_seqlens, world_size=size)
        aux, embeds, teacher = (padding.pad(t) for t in (aux, embeds, teacher))
        loss_mask = padding.pad(loss_mask, value=False)
        cu_seqlens = padding.cu_seqlens
        ref_aux_grad, ref_embeds_grad = padding.pad(ref_aux_grad), padding.pad(ref_embeds_grad)

    def shard(tensor):
        return zigzag_shard(tensor, 1, rank, size, cu_seqlens)

    out, param_grads, aux_grad, embeds_grad = run_ttt(
        draft,
        *(shard(t) for t in (aux, embeds, teacher, loss_mask)),
        cu_seqlens=cu_seqlens,
        ttt_steps=steps,
        cp_group=group,
    )
    for parameter, grad in zip(draft.parameters(), param_grads):
        parameter.grad = grad
    all_reduce_gradients(draft.parameters(), group)
    param_grads = [p.grad for p in draft.parameters()]

    if dtype == torch.float64:
        value_tol, grad_tol = {"rtol": 1e-10, "atol": 1e-10}, {"rtol": 1e-9, "atol": 1e-10}
    else:  # same float32 inputs, only the order of the sums differs
        value_tol, grad_tol = {"rtol": 1e-5, "atol": 1e-6}, {"rtol": 1e-4, "atol": 1e-6}
    total = out.loss.detach().clone()
    dist.all_reduce(total, group=group)
    torch.testing.assert_close(total, reference.loss.detach(), **value_tol)
    torch.testing.assert_close(out.step_losses, reference.step_losses, **value_tol)
    torch.testing.assert_close(out.step_accuracies, reference.step_accuracies, **value_tol)
    assert torch.equal(out.step_counts, reference.step_counts)
    for (name, _), got, want in zip(draft.named_parameters(), param_grads, ref_param_grads):
        torch.testing.assert_close(got, want, **grad_tol, msg=lambda m, n=name: f"{n}: {m}")
    torch.testing.assert_close(aux_grad, shard(ref_aux_grad), **grad_tol)
    torch.testing.assert_close(embeds_grad, shard(ref_embeds_grad), **grad_tol)
    return float(total)


TTT_CASES = {
    2: [
        {"doc_lengths": [8, 4, 12], "batch": 1, "num_layers": 1, "ttt_steps": 3, "seed": 1},
        {"doc_lengths": None, "length": 12, "batch": 2, "num_layers": 2, "ttt_steps": 3, "seed": 2},
        {"doc_lengths": [5, 9, 1, 6], "batch": 1, "num_layers": 1, "ttt_steps": 4, "seed": 3, "pad": True},
    ],
    4: [
        {"doc_lengths": [16, 8, 24], "batch": 1, "num_layers": 1, "ttt_steps": 3, "seed": 4},
        {"doc_lengths": None, "length": 16, "batch": 2, "num_layers": 2, "ttt_steps": 3, "seed": 5},
        {"doc_lengths": [11, 3, 17], "batch": 1, "num_layers": 1, "ttt_steps": 3, "seed": 6, "pad": True},
    ],
}


def check_ttt_cases(size: int, dtype: torch.dtype) -> list[float]:
    group_index = dist.get_rank() // size
    cases = TTT_CASES[size]
    # With two groups of 2, each runs half the cases (the first also the last, so both see a padded case).
    if POOL_WORLD_SIZE // size == 2:
        cases = cases[:2] if group_index == 0 else cases[1:]
    return [check_ttt(size, case, dtype) for case in cases]


@pytest.mark.distributed
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("size", [2, 4])
def test_ttt_loss_and_gradients_equal_single_device(cp_pool, size, dtype):
    totals = cp_pool.run(check_ttt_cases, size, dtype)
    # The ranks of a group agree on the summed loss, and the loss is not trivial.
    for rank in range(POOL_WORLD_SIZE):
        assert totals[rank] == totals[rank // size * size]
        assert all(value > 0 for value in totals[rank])


def attention_mask_is_refused() -> None:
    group = subgroup(2)
    draft = tiny_draft(1, torch.float64)
    aux, embeds, teacher, loss_mask = make_inputs(draft, 2, 4, 0)
    with pytest.raises(ValueError, match="attention_mask` is not supported with `cp_group`"):
        ttt_loss(
            draft,
            aux_hidden_states=aux,
            input_embeds=embeds,
            teacher_logits=teacher,
            attention_mask=torch.ones(2, 4, dtype=torch.bool),
            cp_group=group,
        )
    with pytest.raises(ValueError, match=r"multiple of 2 \* world_size = 4"):
        ttt_loss(
            draft,
            aux_hidden_states=aux[:1],
            input_embeds=embeds[:1],
            teacher_logits=teacher[:1],
            cu_seqlens=torch.tensor([0, 2, 8]),
            cp_group=group,
        )


@pytest.mark.distributed
def test_invalid_context_parallel_inputs(cp_pool):
    cp_pool.run(attention_mask_is_refused)
