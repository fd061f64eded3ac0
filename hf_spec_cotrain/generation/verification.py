"""Verification of one speculative round: which drafts the target accepts, and the token that follows them. Greedy
verification, and speculative rejection sampling, whose emitted tokens follow the target's distribution exactly."""

import torch
import torch.nn.functional as F


__all__ = ["greedy_verify", "rejection_sample", "residual_distribution"]


def greedy_verify(
    draft_token_ids: torch.LongTensor, target_logits: torch.Tensor
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Accept drafts while they equal the target's argmax; return ``(num_accepted [B], next_token_ids [B])``.

    ``draft_token_ids [B, K]``; ``target_logits [B, K + 1, V]``, position ``k`` scoring the token after draft ``k``
    (position 0: after the last verified token). The next token is the target's argmax at the first mismatch,
    or after all ``K`` drafts (the bonus).
    """
    target_ids = target_logits.argmax(-1)
    num_drafts = draft_token_ids.shape[1]
    num_accepted = (draft_token_ids == target_ids[:, :num_drafts]).long().cumprod(1).sum(1)
    return num_accepted, target_ids.gather(1, num_accepted[:, None]).squeeze(1)


def rejection_sample(
    draft_token_ids: torch.LongTensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    *,
    generator: torch.Generator | None = None,
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Speculative rejection sampling of one round; return ``(num_accepted [B], next_token_ids [B])``.

    ``target_probs [B, K + 1, V]`` is the target's (warped) distribution ``p`` at each verified position, the last
    one for the bonus token. ``draft_probs [B, K, V]`` is the ``q`` each draft was sampled from; None means the
    draft proposed its argmax (``q`` one-hot). Draft ``k`` is accepted with probability ``min(1, p(d) / q(d))``;
    on the first rejection the next token comes from the normalised residual ``max(0, p - q)``, after ``K``
    acceptances from ``p``, so every emitted token follows ``p`` exactly.
    """
    batch, num_drafts = draft_token_ids.shape
    rows = torch.arange(batch, device=draft_token_ids.device)
    p_of_draft = target_probs[:, :num_drafts].gather(-1, draft_token_ids[..., None]).squeeze(-1)
    if draft_probs is None:
        ratio = p_of_draft
    else:
        ratio = p_of_draft / draft_probs.gather(-1, draft_token_ids[..., None]).squeeze(-1)
    uniform = torch.rand(ratio.shape, generator=generator, device=ratio.device, dtype=ratio.dtype)
    num_accepted = (uniform < ratio).long().cumprod(1).sum(1)

    p_next = target_probs[rows, num_accepted]
    rejected_at = num_accepted.clamp(max=num_drafts - 1)
    if draft_probs is None:
        q_next = F.one_hot(draft_token_ids[rows, rejected_at], p_next.shape[-1]).to(p_next.dtype)
    else:
        q_next = draft_probs[rows, rejected_at]
    rejected = (num_accepted < num_drafts)[:, None]
    distribution = torch.where(rejected, residual_distribution(p_next, q_next), p_next)
    return num_accepted, torch.multinomial(distribution, 1, generator=generator).squeeze(1)


def residual_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """``max(0, p - q)`` normalised over the last dim: where a rejected draft's next token comes from.

    A rejection leaves residual mass unless ``p`` and ``q`` agree up to rounding; ``p`` is then the exact answer.
    """
    residual = (target_probs - draft_probs).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(mass.dtype).tiny), target_probs)
