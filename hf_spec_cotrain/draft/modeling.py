"""The EAGLE-3 draft head (docs/design.md section 3), laid out so vLLM's ``llama_eagle3`` loads it unchanged.

The draft never owns the token embedding: it reads the target's (bound with [`Eagle3DraftModel.bind_target`])
without gradient, so the policy's embedding keeps training and the checkpoint stays small. Attention is a
callable supplied by the caller, which lets the same layers run the training-time-test branch attention
(`hf_spec_cotrain.ttt`) and a KV-cached causal attention for generation (`forward`).
"""

import json
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)
from transformers.utils import CONFIG_NAME, ModelOutput, logging

from ..attention.decoding import causal_slot_mask
from ..taps import validate_aux_layer_ids
from ..validation import check_int
from .base import DraftLossOutput, DraftModel, DraftTrainingBatch, config_field
from .configuration import EAGLE3_ARCHITECTURE, Eagle3DraftConfig
from .eagle3_proposer import Eagle3Proposer
from .eagle3_ttt import Eagle3TrainingOptions, ttt_loss
from .eagle3_vllm import DraftNames
from .speculators_format import (
    CHECKPOINT_FORMATS,
    SPECULATORS_ARCHITECTURE,
    SPECULATORS_KEY_MAPPING,
    eagle3_config_from_speculators,
    eagle3_tensor_name,
    is_speculators_config,
    speculators_config_from_eagle3,
    speculators_state_dict,
)
from .target_fields import draft_layer_fields
from .vocab import select_draft_vocab


logger = logging.get_logger(__name__)

# attend(layer_index, q [B, Hq, L, D], k [B, Hkv, L, D], v [B, Hkv, L, D]) -> [B, Hq, L, D]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Eagle3DraftOutput(ModelOutput):
    """``logits`` over the draft vocabulary; ``hidden_states`` is the pre-norm output, the next step's input."""

    logits: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None
    past_key_values: Cache | None = None


