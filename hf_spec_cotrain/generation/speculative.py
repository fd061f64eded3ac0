"""HF-native speculative decoding with an EAGLE-3 draft: chain drafting and lossless verification, as vLLM runs it.

One round of K drafts, per row, after the target has emitted ``x_n`` (position ``n``):

1. The draft catches up on the verified positions it has not seen (those of the last drafting round, and of any
   plain rounds since), recomputing them from the target's taps; its output at ``n - 1`` proposes ``d_1``, and
   feeding ``(embed(d_k), h)`` with its own pre-norm output ``h`` at position ``n - 1 + k`` it proposes
   ``d_2 .. d_K``. Its speculative cache entries are discarded after the round.
2. One target forward over ``[x_n, d_1 .. d_K]`` scores every proposal; forward hooks (`TapRecorder`) read the taps
   of that same forward.
3. Each row accepts its own prefix of ``a`` drafts and emits a correction (or, after all ``K``, a bonus) token:
   greedy verification, or speculative rejection sampling, so the output follows the target's distribution.

K comes from a `SpeculationPolicy` before every round (fixed, or `AdaptiveSpeculation`); K = 0 is a plain decoding
step that does not run the draft. Any K chosen from the past keeps every round's tokens exact samples of the target.

Caches are never cropped: rows accept different numbers of tokens, so a rejected slot becomes a *hole* in a
``[B, slots]`` slot mask (0 = hole or padding) and every forward gets explicit per-row ``position_ids`` and the
causal-by-slot mask of that slot mask (`causal_slot_mask`), which is exactly what holes need; on CPU the target
attends through `decoding_attention`'s grouped kernel. Finished rows leave the batch, and caches whose holes
outnumber their kept slots are compacted (keys carry their RoPE rotation, so moving slots changes nothing).

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
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    DynamicCache,
    LogitsProcessorList,
    PreTrainedModel,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.cache_utils import DynamicLayer

from ..draft import Eagle3DraftModel
from ..draft.modeling import causal_slot_mask
from ..taps import TapRecorder
from ..validation import ATTENTION_LAYER_TYPES, check_int, layer_types
from .adaptive import FixedSpeculation, SpeculationPolicy
from .decoding_attention import decoding_attention, grouped_attention
from .linear_attention import (
    GATED_DELTANET_MODEL_TYPES,
    LINEAR_ATTENTION,
    LinearAttentionStates,
    new_cache,
    select_rows,
)


if TYPE_CHECKING:
    from .pipelined import PipelinedTarget


__all__ = [
    "DRAFT_SAMPLING_METHODS",
    "SpeculativeOutput",
    "check_speculative_target",
    "greedy_verify",
    "rejection_sample",
    "residual_distribution",
    "speculative_generate",
]

DRAFT_SAMPLING_METHODS = ("probabilistic", "greedy")


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


# ---------------------------------------------------------------------------------------------- verification


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


# ---------------------------------------------------------------------------------------------- generation


def speculative_generate(
    target: PreTrainedModel,
    draft: Eagle3DraftModel,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int,
    num_speculative_tokens: int | SpeculationPolicy = 3,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    draft_sampling: str | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    generator: torch.Generator | None = None,
    pipeline: "PipelinedTarget | None" = None,
) -> SpeculativeOutput:
    r"""
    Generate from ``target`` with ``draft`` proposing ``num_speculative_tokens`` tokens per target forward.

    The output is lossless: greedy decoding returns ``target.generate(do_sample=False)``'s tokens, and sampling
    follows the target's distribution with the same ``temperature``/``top_k``/``top_p`` (HF's warpers, applied
    in that order). Token for token in float32; in bfloat16 the ``K + 1``-token verification rounds differently
    from `generate`'s one-token steps, so a row may take the other token of a near-tie. The draft may run in a
    lower precision than the target (its inputs are cast to it): that changes only what it proposes.

    Args:
        input_ids: ``[B, P]`` prompts, left-padded. ``attention_mask``: ``[B, P]``, 0 on padding (default: none).
        max_new_tokens: generated tokens per row, at most (EOS ends a row earlier).
        num_speculative_tokens: ``K``, drafts per round; or a `SpeculationPolicy` that chooses K in
            ``0 .. max_speculative_tokens`` before every round (`AdaptiveSpeculation`: from an online cost model,
            as the live batch shrinks). Every K keeps the output lossless; which K runs changes only the speed (and
            which random numbers a sampled row draws).
        do_sample: sample (speculative rejection sampling) instead of greedy decoding.
        draft_sampling: how the draft proposes when sampling: ``"probabilistic"`` (default) samples from the
            draft's own warped distribution ``q`` (zero outside the draft vocabulary) and accepts with
            ``min(1, p/q)``; ``"greedy"`` proposes the draft's argmax (vLLM's default), accepted with ``p(token)``.
        eos_token_id / pad_token_id: default to the target's ``generation_config`` (pad falls back to EOS).
        generator: random source for sampling (on the models' device).
        pipeline: the target's pipeline stages (`hf_spec_cotrain.generation.pipelined.PipelinedTarget`), when
            ``target`` is the last stage of a pipeline cut: every target forward then runs through the stages, each
            with a cache of its own layers, while the other stages serve (`PipelinedTarget.serve`).
    """
    speculation = _speculation_policy(num_speculative_tokens)
    draft_sampling = _validate_arguments(
        target,
        draft,
        input_ids,
        attention_mask,
        max_new_tokens=max_new_tokens,
        do_sample=do_sample,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        draft_sampling=draft_sampling,
    )
    aux_layer_ids = draft.validate_target(target.config)
    eos_ids, pad_token_id = _special_ids(target, eos_token_id, pad_token_id)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    warpers = _warpers(temperature, top_k, top_p) if do_sample else None
    modes = {module: module.training for module in (*target.modules(), *draft.modules())}
    target.eval()
    draft.eval()
    try:
        with (
            torch.no_grad(),
            TapRecorder(target, aux_layer_ids) as recorder,
            decoding_attention(target),
            LinearAttentionStates(target) as linear_states,
        ):
            decoder = (_SpeculativeDecoder if pipeline is None else pipeline.decoder)(
                target,
                draft,
                recorder,
                linear_states,
                speculation=speculation,
                warpers=warpers,
                greedy_drafts=draft_sampling == "greedy",
                eos_ids=eos_ids,
                generator=generator,
            )
            return decoder.generate(
                input_ids, attention_mask, max_new_tokens=max_new_tokens, pad_token_id=pad_token_id
            )
    finally:
        for module, training in modes.items():
            module.training = training


class _SpeculativeDecoder:
    """The state of one `speculative_generate` call; rows are the still-running rows, ``row_ids`` their batch ids."""

    def __init__(
        self,
        target: PreTrainedModel,
        draft: Eagle3DraftModel,
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
        self.device = self._input_device()
        self.draft_ids = draft.draft_to_target_ids.to(self.device)
        self.eos_ids = eos_ids.to(self.device)
        self.text_config = target.config.get_text_config()
        self.layer_windows = _layer_windows(self.text_config)
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

        # Prefill: the target over the prompts (taps by hooks) and its first token. What the draft has not seen yet
        # (here the prompts) waits in `pending` until a round drafts: rounds of K = 0 never run the draft.
        slot_mask = attention_mask.to(device=device, dtype=torch.bool)
        positions = (slot_mask.long().cumsum(1) - 1).clamp(min=0)
        self.target_cache, self.target_mask = new_cache(self.text_config), slot_mask
        self.draft_cache, self.draft_mask = DynamicCache(), slot_mask[:, :0]
        logits, taps = self._target_forward(input_ids, positions, logits_to_keep=1)
        num_target_forwards = 1
        last_token = self._sample_target(logits[:, -1])
        row_ids = torch.arange(batch, device=device)
        finished = self._emit(row_ids, last_token[:, None], torch.ones_like(last_token))
        pending = [(torch.cat([input_ids[:, 1:], last_token[:, None]], dim=1), taps, positions, slot_mask)]
        next_position = positions[:, -1] + 1
        (row_ids, last_token, next_position), pending = self._drop_finished(
            finished, (row_ids, last_token, next_position), pending
        )

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
                # 1. The draft catches up on the verified positions it has not seen, whose last output proposes
                # d_1; then chain drafting proposes d_2..d_K from the draft's own output.
                draft_logits, draft_hidden = self._draft_forward(*_concat_slots(pending))
                pending = []
                spec_start = self.draft_mask.shape[1]
                drafts, draft_probs = [], []
                for step in range(k):
                    token, q = self._propose(draft_logits)
                    drafts.append(token)
                    draft_probs.append(q)
                    if step < k - 1:
                        draft_logits, draft_hidden = self._draft_step(token, draft_hidden, next_position + step)
                drafts = torch.stack(drafts, dim=1)
                self.draft_mask[:, spec_start:] = False  # speculative entries never serve a later round
            else:
                drafts = last_token[:, None][:, :0]
            draft_seconds = self._clock() - started

            # 2. One target forward verifies [x_n, d_1..d_K]; its taps feed the draft's next catch-up.
            verify_ids = torch.cat([last_token[:, None], drafts], dim=1)
            verify_positions = next_position[:, None] + offsets[: k + 1]
            self.target_mask = F.pad(self.target_mask, (0, k + 1), value=True)
            logits, taps = self._target_forward(verify_ids, verify_positions)
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
            # verified token); the verified positions wait for the draft's next catch-up.
            verified = offsets[: k + 1] <= num_accepted[:, None]
            self.target_mask[:, -(k + 1) :] = verified
            self.linear_states.keep(num_accepted)
            tokens_per_row = float(num_accepted.sum()) / live + 1.0
            pending.append((emitted, taps, verify_positions, verified))
            last_token, next_position = next_token, next_position + num_accepted + 1
            (row_ids, last_token, next_position), pending = self._drop_finished(
                finished, (row_ids, last_token, next_position), pending
            )
            if row_ids.numel():
                self._compact_caches()
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

    def _target_forward(
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

    def _input_device(self) -> torch.device:
        """Where the target takes token ids (and the loop keeps its bookkeeping)."""
        return self.embedding.weight.device

    # ------------------------------------------------------------------ draft

    def _propose(self, draft_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A draft token (target id) and the distribution ``q`` it was sampled from (None: argmax)."""
        if self.greedy_drafts:
            return self.draft_ids[draft_logits.argmax(-1)], None
        scores = draft_logits.new_full((draft_logits.shape[0], self.draft.config.vocab_size), float("-inf"))
        scores[:, self.draft_ids] = draft_logits  # zero probability outside the draft vocabulary
        q = self._probs(scores)
        return torch.multinomial(q, 1, generator=self.generator).squeeze(1), q

    def _draft_step(
        self, token: torch.Tensor, hidden: torch.Tensor, position: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One speculative step: ``(embed(token), h)`` at ``position``, a new (visible) cache slot."""
        return self._run_draft(
            self._embed(token[:, None]),
            hidden,
            position[:, None],
            torch.ones_like(token[:, None], dtype=torch.bool),
            select=None,
        )

    def _draft_forward(
        self, tokens: torch.Tensor, taps: torch.Tensor, position_ids: torch.Tensor, valid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft positions recomputed from target taps: ``(embed(x_{j+1}), fc(taps_j))`` at ``j``; the logits and
        ``h`` of each row's last valid slot (the last verified position)."""
        hidden = self.draft.project_hidden_states(taps)
        last_valid = valid.shape[1] - 1 - valid.flip(1).long().argmax(1)
        return self._run_draft(self._embed(tokens), hidden, position_ids, valid, select=last_valid)

    def _run_draft(
        self,
        input_embeds: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        valid: torch.Tensor,
        *,
        select: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``L`` slots (``valid``: not holes) to the draft cache; return the logits and ``h`` at one slot per
        row (``select``; default the last), so a long prompt never materialises ``[B, L, vocab]`` logits."""
        self.draft_mask = torch.cat([self.draft_mask, valid], dim=1)
        visible = causal_slot_mask(self.draft_mask, input_embeds.shape[1])
        cache = self.draft_cache

        def attend(layer_index, q, k, v):
            k, v = cache.update(k, v, layer_index)
            return grouped_attention(q, k, v, visible)

        hidden = self.draft.backbone(input_embeds, hidden, position_ids, attend)
        if select is None:
            hidden = hidden[:, -1:]
        else:
            hidden = hidden[torch.arange(hidden.shape[0], device=hidden.device), select][:, None]
        return self.draft.compute_logits(hidden)[:, 0], hidden

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The target's own embedding (the draft's inputs always match the model being decoded)."""
        return self.embedding(token_ids).to(self.draft.fc.weight.dtype)

    # ------------------------------------------------------------------ caches

    def _drop_finished(
        self, finished: torch.Tensor, row_tensors: tuple[torch.Tensor, ...], pending: list[tuple[torch.Tensor, ...]]
    ) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, ...]]]:
        """Remove finished rows from both caches, their slot masks, ``row_tensors`` and the draft's ``pending``
        inputs (returned filtered)."""
        if not finished.any():
            return list(row_tensors), pending
        keep = (~finished).nonzero().squeeze(1)
        for cache in (self.target_cache, self.draft_cache):
            select_rows(cache, keep)
        self.target_mask, self.draft_mask = self.target_mask[keep], self.draft_mask[keep]
        return [t[keep] for t in row_tensors], [tuple(t[keep] for t in chunk) for chunk in pending]

    def _clock(self) -> float:
        """Wall time once the device has finished what was queued (the cost model times rounds)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _compact_caches(self) -> None:
        self.target_mask = _compact(self.target_cache, self.target_mask)
        self.draft_mask = _compact(self.draft_cache, self.draft_mask)


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


def _compact(cache: DynamicCache, slot_mask: torch.Tensor) -> torch.Tensor:
    """Drop holes in place once they outnumber the kept slots of the fullest row; return the new slot mask. Kept
    slots keep their order, left-padded (every attention layer keeps all its slots: see the module docstring on
    sliding windows); linear-attention layers have no slots, and a pipeline stage's cache has no entries for other
    stages' layers."""
    slots = slot_mask.shape[1]
    width = int(slot_mask.sum(1).max())
    if slots - width <= width:
        return slot_mask
    slot = torch.arange(slots, device=slot_mask.device)
    order = torch.argsort(torch.where(slot_mask, slot + slots, slot), dim=1, stable=True)[:, slots - width :]

    def gather(states: torch.Tensor) -> torch.Tensor:
        return states.gather(2, order[:, None, :, None].expand(-1, states.shape[1], -1, states.shape[3]))

    for layer in cache.layers:
        if isinstance(layer, DynamicLayer) and layer.is_initialized:
            layer.keys, layer.values = gather(layer.keys), gather(layer.values)
    return slot_mask.gather(1, order)


