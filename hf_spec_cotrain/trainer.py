"""`SpecCoTrainGRPOTrainer`: TRL's GRPO step with an EAGLE-3 draft co-trained online on the policy's own taps.

What the subclass adds, hook by hook:

* ``_compute_loss``: hooks on the policy's decoder record the taps, the token embeddings and the final hidden
  state of the policy's *own* training forward (no extra forward pass), detached.
* ``training_step``: after the policy's backward, the draft's TTT loss on those taps is backpropagated into the
  draft's own gradients (no gradient crosses between policy and draft).
* ``_DraftUpdateCallback.on_step_end``: after the policy's optimizer step, the draft's optimizer steps (gradients
  averaged across data-parallel ranks, clipped, skipped when non-finite) and the ``draft/*`` metrics are logged.
* ``_generate_single_turn``: rollouts use `speculative_generate` with the draft of this very step, and fall back
  to plain generation (logged) when the draft cannot be used.
* ``_save_checkpoint`` / ``_load_optimizer_and_scheduler``: checkpoints hold the draft (a vLLM-loadable folder)
  and its optimizer and scheduler state.
* ``_context_parallel_training_step`` (``context_parallel_size > 1``): the policy's GRPO forward/backward and the
  draft's TTT run on zigzag shards of each group member's micro-batch in turn (see its docstring).
* ``_pipeline_training_step`` (``pipeline_parallel_size > 1``): the policy is cut into stages, one per rank; every
  stage runs all ranks' rows through `PipelineCoTrainStep`, the draft trains on the last stage, and rank 0 generates
  every rollout with a full copy of the policy and the draft streamed to it (see `_build_pipeline`).
"""

import copy
import os
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate.utils import gather, is_peft_model
from transformers import TrainerCallback, get_scheduler
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging
from trl import GRPOTrainer
from trl.data_utils import apply_chat_template, is_conversational
from trl.models import unwrap_model_for_generation
from trl.trainer.utils import pad

from .attention.hf_adapter import zigzag_ring_attention
from .config import SpecCoTrainConfig
from .draft import Eagle3DraftModel, count_tokens
from .generation.client import VLLMServerClient
from .generation.speculative import speculative_generate
from .hub import push_draft_folder, render_draft_card
from .parallel.pipeline import GRPOBatch, PipelineCoTrainStep, stream_pipeline_weights
from .parallel.policy_context_parallel import PackedRows, pack_rows, policy_log_probs
from .taps import TapRecorder, Taps
from .ttt import ttt_loss


logger = logging.get_logger(__name__)

DRAFT_FOLDER = "draft"
DRAFT_STATE_FILE = "draft_training_state.pt"


