"""`speculative_generate`: HF-native speculative decoding with a draft of any family (its `DraftProposer` drafts)
and lossless verification as vLLM runs it. This module checks the call and sets the models up; the decoding loop is
`hf_spec_cotrain.generation.decoder`, the acceptance maths `hf_spec_cotrain.generation.verification`.
"""

import warnings
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers import (
    LogitsProcessorList,
    PreTrainedModel,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ..attention.decoding import decoding_attention
from ..draft import DraftModel
from ..taps import TapRecorder
from ..validation import ATTENTION_LAYER_TYPES, check_int, layer_types
from .adaptive import FixedSpeculation, SpeculationPolicy
from .decoder import SpeculativeDecoder, SpeculativeOutput, eval_mode
from .linear_attention import GATED_DELTANET_MODEL_TYPES, LINEAR_ATTENTION, LinearAttentionStates


if TYPE_CHECKING:
    from .pipelined import PipelinedTarget


__all__ = [
    "DRAFT_SAMPLING_METHODS",
    "SpeculativeOutput",
    "check_speculative_target",
    "speculative_generate",
]

DRAFT_SAMPLING_METHODS = ("probabilistic", "greedy")


def speculative_generate(
    target: PreTrainedModel,
    draft: DraftModel,
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
    with (
        eval_mode(target, draft),
        torch.no_grad(),
        TapRecorder(target, aux_layer_ids) as recorder,
        decoding_attention(target),
        LinearAttentionStates(target) as linear_states,
    ):
        decoder = (SpeculativeDecoder if pipeline is None else pipeline.decoder)(
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
        return decoder.generate(input_ids, attention_mask, max_new_tokens=max_new_tokens, pad_token_id=pad_token_id)


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
            f"{', '.join(GATED_DELTANET_MODEL_TYPES)} (Qwen3.5 dense and MoE, Qwen3-Next): other layers may keep "
            "their states elsewhere. No speculative rollout path of hf_spec_cotrain serves this family yet (the vLLM weight sync "
            "does not map linear-attention tensors, and vLLM-CPU does not run them)."
        )
    other = sorted(kinds - {*ATTENTION_LAYER_TYPES, LINEAR_ATTENTION})
    if other:
        raise ValueError(
            f"This {text_config.model_type} target has {', '.join(other)} layers, and speculative_generate verifies "
            f"{', '.join(ATTENTION_LAYER_TYPES)} and ({', '.join(GATED_DELTANET_MODEL_TYPES)}) "
            f"{LINEAR_ATTENTION} layers only."
        )
