"""The fields a draft family copies from its target's text config, written once for every family."""

from typing import Any


def draft_layer_fields(text_config) -> dict[str, Any]:
    """The target's layer shapes, norms, RoPE and vocabulary, as a draft config takes them: the draft's own layers
    match the target's width (it reads the target's embeddings and, for some families, its lm_head), ``vocab_size``
    is the target's and ``target_*`` record what the taps come from."""
    return {
        "hidden_size": text_config.hidden_size,
        "intermediate_size": text_config.intermediate_size,
        "num_attention_heads": text_config.num_attention_heads,
        "num_key_value_heads": getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads,
        "head_dim": getattr(text_config, "head_dim", None)
        or text_config.hidden_size // text_config.num_attention_heads,
        "hidden_act": text_config.hidden_act,
        "rms_norm_eps": text_config.rms_norm_eps,
        "rope_parameters": dict(text_config.rope_parameters)
        if getattr(text_config, "rope_parameters", None)
        else None,
        "max_position_embeddings": text_config.max_position_embeddings,
        "vocab_size": text_config.vocab_size,
        "target_hidden_size": text_config.hidden_size,
        "target_num_hidden_layers": text_config.num_hidden_layers,
        "bos_token_id": text_config.bos_token_id,
        "eos_token_id": text_config.eos_token_id,
        "pad_token_id": text_config.pad_token_id,
    }
