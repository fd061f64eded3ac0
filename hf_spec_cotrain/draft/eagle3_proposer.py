"""HF-native drafting with an EAGLE-3 draft: chain drafting over the draft's own KV cache, as vLLM runs it
(`Eagle3DraftModel.new_proposer`; the decoding loop that calls it is `hf_spec_cotrain.generation.decoder`).

After the target has emitted ``x_n`` (position ``n``), a round of K drafts:

1. The draft catches up on the verified positions it has not seen (those of the last drafting round, and of any
   plain rounds since), recomputing them from the target's taps: ``(embed(x_{j+1}), fc(taps_j))`` at ``j``. Its
   output at ``n - 1`` proposes ``d_1``.
2. Feeding ``(embed(d_k), h)`` with its own pre-norm output ``h`` at position ``n - 1 + k``, it proposes
   ``d_2 .. d_K``. These speculative cache entries are hidden after the round: the next catch-up recomputes the
   verified ones from the target's taps.

The cache is never cropped: a rejected slot is a hole of the slot mask (`causal_slot_mask`), compacted once holes
outnumber the kept slots (`compact_slots`).
"""

import torch

from ..attention.decoding import causal_slot_mask, grouped_attention
from .base import CachedProposer, SampleFn


__all__ = ["Eagle3Proposer"]


class Eagle3Proposer(CachedProposer):
    """One generate call's EAGLE-3 drafting state: its KV cache, slot mask and the verified positions waiting for
    the next catch-up (``pending``: kept until a round drafts, so rounds of K = 0 never run the draft).

    Args:
        draft: an `Eagle3DraftModel` (its four-call interface: `embed_input_ids` aside, all it runs).
        embed: token ids -> the target's embeddings in the draft's dtype.
    """

    def propose(
        self, last_token: torch.Tensor, next_position: torch.Tensor, k: int, sample: SampleFn
    ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """The catch-up's last output proposes ``d_1``, the chain ``d_2 .. d_K`` (``last_token`` is already the
        last pending position's next token)."""
        draft_logits, hidden = self._catch_up_forward(*_concat_slots(self.pending))
        self.pending = []
        speculative_start = self.slot_mask.shape[1]
        drafts, draft_probs = [], []
        for step in range(k):
            token, q = sample(draft_logits)
            drafts.append(token)
            draft_probs.append(q)
            if step < k - 1:
                draft_logits, hidden = self._chain_step(token, hidden, next_position + step)
        self.slot_mask[:, speculative_start:] = False  # speculative entries never serve a later round
        return torch.stack(drafts, dim=1), draft_probs

    def _chain_step(
        self, token: torch.Tensor, hidden: torch.Tensor, position: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One speculative step: ``(embed(token), h)`` at ``position``, a new (visible) cache slot."""
        return self._run(
            self.embed(token[:, None]),
            hidden,
            position[:, None],
            torch.ones_like(token[:, None], dtype=torch.bool),
            select=None,
        )

    def _catch_up_forward(
        self, tokens: torch.Tensor, taps: torch.Tensor, position_ids: torch.Tensor, valid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft positions recomputed from target taps: ``(embed(x_{j+1}), fc(taps_j))`` at ``j``; the logits and
        ``h`` of each row's last valid slot (the last verified position)."""
        hidden = self.draft.project_hidden_states(taps)
        last_valid = valid.shape[1] - 1 - valid.flip(1).long().argmax(1)
        return self._run(self.embed(tokens), hidden, position_ids, valid, select=last_valid)

    def _run(
        self,
        input_embeds: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        valid: torch.Tensor,
        *,
        select: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``L`` slots (``valid``: not holes) to the cache; return the logits and ``h`` at one slot per row
        (``select``; default the last), so a long prompt never materialises ``[B, L, vocab]`` logits."""
        self.slot_mask = torch.cat([self.slot_mask, valid], dim=1)
        visible = causal_slot_mask(self.slot_mask, input_embeds.shape[1])
        cache = self.cache

        def attend(layer_index, q, k, v):
            k, v = cache.update(k, v, layer_index)
            return grouped_attention(q, k, v, visible)

        hidden = self.draft.backbone(input_embeds, hidden, position_ids, attend)
        if select is None:
            hidden = hidden[:, -1:]
        else:
            hidden = hidden[torch.arange(hidden.shape[0], device=hidden.device), select][:, None]
        return self.draft.compute_logits(hidden)[:, 0], hidden


def _concat_slots(chunks: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """The pending inputs ``(tokens, taps, positions, valid)`` of several rounds as one run of slots."""
    if len(chunks) == 1:
        return chunks[0]
    return tuple(torch.cat(parts, dim=1) for parts in zip(*chunks))
