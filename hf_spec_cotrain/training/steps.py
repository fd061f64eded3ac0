"""Training-step strategies of context and pipeline parallelism, in place of TRL's ``training_step``.

Both keep rollouts and scoring per rank, as under data parallelism (``_prepare_inputs``), so TRL's sampling, rewards
and advantages are untouched; they differ in how the ranks then share the forward and backward of the policy and the
draft. `TrainingStepStrategy` holds what both keep of TRL's step (train mode, inputs, the micro-step counter and
``step_time``), so neither re-implements it.
"""

import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from accelerate import PartialState
from accelerate.utils import patch_environment
from transformers import AutoConfig, PreTrainedModel
from trl.trainer.utils import create_model_from_path, pad

from ..attention.hf_adapter import zigzag_ring_attention
from ..generation.pipelined import PipelinedTarget
from ..parallel.dims import ParallelDims
from ..parallel.packed_rows import PackedRows, pack_rows, policy_log_probs
from ..parallel.pipeline import pipeline_stage_class
from .draft_cotraining import RecordedTaps
from .pipeline_step import GRPOBatch, PipelineCoTrainStep, grpo_loss_normalizer


MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "token_type_ids")


def inputs_to(inputs: dict, device) -> dict:
    """A micro-batch dict with its tensors on `device` (other values as they are)."""
    return {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in inputs.items()}


class TrainingStepStrategy:
    """TRL's training step around a strategy's forward and backward (`run`); call it as ``training_step``."""

    name = ""

    def __init__(self, trainer):
        self.trainer = trainer

    def __call__(self, model, inputs, num_items_in_batch):
        trainer = self.trainer
        started = time.perf_counter()
        model.train()
        if hasattr(trainer.optimizer, "train") and callable(trainer.optimizer.train):
            trainer.optimizer.train()
        loss = self.run(model, trainer._prepare_inputs(inputs), num_items_in_batch)
        # What GRPOTrainer.training_step records around the base step: the micro-step counter and the step time.
        trainer._step += 1
        trainer._current_train_step_time += time.perf_counter() - started
        if trainer._step % trainer.current_gradient_accumulation_steps == 0:
            trainer._metrics["train"]["step_time"].append(trainer._current_train_step_time)
            trainer._current_train_step_time = 0.0
        return loss

    def run(self, model, inputs: dict, num_items_in_batch) -> torch.Tensor:
        raise NotImplementedError

    def members_inputs(self, inputs: dict, group: dist.ProcessGroup | None = None) -> list[dict]:
        """Every member's micro-batch (on the CPU), in rank order."""
        members = [None] * dist.get_world_size(group)
        dist.all_gather_object(members, inputs_to(inputs, "cpu"), group=group)
        multimodal = [key for key in MULTIMODAL_KEYS if members[0].get(key) is not None]
        if multimodal:
            raise ValueError(f"{self.name} supports text-only policies; this batch has {multimodal}.")
        return members

    def loss_is_unscaled(self, num_items_in_batch) -> bool:
        """Whether the step divides the loss by the accumulation steps itself, as `Trainer.training_step` does
        (TRL's loss is scaled already when the model takes loss kwargs)."""
        trainer = self.trainer
        return (
            not trainer.model_accepts_loss_kwargs or num_items_in_batch is None
        ) and trainer.compute_loss_func is None


