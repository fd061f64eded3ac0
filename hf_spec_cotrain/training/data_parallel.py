"""`DataParallel`: the trainer's parallel strategy where every rank holds the whole policy, and the base of the others.

A strategy owns what differs between the parallelisms: the training step, scoring log-probs, the gradient norm and
its clipping, saving and loading the policy's checkpoint shards, and the policy that HF-native generation runs on. It
gets its collaborators explicitly (the accelerator, the draft's co-trainer, the trainer's TRL behaviour as callables,
`TRLHooks`), never the trainer; data parallelism runs TRL's own behaviour throughout and adds the draft's objective
(`DraftModel.training_loss`) after the policy's backward.
"""

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from trl.models import unwrap_model_for_generation

from ..generation.pipelined import PipelinedTarget
from ..losses import draft_loss_mask
from ..parallel.fsdp import gathered_for_generation
from .draft_cotraining import DraftCoTrainer, RecordedTaps


@dataclass(frozen=True)
class TRLHooks:
    """The trainer's TRL behaviour that a strategy runs or replaces, as callables (bound to the trainer, which keeps
    TRL's bookkeeping): a strategy calls these, and never writes the trainer's state."""

    training_step: Callable  # TRL's own ``training_step(model, inputs, num_items_in_batch)``
    log_probs: Callable  # TRL's ``_get_per_token_logps_and_entropies``
    clip_grad_norm: Callable  # TRL's ``_clip_grad_norm(model)``
    grad_norm: Callable  # TRL's ``_get_grad_norm(model, grad_norm)``
    save_model: Callable  # TRL's ``save_model(output_dir, _internal_call)``
    save_state_dict: Callable  # transformers' ``_save(output_dir, state_dict=...)``: the files of a whole policy
    save_optimizer_and_scheduler: Callable
    load_from_checkpoint: Callable
    load_optimizer_and_scheduler: Callable
    prepare_inputs: Callable  # TRL's ``_prepare_inputs`` (rollouts, scoring, advantages)
    compute_loss: Callable  # ``compute_loss(model, inputs, num_items_in_batch)`` inside TRL's loss context
    loss_is_unscaled: Callable[[object], bool]  # whether the step divides the loss by the accumulation steps
    gradient_accumulation_steps: Callable[[], int]
    draft_loss_divisor: Callable[[], int]  # the micro-steps the draft's gradients accumulate over
    count_micro_step: Callable[[float], None]  # TRL's micro-step counter and ``step_time``, given the step's seconds
    model_wrapped: Callable[[], nn.Module]  # the policy as the accelerator wrapped it (DDP, FSDP, DeepSpeed)
    global_step: Callable[[], int]
    optimizer: Callable[[], torch.optim.Optimizer]  # built by the Trainer after the strategy
    lr_scheduler: Callable[[], object]


class DataParallel:
    """Every rank holds the whole policy (DDP, accelerate's FSDP or DeepSpeed): TRL's step, then the draft's objective
    on the taps of the policy's forward."""

    def __init__(
        self,
        trl: TRLHooks,
        *,
        accelerator,
        draft_cotrainer: DraftCoTrainer,
        args,
        distributed,
        should_save: bool,
    ):
        self.trl, self.accelerator, self.draft_cotrainer, self.args = trl, accelerator, draft_cotrainer, args
        self.distributed = distributed  # TRL's `DistributedBackend`, which gathers FSDP1's parameters
        self.should_save = should_save

    def training_step(self, model, inputs, num_items_in_batch) -> torch.Tensor:
        loss = self.trl.training_step(model, inputs, num_items_in_batch)
        self.draft_cotrainer.train_recorded(loss_divisor=self.trl.draft_loss_divisor())
        return loss

    def record_taps(self, taps, inputs: dict) -> None:
        """The draft trains on the taps of the policy's GRPO forward over `inputs`: the tokens the policy generated
        (the ones rollouts will draft), on the rows `rows_to_train` draws."""
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        loss_mask = draft_loss_mask(inputs["prompt_mask"], inputs["completion_mask"], inputs.get("tool_mask"))
        cotrainer = self.draft_cotrainer
        rows = cotrainer.rows_to_train(len(loss_mask), step=self.trl.global_step())
        if rows is None:
            cotrainer.record(RecordedTaps(taps, attention_mask, loss_mask))
        else:
            cotrainer.record(RecordedTaps(taps.select_rows(rows), attention_mask[rows], loss_mask[rows]))

    def log_probs(self, model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, **kwargs):
        return self.trl.log_probs(
            model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, **kwargs
        )

    def clip_grad_norm(self, model):
        return self.trl.clip_grad_norm(model)

    def grad_norm(self, model, grad_norm=None):
        return self.trl.grad_norm(model, grad_norm)

    def writes_draft(self) -> bool:
        """Whether this process writes the draft (the main process)."""
        return self.should_save

    def save_policy(self, folder: Path, internal_call: bool) -> None:
        self.trl.save_model(str(folder), internal_call)

    def save_optimizer_and_scheduler(self, folder) -> None:
        self.trl.save_optimizer_and_scheduler(folder)

    def load_from_checkpoint(self, checkpoint, model=None):
        return self.trl.load_from_checkpoint(checkpoint, model)

    def load_optimizer_and_scheduler(self, checkpoint) -> None:
        self.trl.load_optimizer_and_scheduler(checkpoint)

    def generation_pipeline(self) -> PipelinedTarget | None:
        """The pipeline's stages that HF-native generation runs through, where no rank holds the whole policy."""
        return None

    @contextmanager
    def policy_for_generation(self) -> Iterator[nn.Module]:
        """The policy as TRL unwraps it for its own generation (DeepSpeed-3 gathered, full FSDP parameters), with
        FSDP2's parameters gathered too, and the draft's when it is sharded (`shard_draft`): a speculative loop's
        forwards differ in number between ranks."""
        model_wrapped = self.trl.model_wrapped()
        with (
            unwrap_model_for_generation(
                model_wrapped,
                self.accelerator,
                gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
            ) as unwrapped_model,
            torch.no_grad(),
            self.distributed.summon_full_params(model_wrapped, recurse=False),
            gathered_for_generation(unwrapped_model),
            gathered_for_generation(self.draft_cotrainer.draft),
        ):
            yield unwrapped_model


class OwnTrainingStep(DataParallel):
    """A strategy that replaces TRL's training step with its own forward and backward (`run`), keeping what TRL's
    step does around it: train mode, TRL's inputs, and its micro-step bookkeeping (`TRLHooks.count_micro_step`)."""

    name = ""

    def training_step(self, model, inputs, num_items_in_batch) -> torch.Tensor:
        started = time.perf_counter()
        model.train()
        optimizer = self.trl.optimizer()
        if hasattr(optimizer, "train") and callable(optimizer.train):
            optimizer.train()
        loss = self.run(model, self.trl.prepare_inputs(inputs), num_items_in_batch)
        self.trl.count_micro_step(time.perf_counter() - started)
        return loss

    def run(self, model, inputs: dict, num_items_in_batch) -> torch.Tensor:
        raise NotImplementedError


__all__ = ["DataParallel", "OwnTrainingStep", "TRLHooks"]