# ---------------------------------------------------------------------------------------------- arguments


def _speculation_policy(num_speculative_tokens: int | SpeculationPolicy) -> SpeculationPolicy:
    if isinstance(num_speculative_tokens, SpeculationPolicy):
        check_int(num_speculative_tokens.max_speculative_tokens, "max_speculative_tokens")
        return num_speculative_tokens
    check_int(
        num_speculative_tokens,
        "num_speculative_tokens",
        hint=" (the draft's tokens per round, or an AdaptiveSpeculation; use `target.generate` to decode without a "
        "draft)",
    )
    return FixedSpeculation(num_speculative_tokens)


def _concat_slots(chunks: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """The draft's pending inputs ``(tokens, taps, positions, valid)`` of several rounds as one run of slots."""
    if len(chunks) == 1:
        return chunks[0]
    return tuple(torch.cat(parts, dim=1) for parts in zip(*chunks))


def _warpers(temperature: float, top_k: int, top_p: float) -> LogitsProcessorList:
    """HF ``generate``'s sampling warpers, in its order: temperature, top-k, top-p."""
    warpers = LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    return warpers


def _special_ids(target: nn.Module, eos_token_id, pad_token_id) -> tuple[torch.Tensor, int]:
    generation_config = getattr(target, "generation_config", None)
    if eos_token_id is None and generation_config is not None:
        eos_token_id = generation_config.eos_token_id
    eos_ids = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if pad_token_id is None and generation_config is not None:
        pad_token_id = generation_config.pad_token_id
    if pad_token_id is None:
        pad_token_id = eos_ids[0] if eos_ids else 0
    return torch.tensor(eos_ids, dtype=torch.long), int(pad_token_id)


def _validate_arguments(
    target,
    draft,
    input_ids,
    attention_mask,
    *,
    max_new_tokens,
    do_sample,
    temperature,
    top_p,
    top_k,
    draft_sampling,
) -> str:
    """Raise a ValueError naming any bad argument; return the effective ``draft_sampling``."""
    check_int(max_new_tokens, "max_new_tokens")
    if draft_sampling is not None and draft_sampling not in DRAFT_SAMPLING_METHODS:
        raise ValueError(
            f"`draft_sampling`={draft_sampling!r} is not allowed; choose one of {', '.join(DRAFT_SAMPLING_METHODS)}."
        )
    if do_sample:
        if not temperature > 0:
            raise ValueError(
                f"`temperature`={temperature!r} is not allowed with `do_sample=True`: it must be > 0 "
                "(use `do_sample=False` for greedy decoding)."
            )
        if not 0 < top_p <= 1:
            raise ValueError(f"`top_p`={top_p!r} is not allowed: it must be in (0, 1] (1 disables it).")
        check_int(top_k, "top_k", minimum=0, hint=" (0 disables it)")
    elif draft_sampling == "probabilistic":
        warnings.warn(
            "`draft_sampling='probabilistic'` has no effect with `do_sample=False`: greedy decoding verifies the "
            "draft's argmax.",
            stacklevel=3,
        )
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"`input_ids` must be an int64 tensor [batch, prompt_len]; got {shape}.")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"`input_ids` has shape {tuple(input_ids.shape)}: give at least one prompt of >= 1 token.")
    if attention_mask is not None:
        if tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise ValueError(
                f"`attention_mask` has shape {tuple(attention_mask.shape)}; expected {tuple(input_ids.shape)} "
                "like `input_ids`."
            )
        mask = attention_mask.to(torch.bool)
        empty = (~mask.any(1)).nonzero().flatten().tolist()
        if empty:
            raise ValueError(f"Prompt rows {empty} have no real token (`attention_mask` all 0); drop them.")
        if (mask[:, :-1] & ~mask[:, 1:]).any():
            raise ValueError(
                "`attention_mask` is not left-padded: a 0 follows a 1 in some row. Pad prompts on the left "
                "(`tokenizer.padding_side = 'left'`), as for `generate`."
            )
    check_speculative_target(target.config)
    return draft_sampling or ("probabilistic" if do_sample else "greedy")


