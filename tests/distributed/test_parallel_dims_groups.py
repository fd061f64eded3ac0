"""`ParallelDims.build_mesh` on 4 gloo ranks: the 2-D mesh (data parallel x context parallel), whose `cp` axis is
every rank's group of consecutive ranks, and under FSDP2 a flattened axis of every rank to shard over."""

import pytest
import torch
import torch.distributed as dist

from hf_spec_cotrain.parallel import ParallelDims


pytestmark = pytest.mark.distributed


def run_build_mesh(size: int, fsdp: bool):
    mesh = ParallelDims(context_parallel_size=size, world_size=dist.get_world_size(), fsdp=fsdp).build_mesh("cpu")
    group = mesh["cp"].get_group()
    total = torch.tensor([dist.get_rank()])
    dist.all_reduce(total, group=group)  # the group works, and holds exactly these ranks
    data_parallel = mesh.mesh_dim_names[0]
    shard = dist.get_process_group_ranks(mesh["dp_shard_cp"].get_group()) if fsdp else None
    return dist.get_process_group_ranks(group), int(total), data_parallel, mesh[data_parallel].mesh.tolist(), shard


@pytest.mark.parametrize("fsdp", [False, True])
@pytest.mark.parametrize("size", [2, 4])
def test_the_mesh_has_groups_of_consecutive_ranks_along_cp(cp_pool, size, fsdp):
    for rank, (members, total, axis, data_parallel, shard) in enumerate(cp_pool.run(run_build_mesh, size, fsdp)):
        start = rank - rank % size
        assert members == list(range(start, start + size))
        assert total == sum(members)
        assert axis == ("dp_shard" if fsdp else "dp_replicate")
        assert data_parallel == list(range(rank % size, 4, size))  # the same position in every group
        assert shard == (list(range(4)) if fsdp else None)
