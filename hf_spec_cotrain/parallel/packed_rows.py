"""The policy's GRPO forward under context parallelism: TRL's rows packed as documents and zigzag-sharded.

TRL lays a micro-batch out as rows of a left-padded prompt and a right-padded completion, and scores the completion
tokens with its fused LM head (`model(..., labels=..., fused_lm_head=True)`). Under context parallelism the real
tokens of each row become one packed document (`pack_rows`), padded at its end to a multiple of `2 W`, and each rank
of the group runs the policy on its zigzag shard, with the global within-document positions (what RoPE must see)
and `zigzag_ring_attention_forward` in every attention layer (`policy_log_probs`).

Labels: position `t` scores the next token `x_{t+1}`, which may live on another rank. Every rank holds the token ids
of the whole micro-batch (tiny next to the activations), so the labels are shifted on the packed sequence *before*
sharding, as TRL's pre-shifted `shift_labels`, which its fused head scores in place. No halo is needed: only values
that exist on one rank each (hidden states, as in the draft's `ZigzagHalo`) would need one.

Back to TRL's `[B, C]` layout: each rank scatters the log-probs of its own positions and an all-reduce sums the
disjoint pieces, so every rank holds the full `[B, C]` log-probs and computes the same GRPO loss from them, whatever
the loss type. The all-reduce's backward is the identity: each rank's gradient with respect to the sum already is
the full one, and the scatter keeps the part at this rank's positions. Summing the policy's parameter gradients over
the group gives the single-device gradient.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..validation import contiguous_row_spans
from .comm import is_context_parallel
from .zigzag import pad_documents, zigzag_position_ids, zigzag_shard


IGNORE_INDEX = -100


@dataclass(frozen=True)
class PackedRows:
    """One rank's zigzag shard of a micro-batch packed as documents; every per-position tensor is `[1, n]`.

    Attributes:
        input_ids: the tokens (document padding: `pad_token_id`).
        position_ids: within-document positions (RoPE positions) of the shard.
        shift_labels: the next token where it is a completion token to score, else -100.
        loss_mask: bool, True where the token itself is a counted completion token (the draft's TTT loss mask).
        cu_seqlens: int64 global boundaries of the padded documents, on the CPU.
        completion_index: int64 `[n]`: where each position's score lands in the flattened `[B, C]` completion
            layout, -1 where the position scores nothing.
        batch_size, completion_length: `B` and `C` of that layout.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    shift_labels: torch.Tensor
    loss_mask: torch.Tensor
    cu_seqlens: torch.Tensor
    completion_index: torch.Tensor
    batch_size: int
    completion_length: int


def _check_rows(prompt_ids, prompt_mask, completion_ids, completion_mask, completion_loss_mask) -> None:
    for name, tensor in (
        ("prompt_ids", prompt_ids),
        ("prompt_mask", prompt_mask),
        ("completion_ids", completion_ids),
        ("completion_mask", completion_mask),
        ("completion_loss_mask", completion_loss_mask),
    ):
        if tensor is not None and (not isinstance(tensor, torch.Tensor) or tensor.dim() != 2):
            raise ValueError(f"`{name}` must be a 2-D tensor [B, length], got {getattr(tensor, 'shape', tensor)}.")
    if prompt_ids.shape != prompt_mask.shape or completion_ids.shape != completion_mask.shape:
        raise ValueError(
            f"ids and masks must have the same shapes: prompt {tuple(prompt_ids.shape)} vs "
            f"{tuple(prompt_mask.shape)}, completion {tuple(completion_ids.shape)} vs {tuple(completion_mask.shape)}."
        )
    if prompt_ids.shape[0] != completion_ids.shape[0]:
        raise ValueError(
            f"prompt rows ({prompt_ids.shape[0]}) and completion rows ({completion_ids.shape[0]}) differ."
        )
    if completion_loss_mask is not None and completion_loss_mask.shape != completion_mask.shape:
        raise ValueError(
            f"`completion_loss_mask` has shape {tuple(completion_loss_mask.shape)}; expected "
            f"{tuple(completion_mask.shape)}."
        )


def pack_rows(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    rank: int = 0,
    world_size: int = 1,
    pad_token_id: int = 0,
    completion_loss_mask: torch.Tensor | None = None,
) -> PackedRows:
    """Pack TRL's rows (real tokens contiguous: left-padded prompt, right-padded completion) and take this rank's
    zigzag shard of the result.

    Args:
        prompt_ids, prompt_mask: `[B, P]`; every row needs at least one prompt token (it predicts the first
            completion token).
        completion_ids, completion_mask: `[B, C]`; the completion tokens with mask 1 are scored, as TRL scores them.
        rank, world_size: this rank in the context-parallel group and the group's size (1: one device, no
            sharding; the packing is the same).
        pad_token_id: the token id of the document padding (never attended to by real tokens, never scored).
        completion_loss_mask: `[B, C]`, which completion tokens count in the draft's loss (e.g.
            `completion_mask * tool_mask`); defaults to `completion_mask`.
    """
    _check_rows(prompt_ids, prompt_mask, completion_ids, completion_mask, completion_loss_mask)
    batch_size, prompt_length = prompt_ids.shape
    completion_length = completion_ids.shape[1]
    device = prompt_ids.device
    real = torch.cat([prompt_mask, completion_mask], dim=1).to(torch.bool)
    _, lengths = contiguous_row_spans(
        real,
        fix="context parallelism packs each row's real tokens as one document and needs a left-padded prompt "
        "followed by a right-padded completion.",
    )
    columns = torch.arange(prompt_length + completion_length, device=device)
    prompt_lengths = prompt_mask.to(torch.bool).sum(1)
    if bool((prompt_lengths == 0).any()):
        raise ValueError(
            f"Rows {torch.nonzero(prompt_lengths == 0).flatten().tolist()} have no prompt token; every row needs one "
            "to predict its first completion token."
        )

    ids = torch.cat([prompt_ids, completion_ids], dim=1)[real]
    is_completion = (columns >= prompt_length).expand(batch_size, -1)[real]
    counted_columns = completion_mask if completion_loss_mask is None else completion_loss_mask
    counted = torch.cat([torch.zeros_like(prompt_mask), counted_columns], dim=1).to(torch.bool)[real]
    flat_index = (torch.arange(batch_size, device=device)[:, None] * completion_length + columns - prompt_length)[real]
    # Position t scores x_{t+1} when that is a completion token; a document starts with a prompt token, so the next
    # completion token is always in the same document.
    scores_next = torch.cat([is_completion[1:], is_completion.new_zeros(1)])
    next_ids = torch.cat([ids[1:], ids.new_full((1,), pad_token_id)])
    next_index = torch.cat([flat_index[1:], flat_index.new_full((1,), -1)])
    shift_labels = torch.where(scores_next, next_ids, IGNORE_INDEX)
    completion_index = torch.where(scores_next, next_index, -1)

    padding = pad_documents(torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).cpu(), world_size=world_size)
    cu_seqlens = padding.cu_seqlens

    def shard(values: torch.Tensor, fill) -> torch.Tensor:
        padded = padding.pad(values, dim=0, value=fill)
        return zigzag_shard(padded, 0, rank, world_size, cu_seqlens).unsqueeze(0)

    return PackedRows(
        input_ids=shard(ids, pad_token_id),
        position_ids=zigzag_position_ids(rank, world_size, cu_seqlens=cu_seqlens).to(device).unsqueeze(0),
        shift_labels=shard(shift_labels, IGNORE_INDEX),
        loss_mask=shard(counted, False),
        cu_seqlens=cu_seqlens,
        completion_index=shard(completion_index, -1)[0],
        batch_size=batch_size,
        completion_length=completion_length,
    )


