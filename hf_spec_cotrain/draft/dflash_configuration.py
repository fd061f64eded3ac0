"""Configuration of the DFlash block draft, written as vLLM's ``qwen3_dflash`` loader reads it (docs/design.md
section 3b)."""

from collections.abc import Sequence
from typing import ClassVar

from huggingface_hub.dataclasses import strict
from transformers import Qwen3Config


DFLASH_ARCHITECTURE = "DFlashDraftModel"
"""The ``architectures`` entry vLLM dispatches on (any other name gets "DFlash" prefixed and is not found)."""

DEFAULT_BLOCK_SIZE = 8
"""The anchor plus 7 mask tokens: DFlash's smallest published block, the one its loss decay of 4 was tuned for."""

FULL_ATTENTION = "full_attention"


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """DFlash's published spread of tapped target layers (z-lab/dflash ``build_target_layer_ids``): one per draft
    layer, evenly from layer 1 to layer ``L - 3`` (the middle layer for a one-layer draft), rounded; e.g. a 36-layer
    target and 5 draft layers give ``(1, 9, 17, 25, 33)``. Ids are vLLM's: the *output* of target layer ``i``."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    first, last = 1, num_target_layers - 3
    return tuple(round(first + i * (last - first) / (num_draft_layers - 1)) for i in range(num_draft_layers))


def validate_target_layer_ids(target_layer_ids: Sequence[int], num_target_layers: int) -> tuple[int, ...]:
    """The ids as a tuple; a ValueError for an empty list, a repeat, or an id the package cannot tap.

    Id ``i`` is the output of target layer ``i``, i.e. the input of layer ``i + 1`` (`TapRecorder` id ``i + 1``):
    ``i`` must lie in ``[0, L - 1)``. vLLM also accepts ``L - 1`` (the last layer's output, before the final norm),
    which no tap records.
    """
    ids = tuple(target_layer_ids)
    if not ids:
        raise ValueError(
            f"`target_layer_ids` is empty; give at least one target layer in [0, {num_target_layers - 1})."
        )
    for layer_id in ids:
        if isinstance(layer_id, bool) or not isinstance(layer_id, int) or not 0 <= layer_id < num_target_layers - 1:
            raise ValueError(
                f"Target layer id {layer_id!r} in `target_layer_ids`={list(ids)} is out of range: id i is the output "
                f"of target layer i, the input of layer i + 1, so an int in [0, {num_target_layers - 1}) for this "
                f"{num_target_layers}-layer target."
            )
    if len(set(ids)) != len(ids):
        raise ValueError(
            f"`target_layer_ids`={list(ids)} has duplicates; each target layer may appear once (a small target "
            "needs fewer draft layers or explicit ids)."
        )
    return ids


@strict
class DFlashDraftConfig(Qwen3Config):
    r"""
    A Qwen3 config plus the DFlash fields vLLM reads.

    The Qwen3 fields (``hidden_size``, heads, ``head_dim``, ``intermediate_size``, ``rms_norm_eps``,
    ``rope_parameters``, ``max_position_embeddings``) describe the draft's own layers and are copied from the target
    by [`DFlashDraftModel.from_target`]; ``num_hidden_layers`` is the draft's depth and ``vocab_size`` the *target's*
    vocabulary. Every layer is ``full_attention``, which vLLM reads as non-causal inside the block.

    Args:
        draft_vocab_size (`int`, *optional*):
            Size of the draft's output vocabulary (``<= vocab_size``); below it the checkpoint carries ``d2t`` and its
            own ``lm_head``. Defaults to ``vocab_size``.
        target_hidden_size (`int`, *optional*):
            Hidden size of the target whose hidden states feed ``fc``. Defaults to ``hidden_size``.
        target_num_hidden_layers (`int`, *optional*):
            Depth of the target the draft was built for; used to validate the target layer ids early.
        dflash_config (`dict`):
            ``{"mask_token_id": int, "target_layer_ids": [...], "block_size": int}``. ``mask_token_id`` is the token
            whose (target) embedding fills the block after its anchor; ``target_layer_ids`` the target layers whose
            outputs are concatenated into ``fc`` (vLLM's numbering: id ``i`` is the output of layer ``i``);
            ``block_size`` the trained block (the anchor and ``block_size - 1`` mask tokens), ours: vLLM ignores it
            and queries ``num_speculative_tokens + 1`` positions.
    """

    # No usable default: a DFlash draft needs its mask token and target layers (a saved config writes every field).
    has_no_defaults_at_init: ClassVar[bool] = True

    draft_vocab_size: int | None = None
    target_hidden_size: int | None = None
    target_num_hidden_layers: int | None = None
    dflash_config: dict | None = None

    def __post_init__(self, **kwargs):
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.vocab_size
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.architectures is None:
            self.architectures = [DFLASH_ARCHITECTURE]
        dflash_config = dict(self.dflash_config or {})
        dflash_config.setdefault("block_size", DEFAULT_BLOCK_SIZE)
        self.dflash_config = dflash_config
        if self.layer_types is not None and any(kind != FULL_ATTENTION for kind in self.layer_types):
            raise ValueError(
                f"`layer_types`={self.layer_types} is not allowed: a DFlash draft's layers are all {FULL_ATTENTION!r} "
                "(vLLM's V1 runner serves no sliding or causal DFlash layers)."
            )
        self.use_sliding_window = False
        super().__post_init__(**kwargs)
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"`draft_vocab_size`={self.draft_vocab_size} is not allowed: it must be in [1, vocab_size="
                f"{self.vocab_size}]."
            )
        mask_token_id = dflash_config.get("mask_token_id")
        if (
            isinstance(mask_token_id, bool)
            or not isinstance(mask_token_id, int)
            or not 0 <= mask_token_id < self.vocab_size
        ):
            raise ValueError(
                f"`dflash_config.mask_token_id`={mask_token_id!r} is not allowed: it must be a token id in [0, "
                f"vocab_size={self.vocab_size}) whose embedding fills the block (see `choose_mask_token_id`)."
            )
        block_size = dflash_config["block_size"]
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
            raise ValueError(
                f"`dflash_config.block_size`={block_size!r} is not allowed: a block is the anchor and at least one mask "
                "token, an int >= 2."
            )
        ids = dflash_config.get("target_layer_ids")
        if ids is None:
            raise ValueError("`dflash_config.target_layer_ids` is missing: name the target layers `fc` reads.")
        if self.target_num_hidden_layers is not None:
            validate_target_layer_ids(ids, self.target_num_hidden_layers)

    @property
    def mask_token_id(self) -> int:
        return self.dflash_config["mask_token_id"]

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return tuple(self.dflash_config["target_layer_ids"])

    @property
    def block_size(self) -> int:
        return self.dflash_config["block_size"]


def choose_mask_token_id(tokenizer, vocab_size: int) -> int:
    """The token whose embedding fills a DFlash block: the tokenizer's mask token, else the first embedding row no
    token uses (the target's vocabulary is often padded past the tokenizer's); a ValueError when there is neither."""
    mask_token_id = getattr(tokenizer, "mask_token_id", None)
    if mask_token_id is not None and 0 <= mask_token_id < vocab_size:
        return mask_token_id
    if vocab_size > len(tokenizer):
        return len(tokenizer)
    raise ValueError(
        f"The tokenizer has no mask token and its {len(tokenizer)} tokens fill the target's vocabulary of {vocab_size}: "
        "pass `mask_token_id` explicitly (`dflash_mask_token_id` of the trainer's and `train-draft`'s configs): a token "
        "the completions rarely hold, whose embedding the draft learns to read as a blank."
    )
