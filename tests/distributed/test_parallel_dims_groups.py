"""`ParallelDims.build_mesh` on 2 and 4 gloo ranks: one mesh whose named axes ("pp", the data-parallel axis, "cp")
multiply to the world size, whose `cp` axis is every rank's group of consecutive ranks, and under FSDP2 a flattened
axis of every rank to shard over; what a rank holds of an FSDP2-sharded module (`storage_bytes`)."""

import math

import pytest
import torch
import torch.distributed as dist
from process_pool import ProcessGroupPool, subgroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from hf_spec_cotrain.parallel import ParallelDims
from hf_spec_cotrain.testing import storage_bytes


pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def pools(cp_pool):
    """The pools by world size: the module's 4 ranks, and 2 ranks started on first use."""
    pair = ProcessGroupPool(2)
    yield {4: cp_pool, 2: pair}
    pair.close()


def run_build_mesh(context_parallel_size: int, pipeline_parallel_size: int, fsdp: bool):
    dims = ParallelDims(context_parallel_size, pipeline_parallel_size, world_size=dist.get_world_size(), fsdp=fsdp)
    mesh = dims.build_mesh("cpu")
    axes = mesh.mesh_dim_names + (("dp_shard_cp",) if dims.cp_enabled and fsdp else ())
    members = {axis: dist.get_process_group_ranks(mesh[axis].get_group()) for axis in axes}
    total = torch.tensor([dist.get_rank()])
    dist.all_reduce(total, group=mesh[mesh.mesh_dim_names[-1]].get_group())  # the group works: exactly these ranks
    return mesh.mesh_dim_names, tuple(mesh.mesh.shape), dims.mesh_axes, members, int(total)


@pytest.mark.parametrize(
    ("world_size", "cp", "pp", "fsdp"),
    [
        (2, 2, 1, False),  # DDP = 1 x CP = 2
        (2, 2, 1, True),  # FSDP2 = 1 x CP = 2
        (2, 1, 2, False),  # PP = 2
        (4, 2, 1, False),  # DDP = 2 x CP = 2
        (4, 2, 1, True),  # FSDP2 = 2 x CP = 2
        (4, 4, 1, False),
        (4, 4, 1, True),
        (4, 1, 4, False),  # PP = 4
    ],
)
def test_the_mesh_names_every_axis_and_multiplies_to_the_world(pools, world_size, cp, pp, fsdp):
    data_axis = "dp_shard" if fsdp else "dp_replicate"
    for rank, (names, shape, axes, members, total) in enumerate(pools[world_size].run(run_build_mesh, cp, pp, fsdp)):
        assert names == ("pp",) * (pp > 1) + (data_axis,) + ("cp",) * (cp > 1)
        assert shape == tuple(axes.values()) and tuple(axes) == names
        assert math.prod(shape) == world_size
        assert total == sum(members[names[-1]])
        if pp > 1:
            assert members == {"pp": list(range(world_size)), data_axis: [rank]}  # every stage, no data parallelism
            continue
        start = rank - rank % cp
        assert members["cp"] == list(range(start, start + cp))
        assert members[data_axis] == list(range(rank % cp, world_size, cp))  # the same position in every group
        assert members.get("dp_shard_cp") == (list(range(world_size)) if fsdp else None)


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
