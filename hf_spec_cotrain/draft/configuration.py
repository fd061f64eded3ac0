"""Configuration of the EAGLE-3 draft head, written so vLLM's ``llama_eagle3`` loader reads it unchanged."""

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig

from ..taps import validate_aux_layer_ids
from .speculators_format import eagle3_config_from_speculators, is_speculators_config


EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"


@strict
class Eagle3DraftConfig(LlamaConfig):
    r"""
    A Llama config plus the EAGLE-3 fields vLLM and SGLang read (docs/design.md section 3).

    The Llama fields (``hidden_size``, heads, ``head_dim``, ``intermediate_size``, ``rms_norm_eps``,
    ``rope_parameters``, ``max_position_embeddings``) describe the draft's own decoder layers and are copied
    from the target by [`Eagle3DraftModel.from_target`]; ``num_hidden_layers`` is the draft's depth and
    ``vocab_size`` the *target's* vocabulary.

    Args:
        draft_vocab_size (`int`, *optional*):
            Size of the draft's output vocabulary (``<= vocab_size``). Defaults to ``vocab_size``.
        target_hidden_size (`int`, *optional*):
            Hidden size of the target whose taps feed ``fc``. Defaults to ``hidden_size``.
        eagle_config (`dict`, *optional*):
            ``{"eagle_aux_hidden_state_layer_ids": [...], "use_aux_hidden_state": True}``. Without ids the
            draft uses EAGLE-3's defaults for the target it is bound to.
        norm_before_residual (`bool`, defaults to `False`):
            Some checkpoints (speculators) normalise ``g`` before it enters the residual stream.
        target_num_hidden_layers (`int`, *optional*):
            Depth of the target the draft was built for; used to validate tap ids early.
    """

    draft_vocab_size: int | None = None
    target_hidden_size: int | None = None
    eagle_config: dict | None = None
    norm_before_residual: bool = False
    target_num_hidden_layers: int | None = None

    def __post_init__(self, **kwargs):
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.vocab_size
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.architectures is None:
            self.architectures = [EAGLE3_ARCHITECTURE]
        eagle_config = dict(self.eagle_config or {})
        eagle_config.setdefault("use_aux_hidden_state", True)
        self.eagle_config = eagle_config
        super().__post_init__(**kwargs)
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"`draft_vocab_size`={self.draft_vocab_size} is not allowed: it must be in [1, vocab_size="
                f"{self.vocab_size}]."
            )
        if self.aux_layer_ids is not None and self.target_num_hidden_layers is not None:
            validate_aux_layer_ids(self.aux_layer_ids, self.target_num_hidden_layers)

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """Also reads a speculators ``config.json`` (`speculators_format`): the same draft in another layout."""
        if is_speculators_config(config_dict):
            config_dict = eagle3_config_from_speculators(config_dict)
        return super().from_dict(config_dict, **kwargs)

    @property
    def aux_layer_ids(self) -> tuple[int, ...] | None:
        """Tap ids of the target (vLLM's ``eagle_aux_hidden_state_layer_ids``), or None for the defaults."""
        ids = self.eagle_config.get("eagle_aux_hidden_state_layer_ids")
        return None if ids is None else tuple(ids)

    @property
    def num_aux_hidden_states(self) -> int:
        ids = self.aux_layer_ids
        return 3 if ids is None else len(ids)
