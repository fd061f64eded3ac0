"""Tiny targets with the attention variants the generator's grouped kernel runs beyond the `hf_spec_cotrain.testing`
families: Gemma2 (attention logit soft-cap, alternating sliding-window layers, final logit soft-cap) and DeepSeek-V3
(multi-head latent attention, whose value heads are narrower than its query/key heads; routed experts)."""

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Gemma2Config, Gemma2ForCausalLM, GenerationConfig

from hf_spec_cotrain import Eagle3DraftConfig, Eagle3DraftModel
from hf_spec_cotrain.testing import build_char_tokenizer


ATTENTION_VARIANT_FAMILIES = ("gemma2", "deepseek_v3")
GEMMA2_SLIDING_WINDOW = 8
# An attention soft-cap small enough for these weights that ignoring it changes Gemma2's greedy continuations
# (tests/generation/test_speculative.py checks); the final one bends the largest logits.
ATTENTION_SOFTCAP, FINAL_SOFTCAP = 2.0, 10.0
QK_NOPE_HEAD_DIM, QK_ROPE_HEAD_DIM, V_HEAD_DIM = 32, 16, 24  # queries and keys 48 wide, values 24


def build_attention_variant_target(family: str, *, num_layers: int = 2, seed: int = 0) -> torch.nn.Module:
    """A seeded tiny ``family`` target (one of `ATTENTION_VARIANT_FAMILIES`, hidden size 64, the character
    tokenizer's vocabulary), in eval mode. Gemma2 runs eager attention: transformers' SDPA path drops its soft-cap."""
    tokenizer = build_char_tokenizer()
    special_ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    sizes = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=num_layers)
    if family == "gemma2":
        config = Gemma2Config(
            **sizes,
            **special_ids,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            query_pre_attn_scalar=32,
            attn_logit_softcapping=ATTENTION_SOFTCAP,
            final_logit_softcapping=FINAL_SOFTCAP,
            sliding_window=GEMMA2_SLIDING_WINDOW,
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)],
            attn_implementation="eager",
        )
        model = Gemma2ForCausalLM(config)
    elif family == "deepseek_v3":
        config = DeepseekV3Config(
            **sizes,
            **special_ids,
            num_attention_heads=2,
            num_key_value_heads=2,
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_nope_head_dim=QK_NOPE_HEAD_DIM,
            qk_rope_head_dim=QK_ROPE_HEAD_DIM,
            v_head_dim=V_HEAD_DIM,
            moe_intermediate_size=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
        )
        model = DeepseekV3ForCausalLM(config)
    else:
        raise ValueError(
            f"family={family!r} is not an attention variant here; use one of {ATTENTION_VARIANT_FAMILIES}."
        )
    _fill_seeded(model, seed)
    model.generation_config = GenerationConfig(**special_ids)
    return model.eval()


def build_eagle3_draft(target: torch.nn.Module, *, aux_layer_ids: tuple[int, ...], seed: int = 0) -> Eagle3DraftModel:
    """A fresh one-layer EAGLE-3 draft for ``target``, bound to it, its config written here rather than by
    `Eagle3DraftModel.from_target`, whose copy of the target's fields does not know Gemma2's ``hidden_activation``
    (nor MLA's head sizes): these tests check the generator, not that copy."""
    text_config = target.config.get_text_config()
    config = Eagle3DraftConfig(
        hidden_size=text_config.hidden_size,
        intermediate_size=text_config.intermediate_size,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=text_config.vocab_size,
        max_position_embeddings=text_config.max_position_embeddings,
        target_hidden_size=text_config.hidden_size,
        target_num_hidden_layers=text_config.num_hidden_layers,
        num_hidden_layers=1,
        eagle_config={"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids), "use_aux_hidden_state": True},
        tie_word_embeddings=False,
        bos_token_id=text_config.bos_token_id,
        eos_token_id=text_config.eos_token_id,
        pad_token_id=text_config.pad_token_id,
    )
    torch.manual_seed(seed)
    return Eagle3DraftModel(config).bind_target(target).eval()


@torch.no_grad()
def _fill_seeded(model: torch.nn.Module, seed: int) -> None:
    """Weights of ``1/sqrt(fan_in)`` (the lm_head 3 times that, for peaked logits: a stable greedy argmax), norms
    around 1, biases around 0: every score far from transformers' near-zero initialisation."""
    generator = torch.Generator().manual_seed(seed)
    for name, parameter in model.named_parameters():
        noise = torch.randn(parameter.shape, generator=generator)
        if "norm" in name:
            parameter.copy_(1.0 + 0.1 * noise)
        elif parameter.dim() == 1:
            parameter.copy_(0.1 * noise)
        else:
            gain = 3.0 if name == "lm_head.weight" else 1.0
            parameter.copy_(gain * noise / parameter.shape[-1] ** 0.5)
