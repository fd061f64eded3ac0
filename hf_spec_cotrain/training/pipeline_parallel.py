"""`PipelineParallel`: the trainer's parallel strategy under pipeline parallelism (each rank one stage of the policy),
and `load_pipeline_stage`, which loads only a rank's stage."""

from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import PartialState
from accelerate.utils import patch_environment
from safetensors.torch import load_file
from torch import nn
from transformers import AutoConfig, PreTrainedModel
from transformers.trainer import TRAINING_ARGS_NAME
from trl.trainer.utils import create_model_from_path, pad

from ..generation.pipelined import PipelinedTarget
from ..parallel.dims import ParallelDims
from ..parallel.pipeline import pipeline_stage_class
from .checkpoints import (
    load_pipeline_stage_state,
    pipeline_stage_file,
    save_pipeline_policy_shard,
    save_pipeline_stage_states,
)
from .context_parallel import members_inputs
from .data_parallel import OwnTrainingStep
from .pipeline_step import GRPOBatch, PipelineCoTrainStep, grpo_loss_normalizer


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


class PipelineParallel(OwnTrainingStep):
    """All ranks' rows as one batch through the pipeline.

    Each rank loaded only its stage of the policy (`load_pipeline_stage`; a policy passed already built is cut in
    place by `parallelize_policy`), so the optimizer (built later by the Trainer) holds this stage's parameters only
    and no rank ever holds the whole policy: every stage saves its own shard of the policy, optimizer and scheduler
    (`save_policy`), the last stage, which trains the draft, also the draft.

    In each step the ranks exchange their micro-batches and every stage runs the same batch, the concatenation in rank
    order, through `PipelineCoTrainStep.step`: the GRPO loss with TRL's whole-batch normaliser at the last stage, and
    the draft's objective on the taps there. The gradients are those of one process on all rows, which is what data
    parallelism's average over the same ranks computes.

    Args (besides `DataParallel`'s):
        stage: this rank's `PipelineCoTrainStep` (`parallelize_policy` builds it).
        policy: this rank's stage of the policy (its config and generation config go into a saved folder).
        aux_layer_ids: the draft's taps, which the stages send the driver in generation.
        reference_model: TRL's reference model (cut to this stage too), or None.
        processing_class: saved with the policy.
        pad_token_id, loss_type, max_completion_length: the trainer's.
    """

    name = "Pipeline parallelism"

    def __init__(
        self,
        trl,
        *,
        stage: PipelineCoTrainStep,
        policy: nn.Module,
        aux_layer_ids,
        reference_model: nn.Module | None,
        processing_class,
        pad_token_id: int,
        loss_type: str,
        max_completion_length: int,
        **common,
    ):
        super().__init__(trl, **common)
        self.stage, self.policy, self.reference_model = stage, policy, reference_model
        self.aux_layer_ids = aux_layer_ids
        self.processing_class, self.pad_token_id = processing_class, pad_token_id
        self.loss_type, self.max_completion_length = loss_type, max_completion_length
        self.last_rank = self.accelerator.num_processes - 1

    def run(self, model, inputs, num_items_in_batch):
        device = self.accelerator.device
        batch = self.batch(members_inputs(inputs, self.name))
        accumulation = self.trl.gradient_accumulation_steps()
        # TRL's normaliser of the whole batch as one process holding every member's rows computes it (with DDP, TRL
        # would divide dapo's by the number of processes, whose gradients DDP averages).
        normalizer = grpo_loss_normalizer(
            self.loss_type,
            batch.loss_mask,
            max_completion_length=self.max_completion_length,
            num_items_in_batch=inputs["num_items_in_batch"],
            gradient_accumulation_steps=accumulation,
            steps_per_generation=self.args.steps_per_generation,
        )
        if self.trl.loss_is_unscaled(num_items_in_batch):
            normalizer = normalizer * accumulation
        out = self.stage.step(
            batch, loss_normalizer=normalizer.to(device), draft_loss_scale=1.0 / self.trl.draft_loss_divisor()
        )
        loss = torch.zeros((), device=device) if out.policy_loss is None else out.policy_loss
        dist.broadcast(loss, src=self.last_rank)  # every rank reports the loss of the last stage
        self.draft_cotrainer.record_metrics(out.draft)
        return loss.detach()

    def batch(self, members: list[dict]) -> GRPOBatch:
        """The ranks' micro-batches as one `GRPOBatch`: prompts left-padded and completions right-padded to the
        longest, as one process holding all the rows would pad them."""
        pad_id = self.pad_token_id

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

    def log_probs(self, model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, **kwargs):
        if self.reference_model is not None and model is self.reference_model:
            # The reference is cut into stages: they compute its log-probs in the training step (`beta` > 0).
            return None, None, None
        return super().log_probs(
            model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, **kwargs
        )

    def clip_grad_norm(self, model):
        return self.stage.clip_grad_norm_(self.args.max_grad_norm)  # the norm over every stage

    def grad_norm(self, model, grad_norm=None):
        if grad_norm is None:
            grad_norm = self.stage.clip_grad_norm_(float("inf"))
        return super().grad_norm(model, grad_norm)

    def generation_pipeline(self) -> PipelinedTarget:
        """The stages that every rollout runs through: the last one drives, the others serve its forwards."""
        return PipelinedTarget(
            self.policy,
            layer_ranges=self.stage.layer_ranges,
            aux_layer_ids=self.aux_layer_ids,
            group=self.stage.group,
            device=self.accelerator.device,
        )

    def writes_draft(self) -> bool:
        """The last stage writes the draft: it trains the draft, and generated the rollouts whose acceptance history
        goes with it."""
        return self.accelerator.process_index == self.last_rank

    def save_policy(self, folder: Path, internal_call: bool) -> None:
        """Every rank writes its stage's shard of the policy (rank 0 also the config, the tokenizer, the arguments
        and the index), so the folder is a HF sharded checkpoint of the whole policy that no rank gathered."""
        folder.mkdir(parents=True, exist_ok=True)
        save_pipeline_policy_shard(folder, self.stage.state_dict())
        if self.should_save:
            self.policy.config.save_pretrained(folder)
            if self.policy.generation_config is not None:
                self.policy.generation_config.save_pretrained(folder)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(folder)
            torch.save(self.args, folder / TRAINING_ARGS_NAME)

    def save_optimizer_and_scheduler(self, folder) -> None:
        save_pipeline_stage_states(folder, self.trl.optimizer(), self.trl.lr_scheduler())

    def load_from_checkpoint(self, checkpoint, model=None):
        stage = self.stage
        shard = Path(checkpoint) / pipeline_stage_file("model", stage.stage_index, stage.num_stages)
        stage.model.load_state_dict(load_file(shard))  # copied into the stage's parameters, on its device

    def load_optimizer_and_scheduler(self, checkpoint) -> None:
        if checkpoint is None:
            return super().load_optimizer_and_scheduler(checkpoint)
        self.trl.optimizer().load_state_dict(load_pipeline_stage_state(checkpoint, "optimizer"))
        self.trl.lr_scheduler().load_state_dict(load_pipeline_stage_state(checkpoint, "scheduler"))


__all__ = ["PipelineParallel", "load_pipeline_stage"]
