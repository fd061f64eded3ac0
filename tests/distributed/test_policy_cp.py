"""The policy's GRPO forward under context parallelism on gloo: per-token log-probs, entropies and parameter
gradients of the zigzag-sharded policy (ring attention in its own layers, gradient checkpointing on) against the
unsharded forward of TRL's fused head, in float64. Sliding windows and sinks against transformers' own masks and
gpt-oss's eager attention."""

import pytest
import torch
import torch.distributed as dist
from process_pool import subgroup
from trl.trainer.utils import add_fused_lm_head

from hf_spec_cotrain.attention.hf_adapter import zigzag_ring_attention
from hf_spec_cotrain.parallel import all_reduce_gradients
from hf_spec_cotrain.parallel.packed_rows import IGNORE_INDEX, pack_rows, policy_log_probs
from hf_spec_cotrain.testing import build_tiny_target


pytestmark = pytest.mark.distributed


def rows_of(prompt_lengths, completion_lengths, prompt_width, completion_width):
    generator = torch.Generator().manual_seed(21)
    batch = len(prompt_lengths)
    prompt_mask = (torch.arange(prompt_width) >= prompt_width - torch.tensor(prompt_lengths)[:, None]).long()
    completion_mask = (torch.arange(completion_width) < torch.tensor(completion_lengths)[:, None]).long()
    prompt_ids = torch.randint(4, 60, (batch, prompt_width), generator=generator).masked_fill(prompt_mask == 0, 0)
    completion_ids = torch.randint(4, 60, (batch, completion_width), generator=generator)
    return prompt_ids, prompt_mask, completion_ids.masked_fill(completion_mask == 0, 0), completion_mask


def check_policy_parity(size: int, family: str, window: int | None) -> float:
    group = subgroup(size)
    rank = dist.get_rank(group)
    model = build_tiny_target(
        family,
        num_layers=3,
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=96,
        seed=2,
        dtype=torch.float64,
        sliding_window=window,
    )
    if family in ("qwen3_moe", "gpt_oss"):
        model.set_experts_implementation("eager")  # torch's grouped matmul takes no float64
    add_fused_lm_head(model, temperature=0.9, outputs=("log_probs", "entropy"))
    model.gradient_checkpointing_enable()  # the recomputation in the backward runs the ring again
    model.train()
    # Documents of 23, 9, 30 and 14 real tokens: padded to multiples of 2W, several chunks cut the completions.
    rows = rows_of([9, 3, 12, 6], [14, 6, 18, 8], prompt_width=12, completion_width=18)
    weights = torch.randn(2, 4, 18, generator=torch.Generator().manual_seed(5), dtype=torch.float64)

    def loss_of(logps, entropies):  # nonlinear, like the GRPO loss
        return (weights[0] * logps.exp()).sum() + (weights[1] * entropies).sum()

    input_ids = torch.cat([rows[0], rows[2]], dim=1)
    attention_mask = torch.cat([rows[1], rows[3]], dim=1)
    labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
    labels[:, :-18] = IGNORE_INDEX
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=(attention_mask.cumsum(1) - 1).clamp(min=0),  # float32 RoPE tables: same positions as packed
        labels=labels,
        fused_lm_head=True,
    )
    ref_logps, ref_entropies = out.log_probs[:, -18:], out.entropy[:, -18:]
    loss_of(ref_logps, ref_entropies).backward()
    ref_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    packed = pack_rows(*rows, rank=rank, world_size=size)
    assert packed.input_ids.shape[1] * size == int(packed.cu_seqlens[-1])
    with zigzag_ring_attention(model):
        logps, entropies = policy_log_probs(model, packed, group=group)
        loss = loss_of(logps, entropies)
        loss.backward()
    all_reduce_gradients(model.parameters(), group)
    torch.testing.assert_close(logps, ref_logps, rtol=0, atol=1e-10)
    torch.testing.assert_close(entropies, ref_entropies, rtol=0, atol=1e-10)
    head = model.get_output_embeddings().weight
    for name, parameter in model.named_parameters():
        # TRL's fused head accumulates its weight gradient in float32 (whatever the dtype): the shards' partial sums
        # then differ from the one-device sum by float32 rounding. Every other gradient is float64.
        tolerance = {"rtol": 1e-6, "atol": 1e-6} if parameter is head else {"rtol": 1e-9, "atol": 1e-10}
        torch.testing.assert_close(parameter.grad, ref_grads[name], **tolerance, msg=name)
    return float(packed.shift_labels.ne(IGNORE_INDEX).sum())


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize(
    "family, window",
    # MoE layers route each token on its own. gpt-oss: sinks, and a window of 3 on every other layer, shorter than
    # most chunks (ring steps 0, 1 and W - 1 only at W = 4); Mistral: a window of 5 on every layer.
    [("llama", None), ("qwen3", None), ("qwen3_moe", None), ("gpt_oss", 3), ("mistral", 5)],
)
def test_sharded_policy_log_probs_and_gradients_equal_one_device(cp_pool, size, family, window):
    scored = cp_pool.run(check_policy_parity, size, family, window)
    # every rank scored a part of the 46 completion tokens, and each group scored all of them once
    assert all(count > 0 for count in scored)
    assert [sum(scored[start : start + size]) for start in range(0, 4, size)] == [46.0] * (4 // size)
