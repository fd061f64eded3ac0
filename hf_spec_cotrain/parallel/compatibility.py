"""What each parallelism cannot honour: the TRL options of a run and the layers of its policy, refused with the value,
the reason and the way out. `ParallelDims.from_config` and `ParallelDims.check_policy` apply these rules, so that the
config (at construction) and the trainer (at start, with the facts only it knows) reject the same things with the
same messages; `launcher_fsdp_version` is the FSDP that `accelerate launch` asked for, which counts as the config's.
"""

import os

from ..losses import GRPO_LOSS_TYPES
from ..validation import ATTENTION_LAYER_TYPES, check_int, layer_types
from .pipeline import MIN_MICROBATCHES, PIPELINE_SCHEDULES, TAP_TRANSPORTS, min_microbatches


AUX_LOSS_OPTIONS = "TRL's `router_aux_loss_coef`, on by default for MoE policies, or `output_router_logits=True`"


def check_parallel_options(
    config,
    *,
    context_parallel: bool,
    pipeline_parallel: bool,
    deepspeed: bool,
    fsdp: bool,
    fsdp_version: int | None,
    peft: bool,
    tools: bool,
) -> None:
    """Refuse the options of a `SpecCoTrainConfig` (read by attribute) that the run's parallel step cannot honour,
    given the facts only the trainer knows (without them: what the config itself says), and pipeline options whose
    values no pipeline takes, whether pipeline parallelism is on or not."""
    _check_pipeline_values(config)
    if context_parallel:
        _check_context_parallel_options(config, deepspeed=deepspeed, fsdp_version=fsdp_version)
    if config.shard_draft:
        _check_shard_draft(config, pipeline_parallel=pipeline_parallel, fsdp=fsdp, fsdp_version=fsdp_version)
    if pipeline_parallel:
        _check_pipeline_parallel_options(config, deepspeed=deepspeed, fsdp=fsdp, peft=peft, tools=tools)
    if tools and fsdp and config.speculative_decoding and not config.use_vllm:
        raise ValueError(
            "Tool calls with HF-native speculative rollouts of an FSDP-sharded policy are not supported: each turn "
            "gathers the sharded policy on every rank (a collective), but TRL's tool loop runs as many turns on a rank "
            "as its own rollouts call tools, so the ranks would wait on each other for ever. Use use_vllm=True (the "
            "engine takes the weights once per step), or a policy that is not sharded."
        )
    if config.draft_train_fraction < 1 and (context_parallel or pipeline_parallel):
        raise ValueError(
            f"`draft_train_fraction`={config.draft_train_fraction} cannot be combined with `context_parallel_size` "
            "> 1 or `pipeline_parallel_size` > 1: those steps train the draft on packed or pipelined rows, not on "
            "a choice of a micro-batch's sequences (set it to 1.0)."
        )


def check_parallel_policy(
    policy, *, context_parallel_size: int, pipeline_parallel_size: int, aux_loss: bool = False
) -> None:
    """Refuse, at trainer start, a policy whose layers the run's parallel step would compute wrongly.

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
    if context_parallel_size > 1:
        other = sorted(kinds - {*ATTENTION_LAYER_TYPES, "linear_attention"})
        reasons = {
            "its linear_attention layers carry a recurrent state along the sequence, which has no "
            "sequence-parallel scan yet": "linear_attention" in kinds,
            f"its {other} layers are not attention layers the ring runs": bool(other),
            f"its MoE auxiliary loss ({AUX_LOSS_OPTIONS}) is not computed on sharded sequences": aux_loss,
        }
        pipeline = "" if any(pipeline_reasons.values()) else " or with `pipeline_parallel_size` > 1"
        _refuse_policy(
            f"`context_parallel_size`={context_parallel_size}",
            config.model_type,
            reasons,
            f"train it with `context_parallel_size=1` (data parallelism){pipeline}{no_aux_loss}.",
        )
    if pipeline_parallel_size > 1:
        _refuse_policy(
            f"`pipeline_parallel_size`={pipeline_parallel_size}",
            config.model_type,
            pipeline_reasons,
            f"train it with `pipeline_parallel_size=1` (data parallelism){no_aux_loss}.",
        )


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


def parallelism_config_shards(parallelism_config) -> bool:
    """Whether accelerate's `ParallelismConfig` (if any) shards the model over a data-parallel axis."""
    return parallelism_config is not None and parallelism_config.dp_shard_size > 1


def _configured_fsdp_version(config, fsdp_version: int | None) -> int | None:
    """The FSDP version the run uses: the one given (accelerate's, the launcher's), else the config's own (its
    `fsdp_config`'s version, before or after transformers strips the `fsdp_` prefix; transformers' default is 1)."""
    if fsdp_version is None and config.fsdp:
        options = config.fsdp_config or {}
        fsdp_version = int(options.get("version", options.get("fsdp_version", 1)))
    return fsdp_version


def _check_shard_draft(config, *, pipeline_parallel: bool, fsdp: bool, fsdp_version: int | None) -> None:
    """`shard_draft` shards the draft with FSDP2 over the mesh the policy is sharded over: there must be one."""
    if pipeline_parallel:
        raise ValueError(
            f"`shard_draft=True` cannot be combined with `pipeline_parallel_size`={config.pipeline_parallel_size}: "
            "the last stage alone holds and trains the draft, with no FSDP2 mesh to shard it over. Set "
            "`shard_draft=False`."
        )
    fsdp_version = _configured_fsdp_version(config, fsdp_version)
    if not fsdp or fsdp_version != 2:
        running = f"FSDP version {fsdp_version}" if fsdp else "no FSDP (DDP, DeepSpeed or one process)"
        raise ValueError(
            f"`shard_draft=True` needs FSDP2, but this run uses {running}: the draft is sharded over the FSDP2 mesh "
            "of the policy. Enable FSDP2 (`fsdp_version=2` in the FSDP config, or a `parallelism_config` with "
            "`dp_shard_size` > 1), or set `shard_draft=False` to keep a replica of the draft on every rank."
        )


def _check_context_parallel_options(config, *, deepspeed: bool, fsdp_version: int | None) -> None:
    """Options that the context-parallel training step cannot honour."""
    fsdp_version = _configured_fsdp_version(config, fsdp_version)
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


def _check_pipeline_values(config) -> None:
    """The pipeline options' own values, checked whether pipeline parallelism is on or not: a typo in one is refused
    when it is written, not in a later run that turns the pipeline on."""
    schedule = config.pipeline_schedule
    if not isinstance(schedule, str) or schedule.lower() not in PIPELINE_SCHEDULES:
        raise ValueError(f"`pipeline_schedule`={schedule!r} is not allowed: choose '1F1B' or 'GPipe'.")
    if config.pipeline_tap_transport not in TAP_TRANSPORTS:
        raise ValueError(
            f"`pipeline_tap_transport`={config.pipeline_tap_transport!r} is not allowed: choose one of "
            f"{TAP_TRANSPORTS}."
        )
    check_int(
        config.pipeline_num_microbatches,
        "pipeline_num_microbatches",
        minimum=min_microbatches(schedule, config.pipeline_parallel_size),
        hint=f" (at least {MIN_MICROBATCHES}, and at least `pipeline_parallel_size` under 1F1B)",
    )


def _check_pipeline_parallel_options(config, *, deepspeed: bool, fsdp: bool, peft: bool, tools: bool) -> None:
    """Options that the pipelined training step cannot honour (`_check_pipeline_values` checked the pipeline
    options' own values)."""
    size = config.pipeline_parallel_size
    microbatches = config.pipeline_num_microbatches
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
