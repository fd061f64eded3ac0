"""A draft sharded with FSDP2 (`shard_draft`) at rollout time: speculative decoding on ranks that run different
numbers of rounds drafts through it gathered for generation (`gathered_for_generation`) and equals the replicated
draft, and an engine push gathers it one tensor at a time (`full_state_items`)."""

import pytest
import torch
import torch.distributed as dist
from process_pool import subgroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from hf_spec_cotrain import speculative_generate
from hf_spec_cotrain.parallel.fsdp import full_state_items, gathered_for_generation, shard_draft
from hf_spec_cotrain.testing import build_pass_through_draft, build_tiny_target


pytestmark = pytest.mark.distributed
SIZE = 2


def draft_pair(drafter: str, policy):
    if drafter == "dflash":
        options = {"block_size": 4, "mask_token_id": 3}
    else:
        options = {"aux_layer_ids": (0, 1, 2)}
    return [build_pass_through_draft(policy, seed=1, noise=0.05, drafter=drafter, **options) for _ in range(2)]


def generate_with_a_sharded_draft(drafter: str) -> dict:
    group = subgroup(SIZE)
    rank = dist.get_rank(group)
    mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("dp_shard",))
    policy = build_tiny_target(
        "llama", num_layers=3, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32, seed=5
    ).eval()
    replicated, sharded = draft_pair(drafter, policy)
    shard_draft(sharded, mesh)
    generator = torch.Generator().manual_seed(100 + rank)
    prompt = torch.randint(3, policy.config.vocab_size, (rank + 1, 5 + 3 * rank), generator=generator)
    kwargs = dict(max_new_tokens=6 + 5 * rank, num_speculative_tokens=3)
    with torch.no_grad():
        with gathered_for_generation(sharded) as draft:
            got = speculative_generate(policy, draft, prompt, **kwargs)
        want = speculative_generate(policy, replicated, prompt, **kwargs)
    pushed, gathers_before, gathers = {}, [], []
    full_tensor = DTensor.full_tensor

    def counted_full_tensor(tensor):
        gathers.append(tuple(tensor.shape))
        return full_tensor(tensor)

    DTensor.full_tensor = counted_full_tensor
    try:
        for name, tensor in full_state_items(sharded):  # the engine's side of a push
            gathers_before.append(len(gathers))
            pushed[name] = tensor.clone()
    finally:
        DTensor.full_tensor = full_tensor
    sharded_names = [name for name, tensor in sharded.state_dict().items() if isinstance(tensor, DTensor)]
    return {
        "equal": torch.equal(got.sequences, want.sequences),
        "rounds": len(got.rounds),
        "sharded_after": all(isinstance(p, DTensor) for p in sharded.parameters()),
        "pushed_equal": pushed.keys() == replicated.state_dict().keys()
        and all(torch.equal(pushed[n], t) for n, t in replicated.state_dict().items()),
        "pushed_types": sorted({type(t).__name__ for t in pushed.values()}),
        # each sharded tensor gathered when it is reached, not before: one whole tensor at a time
        "one_at_a_time": len(gathers) == len(sharded_names) > 0
        and gathers_before == [sum(n in sharded_names for n in list(pushed)[: i + 1]) for i in range(len(pushed))],
    }


@pytest.mark.parametrize("drafter", ["eagle3", pytest.param("dflash", marks=pytest.mark.slow)])
def test_speculative_generation_and_engine_push_with_a_sharded_draft(cp_pool, drafter):
    results = cp_pool.run(generate_with_a_sharded_draft, drafter)[:SIZE]
    assert results[0]["rounds"] != results[1]["rounds"]  # the ranks' draft forwards differ in number
    for result in results:
        assert result["equal"], "speculative output with the gathered draft differs from the replicated draft's"
        assert result["sharded_after"], "the draft was left gathered after generation"
        assert result["pushed_equal"] and result["pushed_types"] == ["Tensor"]
        assert result["one_at_a_time"], "the push did not gather the draft one tensor at a time"
