"""The DFlash block draft (docs/design.md section 3b), laid out so vLLM's ``qwen3_dflash`` loads it unchanged.

One forward drafts a whole block: the target's hidden states of the verified positions, concatenated from a few
layers, become ``ctx = hidden_norm(fc(taps))``; every draft layer turns ``ctx`` into context keys and values
(``k_norm(k_proj(ctx))`` with RoPE at the context positions, ``v_proj(ctx)``; no input norm). The block is the
last verified token (the anchor, at position ``a``) followed by ``mask_token_id`` tokens at ``a + 1, ...``, embedded
with the target's embedding, through Qwen3 layers whose queries see the context before ``a`` and the whole block
(no causal mask); then ``norm`` and the lm_head. Block position ``i >= 1`` predicts the token at ``a + i``.

The draft owns no embedding; with the full vocabulary it owns no lm_head either (it reads the target's, as vLLM
shares it when the checkpoint has none). With a reduced vocabulary vLLM's shared head would have the wrong rows, so
such a draft keeps its own ``lm_head`` (the target's rows at the draft ids to start with) and saves it with ``d2t``.
"""

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from ..attention import anchor_query_positions, block_draft_attention
from ..attention.masks import positions_in_document
from ..validation import check_int
from .base import DraftLossOutput, DraftModel, DraftTrainingBatch, config_field
from .dflash_configuration import (
    DEFAULT_BLOCK_SIZE,
    DFLASH_ARCHITECTURE,
    FULL_ATTENTION,
    DFlashDraftConfig,
    choose_mask_token_id,
    default_target_layer_ids,
    validate_target_layer_ids,
)
from .dflash_objective import DFlashTrainingOptions, dflash_loss
from .dflash_proposer import DFlashProposer
from .dflash_vllm import DFlashNames
from .target_fields import draft_layer_fields
from .vocab import select_draft_vocab