class ContextParallelStep(TrainingStepStrategy):
    """Every member's micro-batch in turn, sharded across the context-parallel group.

    The group takes its members' micro-batches one after the other: for each, every rank runs the policy's GRPO
    forward and backward on its zigzag shard of the packed rows (ring attention in the policy's layers,
    `policy_log_probs`), then the draft's TTT on the taps of that forward (`ttt_loss(..., cp_group=...)`). A rank
    thus holds ``1 / context_parallel_size`` of one micro-batch's activations at a time. Each rank's policy and draft
    gradients are its positions' share of every member's loss, so the average over the world (DDP's, or FSDP2's
    reduce-scatter over every rank, for the policy; `DraftCoTrainer.update` for the replicated draft) equals data
    parallelism's gradient over the same rows.
    """

    name = "Context parallelism"

    def __init__(self, trainer, group: dist.ProcessGroup):
        super().__init__(trainer)
        self.group = group
        self.rows: PackedRows | None = None  # the member being trained on: read by the trainer's loss hooks

    def run(self, model, inputs, num_items_in_batch):
        trainer = self.trainer
        members = self.members_inputs(inputs, self.group)
        losses = []
        for index, member in enumerate(members):
            member = inputs_to(member, trainer.accelerator.device)
            # DDP synchronises the accumulated gradients in the last member's backward (if this micro-step syncs).
            sync = nullcontext() if index == len(members) - 1 else trainer.accelerator.no_sync(model)
            # The backward stays inside: gradient checkpointing recomputes the attention layers there.
            with sync, zigzag_ring_attention(trainer._policy()):
                self.rows = self.pack(member)
                try:
                    with trainer.compute_loss_context_manager():
                        loss = trainer.compute_loss(model, member, num_items_in_batch=num_items_in_batch)
                    if self.loss_is_unscaled(num_items_in_batch):
                        loss = loss / trainer.current_gradient_accumulation_steps
                    trainer.accelerator.backward(loss)
                finally:
                    self.rows = None
            losses.append(loss.detach())
            trainer.draft_cotrainer.train_recorded(loss_divisor=trainer._draft_loss_divisor(), cp_group=self.group)
        return torch.stack(losses).mean()

    def pack(self, inputs: dict) -> PackedRows:
        """This rank's zigzag shard of one member's rows, packed as documents."""
        completion_mask = inputs["completion_mask"]
        return self.pack_rows(
            inputs["prompt_ids"],
            inputs["prompt_mask"],
            inputs["completion_ids"],
            completion_mask,
            completion_loss_mask=completion_mask * inputs["tool_mask"] if "tool_mask" in inputs else completion_mask,
        )

    def pack_rows(self, prompt_ids, prompt_mask, completion_ids, completion_mask, **kwargs) -> PackedRows:
        """`pack_rows` for this rank of the group."""
        return pack_rows(
            prompt_ids,
            prompt_mask,
            completion_ids,
            completion_mask,
            rank=dist.get_rank(self.group),
            world_size=dist.get_world_size(self.group),
            pad_token_id=self.trainer._tokenizer.pad_token_id,
            **kwargs,
        )

    def record_taps(self, taps) -> None:
        """The draft trains on the taps of this shard of the packed rows."""
        rows = self.rows
        self.trainer.draft_cotrainer.record(RecordedTaps(taps, None, rows.loss_mask, rows.cu_seqlens))

    def score_log_probs(
        self,
        model,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        *,
        batch_size: int | None,
        compute_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and entropies) of this rank's rows outside the training step, sharded like it: TRL's scoring
        passes (the old policy, the reference model; `model` is either) and the evaluation loss.

        The group gathers its members' token ids and masks (small), then runs each member's rows, `batch_size` rows
        at a time as TRL chunks them, as zigzag shards of packed documents through `model` with the ring attention;
        a rank keeps the `[B, C]` log-probs of its own rows. No rank ever holds a whole sequence's activations.
        """
        members = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(members, (input_ids.cpu(), attention_mask.cpu(), logits_to_keep), group=self.group)
        own = dist.get_rank(self.group)
        device = input_ids.device
        logps, entropies = [], []
        with zigzag_ring_attention(self.trainer.unwrapped(model)), self.trainer.accelerator.autocast():
            for member, (ids, mask, keep) in enumerate(members):
                ids, mask = ids.to(device), mask.to(device)
                chunk = batch_size or len(ids)
                for start in range(0, len(ids), chunk):
                    rows = slice(start, start + chunk)
                    packed = self.pack_rows(
                        ids[rows, :-keep], mask[rows, :-keep], ids[rows, -keep:], mask[rows, -keep:]
                    )
                    chunk_logps, chunk_entropies = policy_log_probs(model, packed, group=self.group)
                    if member == own:
                        logps.append(chunk_logps)
                        entropies.append(chunk_entropies)
        return torch.cat(logps), torch.cat(entropies) if compute_entropy else None

    def log_probs(self, model, *, compute_entropy: bool, compute_aux_loss: bool):
        """The GRPO forward's log-probs (and entropies) of the member being trained on, in TRL's `[B, C]` layout."""
        if compute_aux_loss:
            raise ValueError("Context parallelism does not support the MoE auxiliary loss (`router_aux_loss_coef`).")
        with self.trainer.accelerator.autocast():
            logps, entropies = policy_log_probs(model, self.rows, group=self.group)
        return logps, entropies if compute_entropy else None, None


def load_pipeline_stage(name_or_path: str, args, **defaults) -> PreTrainedModel:
    """This process's stage of the causal LM `name_or_path` (its rank is its stage), loaded the way TRL loads the
    whole model (`create_model_from_path` with ``args.model_init_kwargs``, then `defaults` where those leave a key
    unset) but reading only the stage's tensors from the checkpoint (`pipeline_stage_class`)."""
    state = PartialState()
    ParallelDims(args.context_parallel_size, args.pipeline_parallel_size, world_size=state.num_processes)  # checks
    kwargs = {**defaults, **(args.model_init_kwargs or {})}
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    kwargs["device_map"] = None  # one stage per process, which the Trainer places on the process's device
    config = AutoConfig.from_pretrained(
        name_or_path, trust_remote_code=kwargs["trust_remote_code"], revision=kwargs.get("revision")
    )
    architecture = pipeline_stage_class(
        config, state.process_index, args.pipeline_parallel_size, trust_remote_code=kwargs["trust_remote_code"]
    )
    # Each rank reads its own stage, which FSDP never wraps: not only local rank 0, as transformers does under FSDP's
    # CPU-RAM-efficient loading (the other ranks would keep zeros).
    with patch_environment(FSDP_CPU_RAM_EFFICIENT_LOADING="false"):
        return create_model_from_path(name_or_path, architecture=architecture, **kwargs)


