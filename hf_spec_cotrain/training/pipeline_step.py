"""The pipelined GRPO step with the draft co-trained on the last stage (docs/design.md section 6).

`PipelineCoTrainStep` cuts a HF causal LM into stages (`hf_spec_cotrain.parallel.pipeline`); the last stage holds
the final norm, the lm_head, the GRPO loss and the whole draft. One step runs the policy's forward and backward
through a `torch.distributed.pipelining` schedule (GPipe or 1F1B), with the GRPO loss of TRL
(`hf_spec_cotrain.losses.grpo_loss`) on each micro-batch at the last stage.

Taps reach the draft in one of two ways (``tap_transport``):

* ``"channel"`` (default): each stage sends the taps it owns, as they are produced, over a `TapChannel`, a
  separate process group with non-blocking point-to-point ops into landing buffers the last stage posted
  before the schedule started. Nothing waits on a tap inside the schedule.
* ``"relay"`` (the baseline): taps ride the pipeline as extra stage outputs; every stage forwards the taps of
  earlier stages plus its own with its activations.

A draft that looks up token embeddings itself (`DraftModel.embedded_token_ids`: DFlash's mask token) gets their
rows from the first stage, which holds the embedding: sent over the `TapChannel` once per step before the schedule
(under either transport), and bound to the draft for its step (`DraftModel.token_rows`).

The draft's training objective (`DraftCoTrainer.draft_micro_step`, the micro-step of every draft) runs on the last
stage once its part of the schedule is done (while the earlier stages still drain their backward passes), on the
whole batch, with the teacher computed there from the final norm's output and the lm_head rows of the draft
vocabulary. Policy gradients accumulate in each stage's parameters and draft gradients in the draft's, exactly as
one process would compute them on the whole model.
"""

import math
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from ..draft import DraftLossOutput
from ..losses import (
    check_grpo_loss_type,
    completion_loss_mask,
    draft_loss_mask,
    grpo_loss,
    grpo_loss_normalizer,
    grpo_per_token_logps,
)
from ..parallel.pipeline import (
    MIN_MICROBATCHES,
    PIPELINE_SCHEDULES,
    TAP_TRANSPORTS,
    StageModule,
    cut_model_to_stage,
    min_microbatches,
    stage_layer_ranges,
)
from ..parallel.tap_channel import TapChannel
from ..taps import Taps, decoder_layers, validate_aux_layer_ids
from ..validation import check_int
from .draft_cotraining import DraftCoTrainer, DraftStepSettings, RecordedTaps


__all__ = ["GRPOBatch", "PipelineCoTrainStep", "PipelineStepOutput"]

EMBEDDING_TAP = 0  # the input of decoder layer 0 is the token embedding
TOKEN_ROWS_TAP = -1  # the channel's id for the draft's token rows (`embedded_token_ids`), sent once per step


# ---------------------------------------------------------------------------------------------------- the step


class ReferenceLogProbs(nn.Module):
    """A stage of the reference model, run forward-only: the last stage returns the log-probs of the completion
    tokens (``[B, C]``, what the KL term needs), not the logits."""

    def __init__(self, stage: StageModule, *, temperature: float):
        super().__init__()
        self.stage, self.temperature = stage, temperature

    def forward(self, x, *, attention_mask, microbatch, completion_ids):
        out = self.stage(x, attention_mask=attention_mask, microbatch=microbatch)
        if not self.stage.is_last:
            return out
        return grpo_per_token_logps(out, completion_ids, temperature=self.temperature)


