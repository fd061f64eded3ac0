"""`DraftCoTrainer`: the draft's half of a co-training step.

The trainer hands it the taps of each policy forward; it runs the draft's training objective on them (its family's
`DraftModel.training_loss`; its own autocast, its own gradients), steps the draft's optimizer after the policy's
(gradients averaged over the replicas, clipped, the step skipped when anything is non-finite), logs the ``draft/*`` metrics and holds the draft's checkpoint state. Nothing
here touches the policy: no gradient crosses from the draft to the policy or back.

Its micro-step (`DraftCoTrainer.draft_micro_step`, with `DraftStepSettings`) is the draft's only one: the pipeline's
last stage and the offline warm start run it too, and `build_draft_optimizer` builds the warm start's optimizer as it
builds the co-trainer's.

The draft heals: the last draft that passed `DraftModel.validate_weights` after an update (weights and optimizer
state, in host memory: one copy of each) is restored whenever the draft fails it, at the start of every step (before
rollouts use it or an engine receives it) and after every update. Restores that keep failing stop speculation for the
rest of the run, loudly, rather than failing every step.

A draft sharded with FSDP2 (`shard_draft`, `hf_spec_cotrain.parallel.fsdp.shard_draft`) trains from its shards:
FSDP2's reduce-scatter averages its gradients (no all-reduce here), every rank decides together whether a micro-step
runs its backward (a collective), the last good copy keeps each rank's shard, and its checkpoint state is gathered
whole on rank 0 (`state_dict`) and sharded again on load.
"""

import copy
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from accelerate.utils import gather
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from transformers import TrainerCallback, get_scheduler
from transformers.utils import logging

from ..draft import DraftLossOutput, DraftModel, DraftTrainingBatch
from ..parallel.comm import all_reduce_gradients
from ..policy_head import PolicyHead
from ..taps import Taps
from .timing import StepTimes


logger = logging.get_logger(__name__)

# Restores without a good update in between after which the run stops speculating (the draft keeps training).
RESTORES_BEFORE_STOPPING = 3


def seeded_generator(*key: int, device=None) -> torch.Generator:
    """A generator seeded from ``key`` (ints hash the same in every process and run), not from the global RNG, so
    that a resumed run draws what the uninterrupted one would have."""
    return torch.Generator(device=device).manual_seed(hash(key) % 2**63)