class Eagle3Attention(nn.Module):
    """Llama attention projections; the attention itself is the caller's ``attend``."""

    def __init__(self, config: Eagle3DraftConfig, in_features: int):
        super().__init__()
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        bias = config.attention_bias
        self.q_proj = nn.Linear(in_features, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(in_features, self.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(in_features, self.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        batch, _, length, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim))


class Eagle3DecoderLayer(nn.Module):
    """Layer 0 (``midlayer``) reads ``[input_layernorm(embed); hidden_norm(h)]`` (2H); later layers are plain Llama."""

    def __init__(self, config: Eagle3DraftConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.is_first = layer_index == 0
        self.norm_before_residual = config.norm_before_residual
        hidden = config.hidden_size
        self.self_attn = Eagle3Attention(config, in_features=2 * hidden if self.is_first else hidden)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        if self.is_first:
            self.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        input_embeds: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attend: AttendFn,
    ) -> torch.Tensor:
        if self.is_first:
            normed = self.hidden_norm(hidden_states)
            residual = normed if self.norm_before_residual else hidden_states
            x = torch.cat([self.input_layernorm(input_embeds), normed], dim=-1)
        else:
            residual = hidden_states
            x = self.input_layernorm(hidden_states)
        q, k, v = self.self_attn.project(x, *position_embeddings)
        residual = residual + self.self_attn.output(attend(self.layer_index, q, k, v))
        return residual + self.mlp(self.post_attention_layernorm(residual))


class Eagle3DraftModel(DraftModel):
    r"""
    EAGLE-3 draft head (the ``"eagle3"`` drafter family): ``g = fc(concat(taps))``, then ``num_hidden_layers``
    decoder layers over ``(embed(token), g)``, then ``lm_head(norm(h))`` over the draft vocabulary.

    The four-call interface (`embed_input_ids`, `project_hidden_states`, `backbone`, `compute_logits`) is all
    the training-time-test loop and the generators use. Parameters are named as vLLM's ``llama_eagle3`` loader
    expects (``fc``, ``midlayer.*``, ``layers.{i}.*`` for extra layers, ``norm``, ``lm_head``, ``d2t``, ``t2d``).
    `from_pretrained` reads either layout `save_pretrained` writes, and checkpoints from EAGLE, SpecForge or
    speculators.
    """

    drafter_name = "eagle3"
    vllm_method = "eagle3"
    checkpoint_architecture = EAGLE3_ARCHITECTURE
    display_name = "EAGLE-3"
    card_template = "eagle3_draft.md"
    vllm_weight_names = DraftNames()
    config_class = Eagle3DraftConfig
    config: Eagle3DraftConfig
    supports_gradient_checkpointing = False
    _no_split_modules = ["Eagle3DecoderLayer"]
    _supports_sdpa = True

    def __init__(self, config: Eagle3DraftConfig):
        super().__init__(config)
        hidden = config.hidden_size
        self.fc = nn.Linear(config.target_hidden_size * config.num_aux_hidden_states, hidden, bias=False)
        self.midlayer = Eagle3DecoderLayer(config, 0)
        self.layers = nn.ModuleDict(
            {str(i): Eagle3DecoderLayer(config, i) for i in range(1, config.num_hidden_layers)}
        )
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self._register_vocab_maps()
        self.post_init()

    # ------------------------------------------------------------------ building and binding

    @classmethod
    def from_target(
        cls,
        target: PreTrainedModel,
        *,
        num_layers: int = 1,
        aux_layer_ids: Sequence[int] | None = None,
        draft_vocab_size: int | None = None,
        token_counts: torch.Tensor | None = None,
    ) -> "Eagle3DraftModel":
        """A fresh draft sized for ``target`` (its fields: `draft_layer_fields`), bound to its embedding; a ValueError
        for a target whose heads do not divide its width, which a Llama config refuses.

        The draft vocabulary is the ``draft_vocab_size`` most frequent ids of ``token_counts`` (ties: lower id;
        every id when ``draft_vocab_size`` is None) and ``lm_head`` starts from the target's rows at those ids.
        """
        tcfg = target.config.get_text_config()
        check_int(num_layers, "num_layers", hint=" (the draft's decoder layers)")
        aux_ids = validate_aux_layer_ids(aux_layer_ids, tcfg.num_hidden_layers)
        draft_ids = select_draft_vocab(tcfg.vocab_size, draft_vocab_size, token_counts)
        fields = draft_layer_fields(tcfg)
        if fields["hidden_size"] % fields["num_attention_heads"]:
            raise ValueError(
                f"An EAGLE-3 draft cannot copy this {tcfg.model_type!r} policy's num_attention_heads="
                f"{fields['num_attention_heads']}: its config is a LlamaConfig, which transformers (and vLLM's loader "
                f"through it) refuses unless hidden_size={fields['hidden_size']} is a multiple of the heads. Use the "
                "DFlash drafter (`drafter='dflash'`), whose Qwen3 config takes them, or build the EAGLE-3 draft's "
                "config by hand with heads that divide hidden_size and pass the draft as "
                "`SpecCoTrainer(draft_model=...)`."
            )
        config = Eagle3DraftConfig(
            **fields,
            num_hidden_layers=num_layers,
            draft_vocab_size=draft_ids.numel(),
            eagle_config={"eagle_aux_hidden_state_layer_ids": list(aux_ids), "use_aux_hidden_state": True},
            tie_word_embeddings=False,
        )
        target_head = target.get_output_embeddings().weight
        draft = cls(config).to(dtype=target_head.dtype, device=target_head.device)
        draft._set_draft_vocab(draft_ids)
        with torch.no_grad():
            draft.lm_head.weight.copy_(target_head.detach()[draft_ids.to(target_head.device)])
        return draft.bind_target(target)

    @classmethod
    def from_target_options(cls, args: Any, tokenizer: Any = None) -> dict[str, Any]:
        """The draft's depth and taps: ``draft_num_layers`` (`SpecCoTrainConfig`) or ``num_layers``
        (`DraftTrainingConfig`), and ``aux_layer_ids``."""
        return {
            "num_layers": config_field(args, "draft_num_layers", "num_layers"),
            "aux_layer_ids": args.aux_layer_ids,
        }

    @classmethod
    def shape_options(cls, config: Eagle3DraftConfig) -> dict[str, Any]:
        ids = config.aux_layer_ids
        return {
            "draft_num_layers": config.num_hidden_layers,
            "draft_vocab_size": config.draft_vocab_size,
            "aux_layer_ids": None if ids is None else list(ids),
        }

    @classmethod
    def checkpoint_architectures(cls) -> tuple[str, ...]:
        return (cls.checkpoint_architecture, SPECULATORS_ARCHITECTURE)  # and a speculators checkpoint

    @classmethod
    def _checkpoint_model_type(cls, config_dict: dict) -> str | None:
        if is_speculators_config(config_dict):  # no top-level model_type: its decoder layer's (refused unless Llama)
            return eagle3_config_from_speculators(config_dict).get("model_type")
        return super()._checkpoint_model_type(config_dict)

    @classmethod
    def _checkpoint_key_mapping(cls) -> dict[str, str]:
        return SPECULATORS_KEY_MAPPING  # a speculators checkpoint's first layer

    @classmethod
    def _checkpoint_tensor_name(cls, stored_name: str) -> str:
        return eagle3_tensor_name(stored_name)

    def save_pretrained(
        self,
        save_directory,
        *args,
        push_to_hub: bool = False,
        on_this_rank: bool = False,
        format: str = "eagle3",
        verifier: str | None = None,
        num_speculative_tokens: int = 3,
        **kwargs,
    ):
        """Write the checkpoint (safetensors) in vLLM's EAGLE-3 layout (``format="eagle3"``, ``architectures:
        ["LlamaForCausalLMEagle3"]``) or in the vllm-project/speculators format (``format="speculators"``), which vLLM
        also reads and speculators' tools use (docs/design.md section 3).

        ``verifier`` and ``num_speculative_tokens`` go into the speculators config (the target's Hub id or folder and
        the K that ``vllm serve <draft>`` then uses). ``on_this_rank``: write the weights from this process whatever
        its rank, the caller having chosen it (under pipeline parallelism the last stage, which trains the draft);
        transformers writes them from global rank 0 only.
        """
        if format not in CHECKPOINT_FORMATS:
            raise ValueError(f"`format`={format!r} is not a draft checkpoint format: use one of {CHECKPOINT_FORMATS}.")
        if push_to_hub and format != "eagle3":
            raise ValueError(
                f"`push_to_hub=True` pushes the EAGLE-3 layout: save with format={format!r} to a folder, then "
                "upload it with `hf_spec_cotrain.draft.upload.push_draft_folder`."
            )
        speculators = format == "speculators" and not push_to_hub
        if speculators:
            state_dict = kwargs.pop("state_dict", None)
            full_vocabulary = self.config.draft_vocab_size == self.config.vocab_size
            kwargs["state_dict"] = speculators_state_dict(
                self.state_dict() if state_dict is None else state_dict, full_vocabulary=full_vocabulary
            )
        result = super().save_pretrained(
            save_directory, *args, push_to_hub=push_to_hub, on_this_rank=on_this_rank, **kwargs
        )
        if speculators:
            config = speculators_config_from_eagle3(
                self.config.to_dict(), verifier=verifier, num_speculative_tokens=num_speculative_tokens
            )
            Path(save_directory, CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        return result

    def validate_target(self, target_config) -> tuple[int, ...]:
        """Raise a ValueError if the draft cannot serve a target with this config; return the tap ids."""
        tcfg = target_config.get_text_config()
        cfg = self.config
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

    def resolved_aux_layer_ids(self, num_target_layers: int) -> tuple[int, ...]:
        """The tap ids for a target of this depth (EAGLE-3's defaults when the checkpoint names none)."""
        ids = validate_aux_layer_ids(self.config.aux_layer_ids, num_target_layers)
        if len(ids) != self.config.num_aux_hidden_states:
            raise ValueError(f"`fc` takes {self.config.num_aux_hidden_states} taps, but {len(ids)} tap ids resolve.")
        return ids

    @property
    def decoder_layers(self) -> list[Eagle3DecoderLayer]:
        return [self.midlayer, *self.layers.values()]

    # ------------------------------------------------------------------ the drafter interface

    def tap_layer_ids(self, num_target_layers: int) -> tuple[int, ...]:
        return self.resolved_aux_layer_ids(num_target_layers)

    @classmethod
    def training_options(cls, args: Any | None) -> Eagle3TrainingOptions:
        """The TTT's K and step weights: ``ttt_steps`` and ``ttt_step_weight_decay`` of a `SpecCoTrainConfig`,
        ``ttt_steps`` and ``step_weight_decay`` of a `DraftTrainingConfig`."""
        if args is None:
            return Eagle3TrainingOptions()
        return Eagle3TrainingOptions(
            ttt_steps=args.ttt_steps,
            step_weight_decay=config_field(args, "ttt_step_weight_decay", "step_weight_decay"),
        )

    def training_loss(
        self,
        batch: DraftTrainingBatch,
        options: Eagle3TrainingOptions,
        *,
        cp_group: dist.ProcessGroup | None = None,
        generator: torch.Generator | None = None,
        gradient_checkpointing: bool = False,
    ) -> DraftLossOutput:
        """The K-step training-time-test loss (`ttt_loss`, docs/design.md section 4); EAGLE-3 draws nothing at
        random, so ``generator`` is unused."""
        return ttt_loss(
            self,
            aux_hidden_states=batch.aux_hidden_states,
            input_embeds=batch.input_embeds,
            teacher_logits=batch.teacher_logits,
            loss_mask=batch.loss_mask,
            attention_mask=batch.attention_mask,
            cu_seqlens=batch.cu_seqlens,
            ttt_steps=options.ttt_steps,
            step_weight_decay=options.step_weight_decay,
            cp_group=cp_group,
            gradient_checkpointing=gradient_checkpointing,
        )

    @staticmethod
    def draft_forwards(k: int) -> int:
        return k  # one chain step per proposed token

    def new_proposer(self, embed: Callable[[torch.Tensor], torch.Tensor]) -> Eagle3Proposer:
        """Chain drafting over the draft's own KV cache (`Eagle3Proposer`)."""
        return Eagle3Proposer(self, embed)

    @classmethod
    def trained_tokens_per_round(cls, args: Any) -> int:
        return args.ttt_steps

    @classmethod
    def check_tokens_per_round(cls, args: Any) -> None:
        """Proposals past the unrolled steps come from inputs the draft never saw in training: allowed, warned."""
        if args.max_draft_tokens <= args.ttt_steps:
            return
        asked = (
            f"`max_speculative_tokens`={args.max_speculative_tokens} (with `num_speculative_tokens='auto'`)"
            if args.num_speculative_tokens == "auto"
            else f"`num_speculative_tokens`={args.num_speculative_tokens}"
        )
        warnings.warn(
            f"{asked} lets the draft propose up to {args.max_draft_tokens} tokens in a row, but it is trained on "
            f"only `ttt_steps`={args.ttt_steps} unrolled steps: its proposals past step {args.ttt_steps} come "
            f"from inputs it never saw in training, and are accepted less the further they go (the logged "
            f"`spec/accepted_per_position_k` shows whether they pay). Set `ttt_steps` to at least "
            f"{args.max_draft_tokens}, or propose at most {args.ttt_steps} tokens.",
            UserWarning,
            stacklevel=4,
        )

    def loss_positions(self, options: Eagle3TrainingOptions) -> int:
        return options.ttt_steps

    @classmethod
    def describe_options(cls, options: Eagle3TrainingOptions) -> dict[str, str]:
        return {"Training-time-test steps": f"{options.ttt_steps} (step weights {options.step_weight_decay:g}^d)"}

    def vllm_bootstrap_state_dict(self) -> dict[str, torch.Tensor]:
        """The lm_head negated: vLLM shares the target's lm_head with a draft whose lm_head equals it when the engine
        starts (a full-vocabulary draft fresh from `from_target`), and the draft's own head could then never be
        synced."""
        return {**self.state_dict(), "lm_head.weight": -self.lm_head.weight.detach()}

    @classmethod
    def vllm_speculative_config(cls, model: str, num_speculative_tokens: int) -> dict[str, Any]:
        return {"method": cls.vllm_method, "model": model, "num_speculative_tokens": num_speculative_tokens}

    # ------------------------------------------------------------------ the four-call interface

    def project_hidden_states(self, aux_hidden_states: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
        """``g = fc(concat(taps))``; taps as one ``[..., n * target_hidden]`` tensor or a sequence of ``n``."""
        if not isinstance(aux_hidden_states, torch.Tensor):
            aux_hidden_states = torch.cat(list(aux_hidden_states), dim=-1)
        expected = self.fc.in_features
        if aux_hidden_states.shape[-1] != expected:
            raise ValueError(
                f"The taps have width {aux_hidden_states.shape[-1]}; this draft's `fc` takes "
                f"{self.config.num_aux_hidden_states} taps of {self.config.target_hidden_size} = {expected}."
            )
        return self.fc(aux_hidden_states.to(self.fc.weight.dtype))

    def backbone(
        self,
        input_embeds: torch.Tensor,
        hidden_states: torch.Tensor,
        position_ids: torch.Tensor,
        attend: AttendFn,
    ) -> torch.Tensor:
        """One draft step over ``[B, L]`` positions; returns the pre-norm output ``h`` (next step's input)."""
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for layer in self.decoder_layers:
            hidden_states = layer(hidden_states, input_embeds, position_embeddings, attend)
        return hidden_states

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary from the pre-norm output."""
        return self.lm_head(self.norm(hidden_states))

    # ------------------------------------------------------------------ cached forward for generation

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        aux_hidden_states: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> Eagle3DraftOutput:
        r"""
        One causal step with an optional KV cache, as vLLM runs the draft.

        Args:
            aux_hidden_states: concatenated target taps ``[B, L, n * target_hidden]`` (a first step), or
            hidden_states: the draft's own previous pre-norm output ``[B, L, hidden]`` (later steps).
            attention_mask: ``[B, past + L]``, 1 where a cache slot (or new position) holds a real token. Slot
                order is time order, so rejected speculative slots can simply be masked out.
            position_ids: ``[B, L]`` RoPE positions (default: consecutive after the cache).
        """
        if (aux_hidden_states is None) == (hidden_states is None):
            raise ValueError("Pass exactly one of `aux_hidden_states` (taps) and `hidden_states` (draft output).")
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of `input_ids` and `inputs_embeds`.")
        if hidden_states is None:
            hidden_states = self.project_hidden_states(aux_hidden_states)
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        batch, length = inputs_embeds.shape[:2]
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + length, device=inputs_embeds.device).expand(batch, -1)
        total = past + length
        if attention_mask is None:
            attention_mask = torch.ones(batch, total, dtype=torch.bool, device=inputs_embeds.device)
        elif attention_mask.shape != (batch, total):
            raise ValueError(f"`attention_mask` has shape {tuple(attention_mask.shape)}; expected ({batch}, {total}).")
        visible = causal_slot_mask(attention_mask.to(device=inputs_embeds.device, dtype=torch.bool), length)

        def attend(layer_index, q, k, v):
            if past_key_values is not None:
                k, v = past_key_values.update(k, v, layer_index)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)

        hidden_states = self.backbone(inputs_embeds, hidden_states, position_ids, attend)
        return Eagle3DraftOutput(
            logits=self.compute_logits(hidden_states), hidden_states=hidden_states, past_key_values=past_key_values
        )
