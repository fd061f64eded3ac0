"""Speculative generation on an FSDP2-sharded policy (`gathered_for_generation`): ranks that decode different numbers
of rounds must not meet in each forward's all-gather, the output equals the unsharded policy's, and on the way out
every module is sharded again with its own `reshard_after_forward`, as a forward shows."""

import pytest
import torch
import torch.distributed as dist
from process_pool import subgroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from hf_spec_cotrain import speculative_generate
from hf_spec_cotrain.parallel.fsdp import apply_fsdp2, gathered_for_generation
from hf_spec_cotrain.testing import build_pass_through_draft, build_tiny_target


pytestmark = pytest.mark.distributed
SIZE = 2


def tiny_policy():
    return build_tiny_target(
        "llama", num_layers=3, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32, seed=5
    ).eval()


def sharded_pattern(model) -> dict[str, bool]:
    """Which parameters are held sharded (as DTensors) right now."""
    return {name: isinstance(parameter, DTensor) for name, parameter in model.named_parameters()}


def generate_on_a_sharded_policy(first_forward_inside: bool) -> dict:
    group = subgroup(SIZE)
    rank = dist.get_rank(group)
    mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("dp_shard",))
    reference, sharded, untouched = tiny_policy(), apply_fsdp2(tiny_policy(), mesh), apply_fsdp2(tiny_policy(), mesh)
    draft = build_pass_through_draft(reference, seed=1, noise=0.05, aux_layer_ids=(0, 1, 2))
    # Each rank its own prompts, of its own length and count: the decoders' rounds differ between ranks.
    generator = torch.Generator().manual_seed(100 + rank)
    prompt = torch.randint(3, reference.config.vocab_size, (rank + 1, 5 + 3 * rank), generator=generator)
    max_new_tokens = 6 + 5 * rank
    with torch.no_grad():
        if not first_forward_inside:  # FSDP2 sets the root up at its first forward
            sharded(prompt)
        with gathered_for_generation(sharded) as policy:
            got = speculative_generate(policy, draft, prompt, max_new_tokens=max_new_tokens, num_speculative_tokens=3)
        want = speculative_generate(reference, draft, prompt, max_new_tokens=max_new_tokens, num_speculative_tokens=3)
        after_generation = sharded_pattern(sharded)
        sharded(prompt)  # a forward as training runs it: what it leaves gathered must be what it did before
        untouched(prompt)
    return {
        "equal": torch.equal(got.sequences, want.sequences),
        "rounds": len(got.rounds),
        "sharded_after_generation": after_generation,
        "after_forward": sharded_pattern(sharded),
        "after_forward_untouched": sharded_pattern(untouched),
    }


@pytest.mark.parametrize("first_forward_inside", [True, False], ids=["first-forward-inside", "after-a-forward"])
def test_speculative_generation_on_a_sharded_policy(cp_pool, first_forward_inside):
    results = cp_pool.run(generate_on_a_sharded_policy, first_forward_inside)[:SIZE]
    assert results[0]["rounds"] != results[1]["rounds"]  # the ranks' forwards differ in number
    for result in results:
        assert result["equal"], "speculative output on the gathered policy differs from the unsharded policy's"
        assert all(result["sharded_after_generation"].values()), "left gathered after generation"
        # blocks reshard after forward, the root keeps its own parameters gathered: as a model never gathered
        assert result["after_forward"] == result["after_forward_untouched"]
        assert any(result["after_forward"].values()) and not all(result["after_forward"].values())