def build_draft_optimizer(
    draft: DraftModel,
    *,
    learning_rate: float,
    weight_decay: float,
    lr_scheduler_type: str,
    warmup_steps: int,
    total_steps: int,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW over the draft's trainable parameters and its transformers learning-rate schedule."""
    optimizer = torch.optim.AdamW(draft.trainable_parameters(), lr=learning_rate, weight_decay=weight_decay)
    scheduler = get_scheduler(
        lr_scheduler_type, optimizer, num_warmup_steps=warmup_steps, num_training_steps=total_steps
    )
    return optimizer, scheduler


@dataclass(frozen=True)
class DraftStepSettings:
    """How the draft's micro-step runs: the family's objective settings (``options``, from
    `DraftModel.training_options`), optionally recomputed in the backward (``gradient_checkpointing``), under bf16
    autocast when ``bf16`` (the draft's weights stay float32)."""

    options: Any
    gradient_checkpointing: bool = False
    bf16: bool = False

    def autocast(self, device_type: str) -> AbstractContextManager:
        return torch.autocast(device_type, dtype=torch.bfloat16) if self.bf16 else nullcontext()


@dataclass
class RecordedTaps:
    """One policy forward's taps, waiting for the draft's micro-step: padded rows (``attention_mask``), or this
    rank's zigzag shard of packed documents (``cu_seqlens``, global) under context parallelism."""

    taps: Taps
    attention_mask: torch.Tensor | None
    loss_mask: torch.Tensor
    cu_seqlens: torch.Tensor | None = None


class DraftCoTrainer:
    """The draft's optimizer, scheduler, micro-steps, update and metrics.

    Args:
        draft: the draft, on the training device in float32 (master weights of a small head).
        args: the trainer's `SpecCoTrainConfig`.
        accelerator: the trainer's accelerator (device, mixed precision, gathering of metrics).
        policy: returns the policy (unwrapped by the accelerator), whose own head on its decoder's output gives the
            teacher (`PolicyHead`).
        metrics: the trainer's ``_metrics`` (mode -> name -> list of values), where ``draft/*`` values go.
        owner_rank: None when every rank holds a replica of the draft (data and context parallelism: gradients are
            averaged over the world); the rank that alone trains it under pipeline parallelism (its decision and
            metrics are broadcast to the others).
    """

    def __init__(self, draft: DraftModel, args, accelerator, *, policy, metrics, owner_rank=None, step_times=None):
        self.draft, self.args, self.accelerator = draft, args, accelerator
        self.step_times = step_times or StepTimes(metrics)
        self.policy, self.metrics, self.owner_rank = policy, metrics, owner_rank
        # The process group of the FSDP2 mesh the draft is sharded over (None: replicated, or trained by one rank).
        meshes = {p.device_mesh for p in draft.parameters() if isinstance(p, DTensor)}
        self.shard_group = meshes.pop().get_group() if meshes else None
        self._policy_head: PolicyHead | None = None
        self.optimizer, self.scheduler = build_draft_optimizer(
            draft,
            learning_rate=args.draft_learning_rate,
            weight_decay=args.draft_weight_decay,
            lr_scheduler_type=args.draft_lr_scheduler_type,
            warmup_steps=args.draft_warmup_steps,
            total_steps=max(1, args.max_steps if args.max_steps > 0 else 10**9),
        )
        # bf16 autocast as `draft_bf16` asks, by default when the policy trains in bf16 (accelerate autocasts only the
        # policy's forward). Under an fp16 policy the draft stays float32 unless asked: fp16 would need a loss scaler.
        draft_bf16 = accelerator.mixed_precision == "bf16" if args.draft_bf16 is None else args.draft_bf16
        self.settings = DraftStepSettings(
            options=draft.training_options(args),
            gradient_checkpointing=args.ttt_gradient_checkpointing,
            bf16=draft_bf16,
        )
        self.num_positions = draft.loss_positions(self.settings.options)
        # The objective's own randomness (a family's sampled positions), one stream for the run: the same on every
        # rank (a context-parallel group draws alike), checkpointed so that a resumed run draws what this one would.
        self.generator = seeded_generator(args.seed, device=accelerator.device)
        self.skipped_steps = 0
        self.restored_steps = 0
        self.speculating = True  # False once the draft kept failing: rollouts are plain for the rest of the run
        self._restores_in_a_row = 0
        self._last_good = self._snapshot()
        self.micro_batch = 0  # micro-batches of this step so far (`rows_to_train` draws per micro-batch)
        self._recorded: list[RecordedTaps] = []
        self._micro_metrics: list[torch.Tensor] = []
        self._has_nonfinite = False

    # ------------------------------------------------------------------ the micro-steps

    def rows_to_train(self, batch_size: int, *, step: int) -> torch.Tensor | None:
        """The rows of this micro-batch the draft trains on (``draft_train_fraction``; None: all), drawn from (seed,
        step, rank, micro-batch) so that a resumed run chooses the rows the uninterrupted one did. Called once per
        micro-batch: it counts them."""
        micro_batch, self.micro_batch = self.micro_batch, self.micro_batch + 1
        count = max(1, round(self.args.draft_train_fraction * batch_size))
        if count >= batch_size:
            return None
        generator = seeded_generator(self.args.seed, step, self.accelerator.process_index, micro_batch)
        return torch.randperm(batch_size, generator=generator)[:count].sort().values

    def record(self, recorded: RecordedTaps) -> None:
        """Keep one forward's taps until `train_recorded` (after the policy's backward)."""
        self._recorded.append(recorded)

    def train_recorded(self, *, loss_divisor: int, cp_group: dist.ProcessGroup | None = None) -> None:
        """The draft's micro-step on every recorded forward, in order."""
        with self.step_times.measure("draft_training"):
            while self._recorded:
                self.micro_step(self._recorded.pop(0), loss_divisor=loss_divisor, cp_group=cp_group)

    def teacher_logits(self, final_hidden: torch.Tensor) -> torch.Tensor:
        """The policy's logits over the draft vocabulary, through its own head (unscaled by the temperature: rollouts
        apply it to both). The head is read once the policy is prepared (FSDP may wrap it after this is built)."""
        policy = self.policy()
        if self._policy_head is None or self._policy_head.policy is not policy:
            self._policy_head = PolicyHead(policy)
        return self._policy_head.teacher_logits(final_hidden, self.draft.draft_to_target_ids)

    def micro_step(
        self, recorded: RecordedTaps, *, loss_divisor: int, cp_group: dist.ProcessGroup | None = None
    ) -> None:
        """`draft_micro_step` on one forward's taps (its loss divided by ``loss_divisor``: the micro-steps the draft's
        gradients accumulate over), its metrics kept for the next `update`."""
        out, total_loss = self.draft_micro_step(
            self.draft,
            recorded,
            teacher_logits=self.teacher_logits(recorded.taps.final_hidden),
            settings=self.settings,
            loss_scale=1.0 / loss_divisor,
            cp_group=cp_group,
            generator=self.generator,
            shard_group=self.shard_group,
        )
        self.record_metrics(out, total_loss)

    @staticmethod
    def draft_forward(
        draft: DraftModel,
        recorded: RecordedTaps,
        *,
        teacher_logits: torch.Tensor,
        settings: DraftStepSettings,
        cp_group: dist.ProcessGroup | None = None,
        generator: torch.Generator | None = None,
    ) -> DraftLossOutput:
        """The draft's training loss on one forward's taps (`DraftModel.training_loss`), under the settings'
        autocast (``cp_group``: that of packed documents' shards); no backward: evaluation runs this alone."""
        batch = DraftTrainingBatch(
            aux_hidden_states=recorded.taps.aux_hidden_states,
            input_embeds=recorded.taps.embeddings,
            teacher_logits=teacher_logits,
            loss_mask=recorded.loss_mask.bool(),
            attention_mask=None if recorded.attention_mask is None else recorded.attention_mask.bool(),
            cu_seqlens=recorded.cu_seqlens,
        )
        with settings.autocast(recorded.taps.aux_hidden_states.device.type):
            return draft.training_loss(
                batch,
                settings.options,
                cp_group=cp_group,
                generator=generator,
                gradient_checkpointing=settings.gradient_checkpointing,
            )

    @staticmethod
    def draft_micro_step(
        draft: DraftModel,
        recorded: RecordedTaps,
        *,
        teacher_logits: torch.Tensor,
        settings: DraftStepSettings,
        loss_scale: float = 1.0,
        cp_group: dist.ProcessGroup | None = None,
        generator: torch.Generator | None = None,
        shard_group: dist.ProcessGroup | None = None,
    ) -> tuple[DraftLossOutput, torch.Tensor]:
        """The draft's micro-step: `draft_forward`, then the backward of its loss times ``loss_scale`` into the
        draft's gradients, skipped when the loss is not finite. Returns the output and the whole loss that decided
        (under context parallelism the global one, ``step_weights * step_losses`` summed, so that every rank of the
        group decides alike: a backward on some ranks only would hang the ring). ``cp_group`` applies to packed
        documents (``recorded.cu_seqlens``) only. ``shard_group``: that of a draft sharded with FSDP2, whose backward
        is a collective: its ranks skip it together when any rank's loss is not finite."""
        cp_group = cp_group if recorded.cu_seqlens is not None else None
        out = DraftCoTrainer.draft_forward(
            draft, recorded, teacher_logits=teacher_logits, settings=settings, cp_group=cp_group, generator=generator
        )
        total_loss = out.loss.detach()
        if cp_group is not None:  # `out.loss` is this rank's share; the step losses are global
            total_loss = (out.step_weights * out.step_losses).sum()
        finite = torch.isfinite(total_loss).float().reshape(1)
        if shard_group is not None:
            dist.all_reduce(finite, op=dist.ReduceOp.MIN, group=shard_group)
        if finite.item() > 0:
            (out.loss * loss_scale).backward()
        return out, total_loss

    def record_metrics(self, out: DraftLossOutput | None, total_loss: torch.Tensor | None = None) -> None:
        """Keep one micro-step's metrics for the next `update`; a placeholder row where another rank trained the
        draft (pipeline parallelism: the owner broadcasts its rows)."""
        if out is None:
            self._micro_metrics.append(torch.zeros(1 + 3 * self.num_positions))
            return
        total_loss = out.loss.detach() if total_loss is None else total_loss
        if not torch.isfinite(total_loss):
            self._has_nonfinite = True
        parts = [total_loss.float().view(1), out.step_losses.float(), out.step_accuracies.float()]
        self._micro_metrics.append(torch.cat([*parts, out.step_counts.float()]).to(self.accelerator.device))

    # ------------------------------------------------------------------ the update

    def update(self, *, step: int) -> None:
        """One draft optimizer step (after the policy's): average, clip, skip if non-finite, step, log."""
        with self.step_times.measure("draft_training"), self.step_times.measure("step"):
            self._update(step)

    def _update(self, step: int) -> None:
        params = self.draft.trainable_parameters()
        nonfinite = torch.tensor(float(self._has_nonfinite), device=self.accelerator.device)
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if distributed and self.owner_rank is None:
            if self.shard_group is None:  # a sharded draft's gradients were averaged by FSDP2's reduce-scatter
                all_reduce_gradients(params, group=None, average=True)
            dist.all_reduce(nonfinite)
        has_grads = any(p.grad is not None for p in params)
        max_norm = self.args.draft_max_grad_norm if self.args.draft_max_grad_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm) if has_grads else torch.zeros(())
        if isinstance(grad_norm, DTensor):  # the norm over every rank's shards, replicated
            grad_norm = grad_norm.full_tensor()
        if self.owner_rank is not None:  # only the owner has gradients (it alone steps); every rank takes its decision
            decision = torch.stack([nonfinite.float(), grad_norm.float().to(nonfinite.device)])
            dist.broadcast(decision, src=self.owner_rank)
            nonfinite, grad_norm = decision[0], decision[1]
        if nonfinite.item() > 0 or not torch.isfinite(grad_norm):
            self.skipped_steps += 1
            logger.warning(
                f"Step {step}: non-finite draft loss or gradient; the draft update is skipped (the policy is "
                "unaffected)."
            )
        else:
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._has_nonfinite = False
        if self.heal(step=step):
            self._last_good, self._restores_in_a_row = self._snapshot(), 0
        self._log_metrics(grad_norm)

    # ------------------------------------------------------------------ healing

    def heal(self, *, step: int) -> bool:
        """Restore the last good draft if this one fails `validate_weights` (on any rank: every replica restores);
        True when the draft was good as it stood."""
        problem = self._draft_problem()
        failed = torch.tensor(float(problem is not None), device=self.accelerator.device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            if self.owner_rank is None:
                dist.all_reduce(failed)
            else:
                dist.broadcast(failed, src=self.owner_rank)
        if failed.item() == 0:
            return True
        self._restore(step, problem or "another replica's draft is unusable")
        return False

    def _draft_problem(self) -> str | None:
        try:
            self.draft.validate_weights()
        except ValueError as error:
            return str(error)
        return None

    def _snapshot(self) -> dict:
        return {
            "draft": _on_host(self.draft.state_dict()),
            "optimizer": _on_host(self.optimizer.state_dict()),
        }

    def _restore(self, step: int, problem: str) -> None:
        """The last good weights and optimizer state; the learning rate stays the scheduler's (it counts steps)."""
        self.draft.load_state_dict(_from_host(self._last_good["draft"]))
        self.optimizer.load_state_dict(_from_host(self._last_good["optimizer"]))
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr
        self.restored_steps += 1
        self._restores_in_a_row += 1
        if self.restored_steps == 1:
            logger.warning(
                f"Step {step}: {problem} The draft was restored to the last good one (weights and optimizer state); "
                "later restores are counted in draft/restored without a warning."
            )
        if self.speculating and self._restores_in_a_row >= RESTORES_BEFORE_STOPPING:
            self.speculating = False
            logger.error(
                f"Step {step}: the draft had to be restored {self._restores_in_a_row} times without a good update in "
                "between: rollouts are plain for the rest of this run (draft/speculation_stopped); the draft keeps "
                "training and is saved as the last good one."
            )

    def _log_metrics(self, grad_norm: torch.Tensor) -> None:
        if not self._micro_metrics:
            return
        k = self.num_positions
        local = torch.stack(self._micro_metrics).to(self.accelerator.device)
        self._micro_metrics.clear()
        if self.owner_rank is not None:  # the owner's metrics (the other ranks hold placeholders)
            dist.broadcast(local, src=self.owner_rank)
            stacked = local
        else:
            stacked = gather(local)  # [num_micro * world, 1 + 3K]
        losses, step_losses = stacked[:, 0], stacked[:, 1 : 1 + k]
        step_acc, counts = stacked[:, 1 + k : 1 + 2 * k], stacked[:, 1 + 2 * k :]
        metrics = self.metrics["train"]
        finite = torch.isfinite(losses)
        metrics["draft/loss"].append(losses[finite].mean().item() if finite.any() else float("nan"))
        total = counts.sum(0).clamp(min=1)
        for d in range(k):
            metrics[f"draft/loss_step_{d}"].append(((step_losses[:, d] * counts[:, d]).nansum() / total[d]).item())
            metrics[f"draft/accuracy_step_{d}"].append(((step_acc[:, d] * counts[:, d]).sum() / total[d]).item())
        metrics["draft/grad_norm"].append(float(grad_norm))
        metrics["draft/lr"].append(self.scheduler.get_last_lr()[0])
        metrics["draft/skipped_steps"].append(float(self.skipped_steps))
        metrics["draft/restored"].append(float(self.restored_steps))
        metrics["draft/speculation_stopped"].append(float(not self.speculating))

    # ------------------------------------------------------------------ checkpoint state

    def state_dict(self) -> dict:
        """The checkpoint state. A sharded draft's optimizer state is gathered whole (by parameter name) on rank 0
        only, the others holding none of it: a collective, which every rank of the mesh calls."""
        return {
            "optimizer": self._optimizer_state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "skipped_steps": self.skipped_steps,
            "restored_steps": self.restored_steps,
            "generator": self.generator.get_state(),
        }

    def whole_draft_weights(self) -> dict[str, torch.Tensor] | None:
        """A sharded draft's weights gathered whole on rank 0, on the CPU (the other ranks get none): a collective,
        which every rank of the mesh calls. None for a replicated draft, whose own weights are whole."""
        if self.shard_group is None:
            return None
        return get_model_state_dict(self.draft, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_draft_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load whole weights (a saved draft's) into the draft; each rank keeps its shard of a sharded one."""
        if self.shard_group is None:
            self.draft.load_state_dict(weights)
        else:
            set_model_state_dict(self.draft, weights, options=StateDictOptions(full_state_dict=True))

    def _optimizer_state_dict(self) -> dict:
        if self.shard_group is None:
            return self.optimizer.state_dict()
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(self.draft, self.optimizer, options=options)

    def load_state_dict(self, state: dict) -> None:
        """The state `state_dict` wrote; a sharded draft's optimizer state (whole, on every rank) is sharded."""
        if self.shard_group is None:
            self.optimizer.load_state_dict(state["optimizer"])
        else:
            options = StateDictOptions(full_state_dict=True)
            set_optimizer_state_dict(self.draft, self.optimizer, state["optimizer"], options=options)
        self.scheduler.load_state_dict(state["scheduler"])
        self.skipped_steps = state["skipped_steps"]
        self.restored_steps = state.get("restored_steps", 0)  # checkpoints written before healing existed
        if "generator" in state:  # checkpoints written before drafter families drew at random
            self.generator.set_state(state["generator"])
        self._last_good = self._snapshot()


@dataclass(frozen=True)
class HostShard:
    """This rank's shard of an FSDP2-sharded tensor, copied to the CPU, with what makes it a DTensor again."""

    local: torch.Tensor
    mesh: DeviceMesh
    placements: tuple
    shape: torch.Size
    stride: tuple[int, ...]

    def on_device(self) -> DTensor:
        local = self.local.to(self.mesh.device_type, copy=True)
        return DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride
        )


def _on_host(state):
    """A copy of a (nested) state dict with every tensor on the CPU: the last good draft costs no accelerator memory.
    A sharded tensor keeps this rank's shard only (`HostShard`)."""
    if isinstance(state, DTensor):
        local = state.to_local().detach().to("cpu", copy=True)
        return HostShard(local, state.device_mesh, tuple(state.placements), state.shape, state.stride())
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {key: _on_host(value) for key, value in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(_on_host(value) for value in state)
    return copy.deepcopy(state)


def _from_host(state):
    """A fresh copy of an `_on_host` state to load: each `HostShard` a DTensor again on its mesh's device, every
    other tensor a host copy (loading moves it), so that what is loaded never aliases the snapshot."""
    if isinstance(state, HostShard):
        return state.on_device()
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {key: _from_host(value) for key, value in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(_from_host(value) for value in state)
    return copy.deepcopy(state)


class DraftUpdateCallback(TrainerCallback):
    """Steps the draft right after the policy's optimizer step, before logging and saving."""

    def __init__(self, cotrainer: DraftCoTrainer):
        self.cotrainer = cotrainer

    def on_step_begin(self, args, state, control, **kwargs):
        self.cotrainer.heal(step=state.global_step)  # before this step's rollouts use the draft or sync it
        return control

    def on_step_end(self, args, state, control, **kwargs):
        self.cotrainer.micro_batch = 0
        if state.global_step % args.draft_update_interval == 0:
            self.cotrainer.update(step=state.global_step)
        return control