# attend(layer_index, q [B, Hq, T, D], k [B, Hkv, T, D], v [B, Hkv, T, D]) -> [B, Hq, T, D]: the block's own
# projections in, the attention over context and block out (the caller holds the context keys).
BlockAttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x [B, H, T, D]`` with ``cos, sin [B, T, D]`` (transformers' rotate-half layout, vLLM's neox)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class DFlashAttention(nn.Module):
    """Qwen3 attention projections with per-head q/k norms; the attention itself is the caller's."""

    def __init__(self, config: DFlashDraftConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _heads(self, projection: nn.Linear, x: torch.Tensor, num_heads: int) -> torch.Tensor:
        return projection(x).unflatten(-1, (num_heads, self.head_dim)).transpose(1, 2)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``k_norm(k_proj(x))`` with RoPE and ``v_proj(x)``, ``[B, Hkv, T, D]`` each: the block's keys from its
        normed input, the context's from ``ctx`` itself."""
        k = rotate(self.k_norm(self._heads(self.k_proj, x, self.num_key_value_heads)), cos, sin)
        # Under autocast the norm's float32 weight lifts k (and q) to float32 while v leaves its projection in the
        # autocast dtype: one dtype for the attention.
        return k, self._heads(self.v_proj, x, self.num_key_value_heads).to(k.dtype)

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rotate(self.q_norm(self._heads(self.q_proj, x, self.num_heads)), cos, sin)

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        return self.o_proj(attn.transpose(1, 2).flatten(2))


class DFlashDecoderLayer(nn.Module):
    """A Qwen3 decoder layer over the block's tokens; its attention also reads the context (``attend``)."""

    def __init__(self, config: DFlashDraftConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.self_attn = DFlashAttention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attend: BlockAttendFn,
    ) -> torch.Tensor:
        x = self.input_layernorm(hidden_states)
        q = self.self_attn.queries(x, *position_embeddings)
        k, v = self.self_attn.keys_values(x, *position_embeddings)
        hidden_states = hidden_states + self.self_attn.output(attend(self.layer_index, q, k, v))
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class DFlashDraftModel(DraftModel):
    r"""
    DFlash block draft: ``ctx = hidden_norm(fc(concat(taps)))`` as every layer's context keys and values, a block of
    ``[anchor, mask, ..., mask]`` through ``num_hidden_layers`` Qwen3 layers, then ``lm_head(norm(h))``.

    Parameters are named as vLLM's ``qwen3_dflash`` loader reads them, without a ``model.`` prefix (``fc``,
    ``hidden_norm``, ``layers.{i}.*``, ``norm``; ``lm_head`` and ``d2t`` with a reduced vocabulary only).
    """

    config_class = DFlashDraftConfig
    config: DFlashDraftConfig
    drafter_name = "dflash"
    vllm_method = "dflash"
    checkpoint_architecture = DFLASH_ARCHITECTURE
    card_template = "dflash_draft.md"
    display_name = "DFlash"
    vllm_weight_names = DFlashNames()
    supports_gradient_checkpointing = False
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: DFlashDraftConfig):
        super().__init__(config)
        hidden = config.hidden_size
        self.fc = nn.Linear(config.target_hidden_size * len(config.target_layer_ids), hidden, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False) if self.has_own_lm_head else None
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self._register_vocab_maps(with_t2d=False)
        self.__dict__["_target_head"] = None  # the target's output embedding, a reference: never saved or trained
        self.post_init()

    @property
    def has_own_lm_head(self) -> bool:
        """Only a reduced vocabulary needs a head of its own: vLLM shares the target's when the checkpoint has none,
        and the target's rows are what a full-vocabulary draft starts from anyway."""
        return self.config.draft_vocab_size < self.config.vocab_size

    # ------------------------------------------------------------------ building and binding

    @classmethod
    def from_target(
        cls,
        target: PreTrainedModel,
        *,
        mask_token_id: int | None = None,
        tokenizer: Any = None,
        num_layers: int = 1,
        target_layer_ids: Sequence[int] | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        draft_vocab_size: int | None = None,
        token_counts: torch.Tensor | None = None,
    ) -> "DFlashDraftModel":
        """A fresh draft sized for ``target``, bound to its embedding (and its lm_head with the full vocabulary).

        ``target_layer_ids`` (vLLM's numbering: the output of target layer ``i``) default to DFlash's published spread
        (`default_target_layer_ids`: one per draft layer from layer 1 to ``L - 3``). ``mask_token_id``: the token
        whose embedding fills the block; unset, `choose_mask_token_id` picks one from ``tokenizer``. The draft vocabulary is
        the ``draft_vocab_size`` most frequent ids of ``token_counts`` (every id when None); a reduced one gets its
        own ``lm_head``, the target's rows at those ids.
        """
        tcfg = target.config.get_text_config()
        if mask_token_id is None:
            if tokenizer is None:
                raise ValueError(
                    "Pass `mask_token_id`, or the `tokenizer` to choose it from (`choose_mask_token_id`)."
                )
            mask_token_id = choose_mask_token_id(tokenizer, tcfg.vocab_size)
        check_int(num_layers, "num_layers", hint=" (the draft's decoder layers)")
        check_int(block_size, "block_size", minimum=2, hint=" (the anchor and at least one mask token)")
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(tcfg.num_hidden_layers, num_layers)
        target_layer_ids = validate_target_layer_ids(target_layer_ids, tcfg.num_hidden_layers)
        draft_ids = select_draft_vocab(tcfg.vocab_size, draft_vocab_size, token_counts)
        config = DFlashDraftConfig(
            **draft_layer_fields(tcfg),
            num_hidden_layers=num_layers,
            layer_types=[FULL_ATTENTION] * num_layers,
            draft_vocab_size=draft_ids.numel(),
            dflash_config={
                "mask_token_id": mask_token_id,
                "target_layer_ids": list(target_layer_ids),
                "block_size": block_size,
            },
            tie_word_embeddings=False,
        )
        target_head = target.get_output_embeddings().weight
        draft = cls(config).to(dtype=target_head.dtype, device=target_head.device)
        draft._set_draft_vocab(draft_ids)
        if draft.lm_head is not None:
            with torch.no_grad():
                draft.lm_head.weight.copy_(target_head.detach()[draft_ids.to(target_head.device)])
        return draft.bind_target(target)

    @classmethod
    def from_target_options(cls, args: Any, tokenizer: Any = None) -> dict[str, Any]:
        """The draft's depth (``draft_num_layers`` of a `SpecCoTrainConfig`, ``num_layers`` of a
        `DraftTrainingConfig`), ``dflash_target_layer_ids``, ``dflash_block_size`` and ``dflash_mask_token_id``
        (unset: `choose_mask_token_id` on ``tokenizer``, at `from_target`, which knows the target's vocabulary)."""
        mask_token_id = getattr(args, "dflash_mask_token_id", None)
        if mask_token_id is None and tokenizer is None:
            raise ValueError(
                "A DFlash draft needs `dflash_mask_token_id`, the token whose embedding fills its blocks: set it, e.g. "
                "to `hf_spec_cotrain.draft.choose_mask_token_id(tokenizer, vocab_size)` (the tokenizer's mask token, "
                "else an embedding row no token uses), or pass the tokenizer."
            )
        options = {} if mask_token_id is not None else {"tokenizer": tokenizer}
        return {
            **options,
            "mask_token_id": mask_token_id,
            "num_layers": config_field(args, "draft_num_layers", "num_layers"),
            "target_layer_ids": getattr(args, "dflash_target_layer_ids", None),
            "block_size": getattr(args, "dflash_block_size", DEFAULT_BLOCK_SIZE),
        }

    @classmethod
    def shape_options(cls, config: DFlashDraftConfig) -> dict[str, Any]:
        return {
            "draft_num_layers": config.num_hidden_layers,
            "draft_vocab_size": config.draft_vocab_size,
            "dflash_target_layer_ids": list(config.target_layer_ids),
            "dflash_block_size": config.block_size,
            "dflash_mask_token_id": config.mask_token_id,
        }

    def bind_target(self, target: PreTrainedModel) -> "DFlashDraftModel":
        """Check that this draft fits ``target``; read token embeddings (and, without a head of its own, the lm_head)
        from it from now on."""
        super().bind_target(target)
        self.__dict__["_target_head"] = None if self.has_own_lm_head else target.get_output_embeddings()
        return self

    def validate_target(self, target_config) -> tuple[int, ...]:
        """Raise a ValueError if the draft cannot serve a target with this config; return the tap ids."""
        tcfg = target_config.get_text_config()
        cfg = self.config
        # The target's embedding feeds the block and its lm_head reads the draft's output: both widths must match.
        checks = [
            ("target_hidden_size", cfg.target_hidden_size, "hidden_size", tcfg.hidden_size),
            ("hidden_size", cfg.hidden_size, "hidden_size", tcfg.hidden_size),
            ("vocab_size", cfg.vocab_size, "vocab_size", tcfg.vocab_size),
        ]
        for draft_field, draft_value, target_field, target_value in checks:
            if draft_value != target_value:
                raise ValueError(
                    f"This draft does not fit the target: draft {draft_field}={draft_value} but the target's "
                    f"{target_field}={target_value}; they must be equal."
                )
        try:
            return self.tap_layer_ids(tcfg.num_hidden_layers)
        except ValueError as err:
            raise ValueError(f"This draft does not fit the target: {err}") from None

    @classmethod
    def trained_tokens_per_round(cls, args: Any) -> int:
        return getattr(args, "dflash_block_size", DEFAULT_BLOCK_SIZE) - 1

    @classmethod
    def check_tokens_per_round(cls, args: Any) -> None:
        """A block drafts its mask positions only: more tokens than ``block_size - 1`` cannot be proposed."""
        limit = cls.trained_tokens_per_round(args)
        if args.max_draft_tokens > limit:
            raise ValueError(cls.tokens_per_round_error(args.max_draft_tokens, limit + 1))

    def max_tokens_per_round(self) -> int:
        return self.config.block_size - 1

    @staticmethod
    def draft_forwards(k: int) -> int:
        return min(k, 1)  # the whole block in one forward

    def loss_positions(self, options: DFlashTrainingOptions) -> int:
        return self.config.block_size - 1

    @staticmethod
    def tokens_per_round_error(asked: int, block_size: int) -> str:
        return (
            f"A DFlash draft with blocks of {block_size} proposes at most {block_size - 1} tokens per round, but up to "
            f"{asked} were asked (`num_speculative_tokens`, or `max_speculative_tokens` under 'auto'): ask for at "
            f"most {block_size - 1}, or use a draft with `dflash_block_size` >= {asked + 1}."
        )

    def embedded_token_ids(self) -> tuple[int, ...]:
        """The mask token, whose embedding fills every block after its anchor (the anchors' own come with the taps)."""
        return (self.config.mask_token_id,)

    def tap_layer_ids(self, num_target_layers: int) -> tuple[int, ...]:
        """vLLM's id ``i`` (the output of target layer ``i``) is the input of layer ``i + 1``: tap id ``i + 1``."""
        return tuple(i + 1 for i in validate_target_layer_ids(self.config.target_layer_ids, num_target_layers))

    # ------------------------------------------------------------------ the forward pieces

    @property
    def output_weight(self) -> torch.Tensor:
        """The lm_head weight the draft reads: its own, or the bound target's (detached, gathered if sharded)."""
        if self.lm_head is not None:
            return self.lm_head.weight
        if self._target_head is None:
            raise RuntimeError(
                "This full-vocabulary draft reads the target's lm_head and is not bound to a target: call "
                "`draft.bind_target(target)` (or pass `target=` to `from_pretrained`)."
            )
        weight = self._target_head.weight
        if hasattr(weight, "full_tensor"):
            weight = weight.full_tensor()
        return weight.detach().to(self.fc.weight.dtype)

    def context_states(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """``hidden_norm(fc(taps))`` from the tapped hidden states ``[..., n * target_hidden]``."""
        expected = self.fc.in_features
        if aux_hidden_states.shape[-1] != expected:
            raise ValueError(
                f"The taps have width {aux_hidden_states.shape[-1]}; this draft's `fc` takes "
                f"{len(self.config.target_layer_ids)} taps of {self.config.target_hidden_size} = {expected}."
            )
        return self.hidden_norm(self.fc(aux_hidden_states.to(self.fc.weight.dtype)))

    def context_keys_values(
        self, context: torch.Tensor, position_ids: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's context keys and values ``[B, Hkv, L, D]`` from ``context_states`` ``[B, L, H]`` at RoPE
        positions ``position_ids`` ``[B, L]``."""
        cos, sin = self.rotary_emb(context, position_ids)
        return [layer.self_attn.keys_values(context, cos, sin) for layer in self.layers]

    def block_embeddings(self, anchor_embeds: torch.Tensor, block_size: int) -> torch.Tensor:
        """``[..., block_size, H]``: each anchor's embedding ``[..., H]`` followed by ``block_size - 1`` copies of the
        mask token's embedding."""
        mask = self.embed_input_ids(torch.tensor([self.config.mask_token_id], device=anchor_embeds.device))[0]
        masks = mask.to(anchor_embeds.dtype).expand(*anchor_embeds.shape[:-1], block_size - 1, mask.shape[-1])
        return torch.cat([anchor_embeds.unsqueeze(-2), masks], dim=-2)

    def backbone(self, block_embeds: torch.Tensor, position_ids: torch.Tensor, attend: BlockAttendFn) -> torch.Tensor:
        """The layers over the block tokens ``[B, T, H]`` at ``position_ids`` ``[B, T]``; returns the pre-norm output."""
        position_embeddings = self.rotary_emb(block_embeds, position_ids)
        hidden_states = block_embeds.to(self.fc.weight.dtype)
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings, attend)
        return hidden_states

    def compute_logits(self, hidden_states: torch.Tensor, output_weight: torch.Tensor | None = None) -> torch.Tensor:
        """Logits over the draft vocabulary from the pre-norm output; ``output_weight``: `output_weight` read once by
        a caller that computes logits many times (gathering an FSDP2-sharded head is a collective)."""
        return F.linear(self.norm(hidden_states), self.output_weight if output_weight is None else output_weight)

    def block_logits(
        self,
        aux_hidden_states: torch.Tensor,
        anchor_embeds: torch.Tensor,
        anchors: torch.Tensor,
        *,
        anchor_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        block_size: int | None = None,
        cp_group: dist.ProcessGroup | None = None,
    ) -> torch.Tensor:
        """The pre-norm block outputs ``[B, N, S, H]`` of N anchors per row over whole sequences, in one forward.

        ``aux_hidden_states`` ``[B, L, n * target_hidden]`` are the taps of every position; ``anchors`` ``[B, N]``
        the anchor positions (`block_draft_attention`: context before each one, in its document); ``anchor_embeds``
        ``[B, N, H]`` the anchors' token embeddings; ``position_ids`` ``[B, L]`` the RoPE positions (default: the
        offset in the document); a block sits at its anchor's position onwards. Under context parallelism
        (``cp_group``) the taps and positions are this rank's zigzag shard and the anchors those whose ``anchor - 1``
        it holds (`block_draft_attention`).
        """
        block_size = self.config.block_size if block_size is None else block_size
        batch, length = aux_hidden_states.shape[:2]
        num_anchors = anchors.shape[1]
        if position_ids is None:
            position_ids = _positions_in_documents(cu_seqlens, length, aux_hidden_states.device).expand(batch, length)
        context = self.context_states(aux_hidden_states)
        context_kv = self.context_keys_values(context, position_ids)
        offsets = torch.arange(block_size, device=anchors.device)
        query, _ = anchor_query_positions(anchors, local_length=length, cu_seqlens=cu_seqlens, cp_group=cp_group)
        anchor_positions = position_ids.gather(1, query.clamp(0, length - 1)) + 1
        block_positions = (anchor_positions[..., None] + offsets).flatten(1)  # [B, N * S]

        def attend(layer_index, q, k, v):
            blocks = [x.unflatten(2, (num_anchors, block_size)) for x in (q, k, v)]
            out = block_draft_attention(
                blocks[0],
                *context_kv[layer_index],
                *blocks[1:],
                anchors,
                anchor_mask,
                cu_seqlens=cu_seqlens,
                cp_group=cp_group,
                cp_mode="gather_queries",  # a few blocks against a long context: the queries travel, not the K/V
            )
            return out.flatten(2, 3)

        embeds = self.block_embeddings(anchor_embeds, block_size).flatten(1, 2)
        return self.backbone(embeds, block_positions, attend).unflatten(1, (num_anchors, block_size))

    # ------------------------------------------------------------------ training

    @classmethod
    def training_options(cls, args: Any) -> DFlashTrainingOptions:
        """Anchors per row and the loss decay: ``dflash_anchors_per_row``, ``dflash_loss_decay_gamma`` of a
        `SpecCoTrainConfig` or `DraftTrainingConfig` (DFlash's defaults where the config has no such field)."""
        return DFlashTrainingOptions.from_args(args)

    def training_loss(
        self,
        batch: DraftTrainingBatch,
        options: DFlashTrainingOptions,
        *,
        cp_group: dist.ProcessGroup | None = None,
        generator: torch.Generator | None = None,
        gradient_checkpointing: bool = False,
    ) -> DraftLossOutput:
        """Blocks at anchors sampled with ``generator`` inside the counted tokens, all rows in one forward, soft
        cross-entropy to the policy at every block position (`dflash_loss`, docs/design.md section 4b)."""
        return dflash_loss(
            self, batch, options, cp_group=cp_group, generator=generator, gradient_checkpointing=gradient_checkpointing
        )

    # ------------------------------------------------------------------ generation and serving

    def new_proposer(self, embed: Callable[[torch.Tensor], torch.Tensor]) -> DFlashProposer:
        """One generate call's drafting state: cached context keys and values, one block forward per round."""
        return DFlashProposer(self, embed)

    @classmethod
    def vllm_speculative_config(cls, model: str, num_speculative_tokens: int) -> dict[str, Any]:
        """vLLM queries the anchor and ``num_speculative_tokens`` mask tokens per step (a block of K + 1)."""
        check_int(num_speculative_tokens, "num_speculative_tokens")
        return {"method": cls.vllm_method, "model": str(model), "num_speculative_tokens": num_speculative_tokens}


def _positions_in_documents(cu_seqlens: torch.Tensor | None, length: int, device) -> torch.Tensor:
    """``[1, L]`` RoPE positions: offsets from each packed document's start (from 0 without ``cu_seqlens``)."""
    if cu_seqlens is None:
        return torch.arange(length, device=device)[None]
    return positions_in_document(cu_seqlens.to(device))[None]