class _SumDisjointShards(torch.autograd.Function):
    """All-reduce SUM of tensors that are zero outside each rank's own positions; identity backward (every rank
    computes the same loss from the sum, so its gradient w.r.t. the sum is already the full one)."""

    @staticmethod
    def forward(ctx, x, group):
        summed = x.clone()
        dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group)
        return summed

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def completion_values(
    values: torch.Tensor | None, rows: PackedRows, *, group: dist.ProcessGroup | None = None
) -> torch.Tensor | None:
    """Per-position scores of a shard (`[1, n]`, e.g. log-probs) in TRL's `[B, C]` completion layout, the same
    (full) tensor on every rank of `group`; zero where a completion token is padding. Differentiable."""
    if values is None:
        return None
    valid = rows.completion_index >= 0
    flat = values.new_zeros(rows.batch_size * rows.completion_length)
    flat = flat.index_put((rows.completion_index[valid],), values[0, valid])
    if is_context_parallel(group):
        flat = _SumDisjointShards.apply(flat, group)
    return flat.view(rows.batch_size, rows.completion_length)


def policy_log_probs(
    model: nn.Module, rows: PackedRows, *, group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs and entropies `[B, C]` of the completions from the policy's forward on this rank's shard.

    `model` carries TRL's fused LM head (`trl.trainer.utils.add_fused_lm_head`, which `GRPOTrainer` applies) and
    must run its attention through `zigzag_ring_attention` (`hf_spec_cotrain.attention.hf_adapter`) around this call
    *and* its backward. Every rank of `group` must call. The entropy is None when the head does not compute it.
    """
    outputs = model(
        input_ids=rows.input_ids,
        position_ids=rows.position_ids,
        shift_labels=rows.shift_labels,
        fused_lm_head=True,
        cu_seqlens=rows.cu_seqlens,
        cp_group=group,
    )
    return completion_values(outputs.log_probs, rows, group=group), completion_values(
        outputs.entropy, rows, group=group
    )


__all__ = ["IGNORE_INDEX", "PackedRows", "completion_values", "pack_rows", "policy_log_probs"]
