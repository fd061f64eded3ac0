"""The policy's attention under context parallelism inside bf16 / fp16 autocast (accelerate's `mixed_precision`).

Under autocast a Llama layer hands its attention q and k in float32 (RoPE tables follow the float32 residual stream)
and v in the autocast dtype (the projection's output). transformers' SDPA and eager attentions then compute in the
autocast dtype; the ring adapter must do the same: its zigzag shards of the layer's output and of every gradient are
compared with the unsharded layer under the same autocast.
"""

import pytest
import torch
import torch.distributed as dist
from process_pool import subgroup

from hf_spec_cotrain.attention.hf_adapter import zigzag_ring_attention, zigzag_ring_attention_forward
from hf_spec_cotrain.parallel import all_reduce_gradients, zigzag_position_ids, zigzag_shard
from hf_spec_cotrain.testing import build_tiny_target


pytestmark = pytest.mark.distributed
DOCUMENT_LENGTHS = (8, 12)  # packed; multiples of 2W for W = 2


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def check_layer_under_autocast(size: int, dtype_name: str, implementation: str) -> dict[str, float]:
    group = subgroup(size)
    rank = dist.get_rank(group)
    dtype = getattr(torch, dtype_name)
    model = build_tiny_target(
        "llama", num_layers=1, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, seed=3
    )
    model.config._attn_implementation = implementation
    rotary, layer = model.model.rotary_emb, model.model.layers[0].self_attn
    value_dtypes = []
    layer.v_proj.register_forward_hook(lambda module, args, out: value_dtypes.append(out.dtype))
    cu_seqlens = torch.tensor([0, *torch.tensor(DOCUMENT_LENGTHS).cumsum(0).tolist()])
    length = int(cu_seqlens[-1])
    generator = torch.Generator().manual_seed(7)
    hidden = torch.randn(1, length, 64, generator=generator)
    upstream = torch.randn(1, length, 64, generator=generator)
    document = torch.repeat_interleave(torch.arange(len(DOCUMENT_LENGTHS)), torch.tensor(DOCUMENT_LENGTHS))
    positions = torch.arange(length) - cu_seqlens[document]
    allowed = (document[:, None] == document[None, :]) & torch.ones(length, length, dtype=torch.bool).tril()
    # SDPA takes a boolean mask, the eager attention an additive one
    mask = allowed if implementation == "sdpa" else torch.zeros(length, length).masked_fill(~allowed, float("-inf"))

    full = hidden.clone().requires_grad_()
    with torch.autocast("cpu", dtype=dtype):
        cos, sin = rotary(full, positions[None])
        want, _ = layer(full, position_embeddings=(cos, sin), attention_mask=mask[None, None])
    want.backward(upstream.to(want.dtype))
    want_grads = {name: parameter.grad.clone() for name, parameter in layer.named_parameters()}
    layer.zero_grad()
    assert cos.dtype == torch.float32 and value_dtypes == [dtype], "q, k (after RoPE) and v must reach it mixed"

    shard = zigzag_shard(hidden, 1, rank, size, cu_seqlens=cu_seqlens).requires_grad_()
    shard_positions = zigzag_position_ids(rank, size, cu_seqlens=cu_seqlens)
    with torch.autocast("cpu", dtype=dtype), zigzag_ring_attention(model):
        cos, sin = rotary(shard, shard_positions[None])
        got, _ = layer(
            shard, position_embeddings=(cos, sin), attention_mask=None, cu_seqlens=cu_seqlens, cp_group=group
        )
        got.backward(zigzag_shard(upstream, 1, rank, size, cu_seqlens=cu_seqlens).to(got.dtype))
    all_reduce_gradients(layer.parameters(), group)

    assert got.dtype == want.dtype == dtype, (got.dtype, want.dtype)
    errors = {
        "out": relative_error(got, zigzag_shard(want, 1, rank, size, cu_seqlens=cu_seqlens)),
        "dhidden": relative_error(shard.grad, zigzag_shard(full.grad, 1, rank, size, cu_seqlens=cu_seqlens)),
    }
    errors.update(
        {f"d{name}": relative_error(parameter.grad, want_grads[name]) for name, parameter in layer.named_parameters()}
    )
    return errors


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
def test_ring_attention_under_autocast_equals_the_policys_own_attention(cp_pool, dtype_name, implementation):
    # Both sides round q, k, v and the products to that dtype, in different orders: measured below one unit of
    # its rounding (eps), relative to each tensor's norm.
    tolerance = 2 * torch.finfo(getattr(torch, dtype_name)).eps
    for rank, errors in enumerate(cp_pool.run(check_layer_under_autocast, 2, dtype_name, implementation)):
        worst = max(errors, key=errors.get)
        assert errors[worst] < tolerance, f"rank {rank}: {worst} relative error {errors[worst]:.3g} ({errors})"


def test_outside_autocast_mixed_dtypes_are_still_refused():
    """Only autocast decides the compute dtype; without it a v in another dtype than q is a caller's mistake."""
    model = build_tiny_target("llama", num_layers=1, hidden_size=64, num_attention_heads=2, num_key_value_heads=1)
    query = torch.randn(1, 2, 8, 32)
    value = torch.randn(1, 1, 8, 32, dtype=torch.bfloat16)
    layer = model.model.layers[0].self_attn
    with pytest.raises(ValueError, match=r"v must have q's dtype torch.float32, got torch.bfloat16"):
        zigzag_ring_attention_forward(layer, query, value.float(), value, None, cu_seqlens=torch.tensor([0, 8]))