def check_speculative_target(config) -> None:
    """Refuse a target whose layers `speculative_generate` cannot verify exactly (raises ValueError). It verifies
    attention layers, full or sliding-window, whose rejected tokens stay in the cache as masked slots, and the Gated
    DeltaNet linear-attention layers of Qwen3.5 and Qwen3-Next, whose states it rolls back to each row's last accepted
    token (`linear_attention`); another family's linear-attention layers may keep their states elsewhere."""
    text_config = config.get_text_config()
    kinds = set(layer_types(text_config))
    if LINEAR_ATTENTION in kinds and text_config.model_type not in GATED_DELTANET_MODEL_TYPES:
        raise ValueError(
            f"This {text_config.model_type} target has linear_attention layers, whose recurrent states "
            "speculative_generate can roll back past rejected draft tokens only for the Gated DeltaNet layers of "
            f"{', '.join(GATED_DELTANET_MODEL_TYPES)} (Qwen3.5, Qwen3-Next): other layers may keep their states "
            "elsewhere. No speculative rollout path of hf_spec_cotrain serves this family yet (the vLLM weight sync "
            "does not map linear-attention tensors, and vLLM-CPU does not run them)."
        )
    other = sorted(kinds - {*ATTENTION_LAYER_TYPES, LINEAR_ATTENTION})
    if other:
        raise ValueError(
            f"This {text_config.model_type} target has {', '.join(other)} layers, and speculative_generate verifies "
            f"{', '.join(ATTENTION_LAYER_TYPES)} and ({', '.join(GATED_DELTANET_MODEL_TYPES)}) "
            f"{LINEAR_ATTENTION} layers only."
        )


def _layer_windows(text_config) -> dict[str, int | None]:
    """The sliding window of each attention layer type the target has (None: full attention)."""
    windows = {"full_attention": None, "sliding_attention": getattr(text_config, "sliding_window", None)}
    return {kind: windows[kind] for kind in dict.fromkeys(layer_types(text_config)) if kind != LINEAR_ATTENTION}
