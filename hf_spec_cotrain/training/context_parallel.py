"""`ContextParallel`: the trainer's parallel strategy under context parallelism (zigzag shards of packed rows).

Rollouts and scoring stay per rank, as under data parallelism (``_prepare_inputs``), so TRL's sampling, rewards and
advantages are untouched; the context-parallel group then shares the forward and backward of each member's rows.
"""

from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from ..losses import completion_loss_mask
from ..parallel.packed_rows import PackedRows, pack_rows, policy_log_probs
from .data_parallel import OwnTrainingStep
from .draft_cotraining import RecordedTaps


MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "token_type_ids")


def inputs_to(inputs: dict, device) -> dict:
    """A micro-batch dict with its tensors on `device` (other values as they are)."""
    return {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in inputs.items()}


def members_inputs(inputs: dict, what: str, group: dist.ProcessGroup | None = None) -> list[dict]:
    """Every member's micro-batch (on the CPU), in rank order; `what` (the parallelism) refuses multimodal ones."""
    members = [None] * dist.get_world_size(group)
    dist.all_gather_object(members, inputs_to(inputs, "cpu"), group=group)
    multimodal = [key for key in MULTIMODAL_KEYS if members[0].get(key) is not None]
    if multimodal:
        raise ValueError(f"{what} supports text-only policies; this batch has {multimodal}.")
    return members


class ContextParallel(OwnTrainingStep):
    """Every member's micro-batch in turn, sharded across the context-parallel group.

    The group takes its members' micro-batches one after the other: for each, every rank runs the policy's GRPO
    forward and backward on its zigzag shard of the packed rows (ring attention in the policy's layers,
    `policy_log_probs`), then the draft's objective on the taps of that forward (`DraftModel.training_loss(...,
    cp_group=...)`, each rank's loss its share of the single-device one). A rank
    thus holds ``1 / context_parallel_size`` of one micro-batch's activations at a time. Each rank's policy and draft
    gradients are its positions' share of every member's loss, so the average over the world (DDP's, or FSDP2's
    reduce-scatter over every rank, for the policy; `DraftCoTrainer.update` for the replicated draft) equals data
    parallelism's gradient over the same rows.

    Args (besides `DataParallel`'s):
        group: the context-parallel group.
        policy: the policy as a HF causal LM (the ring attention goes into its layers).
        unwrapped: a model (the policy or the reference model) as a HF causal LM.
        ring_attention: the context in which a model's attention layers run the ring (`parallelize_policy`).
        pad_token_id: what pads the packed documents.
        shards_policy_itself: the trainer applied FSDP2 itself (on CPU): saving gathers the whole policy first.
    """

    name = "Context parallelism"

    def __init__(
        self,
        trl,
        *,
        group: dist.ProcessGroup,
        policy: nn.Module,
        unwrapped: Callable[[nn.Module], nn.Module],
        ring_attention: Callable,
        pad_token_id: int,
        shards_policy_itself: bool,
        **common,
    ):
        super().__init__(trl, **common)
        self.group, self.policy, self.unwrapped = group, policy, unwrapped
        self.ring_attention, self.pad_token_id = ring_attention, pad_token_id
        self.shards_policy_itself = shards_policy_itself
        self.rows: PackedRows | None = None  # the member being trained on, while its forward and backward run

    def run(self, model, inputs, num_items_in_batch):
        members = members_inputs(inputs, self.name, self.group)
        losses = []
        for index, member in enumerate(members):
            member = inputs_to(member, self.accelerator.device)
            # DDP synchronises the accumulated gradients in the last member's backward (if this micro-step syncs).
            sync = nullcontext() if index == len(members) - 1 else self.accelerator.no_sync(model)
            # The backward stays inside: gradient checkpointing recomputes the attention layers there.
            with sync, self.ring_attention(self.policy):
                self.rows = self.pack(member)
                try:
                    loss = self.trl.compute_loss(model, member, num_items_in_batch)
                    if self.trl.loss_is_unscaled(num_items_in_batch):
                        loss = loss / self.trl.gradient_accumulation_steps()
                    self.accelerator.backward(loss)
                finally:
                    self.rows = None
            losses.append(loss.detach())
            self.draft_cotrainer.train_recorded(loss_divisor=self.trl.draft_loss_divisor(), cp_group=self.group)
        return torch.stack(losses).mean()

    def pack(self, inputs: dict) -> PackedRows:
        """This rank's zigzag shard of one member's rows, packed as documents."""
        completion_mask = inputs["completion_mask"]
        return self.pack_rows(
            inputs["prompt_ids"],
            inputs["prompt_mask"],
            inputs["completion_ids"],
            completion_mask,
            completion_loss_mask=completion_loss_mask(completion_mask, inputs.get("tool_mask")),
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
            pad_token_id=self.pad_token_id,
            **kwargs,
        )

    def record_taps(self, taps, inputs: dict) -> None:
        """The draft trains on the taps of this shard of the packed rows."""
        rows = self.rows
        self.draft_cotrainer.record(RecordedTaps(taps, None, rows.loss_mask, rows.cu_seqlens))

    def log_probs(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size,
        compute_entropy,
        compute_aux_loss=False,
        **kwargs,
    ):
        """In the training step: the GRPO forward's log-probs of the member being trained on; outside it (TRL's
        scoring of the old policy and the reference model, the evaluation loss): `score_log_probs`."""
        multimodal = sorted(key for key, value in kwargs.items() if value is not None)
        if self.rows is not None:
            if compute_aux_loss:
                raise ValueError(
                    "Context parallelism does not support the MoE auxiliary loss (`router_aux_loss_coef`)."
                )
            with self.accelerator.autocast():
                logps, entropies = policy_log_probs(model, self.rows, group=self.group)
            return logps, entropies if compute_entropy else None, None
        if compute_aux_loss or multimodal:
            raise ValueError(
                f"Context parallelism scores text-only rows without the MoE auxiliary loss; got {multimodal} "
                f"(compute_aux_loss={compute_aux_loss})."
            )
        logps, entropies = self.score_log_probs(
            model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size, compute_entropy=compute_entropy
        )
        return logps, entropies, None

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
        """Log-probs (and entropies) of this rank's rows outside the training step, sharded like it (`model`: the
        old policy or the reference model).

        The group gathers its members' token ids and masks (small), then runs each member's rows, `batch_size` rows
        at a time as TRL chunks them, as zigzag shards of packed documents through `model` with the ring attention;
        a rank keeps the `[B, C]` log-probs of its own rows. No rank ever holds a whole sequence's activations.
        """
        members = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(members, (input_ids.cpu(), attention_mask.cpu(), logits_to_keep), group=self.group)
        own = dist.get_rank(self.group)
        device = input_ids.device
        logps, entropies = [], []
        with self.ring_attention(self.unwrapped(model)), self.accelerator.autocast():
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

    def save_policy(self, folder: Path, internal_call: bool) -> None:
        if not self.shards_policy_itself:
            return super().save_policy(folder, internal_call)
        # transformers would save each rank's shards: gather the whole policy first (whole on rank 0 only).
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state_dict = get_model_state_dict(self.policy, options=options)
        if self.should_save:
            self.trl.save_state_dict(str(folder), state_dict=state_dict)


__all__ = ["ContextParallel", "inputs_to", "members_inputs"]
