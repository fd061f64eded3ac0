"""HF-native drafting with a DFlash draft: one block forward per round, as vLLM runs it (`DFlashDraftModel
.new_proposer`; the decoding loop that calls it is `hf_spec_cotrain.generation.decoder`).

After the target has emitted ``x_n`` (position ``n``), a round of K drafts:

1. The verified positions the draft has not seen yet become context: each layer's keys and values of
   ``hidden_norm(fc(taps))`` at their positions, appended to a per-layer cache with a slot mask (a rejected slot is a
   hole: it stays in the cache, masked out, until compaction drops it).
2. The block ``[x_n, mask x K]`` at positions ``n .. n + K`` runs through the draft once, attending to every kept
   context slot and to the whole block; block position ``i`` proposes ``d_i``, sampled from its own distribution.
   The block's keys are never cached: the next round's context holds the verified tokens' own.
"""

import torch

from ..attention.decoding import grouped_attention
from .base import CachedProposer, SampleFn


__all__ = ["DFlashProposer"]


class DFlashProposer(CachedProposer):
    """One generate call's DFlash drafting state: the context keys and values per layer, their slot mask, and the
    verified positions waiting to join them (``pending``: kept until a round drafts, so rounds of K = 0 never run the
    draft).

    Args:
        draft: a `DFlashDraftModel` (`context_states`, `context_keys_values`, `block_embeddings`, `backbone`,
            `compute_logits`).
        embed: token ids -> the target's embeddings in the draft's dtype (the anchor's and the mask token's).
    """

    def pending_inputs(
        self, next_tokens: torch.Tensor, taps: torch.Tensor, position_ids: torch.Tensor, valid: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """Only the taps become context (the tokens reach the draft as the next anchor, or through the taps)."""
        return taps, position_ids, valid

    def propose(
        self, last_token: torch.Tensor, next_position: torch.Tensor, k: int, sample: SampleFn
    ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """The block ``[last_token, mask x k]`` at ``next_position`` onwards; each of its positions ``1 .. k``
        samples its draft token independently (DFlash drafts the whole block at once)."""
        if k > self.draft.max_tokens_per_round():
            raise ValueError(self.draft.tokens_per_round_error(k, self.draft.config.block_size))
        self._append_pending()
        logits = self.block_logits(last_token, next_position, k)
        drafts, draft_probs = [], []
        for position in range(k):
            token, q = sample(logits[:, position])
            drafts.append(token)
            draft_probs.append(q)
        return torch.stack(drafts, dim=1), draft_probs

    def block_logits(self, last_token: torch.Tensor, next_position: torch.Tensor, k: int) -> torch.Tensor:
        """Draft logits ``[R, k, draft_vocab]`` of block positions ``1 .. k`` over the cached context."""
        draft = self.draft
        mask_token = torch.full_like(last_token, draft.config.mask_token_id)
        embeds = self.embed(torch.stack([last_token, *[mask_token] * k], dim=1))
        positions = next_position[:, None] + torch.arange(k + 1, device=next_position.device)
        rows, slots = self.slot_mask.shape
        # Every query sees the kept context slots and the whole block.
        visible = torch.cat([self.slot_mask, self.slot_mask.new_ones(rows, k + 1)], dim=1)
        visible = visible[:, None, None, :].expand(rows, 1, k + 1, slots + k + 1)
        layers = self.cache.layers

        def attend(layer_index, q, block_k, block_v):
            keys = torch.cat([layers[layer_index].keys, block_k], dim=2)
            values = torch.cat([layers[layer_index].values, block_v], dim=2)
            return grouped_attention(q, keys, values, visible)

        hidden = draft.backbone(embeds, positions, attend)
        return draft.compute_logits(hidden[:, 1:])

    def _append_pending(self) -> None:
        """The pending verified positions become context slots (their keys and values in every layer)."""
        if not self.pending:
            return
        taps, position_ids, valid = (torch.cat(parts, dim=1) for parts in zip(*self.pending, strict=True))
        self.pending = []
        context = self.draft.context_states(taps)
        for layer_index, (keys, values) in enumerate(self.draft.context_keys_values(context, position_ids)):
            self.cache.update(keys, values, layer_index)
        self.slot_mask = torch.cat([self.slot_mask, valid], dim=1)
