"""The loop of HF-native speculative decoding: the draft's proposals and lossless verification, as vLLM runs it
(`speculative_generate` is its entry point).

One round of K drafts, per row, after the target has emitted ``x_n`` (position ``n``):

1. The draft proposes ``d_1 .. d_K`` through its family's `DraftProposer` (``draft.new_proposer``), which the loop
   has told what the target verified since its last proposal (`catch_up`) and which rows remain (`keep_rows`);
   the proposer keeps the draft's own caches (EAGLE-3: `hf_spec_cotrain.draft.eagle3_proposer`).
2. One target forward over ``[x_n, d_1 .. d_K]`` scores every proposal; forward hooks (`TapRecorder`) read the taps
   of that same forward.
3. Each row accepts its own prefix of ``a`` drafts and emits a correction (or, after all ``K``, a bonus) token:
   greedy verification, or speculative rejection sampling, so the output follows the target's distribution.

K comes from a `SpeculationPolicy` before every round (fixed, or `AdaptiveSpeculation`); K = 0 is a plain decoding
step that does not run the draft. Any K chosen from the past keeps every round's tokens exact samples of the target.

Caches are never cropped: rows accept different numbers of tokens, so a rejected slot becomes a *hole* in a
``[B, slots]`` slot mask (0 = hole or padding) and every forward gets explicit per-row ``position_ids`` and the
causal-by-slot mask of that slot mask (`causal_slot_mask`), which is exactly what holes need; on CPU the target
attends through `decoding_attention`'s grouped kernel (all three in `hf_spec_cotrain.attention.decoding`). Finished
rows leave the batch, and caches whose holes outnumber their kept slots are compacted (`compact_slots`: keys carry
their RoPE rotation, so moving slots changes nothing).

Sliding-window layers (gpt-oss, Mistral, interleaved ``layer_types``) get the same mask with the window counted in
real tokens (`causal_slot_mask`'s ``window``), so holes never take a place in it; a target mixing layer types gets
one mask per type. Their caches keep every slot, as full-attention layers' do: HF's sliding-window cache keeps the
last ``W - 1`` slots, holes included, which would drop tokens still inside the window.

Linear-attention layers (the Gated DeltaNet layers of Qwen3.5 and Qwen3-Next, between their full-attention layers)
have no slots to mask: their recurrent and convolution states fold in every token they read. A verification runs
them token by token, keeping their states after each verified token, and each row keeps those after its last
accepted one (`linear_attention`); finished rows leave them as they leave the caches, and compaction leaves them be.
Other families' linear-attention layers are refused (`check_speculative_target`).
"""

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LogitsProcessorList, PreTrainedModel

from ..attention.decoding import causal_slot_mask, compact_slots
from ..draft import DraftModel
from ..taps import TapRecorder
from ..validation import layer_types
from .adaptive import SpeculationPolicy
from .linear_attention import LINEAR_ATTENTION, LinearAttentionStates, new_cache, select_rows
from .verification import greedy_verify, rejection_sample


__all__ = ["SpeculativeDecoder", "SpeculativeOutput", "eval_mode", "layer_windows", "target_attention_mask"]


@contextmanager
def eval_mode(*models: nn.Module) -> Iterator[None]:
    """``models`` in eval mode (no dropout: decoding is deterministic) and each module's own mode restored after, as
    a trainer left it."""
    modes = {module: module.training for model in models for module in model.modules()}
    for model in models:
        model.eval()
    try:
        yield
    finally:
        for module, training in modes.items():
            module.training = training