@dataclass
class GRPOBatch:
    """One GRPO micro-batch as TRL's `_compute_loss` receives it (prompts left-padded, completions right-padded)."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    advantages: torch.Tensor
    old_per_token_logps: torch.Tensor | None = None
    tool_mask: torch.Tensor | None = None

    @property
    def loss_mask(self) -> torch.Tensor:
        """The completion tokens that count in the loss."""
        return completion_loss_mask(self.completion_mask, self.tool_mask)


@dataclass
class PipelineStepOutput:
    """What one step leaves on this rank: losses on the last stage (None elsewhere).

    ``policy_loss`` is the GRPO loss of the whole batch (the sum of the micro-batch losses, each normalised by the
    whole batch's normaliser), ``draft`` the draft's `DraftLossOutput` (its loss was backpropagated, times
    ``draft_loss_scale``), None without co-training.
    """

    policy_loss: torch.Tensor | None = None
    draft: DraftLossOutput | None = None


class PipelineCoTrainStep:
    r"""
    The GRPO training step of a HF causal LM cut into pipeline stages, with a draft (any family) co-trained on the
    last stage from the policy's own taps.

    Build it on every rank of the pipeline group with the same arguments (the draft only on the last stage);
    then per step call `step(batch)` on every rank with the same batch, and step your optimizers: the stage's
    parameters (`parameters()`, named as in the full model by `named_parameters()`) and the draft's hold the
    gradients of the whole model's step.

    Args:
        model: the policy on every rank, whole or loaded as this rank's stage alone (`pipeline_stage_class`); it
            is cut **in place** to this rank's stage (modules of other stages are replaced by identity placeholders
            and their weights released). Tied input and output
            embeddings are refused: they would live on two stages.
        group: the pipeline's process group (default: the world); stage i is group rank i.
        draft: the `DraftModel` to co-train, required on the last stage when ``aux_layer_ids`` is set.
        aux_layer_ids: tapped layers (the draft's `tap_layer_ids`, in its order). None: no co-training (plain
            pipelined GRPO).
        embedded_token_ids: the token ids whose embeddings the draft looks up itself (the draft's
            `embedded_token_ids`, given on every rank): the first stage sends their rows to the last every step.
        schedule: ``"1F1B"`` (default) or ``"GPipe"``.
        num_microbatches: pipeline micro-batches per step (>= 4, and >= the number of stages for 1F1B); the
            batch size must be a multiple of it.
        tap_transport: ``"channel"`` (`TapChannel`, default) or ``"relay"`` (taps ride the activations).
        layers_per_stage: decoder layers of each stage (default: as even as possible, extras first).
        temperature, epsilon_low, epsilon_high, loss_type: as in `grpo_loss` (TRL's `temperature`, `epsilon`,
            `epsilon_high`, `loss_type`).
        beta, bias_correction_kl: the KL term of `grpo_loss` (TRL's `beta`, `use_bias_correction_kl`).
        reference_model: the reference policy of the KL term, required when ``beta`` is not 0: on every rank,
            whole or this rank's stage alone, cut **in place** to the same stage; each step first runs it
            forward-only through the pipeline (`torch.distributed.pipelining`'s ``eval``) on the step's batch, so
            the last stage gets the reference log-probs of every row without any rank holding the whole reference.
        draft_settings: how the draft's micro-step runs (`DraftStepSettings`: its family's objective, gradient
            checkpointing, bf16 autocast over float32 weights); default: the family's default objective in float32.
        draft_generator: the random stream of the draft's objective (`DraftModel.training_loss`).
        device: where this stage runs (default: the model's device).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        group: dist.ProcessGroup | None = None,
        draft: nn.Module | None = None,
        aux_layer_ids: Sequence[int] | None = None,
        embedded_token_ids: Sequence[int] = (),
        schedule: str = "1F1B",
        num_microbatches: int = MIN_MICROBATCHES,
        tap_transport: str = "channel",
        layers_per_stage: Sequence[int] | None = None,
        temperature: float = 1.0,
        epsilon_low: float = 0.2,
        epsilon_high: float | None = None,
        loss_type: str = "dapo",
        beta: float = 0.0,
        bias_correction_kl: bool = True,
        reference_model: nn.Module | None = None,
        draft_settings: DraftStepSettings | None = None,
        draft_generator: torch.Generator | None = None,
        device: torch.device | str | None = None,
    ):
        self.group = group if group is not None else dist.group.WORLD
        self.num_stages = dist.get_world_size(self.group)
        self.stage_index = dist.get_rank(self.group)
        self.is_first, self.is_last = self.stage_index == 0, self.stage_index == self.num_stages - 1
        if schedule.lower() not in PIPELINE_SCHEDULES:
            raise ValueError(f"`schedule`={schedule!r} is not supported; choose one of 'GPipe', '1F1B'.")
        check_int(num_microbatches, "num_microbatches")
        minimum = min_microbatches(schedule, self.num_stages)
        if num_microbatches < minimum:
            raise ValueError(
                f"`num_microbatches`={num_microbatches} is too few: use at least {minimum} (a pipeline of "
                f"{self.num_stages} stages needs several micro-batches in flight to hide its bubble)."
            )
        if tap_transport not in TAP_TRANSPORTS:
            raise ValueError(f"`tap_transport`={tap_transport!r} is not supported; choose one of {TAP_TRANSPORTS}.")
        text_config = model.config.get_text_config()
        if self.num_stages > 1 and getattr(text_config, "tie_word_embeddings", False):
            raise ValueError(
                "Pipeline parallelism with tied input/output embeddings is not supported: the embedding lives on "
                "the first stage and the lm_head on the last. Untie them (`tie_word_embeddings=False`)."
            )
        check_grpo_loss_type(loss_type)
        if beta != 0.0 and reference_model is None:
            raise ValueError(
                f"`beta`={beta} weighs a KL term to the reference model: pass `reference_model=` (the full reference "
                "policy on every rank; it is cut to the stage), or set `beta=0`."
            )
        self.loss_type = loss_type
        self.beta, self.bias_correction_kl = beta, bias_correction_kl
        self.schedule_class = PIPELINE_SCHEDULES[schedule.lower()]
        self.num_microbatches = num_microbatches
        self.temperature, self.epsilon_low = temperature, epsilon_low
        self.epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
        self.tap_transport = tap_transport
        self.hidden_size = text_config.hidden_size
        self.vocab_size = text_config.vocab_size

        num_layers = len(decoder_layers(model))
        self.layer_ranges = stage_layer_ranges(num_layers, self.num_stages, layers_per_stage)
        self.co_training = aux_layer_ids is not None
        self.aux_layer_ids = validate_aux_layer_ids(aux_layer_ids, num_layers) if self.co_training else ()
        tap_layers = sorted({EMBEDDING_TAP, *self.aux_layer_ids}) if self.co_training else []
        # Taps of each stage in the order it produces them (forward order).
        self.taps_of_stage = [[a for a in tap_layers if a in layers] for layers in self.layer_ranges]
        # Token rows travel only where the draft's stage is not the embedding's.
        self.embedded_token_ids = tuple(embedded_token_ids) if self.co_training and self.num_stages > 1 else ()
        self.draft = draft if self.is_last else None
        if self.draft is not None and draft_settings is None:
            draft_settings = DraftStepSettings(options=self.draft.training_options(None))
        self.draft_settings, self.draft_generator = draft_settings, draft_generator
        if self.is_last and self.co_training:
            if draft is None:
                raise ValueError("The last stage trains the draft: pass `draft=` there when `aux_layer_ids` is set.")
            if tuple(draft.validate_target(model.config)) != self.aux_layer_ids:
                raise ValueError(
                    f"`aux_layer_ids`={list(self.aux_layer_ids)} differ from the draft's taps "
                    f"{list(draft.validate_target(model.config))}."
                )
            if self.num_stages > 1 and tuple(draft.embedded_token_ids()) != self.embedded_token_ids:
                raise ValueError(
                    f"`embedded_token_ids`={list(self.embedded_token_ids)} differ from the token ids the draft embeds "
                    f"itself, {list(draft.embedded_token_ids())}: pass `draft.embedded_token_ids()` on every rank."
                )

        cut_model_to_stage(model, self.layer_ranges[self.stage_index], is_first=self.is_first, is_last=self.is_last)
        self.model = model
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.module = StageModule(
            model,
            is_first=self.is_first,
            is_last=self.is_last,
            tap_layers=self.taps_of_stage[self.stage_index],
            relay=self.co_training and tap_transport == "relay",
        )
        self.reference = None
        if beta != 0.0:
            cut_model_to_stage(
                reference_model, self.layer_ranges[self.stage_index], is_first=self.is_first, is_last=self.is_last
            )
            reference_model.eval().requires_grad_(False)
            self.reference = ReferenceLogProbs(
                StageModule(reference_model, is_first=self.is_first, is_last=self.is_last, tap_layers=(), relay=False),
                temperature=temperature,
            )
        self._reference_schedules: dict[tuple[int, int, int], ScheduleGPipe] = {}
        self._ref_per_token_logps: torch.Tensor | None = None
        uses_channel = self.co_training and (tap_transport == "channel" or bool(self.embedded_token_ids))
        self.channel = TapChannel(self.group, device=self.device) if uses_channel else None
        self._local_taps: dict[tuple[int, int], torch.Tensor] = {}
        if self.co_training:
            self.module.on_tap = self._on_tap
        self._schedules: dict[tuple[int, int, int], object] = {}
        self._batch: GRPOBatch | None = None
        self._normalizer: float | torch.Tensor = 1.0

    # ------------------------------------------------------------------ parameters

    def parameters(self) -> list[nn.Parameter]:
        """This stage's trainable parameters (what its optimizer steps)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This stage's parameters under their names in the full model."""
        return self.model.named_parameters()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's weights under their names in the full model."""
        return self.model.state_dict()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the policy's gradients by their norm over all stages; returns that total norm (every rank)."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        local = torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum() if grads else torch.zeros(())
        local = local.to(self.device)
        dist.all_reduce(local, group=self.group)
        total = local.sqrt()
        if grads and math.isfinite(max_norm):
            torch._foreach_mul_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0).to(grads[0].dtype))
        return total

    # ------------------------------------------------------------------ one step

    def step(
        self,
        batch: GRPOBatch,
        *,
        loss_normalizer: float | torch.Tensor | None = None,
        draft_loss_scale: float = 1.0,
    ) -> PipelineStepOutput:
        """Forward and backward of one GRPO batch through the pipeline, and the draft's TTT on the last stage.

        Every rank of the pipeline passes the same batch. Gradients accumulate (zero them yourself).
        ``loss_normalizer``: the loss's denominator for the whole batch (`grpo_loss_normalizer`; default: the
        batch's own, without gradient accumulation).
        ``draft_loss_scale`` multiplies the draft loss before its backward (e.g. ``1 / gradient_accumulation``).
        """
        batch = self._validated(batch)
        rows = batch.prompt_ids.shape[0]
        micro_rows = rows // self.num_microbatches
        input_ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
        attention_mask = torch.cat([batch.prompt_mask, batch.completion_mask], dim=1)
        length, completion_length = input_ids.shape[1], batch.completion_ids.shape[1]
        schedule = self._schedule(micro_rows, length, completion_length)
        self._batch = batch
        if loss_normalizer is None:
            loss_normalizer = grpo_loss_normalizer(
                self.loss_type, batch.loss_mask, max_completion_length=batch.completion_ids.shape[1]
            )
        self._normalizer = loss_normalizer
        self.module.logits_to_keep = completion_length
        microbatch = torch.arange(rows) // micro_rows  # which micro-batch each row lands in (kept on the CPU)
        kwargs = {"attention_mask": attention_mask, "microbatch": microbatch}
        if self.reference is not None:
            self._ref_per_token_logps = self._reference_log_probs(input_ids, batch.completion_ids, kwargs)
        if self.channel is not None:
            self.channel.begin_step()
            if self.is_last:
                self._post_landing_buffers(micro_rows, length)
            elif self.is_first and self.embedded_token_ids:
                self._send_token_rows()

        losses: list[torch.Tensor] = []
        target = torch.arange(rows, device=self.device) if self.is_last else None
        if self.is_first:
            schedule.step(input_ids, target=target, losses=losses, return_outputs=False, **kwargs)
        else:
            schedule.step(target=target, losses=losses, return_outputs=False, **kwargs)

        output = PipelineStepOutput()
        if self.channel is not None and not self.is_last:
            self.channel.wait_sends()
        if self.is_last:
            output.policy_loss = torch.stack(losses).sum().detach()
            if self.co_training:
                output.draft = self._draft_step(batch, attention_mask, draft_loss_scale)
        self._batch = self._ref_per_token_logps = None
        return output

    def _validated(self, batch: GRPOBatch) -> GRPOBatch:
        rows = batch.prompt_ids.shape[0]
        if rows % self.num_microbatches:
            raise ValueError(
                f"The batch has {rows} rows, not a multiple of `num_microbatches`={self.num_microbatches}: the "
                "pipeline's micro-batches must all have the same shape."
            )
        shapes = {
            "prompt_mask": (batch.prompt_mask, batch.prompt_ids.shape),
            "completion_mask": (batch.completion_mask, batch.completion_ids.shape),
            "completion_ids": (batch.completion_ids, (rows, batch.completion_ids.shape[1])),
        }
        if batch.old_per_token_logps is not None:
            shapes["old_per_token_logps"] = (batch.old_per_token_logps, batch.completion_ids.shape)
        for name, (tensor, shape) in shapes.items():
            if tuple(tensor.shape) != tuple(shape):
                raise ValueError(f"`{name}` has shape {tuple(tensor.shape)}; expected {tuple(shape)}.")
        if batch.advantages.shape[0] != rows:
            raise ValueError(f"`advantages` has {batch.advantages.shape[0]} rows; the batch has {rows}.")
        move = {name: getattr(batch, name) for name in batch.__dataclass_fields__}
        return GRPOBatch(**{k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in move.items()})

    def _schedule(self, micro_rows: int, length: int, completion_length: int):
        """A stage and schedule for these micro-batch shapes (static shapes: no shape inference at run time)."""
        key = (micro_rows, length, completion_length)
        if key not in self._schedules:
            meta = {"device": "meta"}
            hidden = torch.empty(micro_rows, length, self.hidden_size, dtype=self.dtype, **meta)
            relay = self.co_training and self.tap_transport == "relay"

            def relayed(stages: range) -> list[torch.Tensor]:
                count = sum(len(self.taps_of_stage[s]) for s in stages) if relay else 0
                return [torch.empty_like(hidden) for _ in range(count)]

            if self.is_first:
                inputs = (torch.empty(micro_rows, length, dtype=torch.int64, **meta),)
            else:
                inputs = (hidden.clone().requires_grad_(), *relayed(range(self.stage_index)))
            if self.is_last:
                outputs = (
                    torch.empty(
                        micro_rows, completion_length, self.vocab_size, dtype=self.dtype, **meta
                    ).requires_grad_(),
                )
            else:
                outputs = (hidden.clone().requires_grad_(), *relayed(range(self.stage_index + 1)))
            stage = PipelineStage(
                self.module,
                self.stage_index,
                self.num_stages,
                self.device,
                input_args=inputs,
                output_args=outputs,
                group=self.group,
            )
            self._schedules[key] = self.schedule_class(
                stage, n_microbatches=self.num_microbatches, loss_fn=self._micro_loss, scale_grads=False
            )
        return self._schedules[key]

    def _reference_log_probs(
        self, input_ids: torch.Tensor, completion_ids: torch.Tensor, kwargs: dict
    ) -> torch.Tensor | None:
        """The reference model's log-probs of the batch's completion tokens, ``[B, C]`` on the last stage (None
        elsewhere): a forward-only pass of the reference stages through the pipeline, micro-batch by micro-batch."""
        rows, length = input_ids.shape
        micro_rows, completion_length = rows // self.num_microbatches, completion_ids.shape[1]
        key = (micro_rows, length, completion_length)
        if key not in self._reference_schedules:
            meta = {"device": "meta"}
            hidden = torch.empty(micro_rows, length, self.hidden_size, dtype=self.dtype, **meta)
            inputs = (torch.empty(micro_rows, length, dtype=torch.int64, **meta),) if self.is_first else (hidden,)
            log_probs_dtype = torch.promote_types(self.dtype, torch.float32)
            output = torch.empty(micro_rows, completion_length, dtype=log_probs_dtype, **meta)
            stage = PipelineStage(
                self.reference,
                self.stage_index,
                self.num_stages,
                self.device,
                input_args=inputs,
                output_args=(output if self.is_last else hidden,),
                group=self.group,
            )
            self._reference_schedules[key] = ScheduleGPipe(stage, n_microbatches=self.num_microbatches)
        self.reference.stage.logits_to_keep = completion_length
        args = (input_ids,) if self.is_first else ()
        with torch.no_grad():
            return self._reference_schedules[key].eval(*args, completion_ids=completion_ids, **kwargs)

    def _micro_loss(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        batch = self._batch
        old = batch.old_per_token_logps
        ref = self._ref_per_token_logps
        return grpo_loss(
            logits,
            batch.completion_ids[rows],
            batch.loss_mask[rows],
            batch.advantages[rows],
            None if old is None else old[rows],
            temperature=self.temperature,
            epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            loss_type=self.loss_type,
            normalizer=self._normalizer,
            ref_per_token_logps=None if ref is None else ref[rows],
            beta=self.beta,
            bias_correction_kl=self.bias_correction_kl,
        )

    # ------------------------------------------------------------------ taps and the draft

    def _on_tap(self, microbatch: int, tap_id: int, hidden: torch.Tensor) -> None:
        if self.is_last:
            self._local_taps[(microbatch, tap_id)] = hidden
        else:
            self.channel.send(hidden, microbatch=microbatch, tap_id=tap_id)

    def _send_token_rows(self) -> None:
        """The first stage's embedding rows of the draft's `embedded_token_ids`, as the policy holds them this step."""
        weight = self.model.get_input_embeddings().weight.detach()
        rows = weight[torch.tensor(self.embedded_token_ids, device=weight.device)]
        self.channel.send(rows, microbatch=0, tap_id=TOKEN_ROWS_TAP)

    def _post_landing_buffers(self, micro_rows: int, length: int) -> None:
        """One landing buffer per message of each sender, in its sending order: the first stage's token rows (sent
        before the schedule), then every stage's taps under the channel transport."""
        tap_shape = (micro_rows, length, self.hidden_size)
        for source in range(self.num_stages - 1):
            keys, shapes = [], []
            if source == 0 and self.embedded_token_ids:
                keys.append((0, TOKEN_ROWS_TAP))
                shapes.append((len(self.embedded_token_ids), self.hidden_size))
            if self.tap_transport == "channel":
                taps = [(mb, a) for mb in range(self.num_microbatches) for a in self.taps_of_stage[source]]
                keys += taps
                shapes += [tap_shape] * len(taps)
            if keys:
                self.channel.expect(source=source, keys=keys, shapes=shapes, dtype=self.dtype)

    def _gather_taps(self) -> dict[int, torch.Tensor]:
        """Every tap of the step, the micro-batches concatenated in row order."""
        relayed = [a for s in range(self.num_stages - 1) for a in self.taps_of_stage[s]]
        per_tap: dict[int, list[torch.Tensor]] = {}
        for mb in range(self.num_microbatches):
            if self.tap_transport == "relay":
                arrived = dict(zip([*relayed, *self.taps_of_stage[-1]], self.module.relayed_taps.pop(mb)))
            else:
                arrived = {a: self.channel.receive(microbatch=mb, tap_id=a) for a in relayed}
                arrived.update({a: self._local_taps.pop((mb, a)) for a in self.taps_of_stage[-1]})
            for tap_id, tensor in arrived.items():
                per_tap.setdefault(tap_id, []).append(tensor)
        return {tap_id: torch.cat(tensors) for tap_id, tensors in per_tap.items()}

    def _draft_inputs(
        self, batch: GRPOBatch, attention_mask: torch.Tensor
    ) -> tuple[RecordedTaps, torch.Tensor, torch.Tensor | None]:
        """The step's taps, whole batch, the teacher's logits over the draft vocabulary (the policy's own head on
        the decoder's output), and the first stage's rows of the draft's `embedded_token_ids` (None: none)."""
        taps = self._gather_taps()
        final_hidden = torch.cat([self.module.final_hidden.pop(mb) for mb in range(self.num_microbatches)])
        recorded = RecordedTaps(
            Taps(
                aux_hidden_states=torch.cat([taps[a] for a in self.aux_layer_ids], dim=-1),
                embeddings=taps[EMBEDDING_TAP],
                final_hidden=final_hidden,
            ),
            attention_mask=attention_mask,
            loss_mask=draft_loss_mask(batch.prompt_mask, batch.completion_mask, batch.tool_mask),
        )
        teacher = self.module.policy_head.teacher_logits(final_hidden, self.draft.draft_to_target_ids)
        token_rows = self.channel.receive(microbatch=0, tap_id=TOKEN_ROWS_TAP) if self.embedded_token_ids else None
        return recorded, teacher, token_rows

    def _draft_step(self, batch: GRPOBatch, attention_mask: torch.Tensor, scale: float) -> DraftLossOutput:
        recorded, teacher, token_rows = self._draft_inputs(batch, attention_mask)
        with nullcontext() if token_rows is None else self.draft.token_rows(token_rows):
            out, _ = DraftCoTrainer.draft_micro_step(
                self.draft,
                recorded,
                teacher_logits=teacher,
                settings=self.draft_settings,
                loss_scale=scale,
                generator=self.draft_generator,
            )
        return out
