"""`ParallelDims.build_context_parallel_group` on 4 gloo ranks: every rank gets the group of its consecutive ranks."""

import pytest
import torch
import torch.distributed as dist

from hf_spec_cotrain.parallel import ParallelDims


pytestmark = pytest.mark.distributed


def run_build_groups(size: int):
    group = ParallelDims(context_parallel_size=size, world_size=dist.get_world_size()).build_context_parallel_group()
    total = torch.tensor([dist.get_rank()])
    dist.all_reduce(total, group=group)  # the group works, and holds exactly these ranks
    return dist.get_process_group_ranks(group), int(total)


@pytest.mark.parametrize("size", [2, 4])
def test_every_rank_gets_its_block_of_consecutive_ranks(cp_pool, size):
    for rank, (members, total) in enumerate(cp_pool.run(run_build_groups, size)):
        start = rank - rank % size
        assert members == list(range(start, start + size))
        assert total == sum(members)