@dataclass
class SpeculativeOutput:
    """Generated sequences and vLLM-compatible speculation counters.

    ``sequences``: prompt + generated tokens, ``[B, prompt_len + longest generation]``, ``pad_token_id`` after a row
    finishes (the layout of ``generate``). Counters follow vLLM's ``spec_decode`` metrics: a *draft* is one round of
    ``K > 0`` proposals for one row; ``accepted_per_position[k]`` counts drafts whose proposal ``k`` was accepted.
    Accepted tokens are counted as verified, before EOS or ``max_new_tokens`` truncate a row (as vLLM counts).
    ``rounds``: ``(live rows, K)`` of every decoding round after the prefill (K = 0: a plain decoding step).
    """

    sequences: torch.LongTensor
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: list[int]
    num_drafts_per_row: torch.LongTensor
    num_accepted_per_row: torch.LongTensor
    num_target_forwards: int
    rounds: list[tuple[int, int]] = field(default_factory=list)

    @property
    def acceptance_length(self) -> float:
        """Mean tokens per target forward of a drafting row, vLLM's ``1 + accepted / drafts`` (NaN: no drafts)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else float("nan")


class SpeculativeDecoder:
    """The state of one `speculative_generate` call; rows are the still-running rows, ``row_ids`` their batch ids.

    Its public methods besides `generate` (`target_forward`, `embed`, `input_device`, `drop_finished`,
    `compact_caches`) are all the loop does to the target: a subclass overrides them to run the target elsewhere
    (`hf_spec_cotrain.generation.pipelined`, through pipeline stages)."""

    def __init__(
        self,
        target: PreTrainedModel,
        draft: DraftModel,
        recorder: TapRecorder,
        linear_states: LinearAttentionStates,
        *,
        speculation: SpeculationPolicy,
        warpers: LogitsProcessorList | None,
        greedy_drafts: bool,
        eos_ids: torch.Tensor,
        generator: torch.Generator | None,
    ):
        self.target = target
        self.draft = draft
        self.recorder = recorder
        self.linear_states = linear_states
        self.speculation = speculation
        self.warpers = warpers
        self.greedy_drafts = greedy_drafts or warpers is None
        self.generator = generator
        self.embedding = target.get_input_embeddings()
        self.device = self.input_device()
        self.draft_ids = draft.draft_to_target_ids.to(self.device)
        self.eos_ids = eos_ids.to(self.device)
        self.text_config = target.config.get_text_config()
        self.layer_windows = layer_windows(self.text_config)
        self.has_linear_attention = LINEAR_ATTENTION in layer_types(self.text_config)

    # ------------------------------------------------------------------ the loop

    def generate(
        self, input_ids: torch.LongTensor, attention_mask: torch.Tensor, *, max_new_tokens: int, pad_token_id: int
    ) -> SpeculativeOutput:
        device = self.device
        input_ids = input_ids.to(device)
        batch = input_ids.shape[0]
        k_max = self.speculation.max_speculative_tokens
        self.generated = torch.full((batch, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
        self.num_generated = torch.zeros(batch, dtype=torch.long, device=device)
        self.max_new_tokens = max_new_tokens
        drafts_per_row = torch.zeros(batch, dtype=torch.long, device=device)
        accepted_per_row = torch.zeros(batch, dtype=torch.long, device=device)
        accepted_per_position = torch.zeros(k_max, dtype=torch.long, device=device)
        offsets = torch.arange(k_max + 1, device=device)
        num_draft_tokens, rounds = 0, []

        # Prefill: the target over the prompts (taps by hooks) and its first token. The proposer learns what the
        # target verified (here the prompts) and may wait for a round that drafts: rounds of K = 0 never need it.
        slot_mask = attention_mask.to(device=device, dtype=torch.bool)
        positions = (slot_mask.long().cumsum(1) - 1).clamp(min=0)
        self.target_cache, self.target_mask = new_cache(self.text_config), slot_mask
        self.proposer = self.draft.new_proposer(self.embed)
        logits, taps = self.target_forward(input_ids, positions, logits_to_keep=1)
        num_target_forwards = 1
        last_token = self._sample_target(logits[:, -1])
        row_ids = torch.arange(batch, device=device)
        finished = self._emit(row_ids, last_token[:, None], torch.ones_like(last_token))
        self.proposer.catch_up(torch.cat([input_ids[:, 1:], last_token[:, None]], dim=1), taps, positions, slot_mask)
        next_position = positions[:, -1] + 1
        row_ids, last_token, next_position = self.drop_finished(finished, (row_ids, last_token, next_position))

        drafted_before = False
        while row_ids.numel():
            live = row_ids.numel()
            k = self.speculation.choose(live)
            started = self._clock()
            # The first drafting round also runs the draft over the prompts: part of the prefill, not a sample of
            # what a round of K costs.
            costs_a_prefill = k > 0 and not drafted_before
            drafted_before = drafted_before or k > 0
            if k:
                # 1. The draft proposes d_1..d_K after the last verified token.
                drafts, draft_probs = self.proposer.propose(last_token, next_position, k, self._propose)
            else:
                drafts = last_token[:, None][:, :0]
            draft_seconds = self._clock() - started

            # 2. One target forward verifies [x_n, d_1..d_K]; its taps go to the proposer.
            verify_ids = torch.cat([last_token[:, None], drafts], dim=1)
            verify_positions = next_position[:, None] + offsets[: k + 1]
            self.target_mask = F.pad(self.target_mask, (0, k + 1), value=True)
            logits, taps = self.target_forward(verify_ids, verify_positions)
            num_target_forwards += 1

            # 3. Accept a prefix per row, then a correction or bonus token (K = 0: a plain decoding step).
            if not k:
                num_accepted, next_token = torch.zeros_like(last_token), self._sample_target(logits[:, 0])
            elif self.warpers is None:
                num_accepted, next_token = greedy_verify(drafts, logits)
            else:
                target_probs = self._probs(logits)
                q = None if self.greedy_drafts else torch.stack(draft_probs, dim=1)
                num_accepted, next_token = rejection_sample(drafts, target_probs, q, generator=self.generator)
            if k:
                drafts_per_row[row_ids] += 1
                accepted_per_row[row_ids] += num_accepted
                accepted_now = (num_accepted[:, None] > offsets[:k]).sum(0)
                reached_now = (num_accepted[:, None] >= offsets[:k]).sum(0)
                accepted_per_position[:k] += accepted_now
                num_draft_tokens += k * live
            emitted = torch.cat([drafts, next_token[:, None]], dim=1)
            emitted.scatter_(1, num_accepted[:, None], next_token[:, None])
            finished = self._emit(row_ids, emitted, num_accepted + 1)

            # 4. Rejected target slots become holes (linear-attention layers keep the states after each row's last
            # verified token); the proposer learns the verified positions.
            verified = offsets[: k + 1] <= num_accepted[:, None]
            self.target_mask[:, -(k + 1) :] = verified
            self.linear_states.keep(num_accepted)
            tokens_per_row = float(num_accepted.sum()) / live + 1.0
            self.proposer.catch_up(emitted, taps, verify_positions, verified)
            last_token, next_position = next_token, next_position + num_accepted + 1
            row_ids, last_token, next_position = self.drop_finished(finished, (row_ids, last_token, next_position))
            if row_ids.numel():
                self.compact_caches()
            if not costs_a_prefill:
                self.speculation.observe_round(
                    live,
                    k,
                    seconds=self._clock() - started,
                    draft_seconds=draft_seconds,
                    tokens_per_row=tokens_per_row,
                )
            if k:
                self.speculation.observe_acceptance(reached_now.tolist(), accepted_now.tolist())
            rounds.append((live, k))

        longest = int(self.num_generated.max())
        return SpeculativeOutput(
            sequences=torch.cat([input_ids, self.generated[:, :longest]], dim=1),
            num_drafts=int(drafts_per_row.sum()),
            num_draft_tokens=num_draft_tokens,
            num_accepted_tokens=int(accepted_per_row.sum()),
            accepted_per_position=accepted_per_position.tolist(),
            num_drafts_per_row=drafts_per_row,
            num_accepted_per_row=accepted_per_row,
            num_target_forwards=num_target_forwards,
            rounds=rounds,
        )

    def _emit(self, row_ids: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Append ``tokens[:, :counts]`` to the rows, cut at EOS and at the budget; return which rows finished."""
        offsets = torch.arange(tokens.shape[1], device=tokens.device)
        counts = torch.minimum(counts, self.max_new_tokens - self.num_generated[row_ids])
        is_eos = torch.isin(tokens, self.eos_ids) & (offsets < counts[:, None])
        first_eos = torch.where(is_eos, offsets, tokens.shape[1]).min(1).values
        counts = torch.minimum(counts, first_eos + 1)
        write = offsets < counts[:, None]
        columns = self.num_generated[row_ids, None] + offsets
        self.generated[row_ids[:, None].expand_as(tokens)[write], columns[write]] = tokens[write]
        self.num_generated[row_ids] += counts
        return is_eos.any(1) | (self.num_generated[row_ids] >= self.max_new_tokens)

    # ------------------------------------------------------------------ target

    def target_forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, *, logits_to_keep: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the target over new slots (``self.target_mask`` already covers them); return logits and taps."""
        with self.recorder.capture():
            logits = self.target(
                input_ids=input_ids,
                attention_mask=self._target_attention_mask(input_ids.shape[1]),
                position_ids=position_ids,
                past_key_values=self.target_cache,
                use_cache=True,
                logits_to_keep=logits_to_keep,
            ).logits
        return logits, self.recorder.pop().aux_hidden_states

    def _target_attention_mask(self, length: int) -> torch.Tensor | dict[str, torch.Tensor]:
        return target_attention_mask(
            self.target_mask, length, self.layer_windows, linear_attention=self.has_linear_attention
        )

    def _probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Warped probabilities over ``[..., V]``, computed in at least float32."""
        shape = logits.shape
        scores = logits.reshape(-1, shape[-1]).to(torch.promote_types(logits.dtype, torch.float32))
        return self.warpers(None, scores).softmax(-1).view(shape)

    def _sample_target(self, logits: torch.Tensor) -> torch.Tensor:
        if self.warpers is None:
            return logits.argmax(-1)
        return torch.multinomial(self._probs(logits), 1, generator=self.generator).squeeze(1)

    def input_device(self) -> torch.device:
        """Where the target takes token ids (and the loop keeps its bookkeeping)."""
        return self.embedding.weight.device

    # ------------------------------------------------------------------ draft

    def _propose(self, draft_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A draft token (target id) and the distribution ``q`` it was sampled from (None: argmax): the `SampleFn`
        the proposer drafts with, applying the rollout's warpers and random stream."""
        if self.greedy_drafts:
            return self.draft_ids[draft_logits.argmax(-1)], None
        scores = draft_logits.new_full((draft_logits.shape[0], self.draft.config.vocab_size), float("-inf"))
        scores[:, self.draft_ids] = draft_logits  # zero probability outside the draft vocabulary
        q = self._probs(scores)
        return torch.multinomial(q, 1, generator=self.generator).squeeze(1), q

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The target's own embedding, in the draft's dtype (the draft's inputs always match the model being
        decoded)."""
        return self.embedding(token_ids).to(self.draft.dtype)

    # ------------------------------------------------------------------ caches

    def drop_finished(self, finished: torch.Tensor, row_tensors: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """Remove finished rows from the target's cache and slot mask, the proposer and ``row_tensors`` (returned
        filtered)."""
        if not finished.any():
            return list(row_tensors)
        keep = (~finished).nonzero().squeeze(1)
        select_rows(self.target_cache, keep)
        self.target_mask = self.target_mask[keep]
        self.proposer.keep_rows(keep)
        return [t[keep] for t in row_tensors]

    def _clock(self) -> float:
        """Wall time once the device has finished what was queued (the cost model times rounds)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def compact_caches(self) -> None:
        self.target_mask = compact_slots(self.target_cache, self.target_mask)
        self.proposer.compact()


def target_attention_mask(
    slot_mask: torch.Tensor, length: int, layer_windows: dict[str, int | None], *, linear_attention: bool = False
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The target's mask of the last ``length`` of ``slot_mask``'s slots: one tensor if every layer has the same
    window, else one per layer type (the mapping transformers' models take in place of building their own masks);
    linear-attention layers get the 2-D padding mask of the new slots, as in `generate`."""
    masks = {
        layer_type: causal_slot_mask(slot_mask, length, window=window) for layer_type, window in layer_windows.items()
    }
    if linear_attention:
        masks[LINEAR_ATTENTION] = slot_mask[:, -length:]
    return next(iter(masks.values())) if len(masks) == 1 else masks


def layer_windows(text_config) -> dict[str, int | None]:
    """The sliding window of each attention layer type the target has (None: full attention)."""
    windows = {"full_attention": None, "sliding_attention": getattr(text_config, "sliding_window", None)}
    return {kind: windows[kind] for kind in dict.fromkeys(layer_types(text_config)) if kind != LINEAR_ATTENTION}
