"""The fields a draft family copies from its policy's text config, written once for every draft family and every
decoder family transformers ships.

Transformers unifies some of a config's names itself: its `attribute_map`s (gpt2's `n_embd` reads as `hidden_size`),
`per_layer_config` (layers that differ, as Gemma 4's full-attention heads do) and `rope_parameters` (keyed by layer
type where the layers differ). What it leaves to each family (the norm's epsilon, the MLP's width, ...) is read here
by the names the families give it (`FIELD_NAMES`, `COMPUTED_MLP_WIDTHS`).
"""

from typing import Any

from .dflash_configuration import FULL_ATTENTION


DRAFT_ACTIVATION = "silu"
"""The draft's MLP activation, whatever the policy's: vLLM's EAGLE-3 and DFlash draft layers (its Llama and Qwen MLPs)
serve no other ("Unsupported activation ... Only silu is supported")."""

DEFAULT_NORM_EPS = 1e-6
"""The draft's norm epsilon for a policy whose config declares none (OPT, XGLM, OLMo: their modeling code fixes it)."""

# Names the families give one field where transformers maps none of them onto the others; a config's first name that
# is set (not None) counts. Read from the configurations (and, for the MLP, the modeling code) of transformers 5.19.
FIELD_NAMES: dict[str, tuple[str, ...]] = {
    "rms_norm_eps": ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps", "norm_epsilon"),
    "max_position_embeddings": ("max_position_embeddings", "max_seq_len"),  # MPT: `max_seq_len`
    # The width of the policy's dense MLP, the one the draft's layers copy. MoE families that declare it apart from
    # their experts' come first: Llama 4's and MiniMax-M3's `intermediate_size` is an expert's, Cohere2-MoE's dense
    # layers precede its MoE ones, Granite-MoE's shared MLP runs beside the experts for every token (0: it has none,
    # read as undeclared). Elsewhere `intermediate_size` is the dense MLP's (Qwen3-MoE's `mlp_only_layers`, DeepSeek's
    # first dense layers) or, in MoE families without dense layers (Mixtral, gpt-oss), each expert's, itself a full
    # MLP. Last, for MoE families that declare no such width (Qwen3.5-MoE, Solar-Open, ZAYA): one routed expert's.
    "intermediate_size": (
        "intermediate_size_mlp",
        "dense_intermediate_size",
        "prefix_dense_intermediate_size",
        "shared_intermediate_size",
        "intermediate_size",
        "ffn_hidden_size",  # Falcon
        "ffn_dim",  # OPT, XGLM
        "dff",  # CTRL
        "decoder_ffn_dim",  # TrOCR
        "d_inner",  # XLNet
        "dim_ff",  # CPM-Ant
        "moe_intermediate_size",
    ),
}


def _four_times_hidden(config) -> int:
    return 4 * config.hidden_size


def _inner_or_four_times_hidden(config) -> int:
    return config.n_inner or 4 * config.hidden_size


# Families whose modeling code computes the MLP width rather than reading it from one field.
COMPUTED_MLP_WIDTHS = {
    "gpt2": _inner_or_four_times_hidden,
    "gpt_bigcode": _inner_or_four_times_hidden,
    "codegen": _inner_or_four_times_hidden,
    "gptj": _inner_or_four_times_hidden,
    "gpt_neo": lambda config: config.intermediate_size or 4 * config.hidden_size,
    "bloom": _four_times_hidden,
    "openai-gpt": _four_times_hidden,
    "mpt": _four_times_hidden,  # MptMLP ignores `expansion_ratio`
    "gpt_neox_japanese": lambda config: int(config.hidden_size * config.intermediate_multiple_size),
    "moshi": lambda config: config.ffn_dim // 2,  # a gated MLP: `ffn_dim` holds the gate and the up projection
    "dbrx": lambda config: config.ffn_config.ffn_hidden_size,  # each expert's; DBRX has no dense layers
}

_HAND_BUILT_DRAFT = (
    "build the draft's config by hand (`Eagle3DraftConfig` / `DFlashDraftConfig`) and pass the draft as "
    "`SpecCoTrainer(draft_model=...)`, or load a trained one with `draft_model_name_or_path`"
)


