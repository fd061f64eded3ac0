"""The vllm-project/speculators checkpoint format of an EAGLE-3 draft, next to vLLM's EAGLE-3 layout (docs/design.md
section 3).

Both hold the same tensors. A speculators ``config.json`` has no top-level ``model_type`` (vLLM recognises the format
by ``speculators_config``): the draft's Llama fields sit in ``transformer_layer_config``, the EAGLE-3 fields at the
top level, and ``speculators_config`` names the proposal method and the verifier (the target). Its first decoder
layer is ``layers.0.*`` where vLLM's layout says ``midlayer.*``, and a full-vocabulary draft carries neither ``d2t``
nor ``t2d``. These functions translate between the two on plain dicts, so the config and the model can both use them.
"""

import json
from pathlib import Path

import torch
from transformers import PreTrainedConfig


__all__ = [
    "CHECKPOINT_FORMATS",
    "SPECULATORS_ARCHITECTURE",
    "SPECULATORS_KEY_MAPPING",
    "eagle3_config_from_speculators",
    "eagle3_tensor_name",
    "is_speculators_config",
    "speculators_config_from_eagle3",
    "speculators_state_dict",
]

CHECKPOINT_FORMATS = ("eagle3", "speculators")
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
# The draft's fields that the speculators format keeps at the top level (or drops), not in transformer_layer_config.
_EAGLE3_FIELDS = (
    "architectures",
    "draft_vocab_size",
    "target_hidden_size",
    "eagle_config",
    "norm_before_residual",
    "target_num_hidden_layers",
    "transformers_version",
)
# EAGLE-3 variants the speculators format describes and this package's draft does not compute.
_UNSUPPORTED_VARIANTS = ("norm_before_fc", "fc_norm", "norm_output")
_DEFAULT_NUM_TAPS, _NUM_TAPS_FIELD = 3, "num_aux_hidden_states"
_SPECULATORS_FIRST_LAYER, _EAGLE3_FIRST_LAYER = "layers.0.", "midlayer."
# transformers' `key_mapping` for loading: the draft's own layout never has a `layers.0` (its extra layers start at 1).
SPECULATORS_KEY_MAPPING = {r"^layers\.0\.": _EAGLE3_FIRST_LAYER}


def is_speculators_config(config_dict: dict) -> bool:
    return "speculators_model_type" in config_dict


def eagle3_tensor_name(name: str) -> str:
    """A checkpoint tensor's name in vLLM's EAGLE-3 layout (``layers.0.*`` -> ``midlayer.*``)."""
    if name.startswith(_SPECULATORS_FIRST_LAYER):
        return _EAGLE3_FIRST_LAYER + name.removeprefix(_SPECULATORS_FIRST_LAYER)
    return name


def speculators_state_dict(state_dict: dict[str, torch.Tensor], *, full_vocabulary: bool) -> dict[str, torch.Tensor]:
    """The draft's tensors under speculators' names; a full-vocabulary draft drops ``d2t``/``t2d`` (speculators holds
    no vocabulary maps then, and a ``t2d`` would be an unexpected tensor to its loader)."""
    renamed = {}
    for name, tensor in state_dict.items():
        if full_vocabulary and name in ("d2t", "t2d"):
            continue
        if name.startswith(_EAGLE3_FIRST_LAYER):
            name = _SPECULATORS_FIRST_LAYER + name.removeprefix(_EAGLE3_FIRST_LAYER)
        renamed[name] = tensor
    return renamed