class SpecCoTrainGRPOTrainer(GRPOTrainer):
    r"""
    [`~trl.GRPOTrainer`] that co-trains an EAGLE-3 draft head every step and rolls out with it.

    Args:
        model, reward_funcs, args, ...: as for [`~trl.GRPOTrainer`]; ``args`` is a [`SpecCoTrainConfig`].
        draft_model ([`Eagle3DraftModel`], *optional*):
            The draft to co-train. Default: loaded from ``args.draft_model_name_or_path``, or built from the
            policy (``draft_num_layers``, ``draft_vocab_size`` from the training prompts' token counts,
            ``aux_layer_ids``).
    """

    _tag_names = ["trl", "grpo", "hf_spec_cotrain", "eagle3"]

    def __init__(self, model, reward_funcs=None, args: SpecCoTrainConfig | None = None, *, draft_model=None, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = SpecCoTrainConfig(f"{name.split('/')[-1]}-SpecCoTrain")
        if not isinstance(args, SpecCoTrainConfig):
            raise ValueError(
                f"`args` is a {type(args).__name__}; SpecCoTrainGRPOTrainer needs a SpecCoTrainConfig (it adds the "
                "draft and speculative-rollout options to GRPOConfig)."
            )
        # With speculative vLLM rollouts the package owns the engine (it also holds the draft): keep TRL from
        # building a plain one first, since two engines must never coexist.
        speculative_vllm = args.use_vllm and args.speculative_decoding
        if speculative_vllm:
            args.use_vllm = False
        try:
            super().__init__(model, reward_funcs, args, **kwargs)
        finally:
            args.use_vllm = args.use_vllm or speculative_vllm
        self.draft = self._build_draft(draft_model)
        self.aux_layer_ids = self.draft.validate_target(self._policy().config)
        self.draft_optimizer = torch.optim.AdamW(
            self.draft.trainable_parameters(), lr=args.draft_learning_rate, weight_decay=args.draft_weight_decay
        )
        self.draft_scheduler = get_scheduler(
            args.draft_lr_scheduler_type,
            self.draft_optimizer,
            num_warmup_steps=args.draft_warmup_steps,
            num_training_steps=max(1, args.max_steps if args.max_steps > 0 else 10**9),
        )
        self.draft_skipped_steps = 0
        self._draft_step_has_nonfinite = False
        # (taps, attention_mask, loss_mask, cu_seqlens): padded rows, or a context-parallel shard of packed rows
        self._pending_taps: list[tuple[Taps, torch.Tensor | None, torch.Tensor, torch.Tensor | None]] = []
        self._draft_micro_metrics: list[torch.Tensor] = []
        self._draft_micro_batch = 0  # micro-batches of this step so far (`_draft_rows` draws per micro-batch)
        self.acceptance_history: list[tuple[int, float]] = []
        self.add_callback(_DraftUpdateCallback(self))
        self.rollout_engine = self._build_rollout_engine() if speculative_vllm else None
        self._engine_synced_step = -1
        self.context_parallel_group = self._build_context_parallel_group()
        self._context_parallel_rows: PackedRows | None = None
        self.pipeline_step: PipelineCoTrainStep | None = None
        self._rollout_policy = None  # under pipeline parallelism: rank 0's full copy of the policy, for rollouts
        self._rollout_synced_step = -1
        if args.pipeline_parallel_size > 1:
            self._build_pipeline()

    # ------------------------------------------------------------------ the draft

    def _policy(self):
        """The policy as a HF causal LM (PEFT and DDP wrappers removed)."""
        model = self.accelerator.unwrap_model(self.model)
        return model.get_base_model() if hasattr(model, "get_base_model") else model

    def _build_draft(self, draft_model: Eagle3DraftModel | None) -> Eagle3DraftModel:
        args = self.args
        policy = self._policy()
        # A private RNG stream: building the draft must not change the policy run's sampling.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(args.seed)
            if draft_model is not None:
                draft = draft_model
            elif args.draft_model_name_or_path is not None:
                draft = Eagle3DraftModel.from_pretrained(args.draft_model_name_or_path)
            else:
                counts = self._prompt_token_counts() if args.draft_vocab_size is not None else None
                draft = Eagle3DraftModel.from_target(
                    policy,
                    num_layers=args.draft_num_layers,
                    aux_layer_ids=args.aux_layer_ids,
                    draft_vocab_size=args.draft_vocab_size,
                    token_counts=counts,
                )
        draft.bind_target(policy)
        draft.to(device=self.accelerator.device, dtype=torch.float32)  # fp32 master weights for a small head
        draft.train()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            for tensor in [*draft.parameters(), *draft.buffers()]:  # every rank starts from rank 0's draft
                dist.broadcast(tensor.data, src=0)
        return draft

    def _prompt_token_counts(self) -> torch.Tensor:
        """Token frequencies of the training prompts, which choose a reduced draft vocabulary."""
        if self.train_dataset is None:
            raise ValueError("`draft_vocab_size` chooses tokens by frequency in the training prompts: pass a dataset.")
        texts = []
        for example in self.train_dataset:
            if is_conversational(example):
                example = apply_chat_template(example, self.processing_class)
            texts.append(example["prompt"])
        vocab_size = self._policy().config.get_text_config().vocab_size
        return count_tokens(self._tokenizer(texts, add_special_tokens=False)["input_ids"], vocab_size)

    # ------------------------------------------------------------------ taps from the training forward

    def _compute_loss(self, model, inputs):
        if not self.model.training:
            return super()._compute_loss(model, inputs)
        with (
            TapRecorder(model, self.aux_layer_ids, record_embeddings=True, record_final_hidden=True) as recorder,
            recorder.capture(),
        ):
            loss = super()._compute_loss(model, inputs)
        taps = recorder.pop_all()
        if len(taps) != 1:
            raise RuntimeError(f"Expected one recorded policy forward per micro-batch, got {len(taps)}.")
        rows = self._context_parallel_rows
        if rows is not None:  # context parallelism: the taps are this rank's shard of the packed rows
            self._pending_taps.append((taps[0], None, rows.loss_mask, rows.cu_seqlens))
            return loss
        completion_mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            completion_mask = completion_mask * inputs["tool_mask"]
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        # The draft learns to predict the tokens the policy generated (the ones rollouts will draft).
        loss_mask = torch.cat([torch.zeros_like(inputs["prompt_mask"]), completion_mask], dim=1)
        rows = self._draft_rows(len(loss_mask))
        self._draft_micro_batch += 1
        if rows is None:
            self._pending_taps.append((taps[0], attention_mask, loss_mask, None))
        else:
            self._pending_taps.append((taps[0].select_rows(rows), attention_mask[rows], loss_mask[rows], None))
        return loss

    def _draft_rows(self, batch: int) -> torch.Tensor | None:
        """The rows of this micro-batch the draft trains on (``draft_train_fraction``; None: all), drawn from (seed,
        step, rank, micro-batch) so that a resumed run chooses the rows the uninterrupted one did."""
        count = max(1, round(self.args.draft_train_fraction * batch))
        if count >= batch:
            return None
        generator = _seeded_generator(
            self.args.seed, self.state.global_step, self.accelerator.process_index, self._draft_micro_batch
        )
        return torch.randperm(batch, generator=generator)[:count].sort().values

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.context_parallel_group is not None:
            return self._context_parallel_training_step(model, inputs, num_items_in_batch)
        if self.pipeline_step is not None:
            return self._pipeline_training_step(model, inputs, num_items_in_batch)
        loss = super().training_step(model, inputs, num_items_in_batch)
        while self._pending_taps:
            self._draft_micro_step(*self._pending_taps.pop(0))
        return loss

    def _teacher_logits(self, final_hidden: torch.Tensor) -> torch.Tensor:
        """The policy's logits over the draft vocabulary (unscaled: rollouts apply the temperature to both)."""
        weight = self._policy().get_output_embeddings().weight
        if hasattr(weight, "full_tensor"):  # FSDP2 shards the head: gather it for the teacher
            weight = weight.full_tensor()
        rows = weight.detach()[self.draft.draft_to_target_ids.to(weight.device)]
        return final_hidden.to(rows.dtype) @ rows.T

    def _draft_micro_step(
        self,
        taps: Taps,
        attention_mask: torch.Tensor | None,
        loss_mask: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
    ) -> None:
        """The draft's TTT on one forward's taps: padded rows (``attention_mask``), or, under context parallelism,
        this rank's zigzag shard of packed documents (``cu_seqlens``, global)."""
        args = self.args
        cp_group = self.context_parallel_group if cu_seqlens is not None else None
        with torch.no_grad():
            teacher = self._teacher_logits(taps.final_hidden)
        with self._draft_autocast():
            out = ttt_loss(
                self.draft,
                aux_hidden_states=taps.aux_hidden_states,
                input_embeds=taps.embeddings,
                teacher_logits=teacher,
                loss_mask=loss_mask.bool(),
                attention_mask=None if attention_mask is None else attention_mask.bool(),
                cu_seqlens=cu_seqlens,
                ttt_steps=args.ttt_steps,
                step_weight_decay=args.ttt_step_weight_decay,
                cp_group=cp_group,
                gradient_checkpointing=args.ttt_gradient_checkpointing,
            )
        total_loss = out.loss.detach()
        if cp_group is not None:
            # `out.loss` is this rank's share; the step losses are global, so every rank of the group takes the same
            # decision below (a backward on some ranks only would hang the ring).
            weights = args.ttt_step_weight_decay ** torch.arange(args.ttt_steps, device=out.step_losses.device)
            total_loss = (weights * out.step_losses).sum()
        finite = bool(torch.isfinite(total_loss))
        if finite:
            scale = self.current_gradient_accumulation_steps * args.draft_update_interval
            (out.loss / scale).backward()
        else:
            self._draft_step_has_nonfinite = True
        self._draft_micro_metrics.append(
            torch.cat(
                [
                    total_loss.float().view(1),
                    out.step_losses.float(),
                    out.step_accuracies.float(),
                    out.step_counts.float(),
                ]
            )
        )

    def _draft_autocast(self):
        """bf16 autocast for the draft's TTT when `draft_bf16` asks for it, by default when the policy trains in bf16
        (accelerate autocasts only the policy's forward). The draft keeps float32 weights; under an fp16 policy it
        stays float32 unless asked, since fp16 would need a loss scaler of its own."""
        draft_bf16 = self.args.draft_bf16
        if draft_bf16 is None:
            draft_bf16 = self.accelerator.mixed_precision == "bf16"
        if draft_bf16:
            return torch.autocast(self.accelerator.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def _draft_update(self) -> None:
        """One draft optimizer step (called after the policy's): average, clip, skip if non-finite, step."""
        args = self.args
        params = self.draft.trainable_parameters()
        grads = [p.grad for p in params if p.grad is not None]
        nonfinite = torch.tensor(float(self._draft_step_has_nonfinite), device=self.accelerator.device)
        pipeline = self.pipeline_step is not None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and not pipeline:
            world = dist.get_world_size()
            for grad in grads:
                dist.all_reduce(grad)
                grad.div_(world)
            dist.all_reduce(nonfinite)
        max_norm = args.draft_max_grad_norm if args.draft_max_grad_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm) if grads else torch.zeros(())
        if pipeline:  # only the last stage has draft gradients (it alone steps); every rank takes its decision
            decision = torch.stack([nonfinite.float(), grad_norm.float().to(nonfinite.device)])
            dist.broadcast(decision, src=dist.get_world_size() - 1)
            nonfinite, grad_norm = decision[0], decision[1]
        if nonfinite.item() > 0 or not torch.isfinite(grad_norm):
            self.draft_skipped_steps += 1
            logger.warning(
                f"Step {self.state.global_step}: non-finite draft loss or gradient; the draft update is skipped "
                "(the policy is unaffected)."
            )
        else:
            self.draft_optimizer.step()
            self.draft_scheduler.step()
        self.draft_optimizer.zero_grad(set_to_none=True)
        self._draft_step_has_nonfinite = False
        self._log_draft_metrics(grad_norm)

    def _log_draft_metrics(self, grad_norm: torch.Tensor) -> None:
        if not self._draft_micro_metrics:
            return
        k = self.args.ttt_steps
        local = torch.stack(self._draft_micro_metrics).to(self.accelerator.device)
        self._draft_micro_metrics.clear()
        if self.pipeline_step is not None:  # the last stage's metrics (the other stages hold placeholders)
            dist.broadcast(local, src=dist.get_world_size() - 1)
            stacked = local
        else:
            stacked = gather(local)  # [num_micro * world, 1 + 3K]
        losses, step_losses, step_acc, counts = (
            stacked[:, 0],
            stacked[:, 1 : 1 + k],
            stacked[:, 1 + k : 1 + 2 * k],
            stacked[:, 1 + 2 * k :],
        )
        metrics = self._metrics["train"]
        finite = torch.isfinite(losses)
        metrics["draft/loss"].append(losses[finite].mean().item() if finite.any() else float("nan"))
        total = counts.sum(0).clamp(min=1)
        for step in range(k):
            metrics[f"draft/loss_step_{step}"].append(
                ((step_losses[:, step] * counts[:, step]).nansum() / total[step]).item()
            )
            metrics[f"draft/accuracy_step_{step}"].append(
                ((step_acc[:, step] * counts[:, step]).sum() / total[step]).item()
            )
        metrics["draft/grad_norm"].append(float(grad_norm))
        metrics["draft/lr"].append(self.draft_scheduler.get_last_lr()[0])
        metrics["draft/skipped_steps"].append(float(self.draft_skipped_steps))

    # ------------------------------------------------------------------ context parallelism

    def _build_context_parallel_group(self) -> dist.ProcessGroup | None:
        """This rank's group of ``context_parallel_size`` consecutive ranks; None without context parallelism."""
        size = self.args.context_parallel_size
        if size == 1:
            return None
        world_size = self.accelerator.num_processes
        if world_size % size:
            raise ValueError(
                f"`context_parallel_size`={size} must divide the world size ({world_size} processes): launch a "
                f"multiple of {size} processes, or lower `context_parallel_size`."
            )
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError("`context_parallel_size` > 1 runs on DDP; it cannot be combined with DeepSpeed or FSDP.")
        rank, group = self.accelerator.process_index, None
        for start in range(0, world_size, size):  # every rank creates every group, in the same order
            members = dist.new_group(list(range(start, start + size)))
            if start <= rank < start + size:
                group = members
        return group

    def _context_parallel_training_step(self, model, inputs, num_items_in_batch):
        """``training_step`` under context parallelism: every member's micro-batch in turn, sharded across the group.

        Rollouts stay per rank (``_prepare_inputs``): each rank generates and scores its own rows, as under data
        parallelism, so no rank generates anything twice and TRL's sampling, rewards and advantages are untouched.
        The group then takes its members' micro-batches one after the other: for each, every rank runs the policy's
        GRPO forward and backward on its zigzag shard of the packed rows (ring attention in the policy's layers,
        `policy_log_probs`), then the draft's TTT on the taps of that forward (`ttt_loss(..., cp_group=...)`). A rank
        thus holds ``1 / context_parallel_size`` of one micro-batch's activations at a time. Each rank's policy and
        draft gradients are its positions' share of every member's loss, so the average over the world (DDP for the
        policy, `_draft_update` for the draft) equals data parallelism's gradient over the same rows.
        """
        started = time.perf_counter()
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        inputs = self._prepare_inputs(inputs)
        group = self.context_parallel_group
        members = [None] * dist.get_world_size(group)
        dist.all_gather_object(members, _inputs_to(inputs, "cpu"), group=group)
        losses = []
        for index, member_inputs in enumerate(members):
            member_inputs = _inputs_to(member_inputs, self.accelerator.device)
            # DDP synchronises the accumulated gradients in the last member's backward (if this micro-step syncs).
            sync = nullcontext() if index == len(members) - 1 else self.accelerator.no_sync(model)
            # The backward stays inside: gradient checkpointing recomputes the attention layers there.
            with sync, zigzag_ring_attention(self._policy()):
                self._context_parallel_rows = self._pack_rows(member_inputs)
                try:
                    with self.compute_loss_context_manager():
                        loss = self.compute_loss(model, member_inputs, num_items_in_batch=num_items_in_batch)
                    if (
                        not self.model_accepts_loss_kwargs or num_items_in_batch is None
                    ) and self.compute_loss_func is None:  # as Trainer.training_step (TRL's loss is scaled already)
                        loss = loss / self.current_gradient_accumulation_steps
                    self.accelerator.backward(loss)
                finally:
                    self._context_parallel_rows = None
            losses.append(loss.detach())
            while self._pending_taps:
                self._draft_micro_step(*self._pending_taps.pop(0))
        # What GRPOTrainer.training_step records around the base step: the micro-step counter and the step time.
        self._step += 1
        self._current_train_step_time += time.perf_counter() - started
        if self._step % self.current_gradient_accumulation_steps == 0:
            self._metrics["train"]["step_time"].append(self._current_train_step_time)
            self._current_train_step_time = 0.0
        return torch.stack(losses).mean()

    def _pack_rows(self, inputs) -> PackedRows:
        multimodal = [
            key for key in ("pixel_values", "image_grid_thw", "token_type_ids") if inputs.get(key) is not None
        ]
        if multimodal:
            raise ValueError(f"Context parallelism supports text-only policies; this batch has {multimodal}.")
        completion_mask = inputs["completion_mask"]
        return pack_rows(
            inputs["prompt_ids"],
            inputs["prompt_mask"],
            inputs["completion_ids"],
            completion_mask,
            rank=dist.get_rank(self.context_parallel_group),
            world_size=dist.get_world_size(self.context_parallel_group),
            pad_token_id=self._tokenizer.pad_token_id,
            completion_loss_mask=completion_mask * inputs["tool_mask"] if "tool_mask" in inputs else completion_mask,
        )

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **kwargs,
    ):
        rows = self._context_parallel_rows
        if rows is None:
            return super()._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size,
                compute_entropy,
                compute_aux_loss,
                **kwargs,
            )
        if compute_aux_loss:
            raise ValueError("Context parallelism does not support the MoE auxiliary loss (`router_aux_loss_coef`).")
        with self.accelerator.autocast():
            logps, entropies = policy_log_probs(model, rows, group=self.context_parallel_group)
        return logps, entropies if compute_entropy else None, None

    # ------------------------------------------------------------------ pipeline parallelism

    def _build_pipeline(self) -> None:
        """Cut the policy into this rank's pipeline stage (``pipeline_parallel_size > 1``).

        Every rank loaded the full policy; `PipelineCoTrainStep` cuts it in place, so the optimizer (built later by
        the Trainer) holds this stage's parameters only. Rank 0 first keeps a full copy for rollouts: generation
        needs the whole model, and the stages' weights are streamed into it before each generation
        (`_sync_pipeline_rollout_weights`). The draft trains on the last stage; rank 0's draft is its rollout copy.
        """
        args = self.args
        world_size, rank = self.accelerator.num_processes, self.accelerator.process_index
        if world_size != args.pipeline_parallel_size:
            raise ValueError(
                f"`pipeline_parallel_size`={args.pipeline_parallel_size} must equal the world size ({world_size} "
                "processes): launch one process per pipeline stage."
            )
        if (
            self.is_deepspeed_enabled
            or self.is_fsdp_enabled
            or is_peft_model(self.accelerator.unwrap_model(self.model))
        ):
            raise ValueError("`pipeline_parallel_size` > 1 cuts a plain HF model: not with DeepSpeed, FSDP or PEFT.")
        if self.tools:
            raise ValueError(
                "`pipeline_parallel_size` > 1 does not support tool calls: every stage must take part in each "
                "rollout turn that rank 0 generates."
            )
        policy = self._policy()
        if rank == 0:
            self._rollout_policy = copy.deepcopy(policy).eval().requires_grad_(False)
            # TRL patches `forward` per instance with a closure over the original's: the copy runs its own.
            self._rollout_policy.__dict__.pop("forward", None)
            self.draft.bind_target(self._rollout_policy)
        is_last = rank == world_size - 1
        self.pipeline_step = PipelineCoTrainStep(
            policy,
            draft=self.draft if is_last else None,
            aux_layer_ids=self.aux_layer_ids,
            schedule=args.pipeline_schedule,
            num_microbatches=args.pipeline_num_microbatches,
            tap_transport=args.pipeline_tap_transport,
            temperature=self.temperature,
            epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            ttt_steps=args.ttt_steps,
            ttt_step_weight_decay=args.ttt_step_weight_decay,
            ttt_gradient_checkpointing=args.ttt_gradient_checkpointing,
            device=self.accelerator.device,
        )
        # The stages hold different parameters: accelerate must not wrap this one in DDP (it would also try to
        # average gradients across stages).
        policy._is_accelerate_prepared = True

    def _pipeline_training_step(self, model, inputs, num_items_in_batch):
        """``training_step`` under pipeline parallelism: all ranks' rows as one batch through the pipeline.

        Rollouts and scoring stay per rank as under data parallelism (``_prepare_inputs``; rank 0 generates for
        all, `_pipeline_single_turn`), so TRL's sampling, rewards and advantages are untouched. The ranks then
        exchange their micro-batches and every stage runs the same batch, the concatenation in rank order, through
        `PipelineCoTrainStep.step`: the GRPO loss with TRL's whole-batch normaliser at the last stage, and the
        draft's TTT on the taps there. The gradients are those of one process on all rows, which is what data
        parallelism's average over the same ranks computes.
        """
        started = time.perf_counter()
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        inputs = self._prepare_inputs(inputs)
        members = [None] * self.accelerator.num_processes
        dist.all_gather_object(members, _inputs_to(inputs, "cpu"))
        batch = self._pipeline_batch(members)
        accumulation = self.current_gradient_accumulation_steps
        # TRL's dapo normaliser of the whole batch (TRL divides it by the number of processes, whose gradients DDP
        # averages; here one batch holds every process's rows).
        normalizer = inputs["num_items_in_batch"].clamp(min=1.0) * accumulation / self.args.steps_per_generation
        if (
            not self.model_accepts_loss_kwargs or num_items_in_batch is None
        ) and self.compute_loss_func is None:  # as Trainer.training_step
            normalizer = normalizer * accumulation
        out = self.pipeline_step.step(
            batch,
            loss_normalizer=normalizer.to(self.accelerator.device),
            draft_loss_scale=1.0 / (accumulation * self.args.draft_update_interval),
        )
        last = self.accelerator.num_processes - 1
        loss = torch.zeros((), device=self.accelerator.device) if out.policy_loss is None else out.policy_loss
        dist.broadcast(loss, src=last)  # every rank reports the loss of the last stage
        k = self.args.ttt_steps
        if out.draft is None:  # a placeholder row: the last stage broadcasts the real ones (`_log_draft_metrics`)
            self._draft_micro_metrics.append(torch.zeros(1 + 3 * k))
        else:
            draft = out.draft
            if not torch.isfinite(draft.loss):
                self._draft_step_has_nonfinite = True
            self._draft_micro_metrics.append(
                torch.cat(
                    [
                        draft.loss.detach().float().view(1),
                        draft.step_losses.float(),
                        draft.step_accuracies.float(),
                        draft.step_counts.float(),
                    ]
                ).cpu()
            )
        self._step += 1
        self._current_train_step_time += time.perf_counter() - started
        if self._step % accumulation == 0:
            self._metrics["train"]["step_time"].append(self._current_train_step_time)
            self._current_train_step_time = 0.0
        return loss.detach()

    def _pipeline_batch(self, members: list[dict]) -> GRPOBatch:
        """The ranks' micro-batches as one `GRPOBatch`: prompts left-padded and completions right-padded to the
        longest, as one process holding all the rows would pad them."""
        multimodal = [
            key for key in ("pixel_values", "image_grid_thw", "token_type_ids") if members[0].get(key) is not None
        ]
        if multimodal:
            raise ValueError(f"Pipeline parallelism supports text-only policies; this batch has {multimodal}.")
        pad_id = self._tokenizer.pad_token_id

        def cat(key: str, value: float, side: str) -> torch.Tensor:
            rows = [row for member in members for row in member[key]]
            return pad(rows, padding_value=value, padding_side=side)

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

    def _clip_grad_norm(self, model):
        if self.pipeline_step is None:
            return super()._clip_grad_norm(model)
        return self.pipeline_step.clip_grad_norm_(self.args.max_grad_norm)  # the norm over every stage

    def _get_grad_norm(self, model, grad_norm=None):
        if self.pipeline_step is not None and grad_norm is None:
            grad_norm = self.pipeline_step.clip_grad_norm_(float("inf"))
        return super()._get_grad_norm(model, grad_norm)

    def _sync_pipeline_rollout_weights(self) -> None:
        """Stream every stage's weights into rank 0's full policy, and the last stage's draft into rank 0's draft
        (every rank calls it)."""
        is_last = self.accelerator.process_index == self.accelerator.num_processes - 1
        policy_weights = stream_pipeline_weights(self.pipeline_step.state_dict(), dst=0)
        draft_weights = stream_pipeline_weights(self.draft.state_dict() if is_last else {}, dst=0)
        if self._rollout_policy is None:  # not rank 0: send only
            for _ in (*policy_weights, *draft_weights):
                pass
            return
        for model, weights in ((self._rollout_policy, policy_weights), (self.draft, draft_weights)):
            target = model.state_dict()
            received = set()
            with torch.no_grad():
                for name, tensor in weights:
                    target[name].copy_(tensor)
                    received.add(name)
            if received != set(target):
                raise RuntimeError(f"The stages sent no weights for {sorted(set(target) - received)}.")

    def _pipeline_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images):
        """Rank 0 generates every rank's rollouts with its full policy and the draft, fresh from the stages."""
        if images is not None or multimodal_fields:
            raise ValueError("Pipeline parallelism supports text-only rollouts.")
        if self.state.global_step != self._rollout_synced_step:
            self._sync_pipeline_rollout_weights()
            self._rollout_synced_step = self.state.global_step
        per_rank = [None] * self.accelerator.num_processes
        dist.all_gather_object(per_rank, prompt_ids)
        results = [None]
        if self._rollout_policy is not None:
            everyone = [ids for ids in per_rank for ids in ids]
            wrapped, self.model_wrapped = self.model_wrapped, self._rollout_policy
            try:
                completions, logprobs = self._local_single_turn(everyone, None, {}, num_generations)
            finally:
                self.model_wrapped = wrapped
            bounds = torch.tensor([0, *map(len, per_rank)]).cumsum(0).tolist()
            results = [
                [
                    (completions[start:end], None if logprobs is None else logprobs[start:end])
                    for start, end in zip(bounds[:-1], bounds[1:])
                ]
            ]
        dist.broadcast_object_list(results, src=0)
        return results[0][self.accelerator.process_index]

    # ------------------------------------------------------------------ speculative rollouts

    def _build_rollout_engine(self):
        """The vLLM engine (policy + draft) of speculative vLLM rollouts: colocated in this process, or a client of
        an ``hf-spec-cotrain vllm-serve`` server (``vllm_mode="server"``)."""
        args = self.args
        if args.vllm_mode == "server":
            base_url = args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"
            client = VLLMServerClient(base_url, timeout=max(args.vllm_server_timeout, 600.0))
            client.wait_until_ready(timeout=args.vllm_server_timeout)
            return client
        from .generation.vllm_engine import VLLMRolloutEngine

        policy_folder = Path(self._policy().config._name_or_path or "")
        if not (policy_folder / "config.json").exists():  # a model built in memory: vLLM needs a folder
            policy_folder = Path(args.output_dir) / "rollout_policy_init"
            self._policy().save_pretrained(policy_folder)
            self._tokenizer.save_pretrained(policy_folder)
        # The engine starts from a bootstrap draft and gets the real weights at its first sync. Its lm_head must
        # differ from the policy's, or vLLM would share the two and the draft's own head could never be synced.
        draft_folder = Path(args.output_dir) / "rollout_draft_init"
        bootstrap = {**self.draft.state_dict(), "lm_head.weight": -self.draft.lm_head.weight.detach()}
        self.draft.save_pretrained(draft_folder, state_dict=bootstrap)
        draft_sample_method, rejection_sample_method = self._vllm_sampling_methods()
        return VLLMRolloutEngine(
            policy_folder,
            draft_model=draft_folder,
            num_speculative_tokens=args.num_speculative_tokens,
            draft_sample_method=draft_sample_method,
            rejection_sample_method=rejection_sample_method,
            seed=args.seed,
            max_model_len=args.vllm_max_model_length,
            max_num_seqs=args.per_device_train_batch_size * args.steps_per_generation,
            gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        )

    def _vllm_sampling_methods(self) -> tuple[str | None, str | None]:
        """vLLM's draft/rejection sampling methods: probabilistic drafting whenever vLLM accepts it."""
        args = self.args
        if args.vllm_draft_sample_method is not None:
            return args.vllm_draft_sample_method, args.vllm_rejection_sample_method
        wanted = args.draft_sampling or "probabilistic"
        if wanted == "probabilistic" and self.draft.config.draft_vocab_size < self.draft.config.vocab_size:
            logger.warning(
                "vLLM 0.31 refuses probabilistic drafting with a reduced draft vocabulary (draft_vocab_size="
                f"{self.draft.config.draft_vocab_size} < {self.draft.config.vocab_size}): vLLM rollouts use greedy "
                "drafting, whose acceptance collapses at temperature ~1. Use the full vocabulary to avoid this."
            )
            wanted = "greedy"
        return wanted, args.vllm_rejection_sample_method or "standard"

    @contextmanager
    def _policy_weights_for_rollout(self):
        """The policy's weights under HF names, LoRA adapters merged in (and unmerged afterwards)."""
        model = self.accelerator.unwrap_model(self.model)
        if not is_peft_model(model):
            yield list(model.state_dict().items())
            return
        model.merge_adapter()
        try:
            weights = []
            for name, tensor in model.state_dict().items():
                if "lora_" in name or "original_module" in name:
                    continue
                name = name.removeprefix("base_model.model.").replace(".base_layer", "")
                weights.append((name.replace("modules_to_save.default.", ""), tensor))
            yield weights
        finally:
            model.unmerge_adapter()

    def _sync_rollout_engine(self) -> None:
        """Push this step's policy and draft: in place into the colocated engine, or to the shared server (once,
        from the main process, one transaction each)."""
        engine = self.rollout_engine
        if engine.shared_across_processes:
            if self.accelerator.is_main_process:
                with self._policy_weights_for_rollout() as weights:
                    engine.sync_weights("policy", weights)
                engine.sync_weights("draft", self.draft.state_dict().items())
            self.accelerator.wait_for_everyone()
            return
        with self._policy_weights_for_rollout() as weights:
            engine.sync_weights("policy", weights)
        engine.sync_weights("draft", self.draft.state_dict().items())

    def _engine_single_turn(self, prompt_ids):
        engine = self.rollout_engine
        if self.state.global_step != self._engine_synced_step:
            self._sync_rollout_engine()
            self._engine_synced_step = self.state.global_step
        started = time.perf_counter()
        out = engine.generate(
            prompt_ids,
            max_tokens=self.max_completion_length,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k or 0,
        )
        elapsed = time.perf_counter() - started
        self._log_spec_metrics(out.spec_decode, sum(map(len, out.completion_ids)), elapsed)
        return out.completion_ids, None

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if self.pipeline_step is not None:
            return self._pipeline_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        return self._local_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)

    def _local_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        plain = (
            not self.args.speculative_decoding
            or self.use_vllm
            or self.use_transformers_continuous_batching
            or images is not None
            or multimodal_fields
        )
        if plain:
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        try:
            if self.rollout_engine is not None:
                return self._engine_single_turn(prompt_ids)
            return self._speculative_single_turn(prompt_ids)
        except Exception as err:  # the run goes on with plain generation; nothing is lost
            logger.warning(f"Speculative rollout failed ({type(err).__name__}: {err}); plain generation this step.")
            self._metrics["train" if self.model.training else "eval"]["spec/fallback"].append(1.0)
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )

    def _speculative_single_turn(self, prompt_ids):
        device = self.accelerator.device
        padded_ids = pad(
            [torch.tensor(ids) for ids in prompt_ids],
            padding_value=self._tokenizer.pad_token_id,
            padding_side="left",
            pad_to_multiple_of=self.pad_to_multiple_of,
        ).to(device)
        attention_mask = pad(
            [torch.ones(len(ids), dtype=torch.long) for ids in prompt_ids],
            padding_value=0,
            padding_side="left",
            pad_to_multiple_of=self.pad_to_multiple_of,
        ).to(device)
        # Rollout randomness from (seed, step, rank) rather than the global RNG: a resumed run samples exactly
        # the rollouts the uninterrupted run would have.
        mode_offset = 0 if self.model.training else 1
        generator = _seeded_generator(
            self.args.seed, self.state.global_step, self.accelerator.process_index, mode_offset, device=device
        )
        started = time.perf_counter()
        with (
            unwrap_model_for_generation(
                self.model_wrapped,
                self.accelerator,
                gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
            ) as unwrapped_model,
            torch.no_grad(),
            self._dist.summon_full_params(self.model_wrapped, recurse=False),
        ):
            out = speculative_generate(
                unwrapped_model,
                self.draft,
                padded_ids,
                attention_mask,
                max_new_tokens=self.max_completion_length,
                num_speculative_tokens=self.args.num_speculative_tokens,
                do_sample=True,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k or 0,
                draft_sampling=self.args.draft_sampling,
                eos_token_id=self.eos_token_ids,
                pad_token_id=self._tokenizer.pad_token_id,
                generator=generator,
            )
        elapsed = time.perf_counter() - started
        completion_ids = out.sequences[:, padded_ids.shape[1] :]
        is_eos = torch.isin(completion_ids, torch.tensor(self.eos_token_ids, device=completion_ids.device))
        # Keep tokens up to and including the first EOS, as TRL does after generate(); only padding follows it.
        keep = (is_eos.cumsum(1) - is_eos.int()) == 0
        completions = [row[mask].tolist() for row, mask in zip(completion_ids.cpu(), keep.cpu())]
        self._log_spec_metrics(out, sum(map(len, completions)), elapsed)
        return completions, None

    def _log_spec_metrics(self, out, num_tokens: int, elapsed: float) -> None:
        mode = "train" if self.model.training else "eval"
        k = self.args.num_speculative_tokens
        local = torch.tensor(
            [
                out.num_drafts,
                out.num_accepted_tokens,
                num_tokens,
                elapsed,
                *[float(a) for a in out.accepted_per_position][:k],
            ],
            device=self.accelerator.device,
        )
        pipeline = self.pipeline_step is not None  # rank 0 alone generated, for every rank
        total = local if pipeline else gather(local.unsqueeze(0)).sum(0)
        generating_processes = 1 if pipeline else self.accelerator.num_processes
        drafts = total[0].clamp(min=1)
        metrics = self._metrics[mode]
        acceptance = 1.0 + (total[1] / drafts).item()
        metrics["spec/acceptance_length"].append(acceptance)
        for position in range(k):
            metrics[f"spec/accepted_per_position_{position}"].append((total[4 + position] / drafts).item())
        metrics["spec/tokens_per_second"].append((total[2] / (total[3] / generating_processes)).item())
        if mode == "train":
            self.acceptance_history.append((self.state.global_step, acceptance))

    # ------------------------------------------------------------------ checkpoints, saving, the Hub

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.args.save_draft and self.args.should_save:
            folder = Path(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            self.save_draft(folder / DRAFT_FOLDER)
            torch.save(
                {
                    "optimizer": self.draft_optimizer.state_dict(),
                    "scheduler": self.draft_scheduler.state_dict(),
                    "skipped_steps": self.draft_skipped_steps,
                    "acceptance_history": self.acceptance_history,
                },
                folder / DRAFT_STATE_FILE,
            )

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if self.pipeline_step is None:
            return super().save_model(output_dir, _internal_call)
        # Every rank streams its stage; rank 0 saves the full policy (and its draft is now the last stage's).
        self._sync_pipeline_rollout_weights()
        if self.args.should_save:
            stage, self.model = self.model, self._rollout_policy
            try:
                super().save_model(output_dir, _internal_call)
            finally:
                self.model = stage

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None or not (Path(checkpoint) / DRAFT_FOLDER).is_dir():
            return
        loaded = Eagle3DraftModel.from_pretrained(Path(checkpoint) / DRAFT_FOLDER)
        self.draft.load_state_dict(loaded.state_dict())
        state_file = Path(checkpoint) / DRAFT_STATE_FILE
        if state_file.exists():
            state = torch.load(state_file, map_location="cpu", weights_only=True)
            self.draft_optimizer.load_state_dict(state["optimizer"])
            self.draft_scheduler.load_state_dict(state["scheduler"])
            self.draft_skipped_steps = state["skipped_steps"]
            self.acceptance_history = [tuple(item) for item in state["acceptance_history"]]

    def save_draft(self, folder: str | os.PathLike, *, repo_id: str | None = None) -> Path:
        """Write the draft as a vLLM-loadable folder, with its model card (README.md)."""
        folder = Path(folder)
        self.draft.save_pretrained(folder)
        card = render_draft_card(
            self.draft,
            target_model=self._target_name(),
            repo_id=repo_id or self._draft_repo_id(),
            training_steps=self.state.global_step,
            acceptance_history=self.acceptance_history,
            ttt_steps=self.args.ttt_steps,
            step_weight_decay=self.args.ttt_step_weight_decay,
            num_speculative_tokens=self.args.num_speculative_tokens,
        )
        (folder / "README.md").write_text(card, encoding="utf-8")
        return folder

    def push_draft_to_hub(self, repo_id: str | None = None, *, private: bool | None = None):
        """Save the draft with its card and upload that folder to the Hub; returns the commit info."""
        repo_id = repo_id or self._draft_repo_id()
        folder = self.save_draft(Path(self.args.output_dir) / DRAFT_FOLDER, repo_id=repo_id)
        return push_draft_folder(
            folder,
            repo_id,
            token=self.args.hub_token,
            private=private,
            commit_message=f"Co-trained EAGLE-3 draft, step {self.state.global_step}",
        )

    def _target_name(self) -> str:
        if self.args.hub_model_id:
            return self.args.hub_model_id
        return self._policy().config._name_or_path or "policy"

    def _draft_repo_id(self) -> str:
        if self.args.draft_hub_model_id:
            return self.args.draft_hub_model_id
        base = self.args.hub_model_id or Path(self.args.output_dir).name
        return f"{base}-eagle3"

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if self.pipeline_step is not None and resume_from_checkpoint not in (None, False):
            raise ValueError(
                f"`resume_from_checkpoint`={resume_from_checkpoint!r}: resuming is not supported under pipeline "
                "parallelism yet (a checkpoint holds the full policy, but only the first stage's optimizer state)."
            )
        output = super().train(resume_from_checkpoint, *args, **kwargs)
        if self.pipeline_step is not None and self.args.save_draft:
            self._sync_pipeline_rollout_weights()  # the last stage's draft reaches rank 0, which saves it
        if self.args.save_draft and self.args.should_save:
            self.save_draft(Path(self.args.output_dir) / DRAFT_FOLDER)
            if self.args.push_draft_to_hub:
                self.push_draft_to_hub()
        return output


def _seeded_generator(*key: int, device=None) -> torch.Generator:
    """A generator seeded from ``key`` (ints hash the same in every process and run), not from the global RNG."""
    return torch.Generator(device=device).manual_seed(hash(key) % 2**63)


def _inputs_to(inputs: dict, device) -> dict:
    """A micro-batch dict with its tensors on `device` (other values as they are)."""
    return {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in inputs.items()}


class _DraftUpdateCallback(TrainerCallback):
    """Steps the draft right after the policy's optimizer step, before logging and saving."""

    def __init__(self, trainer: SpecCoTrainGRPOTrainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer._draft_micro_batch = 0
        if state.global_step % self.trainer.args.draft_update_interval == 0:
            self.trainer._draft_update()
        return control


__all__ = ["SpecCoTrainGRPOTrainer"]
