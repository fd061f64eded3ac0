"""The objectives: the draft's soft cross-entropy to the policy (with top-1 agreement), and TRL's GRPO loss as the
pipelined step computes it (`grpo_loss`, on the tokens `completion_loss_mask` counts).

`soft_cross_entropy` is the eager reference on materialised logits. `head_soft_cross_entropy` is what training
runs: it applies the draft's head only to the positions that count, in chunks under activation checkpointing,
so no ``[L, draft_vocab]`` tensor outlives its chunk (a TTT step would otherwise keep logits, log-probabilities
and teacher probabilities for every position and step until backward). The two agree to rounding
(tests/test_losses.py).
"""

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
"""TRL's clipped-ratio losses `grpo_loss` computes; they differ only in how a batch's token losses are averaged."""

# Elements of one chunk's [rows, draft_vocab] logits: 16M floats, 64 MB in float32.
CHUNK_ELEMENTS = 2**24


def soft_cross_entropy(
    logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    counted: torch.Tensor,
    *,
    total_count: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean of ``-sum softmax(teacher) * log_softmax(logits)`` over counted positions, top-1 agreement, count.

    Zero counted positions give a zero loss (not NaN), so a batch of prompts only cannot poison a step.
    ``total_count`` replaces the denominator (under context parallelism: the count over all ranks, so that
    every rank returns its share of the global mean).
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)  # half precision computes in float32
    log_q = F.log_softmax(logits.to(dtype), dim=-1)
    p = F.softmax(teacher_logits.to(dtype), dim=-1)
    per_position = -(p * log_q).sum(-1)
    count = counted.sum()
    denominator = (count if total_count is None else total_count).clamp(min=1).to(per_position.dtype)
    loss = torch.where(counted, per_position, 0.0).sum() / denominator
    agree = (logits.detach().argmax(-1) == teacher_logits.argmax(-1)) & counted
    return loss, agree.sum() / denominator, count