def speculators_config_from_eagle3(
    config_dict: dict, *, verifier: str | None = None, num_speculative_tokens: int = 3
) -> dict:
    """The speculators ``config.json`` of a draft whose EAGLE-3 config is ``config_dict`` (`Eagle3DraftConfig.to_dict`).

    ``verifier``: the target's Hub id or folder (``speculators_config.verifier.name_or_path``: ``vllm serve <draft>``
    serves that target with this draft); its architectures are read from a local folder's config.json.
    ``num_speculative_tokens``: the greedy proposal's ``speculative_tokens``, the K ``vllm serve <draft>`` uses.
    """
    generic = PreTrainedConfig().to_dict()  # fields every config has; only the draft's own values are kept
    layer = {
        key: value
        for key, value in config_dict.items()
        if key not in _EAGLE3_FIELDS and key != "_name_or_path" and not (key in generic and generic[key] == value)
    }
    layer["model_type"] = "llama"  # the draft's decoder layers are Llama's (no q/k norms), whatever the target
    aux_layer_ids = (config_dict.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if aux_layer_ids is not None and len(aux_layer_ids) != _DEFAULT_NUM_TAPS:
        # vLLM 0.31's Llama EAGLE-3 model sizes `fc` from this field (or an eagle_config), never from the top-level
        # ids of a speculators config: without it, a draft of 2 or 4 taps fails to load there.
        layer[_NUM_TAPS_FIELD] = len(aux_layer_ids)
    return {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": config_dict["draft_vocab_size"],
        "target_hidden_size": config_dict["target_hidden_size"],
        # vLLM reads a missing norm_before_residual as True: always written.
        "norm_before_residual": config_dict["norm_before_residual"],
        **dict.fromkeys(_UNSUPPORTED_VARIANTS, False),
        "eagle_aux_hidden_state_layer_ids": aux_layer_ids,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": num_speculative_tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": _verifier_architectures(verifier)},
        },
        "dtype": config_dict.get("dtype"),
        "transformers_version": config_dict.get("transformers_version"),
    }


def eagle3_config_from_speculators(config_dict: dict) -> dict:
    """The `Eagle3DraftConfig` fields of a speculators ``config.json``; a ValueError for one this draft cannot compute
    (another algorithm, a Qwen3-style decoder layer, a normalisation variant)."""
    kind = config_dict.get("speculators_model_type")
    if kind != "eagle3":
        raise ValueError(
            f"This speculators checkpoint is a {kind!r} speculator; only 'eagle3' ones load as an Eagle3DraftModel."
        )
    layer = dict(config_dict.get("transformer_layer_config") or {})
    layer.pop(_NUM_TAPS_FIELD, None)  # the draft counts its taps from the ids
    if layer.get("model_type") != "llama":
        raise ValueError(
            f"This speculators EAGLE-3 checkpoint has {layer.get('model_type')!r} decoder layers "
            "(transformer_layer_config.model_type); Eagle3DraftModel computes Llama-style layers (model_type 'llama')."
        )
    variants = [name for name in _UNSUPPORTED_VARIANTS if config_dict.get(name)]
    if variants:
        raise ValueError(
            f"This speculators EAGLE-3 checkpoint sets {', '.join(variants)}, a variant Eagle3DraftModel does not "
            "compute; serve it with vLLM, or use a draft without it."
        )
    eagle_config = {"use_aux_hidden_state": True}
    if config_dict.get("eagle_aux_hidden_state_layer_ids"):
        eagle_config["eagle_aux_hidden_state_layer_ids"] = list(config_dict["eagle_aux_hidden_state_layer_ids"])
    fields = {
        **layer,
        "architectures": None,  # the draft's own default
        "draft_vocab_size": config_dict.get("draft_vocab_size"),
        "target_hidden_size": config_dict.get("target_hidden_size"),
        # speculators' own default when the field is missing (vLLM's is True; files written by speculators have it).
        "norm_before_residual": config_dict.get("norm_before_residual", False),
        "eagle_config": eagle_config,
    }
    if fields.get("dtype") is None and config_dict.get("dtype") is not None:
        fields["dtype"] = config_dict["dtype"]
    return fields


def _verifier_architectures(verifier: str | None) -> list[str]:
    """The verifier's architectures when it is a local folder (no network here); else none, which speculators
    accepts and vLLM does not read."""
    if verifier is None or not (Path(verifier) / "config.json").is_file():
        return []
    return list(json.loads((Path(verifier) / "config.json").read_text()).get("architectures") or [])
