"""The chunked, checkpointed head loss against the eager soft cross-entropy on materialised logits."""

import pytest
import torch
from torch import nn

from hf_spec_cotrain.losses import head_soft_cross_entropy, soft_cross_entropy


def _head(hidden_size, vocab, dtype, seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.LayerNorm(hidden_size), nn.Linear(hidden_size, vocab, bias=False)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk_elements", [7 * 37, 10**9])  # many uneven chunks / one chunk
def test_head_loss_matches_eager_loss_and_gradients(dtype, chunk_elements):
    head = _head(24, 37, dtype, seed=0)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 11, 24, generator=g, dtype=dtype, requires_grad=True)
    teacher = 2 * torch.randn(3, 11, 37, generator=g, dtype=dtype)
    counted = torch.rand(3, 11, generator=g) < 0.6
    tol = {"rtol": 1e-10, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-6}
    want = soft_cross_entropy(head(hidden), teacher, counted)
    got = head_soft_cross_entropy(head, hidden, teacher, counted, chunk_elements=chunk_elements)
    for g_value, w_value in zip(got, want):
        torch.testing.assert_close(g_value.to(w_value.dtype), w_value, **tol)
    params = [hidden, *head.parameters()]
    for g_grad, w_grad in zip(torch.autograd.grad(got[0], params), torch.autograd.grad(want[0], params)):
        torch.testing.assert_close(g_grad, w_grad, **tol)


def test_global_count_and_nothing_counted():
    head = _head(8, 5, torch.float64, seed=2)
    hidden = torch.randn(1, 6, 8, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(1, 6, 5, dtype=torch.float64)
    counted = torch.tensor([[True, False, True, True, False, False]])
    share, _, count = head_soft_cross_entropy(head, hidden, teacher, counted, total_count=torch.tensor(6))
    full, _, _ = head_soft_cross_entropy(head, hidden, teacher, counted)
    assert count == 3
    torch.testing.assert_close(share, full * 3 / 6)
    none = head_soft_cross_entropy(head, hidden, teacher, torch.zeros_like(counted))
    assert none[0].item() == 0.0 and none[2].item() == 0
    none[0].backward()
    assert hidden.grad is None or torch.count_nonzero(hidden.grad) == 0
