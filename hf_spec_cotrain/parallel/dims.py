"""`ParallelDims`: how a run splits its ranks, validated in one place and passed around as one object (torchtitan's
`ParallelDims`).

A run has three sizes: pipeline stages (`pipeline_parallel_size`, one rank each), context-parallel groups of
consecutive ranks that shard each sequence (`context_parallel_size`), and what the world size leaves, data
parallelism (`dp`): DDP replicas (`dp_replicate`), or with FSDP2 the shard degree (`dp_shard`; no HSDP). Their
product is the world size, and `build_mesh` lays the ranks out on one device mesh with those named axes. Context and
pipeline parallelism are exclusive. What the run's options and policy must satisfy under each is checked by
`compatibility` (`from_config`, `check_policy`).
"""

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..validation import check_int
from .compatibility import (
    check_parallel_options,
    check_parallel_policy,
    launcher_fsdp_version,
    parallelism_config_shards,
)


@dataclass(frozen=True)
class ParallelDims:
    """The context- and pipeline-parallel sizes of a run, and its world size when known (None: not yet).

    Attributes:
        context_parallel_size: ranks per context-parallel group (consecutive ranks); must divide the world size.
        pipeline_parallel_size: pipeline stages, one rank each; must equal the world size.
        world_size: the number of processes; None skips the checks against it (a config on its own).
        fsdp: the policy is sharded with FSDP2 (over every rank of the mesh) rather than replicated (DDP).
        data_parallel_size: the data-parallel degree the run asks for (a `ParallelismConfig`'s `dp_shard_size`);
            the world size must then be exactly it times `context_parallel_size`. None: whatever the world size
            leaves.
    """

    context_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    world_size: int | None = None
    fsdp: bool = False
    data_parallel_size: int | None = None

    def __post_init__(self):
        cp = check_int(self.context_parallel_size, "context_parallel_size")
        pp = check_int(self.pipeline_parallel_size, "pipeline_parallel_size")
        if cp > 1 and pp > 1:
            raise ValueError(
                f"`context_parallel_size`={cp} cannot be combined with `pipeline_parallel_size`={pp}: a run either "
                "shards its sequences or cuts its policy into stages. Set one of them to 1."
            )
        if self.world_size is None:
            return
        world_size = check_int(self.world_size, "world_size")
        if world_size % cp:
            raise ValueError(
                f"`context_parallel_size`={cp} must divide the world size ({world_size} processes): launch a "
                f"multiple of {cp} processes, or lower `context_parallel_size`."
            )
        if self.data_parallel_size is not None and world_size != self.data_parallel_size * cp:
            raise ValueError(
                f"The world size ({world_size} processes) is not the mesh's data-parallel size "
                f"{self.data_parallel_size} x `context_parallel_size`={cp}: launch {self.data_parallel_size * cp} "
                "processes, or change the sizes."
            )
        if pp > 1 and world_size != pp:
            raise ValueError(
                f"`pipeline_parallel_size`={pp} must equal the world size ({world_size} processes): launch one "
                "process per pipeline stage."
            )

    @property
    def cp_enabled(self) -> bool:
        return self.context_parallel_size > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pipeline_parallel_size > 1

    @property
    def dp(self) -> int:
        """The data-parallel degree: how many model replicas (or FSDP2 shard groups) see rows of their own (1 under
        pipeline parallelism)."""
        return self._known_world_size("dp") // (self.context_parallel_size * self.pipeline_parallel_size)

    @property
    def dp_replicate(self) -> int:
        """DDP replicas: the data-parallel degree without FSDP, else 1."""
        return 1 if self.fsdp else self.dp

    @property
    def dp_shard(self) -> int:
        """The FSDP2 shard degree (accelerate's `dp_shard_size`): the data-parallel degree under FSDP, else 1."""
        return self.dp if self.fsdp else 1

    @property
    def data_parallel_axis(self) -> str:
        """The mesh's data-parallel axis, in accelerate's names: "dp_shard" under FSDP2, else "dp_replicate"."""
        return "dp_shard" if self.fsdp else "dp_replicate"

    @property
    def mesh_axes(self) -> dict[str, int]:
        """The axes of `build_mesh` in order, with their sizes, whose product is the world size: "pp" and "cp" where
        those parallelisms are on, and the data-parallel axis always (of size 1 too, so that it can be named)."""
        sizes = {
            "pp": self.pipeline_parallel_size,
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "cp": self.context_parallel_size,
        }
        return {axis: size for axis, size in sizes.items() if size > 1 or axis == self.data_parallel_axis}

    @property
    def mesh_axis_names(self) -> tuple[str, ...]:
        return tuple(self.mesh_axes)

    @classmethod
    def from_config(
        cls,
        config,
        *,
        world_size: int | None = None,
        deepspeed: bool = False,
        fsdp: bool = False,
        fsdp_version: int | None = None,
        peft: bool = False,
        tools: bool = False,
    ) -> "ParallelDims":
        """The dims of a `SpecCoTrainConfig` (read by attribute), once its options are checked against them.

        Without `world_size` (the config on its own) only the options are checked. The trainer passes the world
        size and what it knows at run time: DeepSpeed or FSDP enabled (by the config or by accelerate's) and
        accelerate's FSDP version, a PEFT policy, tool calls. FSDP is also on when the config asks for it (`fsdp`, or a
        `parallelism_config` that shards), even where accelerate dropped it (on CPU).
        """
        launched_fsdp_version = launcher_fsdp_version()
        fsdp = (
            fsdp
            or bool(config.fsdp)
            or parallelism_config_shards(config.parallelism_config)
            or launched_fsdp_version is not None
        )
        fsdp_version = fsdp_version or launched_fsdp_version
        dims = cls(
            config.context_parallel_size,
            config.pipeline_parallel_size,
            world_size,
            fsdp,
            config.data_parallel_shard_size,
        )
        check_parallel_options(
            config,
            context_parallel=dims.cp_enabled,
            pipeline_parallel=dims.pp_enabled,
            deepspeed=deepspeed,
            fsdp=fsdp,
            fsdp_version=fsdp_version,
            peft=peft,
            tools=tools,
        )
        return dims

    def check_policy(self, policy, *, aux_loss: bool = False) -> None:
        """Refuse, at trainer start, a policy whose layers this run's parallel step would compute wrongly
        (`check_parallel_policy`; `aux_loss`: TRL adds a MoE auxiliary loss)."""
        check_parallel_policy(
            policy,
            context_parallel_size=self.context_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            aux_loss=aux_loss,
        )

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """The run's device mesh, with the axes `mesh_axes`; None under plain data parallelism, whose one group is
        the world. Collective over the world.

        A context-parallel group is the "cp" axis: `context_parallel_size` consecutive ranks; the data-parallel axis
        holds the same position of every group. Under FSDP2 the mesh also has the flattened axis "dp_shard_cp"
        (every rank, accelerate's and torchtitan's name), which the policy is sharded over: the ranks of a
        context-parallel group hold the same parameters. A pipeline run's "pp" axis is the world.
        """
        if not (self.cp_enabled or self.pp_enabled):
            return None
        self._known_world_size("build_mesh")
        axes = self.mesh_axes
        mesh = init_device_mesh(device_type, tuple(axes.values()), mesh_dim_names=tuple(axes))
        if self.cp_enabled and self.fsdp:
            mesh[(self.data_parallel_axis, "cp")]._flatten("dp_shard_cp")
        return mesh

    def build_shard_mesh(self, device_type: str) -> DeviceMesh:
        """The 1-D mesh the policy is sharded over under FSDP2 (no HSDP: every rank), named as `build_mesh` names
        it ("dp_shard_cp" under context parallelism, else "dp_shard"); the sharded draft (`shard_draft`) is sharded
        over it too. Collective over the world."""
        if not self.fsdp or self.pp_enabled:
            raise ValueError("Only an FSDP2 run without pipeline parallelism shards over every rank.")
        name = "dp_shard_cp" if self.cp_enabled else self.data_parallel_axis
        return init_device_mesh(device_type, (self._known_world_size("build_shard_mesh"),), mesh_dim_names=(name,))

    def _known_world_size(self, needed_by: str) -> int:
        if self.world_size is None:
            raise ValueError(f"ParallelDims.{needed_by} needs the world size: build the dims with `world_size=`.")
        return self.world_size