class PipelineParallelStep(TrainingStepStrategy):
    """All ranks' rows as one batch through the pipeline; the last stage generates every rollout through it.

    Each rank loaded only its stage of the policy (`load_pipeline_stage`; a policy passed already built is cut in
    place by `PipelineCoTrainStep`), so the optimizer (built later by the Trainer) holds this stage's parameters only
    and no rank ever holds the whole policy: the last stage, which holds the draft, drives every rank's rollouts while
    the other stages serve its forwards (`PipelinedTarget`), and every stage saves its own shard of the policy (the
    trainer's `save_model`). The draft trains, and is saved, on the last stage.

    In each step the ranks exchange their micro-batches and every stage runs the same batch, the concatenation in rank
    order, through `PipelineCoTrainStep.step`: the GRPO loss with TRL's whole-batch normaliser at the last stage, and
    the draft's TTT on the taps there. The gradients are those of one process on all rows, which is what data
    parallelism's average over the same ranks computes.
    """

    name = "Pipeline parallelism"

    def __init__(self, trainer):
        super().__init__(trainer)
        args, accelerator = trainer.args, trainer.accelerator
        policy = trainer._policy()
        self.last_rank = accelerator.num_processes - 1
        self.stage = PipelineCoTrainStep(
            policy,
            draft=trainer.draft if accelerator.process_index == self.last_rank else None,
            aux_layer_ids=trainer.aux_layer_ids,
            schedule=args.pipeline_schedule,
            num_microbatches=args.pipeline_num_microbatches,
            tap_transport=args.pipeline_tap_transport,
            temperature=trainer.temperature,
            epsilon_low=trainer.epsilon_low,
            epsilon_high=trainer.epsilon_high,
            loss_type=trainer.loss_type,
            beta=trainer.beta,
            bias_correction_kl=args.use_bias_correction_kl,
            # TRL's reference model, cut to this stage too; TRL no longer computes its log-probs (the trainer skips
            # that), the stages do in each step, on the batch the pipeline trains on.
            reference_model=None if trainer.ref_model is None else accelerator.unwrap_model(trainer.ref_model),
            ttt_steps=args.ttt_steps,
            ttt_step_weight_decay=args.ttt_step_weight_decay,
            ttt_gradient_checkpointing=args.ttt_gradient_checkpointing,
            draft_bf16=trainer.draft_cotrainer.settings.bf16,
            device=accelerator.device,
        )
        # The draft reads token embeddings from its target: this stage's (none but on the first), not the uncut
        # policy's, whose other modules the cut released.
        trainer.draft.bind_target(policy)
        self.generation = PipelinedTarget(
            policy,
            layer_ranges=self.stage.layer_ranges,
            aux_layer_ids=trainer.aux_layer_ids,
            group=self.stage.group,
            device=accelerator.device,
        )
        trainer.rollouts.pipeline = self.generation
        # The stages hold different parameters: accelerate must not wrap this one in DDP (it would also try to
        # average gradients across stages).
        policy._is_accelerate_prepared = True

    def run(self, model, inputs, num_items_in_batch):
        trainer = self.trainer
        device = trainer.accelerator.device
        batch = self.batch(self.members_inputs(inputs))
        accumulation = trainer.current_gradient_accumulation_steps
        # TRL's normaliser of the whole batch as one process holding every member's rows computes it (with DDP, TRL
        # would divide dapo's by the number of processes, whose gradients DDP averages).
        normalizer = grpo_loss_normalizer(
            trainer.loss_type,
            batch.loss_mask,
            max_completion_length=trainer.max_completion_length,
            num_items_in_batch=inputs["num_items_in_batch"],
            gradient_accumulation_steps=accumulation,
            steps_per_generation=trainer.args.steps_per_generation,
        )
        if self.loss_is_unscaled(num_items_in_batch):
            normalizer = normalizer * accumulation
        out = self.stage.step(
            batch, loss_normalizer=normalizer.to(device), draft_loss_scale=1.0 / trainer._draft_loss_divisor()
        )
        loss = torch.zeros((), device=device) if out.policy_loss is None else out.policy_loss
        dist.broadcast(loss, src=self.last_rank)  # every rank reports the loss of the last stage
        trainer.draft_cotrainer.record_metrics(out.draft)
        return loss.detach()

    def batch(self, members: list[dict]) -> GRPOBatch:
        """The ranks' micro-batches as one `GRPOBatch`: prompts left-padded and completions right-padded to the
        longest, as one process holding all the rows would pad them."""
        pad_id = self.trainer._tokenizer.pad_token_id

        def cat(key: str, value: float, side: str) -> torch.Tensor:
            return pad([row for member in members for row in member[key]], padding_value=value, padding_side=side)

        def optional(key: str, value: float) -> torch.Tensor | None:
            return cat(key, value, "right") if members[0].get(key) is not None else None

        return GRPOBatch(
            prompt_ids=cat("prompt_ids", pad_id, "left"),
            prompt_mask=cat("prompt_mask", 0, "left"),
            completion_ids=cat("completion_ids", pad_id, "right"),
            completion_mask=cat("completion_mask", 0, "right"),
            advantages=torch.cat([member["advantages"] for member in members]),
            old_per_token_logps=optional("old_per_token_logps", 0.0),
            tool_mask=optional("tool_mask", 0),
        )

    def generate_for_all_ranks(self, prompt_ids, images, multimodal_fields, num_generations, generate_here):
        """The last stage generates every rank's rollouts through the pipeline, with the draft it trains, or requests
        them from the vLLM server, while the other stages serve its forwards (``generate_here``: the trainer's
        generation on this process, run there). Every rank gets its own rows, and the turn's ``spec/*`` metrics, so
        that every rank logs them."""
        trainer = self.trainer
        if images is not None or multimodal_fields:
            raise ValueError("Pipeline parallelism supports text-only rollouts.")
        per_rank = [None] * trainer.accelerator.num_processes
        dist.all_gather_object(per_rank, prompt_ids)
        if not self.generation.is_driver:
            self.generation.serve()
            results = [None]
            dist.broadcast_object_list(results, src=self.last_rank)
            if isinstance(results[0], Exception):
                raise RuntimeError("The last stage's rollouts failed (its traceback is in its log).") from results[0]
            rows, spec_metrics, acceptance = results[0]
            for (mode, name), values in spec_metrics.items():
                trainer._metrics[mode][name].extend(values)
            trainer.rollouts.acceptance_history.extend(acceptance)
            return rows[trainer.accelerator.process_index]
        logged = _spec_metric_counts(trainer._metrics)
        history = len(trainer.rollouts.acceptance_history)
        results = [None]
        try:
            everyone = [ids for ids in per_rank for ids in ids]
            completions, logprobs = generate_here(everyone, None, {}, num_generations)
            bounds = torch.tensor([0, *map(len, per_rank)]).cumsum(0).tolist()
            rows = [
                (completions[start:end], None if logprobs is None else logprobs[start:end])
                for start, end in zip(bounds[:-1], bounds[1:])
            ]
            spec_metrics = {
                (mode, name): trainer._metrics[mode][name][logged.get((mode, name), 0) :]
                for mode, name in _spec_metric_counts(trainer._metrics)
            }
            results = [(rows, spec_metrics, trainer.rollouts.acceptance_history[history:])]
            return rows[-1]
        except Exception as error:
            results = [RuntimeError(f"{type(error).__name__}: {error}")]
            raise
        finally:
            self.generation.finish()
            dist.broadcast_object_list(results, src=self.last_rank)


def _spec_metric_counts(metrics: dict) -> dict[tuple[str, str], int]:
    """How many values each ``spec/*`` metric holds, by (mode, name)."""
    return {
        (mode, name): len(values)
        for mode in metrics
        for name, values in metrics[mode].items()
        if name.startswith("spec/")
    }
