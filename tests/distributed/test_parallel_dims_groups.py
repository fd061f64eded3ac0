"""`ParallelDims.build_mesh` on 4 gloo ranks: the 2-D mesh (data parallel x context parallel), whose `cp` axis is
every rank's group of consecutive ranks, and under FSDP2 a flattened axis of every rank to shard over; what a rank
holds of an FSDP2-sharded module (`storage_bytes`)."""

import pytest
import torch
import torch.distributed as dist
from process_pool import subgroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from hf_spec_cotrain.parallel import ParallelDims
from hf_spec_cotrain.testing import storage_bytes


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


def run_sharded_storage():
    """A small module's bytes before and after `fully_shard` over 2 ranks, and after a backward (gradients too)."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    full = storage_bytes(module)
    row_bytes = sum(param[0].numel() * param.element_size() for param in module.parameters())
    fully_shard(module, mesh=DeviceMesh.from_group(subgroup(2), "cpu"))
    sharded = storage_bytes(module)
    module(torch.randn(4, 7)).sum().backward()
    return full, row_bytes, sharded, storage_bytes(module)


def test_state_bytes_count_a_sharded_parameter_as_its_local_shard(cp_pool):
    """Each of 2 ranks holds half of every parameter (an odd first dimension adds at most one row of padding), and
    half of every gradient after a backward."""
    for full, row_bytes, sharded, with_grads in cp_pool.run(run_sharded_storage):
        assert full == (7 * 5 + 5 + 5 * 3 + 3) * 4
        assert full / 2 <= sharded <= full / 2 + row_bytes
        assert full <= with_grads <= full + 2 * row_bytes
