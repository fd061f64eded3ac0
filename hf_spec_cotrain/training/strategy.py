"""The trainer's parallel strategy, chosen once from the run's `ParallelDims`, and the parallelisms applied to its
policy in one fixed order (`parallelize_policy`): the pipeline stage cut, FSDP2 where the trainer shards the policy
itself, then the ring attention that the context-parallel forwards run in."""

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

from torch import nn

from ..attention.hf_adapter import zigzag_ring_attention
from ..draft import DraftModel
from ..parallel.dims import ParallelDims
from ..parallel.fsdp import apply_fsdp2
from .context_parallel import ContextParallel
from .data_parallel import DataParallel, TRLHooks
from .draft_cotraining import DraftCoTrainer
from .pipeline_parallel import PipelineParallel
from .pipeline_step import PipelineCoTrainStep


@dataclass(frozen=True)
class GRPOLoss:
    """The trainer's GRPO loss settings, which the pipeline's stages compute the loss with."""

    temperature: float
    epsilon_low: float
    epsilon_high: float
    loss_type: str
    beta: float
    max_completion_length: int


@dataclass
class Parallelized:
    """What `parallelize_policy` applied: the context-parallel group, the pipeline stage, the ring attention."""

    cp_group: object = None
    stage: PipelineCoTrainStep | None = None
    ring_attention: Callable = lambda model: nullcontext()


def parallelize_policy(
    parallel_dims: ParallelDims,
    *,
    model: nn.Module,
    policy: nn.Module,
    reference_model: nn.Module | None,
    draft: DraftModel,
    aux_layer_ids,
    draft_cotrainer: DraftCoTrainer,
    shards_policy_itself: bool,
    accelerator,
    args,
    loss: GRPOLoss,
) -> Parallelized:
    """Apply the run's parallelisms to the policy (`model` as the Trainer holds it, `policy` its HF causal LM) and
    the reference model, in this order:

    1. the pipeline stage cut: the policy (and the reference model) in place to this rank's stage, inside the stage's
       `PipelineCoTrainStep`; the draft reads token embeddings from this stage (on the last, the rows of its
       `embedded_token_ids` that the first stage sends each step);
    2. FSDP2 of the policy and the reference model over the ``dp_shard_cp`` axis, where accelerate dropped FSDP (on
       CPU) and the trainer shards them itself;
    3. the ring attention (`zigzag_ring_attention`) that the context-parallel forwards run their layers in.

    Stages and self-sharded models are marked prepared: accelerate must not wrap them in DDP.
    """
    applied = Parallelized()
    if parallel_dims.pp_enabled:
        last_rank = accelerator.num_processes - 1
        applied.stage = PipelineCoTrainStep(
            policy,
            draft=draft if accelerator.process_index == last_rank else None,
            aux_layer_ids=aux_layer_ids,
            embedded_token_ids=draft.embedded_token_ids(),
            schedule=args.pipeline_schedule,
            num_microbatches=args.pipeline_num_microbatches,
            tap_transport=args.pipeline_tap_transport,
            temperature=loss.temperature,
            epsilon_low=loss.epsilon_low,
            epsilon_high=loss.epsilon_high,
            loss_type=loss.loss_type,
            beta=loss.beta,
            bias_correction_kl=args.use_bias_correction_kl,
            # TRL's reference model, cut to this stage too; TRL no longer computes its log-probs (the strategy skips
            # that), the stages do in each step, on the batch the pipeline trains on.
            reference_model=None if reference_model is None else accelerator.unwrap_model(reference_model),
            draft_settings=draft_cotrainer.settings,
            draft_generator=draft_cotrainer.generator,
            device=accelerator.device,
        )
        # This stage's embeddings (none but on the first), not the uncut policy's, whose other modules the cut freed.
        draft.bind_target(policy)
        # The stages hold different parameters: DDP would also try to average gradients across them.
        policy._is_accelerate_prepared = True
    if parallel_dims.cp_enabled:
        mesh = parallel_dims.build_mesh(accelerator.device.type)
        applied.cp_group = mesh["cp"].get_group()
        if shards_policy_itself:
            apply_fsdp2(policy, mesh["dp_shard_cp"])
            model._is_accelerate_prepared = True  # accelerate leaves the sharded policy as it is
            if reference_model is not None:
                apply_fsdp2(unwrapped_hf(accelerator, reference_model), mesh["dp_shard_cp"])
        applied.ring_attention = zigzag_ring_attention
    return applied


def unwrapped_hf(accelerator, model: nn.Module) -> nn.Module:
    """`model` (the policy or the reference model) as a HF causal LM, PEFT and DDP wrappers removed."""
    model = accelerator.unwrap_model(model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def build_parallel_strategy(
    parallel_dims: ParallelDims,
    trl: TRLHooks,
    *,
    model: nn.Module,
    policy: nn.Module,
    reference_model: nn.Module | None,
    draft: DraftModel,
    aux_layer_ids,
    draft_cotrainer: DraftCoTrainer,
    accelerator,
    args,
    distributed,
    processing_class,
    pad_token_id: int,
    loss: GRPOLoss,
    shards_policy_itself: bool,
) -> DataParallel:
    """The strategy of the run's parallelism, after `parallelize_policy` applied it to the policy."""
    applied = parallelize_policy(
        parallel_dims,
        model=model,
        policy=policy,
        reference_model=reference_model,
        draft=draft,
        aux_layer_ids=aux_layer_ids,
        draft_cotrainer=draft_cotrainer,
        shards_policy_itself=shards_policy_itself,
        accelerator=accelerator,
        args=args,
        loss=loss,
    )
    common = dict(
        accelerator=accelerator,
        draft_cotrainer=draft_cotrainer,
        args=args,
        distributed=distributed,
        should_save=args.should_save,
    )
    if parallel_dims.pp_enabled:
        return PipelineParallel(
            trl,
            stage=applied.stage,
            policy=policy,
            aux_layer_ids=aux_layer_ids,
            reference_model=reference_model,
            processing_class=processing_class,
            pad_token_id=pad_token_id,
            loss_type=loss.loss_type,
            max_completion_length=loss.max_completion_length,
            **common,
        )
    if parallel_dims.cp_enabled:
        return ContextParallel(
            trl,
            group=applied.cp_group,
            policy=policy,
            unwrapped=lambda module: unwrapped_hf(accelerator, module),
            ring_attention=applied.ring_attention,
            pad_token_id=pad_token_id,
            shards_policy_itself=shards_policy_itself,
            **common,
        )
    return DataParallel(trl, **common)


__all__ = ["GRPOLoss", "Parallelized", "build_parallel_strategy", "parallelize_policy", "unwrapped_hf"]