def draft_layer_fields(text_config) -> dict[str, Any]:
    """The policy's layer shapes, norms, RoPE and vocabulary, as a draft config takes them: the draft's own layers
    match the policy's width (it reads the policy's embeddings and, for some families, its lm_head), ``vocab_size``
    is the policy's and ``target_*`` record what the taps come from.

    The draft attends fully: where the policy's layers differ, it takes its full-attention layers' head sizes and
    RoPE. It rotates whole heads (a policy's ``partial_rotary_factor`` is dropped: transformers' default RoPE ignores
    it where vLLM applies it, so a draft trained with it would be served with another rotation); a policy without
    RoPE leaves the draft config's default (theta 10000). Its activation is always `DRAFT_ACTIVATION` ("silu") and
    its norm epsilon the policy's, `DEFAULT_NORM_EPS` when the policy declares none.

    Raises a ValueError naming the field when the policy's config has no value for it (a model without attention
    heads, or without a context length).
    """
    layers = _full_attention_layers(text_config)
    hidden_size = _required_int(layers, "hidden_size")
    num_heads = _required_int(layers, "num_attention_heads")
    num_kv_heads = _declared(layers, "num_key_value_heads") or num_heads  # None: one per head (Nemotron)
    if not _is_positive_int(num_kv_heads) or num_heads % num_kv_heads:
        raise _underivable(
            text_config, "num_key_value_heads", f"{num_kv_heads!r} key-value heads do not divide {num_heads} heads"
        )
    head_dim = getattr(layers, "head_dim", None)
    norm_eps = _declared(layers, "rms_norm_eps")
    return {
        "hidden_size": hidden_size,
        "intermediate_size": _mlp_width(layers),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim if _is_positive_int(head_dim) else hidden_size // num_heads,
        "hidden_act": DRAFT_ACTIVATION,
        "rms_norm_eps": DEFAULT_NORM_EPS if norm_eps is None else norm_eps,
        "rope_parameters": _draft_rope_parameters(text_config),
        "max_position_embeddings": _required_int(layers, "max_position_embeddings"),
        "vocab_size": _required_int(text_config, "vocab_size"),
        "target_hidden_size": hidden_size,
        "target_num_hidden_layers": _required_int(text_config, "num_hidden_layers"),
        "bos_token_id": getattr(text_config, "bos_token_id", None),
        "eos_token_id": getattr(text_config, "eos_token_id", None),
        "pad_token_id": getattr(text_config, "pad_token_id", None),
    }


def _underivable(text_config, field: str, reason: str) -> ValueError:
    return ValueError(
        f"A draft's `{field}` cannot be derived from this {text_config.model_type!r} policy: {reason}. Instead, "
        f"{_HAND_BUILT_DRAFT}."
    )


def _is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _declared(config, field: str):
    """The value of the first of ``field``'s names (`FIELD_NAMES`) that ``config`` sets, else None."""
    for name in FIELD_NAMES.get(field, (field,)):
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def _required_int(config, field: str) -> int:
    value = _declared(config, field)
    if not _is_positive_int(value):
        names = " / ".join(f"`{name}`" for name in FIELD_NAMES.get(field, (field,)))
        reason = "its config has no " + names if value is None else f"its {names} is {value!r}, not a positive int"
        raise _underivable(config, field, reason)
    return value


def _full_attention_layers(text_config):
    """The policy's config as its full-attention layers read it: the config itself unless transformers keeps some of
    its values per layer (`per_layer_config`; Gemma 4's full-attention heads are wider than its sliding ones)."""
    if not text_config.is_heterogeneous:
        return text_config
    try:
        return text_config.per_layer_config[FULL_ATTENTION]
    except ValueError as error:  # no full-attention layers, or ones that differ
        raise _underivable(text_config, "per_layer_config", f"its layers differ and {error}") from None


def _mlp_width(config) -> int:
    computed = COMPUTED_MLP_WIDTHS.get(config.model_type)
    if computed is not None:
        return computed(config)
    for name in FIELD_NAMES["intermediate_size"]:
        width = getattr(config, name, None)
        if isinstance(width, list) and len(set(width)) == 1:  # Gemma 3n: one width per layer
            width = width[0]
        if width:  # None or 0 (Granite-MoE's shared MLP): not declared
            if not _is_positive_int(width):
                raise _underivable(config, "intermediate_size", f"its `{name}` is {width!r}, not one positive int")
            return width
    names = " / ".join(f"`{name}`" for name in FIELD_NAMES["intermediate_size"])
    raise _underivable(config, "intermediate_size", f"its config declares no MLP width ({names})")


def _draft_rope_parameters(text_config) -> dict | None:
    """The policy's RoPE for the draft: its full-attention layers' where `rope_parameters` is keyed by layer type
    (the one type's where all layers share it), rotating whole heads."""
    rope_parameters = getattr(text_config, "rope_parameters", None)
    if not rope_parameters:
        return None
    keys = text_config.nested_rope_parameter_keys(rope_parameters)
    if keys:
        layer_types = set(getattr(text_config, "layer_types", None) or ())
        key = FULL_ATTENTION if FULL_ATTENTION in keys or len(layer_types) != 1 else layer_types.pop()
        if key not in keys:
            raise _underivable(
                text_config,
                "rope_parameters",
                f"they are keyed by {keys}, with no {FULL_ATTENTION!r} entry for the draft's fully attending layers",
            )
        rope_parameters = rope_parameters[key]
        if rope_parameters is None:  # the full-attention layers use no RoPE: the draft keeps its default
            return None
    rope = {name: value for name, value in rope_parameters.items() if name != "partial_rotary_factor"}
    if rope.get("rope_type") == "proportional":  # Gemma 4's partial RoPE; over whole heads it is linear scaling
        rope = {"rope_type": "linear", "rope_theta": rope["rope_theta"], "factor": rope.get("factor", 1.0)}
    return rope
