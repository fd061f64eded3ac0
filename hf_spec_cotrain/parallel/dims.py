"""`ParallelDims`: how a run splits its ranks, validated in one place and passed around as one object.

Context parallelism shards each sequence over groups of consecutive ranks; pipeline parallelism cuts the policy
into one stage per rank of the world; what is left over is data parallelism. The two are exclusive. Under context
parallelism the ranks form a 2-D device mesh, data parallel x context parallel (`build_mesh`): the data-parallel axis
holds DDP replicas, or with FSDP2 the shard axis (accelerate's `dp_shard`; the policy is then sharded over the whole
mesh, accelerate's and torchtitan's `dp_shard_cp`, since the ranks of a context-parallel group hold the same
parameters), and the ring runs along the context-parallel axis. The sizes are
checked against each other and, once the world size is known, against it; `from_config` also checks the options
of a run that those parallelisms cannot honour, so that the config (at construction) and the trainer (at start,
with the facts only it knows) reject the same things with the same messages.
"""

import os
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..losses import GRPO_LOSS_TYPES
from ..validation import ATTENTION_LAYER_TYPES, check_int, layer_types
from .pipeline import MIN_MICROBATCHES, PIPELINE_SCHEDULES, TAP_TRANSPORTS, min_microbatches


AUX_LOSS_OPTIONS = "TRL's `router_aux_loss_coef`, on by default for MoE policies, or `output_router_logits=True`"