def head_soft_cross_entropy(
    head,
    hidden: torch.Tensor,
    teacher_logits: torch.Tensor,
    counted: torch.Tensor,
    *,
    total_count: torch.Tensor | None = None,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`soft_cross_entropy(head(hidden), ...)` without keeping the logits: ``head`` maps ``[N, H]`` to logits
    (e.g. the draft's `compute_logits`) and is re-run in backward, chunk by chunk, on counted positions only."""
    index = counted.reshape(-1).nonzero().squeeze(1)
    count = counted.sum()
    selected = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)
    teacher = teacher_logits.reshape(-1, teacher_logits.shape[-1]).index_select(0, index)
    rows = max(1, chunk_elements // teacher.shape[-1])
    # Zero, but part of the graph: a batch with nothing counted still backpropagates (zeros).
    loss_sum = selected.sum().to(torch.promote_types(hidden.dtype, torch.float32)) * 0
    hits = torch.zeros((), dtype=torch.int64, device=hidden.device)
    for start in range(0, index.numel(), rows):
        chunk_loss, chunk_hits = checkpoint(
            _chunk_loss, head, selected[start : start + rows], teacher[start : start + rows], use_reentrant=False
        )
        loss_sum = loss_sum + chunk_loss
        hits = hits + chunk_hits
    denominator = (count if total_count is None else total_count).clamp(min=1).to(loss_sum.dtype)
    return loss_sum / denominator, hits / denominator, count


def _chunk_loss(head, hidden: torch.Tensor, teacher_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = head(hidden)
    dtype = torch.promote_types(logits.dtype, torch.float32)
    log_q = F.log_softmax(logits.to(dtype), dim=-1)
    p = F.softmax(teacher_logits.to(dtype), dim=-1)
    hits = (logits.detach().argmax(-1) == teacher_logits.argmax(-1)).sum()
    return -(p * log_q).sum(), hits


# ---------------------------------------------------------------------------------------------------- GRPO loss


def check_grpo_loss_type(loss_type: str) -> None:
    """Refuse a TRL ``loss_type`` that `grpo_loss` does not compute."""
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(
            f"`loss_type`={loss_type!r} is not supported; choose one of {', '.join(GRPO_LOSS_TYPES)} (TRL's "
            "clipped-ratio losses with token-level ratios, the ones the pipelined step computes)."
        )


def completion_loss_mask(completion_mask: torch.Tensor, tool_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The completion tokens that count in the losses (the policy's and the draft's): generated ones, not the
    tokens tool calls returned (``tool_mask`` 0, as TRL masks them)."""
    return completion_mask if tool_mask is None else completion_mask * tool_mask


def draft_loss_mask(
    prompt_mask: torch.Tensor, completion_mask: torch.Tensor, tool_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The draft's loss mask over ``[prompt, completion]`` rows: it learns to predict the tokens the policy generated
    (the ones rollouts will draft), never the prompt's."""
    return torch.cat([torch.zeros_like(prompt_mask), completion_loss_mask(completion_mask, tool_mask)], dim=1)


def grpo_per_token_logps(logits: torch.Tensor, completion_ids: torch.Tensor, *, temperature: float = 1.0):
    """``log_softmax(logits / T)`` at the completion tokens, in float32 at least: TRL's policy log-probs.

    ``logits`` are those of the positions that predict the completion tokens, ``[B, C, V]``.
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)
    log_probs = F.log_softmax(logits.to(dtype) / temperature, dim=-1)
    return log_probs.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)


def grpo_loss(
    logits: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    old_per_token_logps: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    loss_type: str = "dapo",
    normalizer: float | torch.Tensor | None = None,
    ref_per_token_logps: torch.Tensor | None = None,
    beta: float = 0.0,
    bias_correction_kl: bool = True,
) -> torch.Tensor:
    r"""
    TRL's GRPO loss with token-level importance sampling, for the loss types of `GRPO_LOSS_TYPES`.

    ``sum (-min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A) + beta kl_t) * mask_t / normalizer`` with
    ``r_t = exp(logp_t - old_logp_t)``, summed over the counted tokens (``loss_type="grpo"``: each row's sum
    divided by its counted tokens first, then summed over the rows); without ``old_per_token_logps`` the ratio is
    1 with the policy's own gradient (TRL detaches the current log-probs then). With ``beta`` > 0, TRL's KL
    estimate to the reference model ``kl_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1``, times ``r_t`` with
    ``bias_correction_kl`` (TRL's ``use_bias_correction_kl``, on by default: ``r_t`` then carries the policy's
    gradient into the KL term even without old log-probs).

    Args:
        logits: ``[B, C, V]`` logits at the positions predicting the completion tokens.
        completion_ids, completion_mask: ``[B, C]``; the mask selects the tokens that count
            (`completion_loss_mask`).
        advantages: ``[B]`` (or ``[B, C]``).
        old_per_token_logps: ``[B, C]`` log-probs of the rollout policy, or None.
        loss_type: one of `GRPO_LOSS_TYPES`.
        normalizer: the denominator (`grpo_loss_normalizer` gives TRL's for a whole batch). Default: this call's
            own, without gradient accumulation. Summing the losses of micro-batches that all use the whole batch's
            normalizer gives the whole batch's loss.
        ref_per_token_logps: ``[B, C]`` log-probs of the reference model, required when ``beta`` is not 0.
        beta, bias_correction_kl: TRL's ``beta`` and ``use_bias_correction_kl``.
    """
    check_grpo_loss_type(loss_type)
    if beta != 0.0 and ref_per_token_logps is None:
        raise ValueError(f"`beta`={beta} weighs a KL term to the reference model: pass `ref_per_token_logps`.")
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    mask = completion_mask.to(torch.float32)
    per_token_logps = grpo_per_token_logps(logits, completion_ids, temperature=temperature)
    per_token_logps = per_token_logps.masked_fill(completion_mask == 0, 0.0)  # as TRL's label mask leaves them
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    old = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
    ratio = torch.exp(per_token_logps - old)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    per_token_loss = -torch.min(ratio * advantages, clipped * advantages)
    if beta != 0.0:
        ref_per_token_logps = ref_per_token_logps.masked_fill(completion_mask == 0, 0.0)  # as TRL's are
        log_ratio_to_reference = ref_per_token_logps - per_token_logps
        per_token_kl = torch.exp(log_ratio_to_reference) - log_ratio_to_reference - 1
        if bias_correction_kl:
            per_token_kl = per_token_kl * ratio
        per_token_loss = per_token_loss + beta * per_token_kl
    per_token_loss = per_token_loss * mask
    if loss_type == "grpo":
        per_token_loss = per_token_loss / mask.sum(-1, keepdim=True).clamp(min=1.0)
    if normalizer is None:
        normalizer = grpo_loss_normalizer(loss_type, completion_mask, max_completion_length=completion_ids.shape[1])
    if isinstance(normalizer, torch.Tensor):
        normalizer = normalizer.to(per_token_loss.dtype).clamp(min=1.0)
    else:
        normalizer = max(float(normalizer), 1.0)
    return per_token_loss.sum() / normalizer


def grpo_loss_normalizer(
    loss_type: str,
    loss_mask: torch.Tensor,
    *,
    max_completion_length: int,
    num_items_in_batch: torch.Tensor | None = None,
    gradient_accumulation_steps: int = 1,
    steps_per_generation: int = 1,
) -> torch.Tensor:
    """TRL's denominator of `grpo_loss` for one whole batch (``loss_mask [B, C]``, the tokens that count) of an
    accumulation window, as one process holding every row of it computes it: ``grpo`` averages the rows, ``bnpo``
    the counted tokens, ``dr_grpo`` a fixed ``B * max_completion_length`` tokens, each then divided by the
    accumulation steps; ``dapo`` divides by ``num_items_in_batch`` (the counted tokens of the generation batch,
    default this batch's) rescaled to one accumulation window."""
    check_grpo_loss_type(loss_type)
    rows = loss_mask.new_tensor(float(loss_mask.shape[0]), dtype=torch.float32)
    counted = loss_mask.sum().to(torch.float32).clamp(min=1.0)
    if loss_type == "dapo":
        items = counted if num_items_in_batch is None else num_items_in_batch.to(torch.float32).clamp(min=1.0)
        return items * gradient_accumulation_steps / steps_per_generation
    per_batch = {"grpo": rows, "bnpo": counted, "dr_grpo": rows * max_completion_length}
    return per_batch[loss_type] * gradient_accumulation_steps