@dataclass(frozen=True)
class ParallelDims:
    """The context- and pipeline-parallel sizes of a run, and its world size when known (None: not yet).

    Attributes:
        context_parallel_size: ranks per context-parallel group (consecutive ranks); must divide the world size.
        pipeline_parallel_size: pipeline stages, one rank each; must equal the world size.
        world_size: the number of processes; None skips the checks against it (a config on its own).
        fsdp: the policy is sharded with FSDP2 (over every rank of the mesh) rather than replicated (DDP).
        data_parallel_size: the mesh's data-parallel axis when given (accelerate's `dp_shard_size`); the world size
            must then be exactly it times `context_parallel_size`. None: whatever the world size leaves.
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
    def mesh_axis_names(self) -> tuple[str, str]:
        """The axes of `build_mesh`: data parallel (accelerate's names: "dp_shard" under FSDP2, else "dp_replicate"),
        then "cp"."""
        return ("dp_shard" if self.fsdp else "dp_replicate", "cp")

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
            fsdp or bool(config.fsdp) or _fsdp_shards(config.parallelism_config) or launched_fsdp_version is not None
        )
        fsdp_version = fsdp_version or launched_fsdp_version
        data_parallel_size = getattr(config, "_data_parallel_shard_size", None)  # from a `ParallelismConfig`
        dims = cls(config.context_parallel_size, config.pipeline_parallel_size, world_size, fsdp, data_parallel_size)
        if dims.cp_enabled:
            _check_context_parallel_options(config, deepspeed=deepspeed, fsdp_version=fsdp_version)
        if dims.pp_enabled:
            _check_pipeline_parallel_options(config, deepspeed=deepspeed, fsdp=fsdp, peft=peft, tools=tools)
        if config.draft_train_fraction < 1 and (dims.cp_enabled or dims.pp_enabled):
            raise ValueError(
                f"`draft_train_fraction`={config.draft_train_fraction} cannot be combined with `context_parallel_size` "
                "> 1 or `pipeline_parallel_size` > 1: those steps train the draft on packed or pipelined rows, not on "
                "a choice of a micro-batch's sequences (set it to 1.0)."
            )
        return dims

    def check_policy(self, policy, *, aux_loss: bool = False) -> None:
        """Refuse, at trainer start, a policy whose layers this run's parallel step would compute wrongly.

        The zigzag ring attention computes full and sliding-window attention layers (with or without sinks) exactly;
        a recurrent (linear-attention) layer would be computed as something else. The pipelined step cuts stages of
        attention layers (full or sliding, dense or MoE). Neither computes a MoE auxiliary loss: `aux_loss` says
        whether TRL adds one to the GRPO loss (the trainer passes its `aux_loss_enabled`, on for an MoE policy unless
        `router_aux_loss_coef=0`); a policy config with `output_router_logits=True` is refused either way.
        """
        config = policy.config.get_text_config()
        kinds = set(layer_types(config))
        aux_loss = aux_loss or bool(getattr(config, "output_router_logits", False))
        no_aux_loss = ", or set `router_aux_loss_coef=0` if the auxiliary loss is the reason" if aux_loss else ""
        pipeline_reasons = _pipeline_refusals(kinds, aux_loss)
        if self.cp_enabled:
            other = sorted(kinds - {*ATTENTION_LAYER_TYPES, "linear_attention"})
            reasons = {
                "its linear_attention layers carry a recurrent state along the sequence, which has no "
                "sequence-parallel scan yet": "linear_attention" in kinds,
                f"its {other} layers are not attention layers the ring runs": bool(other),
                f"its MoE auxiliary loss ({AUX_LOSS_OPTIONS}) is not computed on sharded sequences": aux_loss,
            }
            pipeline = "" if any(pipeline_reasons.values()) else " or with `pipeline_parallel_size` > 1"
            _refuse_policy(
                f"`context_parallel_size`={self.context_parallel_size}",
                config.model_type,
                reasons,
                f"train it with `context_parallel_size=1` (data parallelism){pipeline}{no_aux_loss}.",
            )
        if self.pp_enabled:
            _refuse_policy(
                f"`pipeline_parallel_size`={self.pipeline_parallel_size}",
                config.model_type,
                pipeline_reasons,
                f"train it with `pipeline_parallel_size=1` (data parallelism){no_aux_loss}.",
            )

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """The 2-D mesh (`dp`, `cp`) of a context-parallel run, `mesh_axis_names`; None without context parallelism.

        A context-parallel group is the `cp` axis: `context_parallel_size` consecutive ranks. Under FSDP2 the mesh also
        has the flattened axis "dp_shard_cp" (every rank), which the policy is sharded over. Collective over the world.
        """
        if not self.cp_enabled:
            return None
        world_size = self._known_world_size("build_mesh")
        mesh = init_device_mesh(
            device_type,
            (world_size // self.context_parallel_size, self.context_parallel_size),
            mesh_dim_names=self.mesh_axis_names,
        )
        if self.fsdp:
            mesh[self.mesh_axis_names]._flatten("dp_shard_cp")
        return mesh

    def _known_world_size(self, needed_by: str) -> int:
        if self.world_size is None:
            raise ValueError(f"ParallelDims.{needed_by} needs the world size: build the dims with `world_size=`.")
        return self.world_size


def _refuse(setting: str, incompatible: dict[str, bool], reason: str) -> None:
    """A ValueError naming every option of `incompatible` that is on, when one is."""
    enabled = [name for name, value in incompatible.items() if value]
    if enabled:
        raise ValueError(f"{setting} cannot be combined with {enabled}: {reason}")


def _pipeline_refusals(kinds: set[str], aux_loss: bool) -> dict[str, bool]:
    """Why the pipelined step would refuse a policy with these layer types (reason -> whether it holds)."""
    other = sorted(kinds - set(ATTENTION_LAYER_TYPES))
    return {
        f"its {other} layers are untested in stage cutting (full and sliding-window attention layers are)": bool(
            other
        ),
        f"the pipelined GRPO loss has no MoE auxiliary loss ({AUX_LOSS_OPTIONS})": aux_loss,
    }


def _refuse_policy(setting: str, family: str, reasons: dict[str, bool], instead: str) -> None:
    """A ValueError naming the family and every reason that holds, when one does."""
    holding = [reason for reason, holds in reasons.items() if holds]
    if holding:
        raise ValueError(f"{setting} cannot train this {family} policy: {'; '.join(holding)}. Instead, {instead}")


def launcher_fsdp_version() -> int | None:
    """The FSDP version `accelerate launch` was asked for (an FSDP config), or None. accelerate builds FSDP from
    these settings, even where it then drops it (on CPU). The launcher exports `FSDP_VERSION` with
    `ACCELERATE_USE_FSDP`; an `Accelerator` given an FSDP plugin sets the latter alone, in its own process."""
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() not in ("1", "true") or "FSDP_VERSION" not in os.environ:
        return None
    return int(os.environ["FSDP_VERSION"])


def _fsdp_shards(parallelism_config) -> bool:
    """Whether accelerate's `ParallelismConfig` (if any) shards the model over a data-parallel axis."""
    return parallelism_config is not None and parallelism_config.dp_shard_size > 1


def _check_context_parallel_options(config, *, deepspeed: bool, fsdp_version: int | None) -> None:
    """Options that the context-parallel training step cannot honour."""
    if fsdp_version is None and config.fsdp:
        fsdp_version = (config.fsdp_config or {}).get("version", 1)  # transformers' default FSDP is version 1
    parallelism = config.parallelism_config
    incompatible = {
        "use_liger_kernel": config.use_liger_kernel,  # its GRPO loss reads unsharded hidden states
        "deepspeed": deepspeed or config.deepspeed,
        f"fsdp_version={fsdp_version}": fsdp_version not in (None, 2),
        "parallelism_config.dp_replicate_size > 1": parallelism is not None and parallelism.dp_replicate_size > 1,
        "parallelism_config.tp_size > 1": parallelism is not None and parallelism.tp_size > 1,
    }
    _refuse(
        f"`context_parallel_size`={config.context_parallel_size}",
        incompatible,
        "context parallelism runs with the plain GRPO loss on a 2-D mesh, data parallel (DDP, or FSDP2 over every "
        "rank) x context parallel. Unset them, use FSDP version 2, or set `context_parallel_size=1`.",
    )


def _check_pipeline_parallel_options(config, *, deepspeed: bool, fsdp: bool, peft: bool, tools: bool) -> None:
    """Options that the pipelined training step cannot honour."""
    size = config.pipeline_parallel_size
    schedule = config.pipeline_schedule
    if not isinstance(schedule, str) or schedule.lower() not in PIPELINE_SCHEDULES:
        raise ValueError(f"`pipeline_schedule`={schedule!r} is not allowed: choose '1F1B' or 'GPipe'.")
    if config.pipeline_tap_transport not in TAP_TRANSPORTS:
        raise ValueError(
            f"`pipeline_tap_transport`={config.pipeline_tap_transport!r} is not allowed: choose one of "
            f"{TAP_TRANSPORTS}."
        )
    microbatches = check_int(
        config.pipeline_num_microbatches,
        "pipeline_num_microbatches",
        minimum=min_microbatches(schedule, size),
        hint=f" (at least {MIN_MICROBATCHES}, and at least `pipeline_parallel_size` under 1F1B)",
    )
    rows = config.per_device_train_batch_size * size
    if rows % microbatches:
        raise ValueError(
            f"`pipeline_num_microbatches`={microbatches} does not divide the step's {rows} rows "
            f"(`per_device_train_batch_size`={config.per_device_train_batch_size} x {size} stages): every "
            "micro-batch has the same shape."
        )
    # The pipelined loss is TRL's clipped-ratio loss with token-level ratios and its KL term (`grpo_loss`), and the
    # stages compute log-probs only inside the pipelined step (not the old log-probs of off-step rollouts).
    generate_every = config.steps_per_generation * config.num_iterations
    eval_strategy = getattr(config.eval_strategy, "value", config.eval_strategy)
    _check_pipeline_vllm(config)
    incompatible = {
        "deepspeed": deepspeed or config.deepspeed,
        "fsdp": fsdp or config.fsdp,
        "use_liger_kernel": config.use_liger_kernel,
        "cast_lm_head_to_fp32": config.cast_lm_head_to_fp32,
        f"loss_type={config.loss_type!r}": config.loss_type not in GRPO_LOSS_TYPES,
        f"importance_sampling_level={config.importance_sampling_level!r}": config.importance_sampling_level != "token",
        f"top_entropy_quantile={config.top_entropy_quantile}": config.top_entropy_quantile < 1.0,
        "gradient_accumulation_steps not a multiple of steps_per_generation * num_iterations": (
            config.gradient_accumulation_steps % generate_every != 0
        ),
        f"eval_strategy={eval_strategy!r}": eval_strategy != "no",
        # Rollouts, plain ones too, are the package's own decoding through the stages: temperature, top_p, top_k.
        f"repetition_penalty={config.repetition_penalty}": config.repetition_penalty not in (None, 1.0),
        f"min_p={config.min_p}": config.min_p not in (None, 0.0),
        "use_transformers_continuous_batching": config.use_transformers_continuous_batching,
    }
    _refuse(
        f"`pipeline_parallel_size`={size}",
        incompatible,
        f"the pipelined step computes TRL's GRPO loss (loss_type one of {', '.join(GRPO_LOSS_TYPES)}, "
        "token-level ratios) on plain processes, with rollouts through the stages or from a vLLM server. Change them "
        "or set `pipeline_parallel_size=1`.",
    )
    if peft:
        raise ValueError(
            "`pipeline_parallel_size` > 1 cuts a plain HF model: not a PEFT policy (merge the adapter first, or set "
            "`pipeline_parallel_size=1`)."
        )
    if tools:
        raise ValueError(
            "`pipeline_parallel_size` > 1 does not support tool calls: every stage must take part in each "
            "rollout turn that the last stage generates."
        )


def _check_pipeline_vllm(config) -> None:
    """vLLM rollouts under pipeline parallelism: the package's server only, into which every stage pushes its own
    weights (no rank holds the whole policy)."""
    if not config.use_vllm:
        return
    size = config.pipeline_parallel_size
    if not config.speculative_decoding:
        raise ValueError(
            f"`pipeline_parallel_size`={size} cannot be combined with `use_vllm=True` and `speculative_decoding=False`:"
            " the rollouts would be TRL's own vLLM's, whose weight sync sends the whole policy from one process, and "
            "no stage holds it. Set `speculative_decoding=True` with `vllm_mode='server'` (every stage pushes its own "
            "weights into `hf-spec-cotrain vllm-serve`), or `use_vllm=False` (rollouts through the stages)."
        )
    if config.vllm_mode != "server":
        raise ValueError(
            f"`pipeline_parallel_size`={size} cannot be combined with `vllm_mode`={config.vllm_mode!r}: a colocated "
            "engine holds the whole policy on one rank, and every sync reads it all back there (a second full copy), "
            "while loading only a stage's layers is no way out (vLLM's layerwise partial reload breaks its fused "
            "modules, such as qkv_proj and gate_up_proj). Use `vllm_mode='server'` (`hf-spec-cotrain vllm-serve`, "
            "into which every stage pushes its own weights), or `use_vllm=False` (rollouts through the stages)."
        )
