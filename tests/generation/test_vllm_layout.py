"""The checkpoint-name <-> vLLM-name mapping and the check of a weight set, without vLLM (`generation.vllm_layout`)."""

import pytest
import torch

from hf_spec_cotrain.draft.eagle3_vllm import DraftNames
from hf_spec_cotrain.generation.vllm_layout import ModelLayout, ParamShape, PolicyNames


GATE_UP = "model.layers.0.mlp.gate_up_proj.weight"


def _draft_layout(*, with_lm_head: bool = True) -> ModelLayout:
    """A one-layer EAGLE-3 draft as vLLM holds it: fused gate/up, its own lm_head unless vLLM shares the target's."""
    params = {
        "model.fc.weight": ParamShape((4, 12)),
        GATE_UP: ParamShape((12, 4), [(6, 4), (6, 4)]),
        "model.norm.weight": ParamShape((4,)),
        "draft_id_to_target_id": ParamShape((8,)),
    }
    if with_lm_head:
        params["lm_head.weight"] = ParamShape((8, 4))
    return ModelLayout(
        params=params, packed_modules={"gate_up_proj": ["gate_proj", "up_proj"]}, tie_word_embeddings=False
    )


def _draft_weights() -> dict[str, torch.Tensor]:
    return {
        "fc.weight": torch.randn(4, 12),
        "midlayer.mlp.up_proj.weight": torch.randn(6, 4),
        "midlayer.mlp.gate_proj.weight": torch.randn(6, 4),
        "norm.weight": torch.randn(4),
        "lm_head.weight": torch.randn(8, 4),
        "d2t": torch.arange(8),
        "t2d": torch.ones(16, dtype=torch.bool),
    }


def test_layout_fuses_in_vllm_order_and_names_bad_tensors():
    layout = ModelLayout(
        params={
            "model.layers.0.self_attn.qkv_proj.weight": ParamShape((8, 4), [(4, 4), (2, 4), (2, 4)]),
            "model.norm.weight": ParamShape((4,)),
            "model.embed_tokens.weight": ParamShape((10, 4)),
        },
        packed_modules={"qkv_proj": ["q_proj", "k_proj", "v_proj"]},
        tie_word_embeddings=True,
    )
    names = PolicyNames(tie_word_embeddings=True)
    q, k, v = torch.randn(4, 4), torch.randn(2, 4), torch.randn(2, 4)
    embed, norm = torch.randn(10, 4), torch.randn(4)
    weights = [
        ("model.layers.0.self_attn.v_proj.weight", v),
        ("model.layers.0.self_attn.q_proj.weight", q),
        ("model.layers.0.self_attn.k_proj.weight", k),
        ("model.norm.weight", norm),
        ("model.embed_tokens.weight", embed),
        ("lm_head.weight", embed),  # tied: vLLM has no parameter for it
    ]
    expected = layout.fuse_and_check(weights, names=names, what="policy")
    assert torch.equal(expected["model.layers.0.self_attn.qkv_proj.weight"], torch.cat([q, k, v]))
    assert expected["model.norm.weight"] is norm and len(expected) == 3

    bad = [*weights[:2], ("model.layers.0.self_attn.k_proj.weight", torch.randn(3, 4)), ("model.extra.weight", norm)]
    with pytest.raises(ValueError) as error:
        layout.fuse_and_check(bad + [bad[1]], names=names, what="policy")
    message = str(error.value)
    assert "nothing was sent to vLLM" in message
    assert "no policy parameter in vLLM for: model.extra.weight" in message
    assert "given more than once: model.layers.0.self_attn.q_proj.weight" in message
    assert "missing: model.norm.weight, model.embed_tokens.weight" in message
    assert "model.layers.0.self_attn.k_proj.weight has shape [3, 4], vLLM expects [2, 4]" in message


def test_draft_names_follow_vllm_eagle3_loader():
    names = DraftNames()
    mapping = {
        "fc.weight": "model.fc.weight",
        "midlayer.self_attn.q_proj.weight": "model.layers.0.self_attn.q_proj.weight",
        "midlayer.hidden_norm.weight": "model.layers.0.hidden_norm.weight",
        "norm.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight",
        "d2t": "draft_id_to_target_id",
    }
    for checkpoint_name, vllm_name in mapping.items():
        assert names.to_vllm(checkpoint_name) == vllm_name
        assert names.to_checkpoint(vllm_name) == checkpoint_name
    assert names.to_vllm("t2d") is None


def test_only_a_tied_policy_lm_head_is_skipped():
    assert PolicyNames(tie_word_embeddings=True).to_vllm("lm_head.weight") is None
    assert PolicyNames(tie_word_embeddings=False).to_vllm("lm_head.weight") == "lm_head.weight"
    assert PolicyNames(tie_word_embeddings=True).to_vllm("model.embed_tokens.weight") == "model.embed_tokens.weight"


def test_draft_gate_up_fuse_in_order_and_split_back_to_checkpoint_names():
    layout, weights = _draft_layout(), _draft_weights()
    expected = layout.fuse_and_check(list(weights.items()), names=DraftNames(), what="draft")
    assert set(expected) == set(layout.params)  # t2d is ignored, d2t is vLLM's draft_id_to_target_id
    gate_up = torch.cat([weights["midlayer.mlp.gate_proj.weight"], weights["midlayer.mlp.up_proj.weight"]])
    assert torch.equal(expected[GATE_UP], gate_up)
    assert expected["draft_id_to_target_id"] is weights["d2t"]
    assert layout.checkpoint_names(GATE_UP, DraftNames()) == [
        "midlayer.mlp.gate_proj.weight",
        "midlayer.mlp.up_proj.weight",
    ]
    assert layout.checkpoint_names("draft_id_to_target_id", DraftNames()) == ["d2t"]


def test_draft_lm_head_that_vllm_shares_with_the_target_is_refused_with_the_way_out():
    weights = _draft_weights()
    with pytest.raises(ValueError) as error:
        _draft_layout(with_lm_head=False).fuse_and_check(list(weights.items()), names=DraftNames(), what="draft")
    message = str(error.value)
    assert message.startswith("Cannot sync the draft weights, nothing was sent to vLLM: ")
    assert "no draft parameter in vLLM for: lm_head.weight" in message
    assert "start the engine from a draft folder whose lm_head differs" in message


def test_partial_set_keeps_only_complete_parameters_and_still_refuses_bad_tensors():
    layout, weights = _draft_layout(), _draft_weights()
    chunk = [(name, weights[name]) for name in ("fc.weight", "midlayer.mlp.up_proj.weight")]
    with pytest.raises(ValueError, match=r"missing: midlayer.mlp.gate_proj.weight, norm.weight, d2t, lm_head.weight"):
        layout.fuse_and_check(chunk, names=DraftNames(), what="draft")
    # Half of gate/up is not a parameter yet: only fc comes back.
    assert list(layout.fuse_and_check(chunk, names=DraftNames(), what="draft", complete=False)) == ["model.fc.weight"]
    for bad, problem in (
        (("midlayer.mlp.gate_proj.weight", torch.randn(5, 4)), "has shape [5, 4], vLLM expects [6, 4]"),
        (("midlayer.extra.weight", torch.randn(4)), "no draft parameter in vLLM for: midlayer.extra.weight"),
        (("fc.weight", torch.randn(4, 12)), "given more than once: fc.weight"),
    ):
        with pytest.raises(ValueError) as error:
            layout.fuse_and_check([*chunk, bad], names=DraftNames(), what="draft", complete=False)
        assert problem in str(error.value) and "missing" not in str(error.value)


def test_fused_moe_experts_map_to_vllms_routed_experts_and_back():
    names = PolicyNames(tie_word_embeddings=False)
    for checkpoint_name, vllm_name in (
        ("model.layers.3.mlp.experts.gate_up_proj", "model.layers.3.mlp.experts.routed_experts.w13_weight"),
        ("model.layers.3.mlp.experts.down_proj", "model.layers.3.mlp.experts.routed_experts.w2_weight"),
    ):
        assert names.to_vllm(checkpoint_name) == vllm_name
        assert names.to_checkpoint(vllm_name) == checkpoint_name
    # A dense MLP's names are vLLM's own.
    assert names.to_vllm("model.layers.3.mlp.down_proj.weight") == "model.layers.3.mlp.down_proj.weight"


def test_gpt_oss_names_layouts_and_the_tensors_vllms_reload_would_skip():
    names = PolicyNames(tie_word_embeddings=False, architecture="GptOssForCausalLM")
    for checkpoint_name, vllm_name in (
        ("model.embed_tokens.weight", "model.embedding.weight"),
        ("model.layers.1.self_attn.sinks", "model.layers.1.attn.sinks"),
        ("model.layers.1.self_attn.q_proj.bias", "model.layers.1.attn.q_proj.bias"),
        ("model.layers.1.mlp.router.weight", "model.layers.1.mlp.router.weight"),
        ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.routed_experts.w13_weight"),
        ("model.layers.1.mlp.experts.gate_up_proj_bias", "model.layers.1.mlp.experts.routed_experts.w13_bias"),
        ("model.layers.1.mlp.experts.down_proj_bias", "model.layers.1.mlp.experts.routed_experts.w2_bias"),
    ):
        assert names.to_vllm(checkpoint_name) == vllm_name
        assert names.to_checkpoint(vllm_name) == checkpoint_name
    gate_up, bias, sinks = torch.randn(2, 4, 6), torch.randn(2, 6), torch.randn(3)
    assert torch.equal(names.relayout("model.layers.1.mlp.experts.routed_experts.w13_weight", gate_up), gate_up.mT)
    assert names.relayout("model.layers.1.mlp.experts.routed_experts.w13_bias", bias) is bias
    # vLLM's layout of the experts, checked in the checkpoint's terms.
    layout = ModelLayout(
        params={"model.layers.1.mlp.experts.routed_experts.w13_weight": ParamShape((2, 6, 4))},
        packed_modules={},
        tie_word_embeddings=False,
        architecture="GptOssForCausalLM",
    )
    expected = layout.fuse_and_check(
        [("model.layers.1.mlp.experts.gate_up_proj", gate_up)], names=names, what="policy"
    )
    assert torch.equal(expected["model.layers.1.mlp.experts.routed_experts.w13_weight"], gate_up.mT)
    with pytest.raises(ValueError, match=r"gate_up_proj has shape \[2, 6, 4\], vLLM expects \[2, 4, 6\]"):
        layout.fuse_and_check([("model.layers.1.mlp.experts.gate_up_proj", gate_up.mT)], names=names, what="policy")

    reloaded, copied = names.for_loader(
        [
            ("model.layers.1.self_attn.sinks", sinks),
            ("model.layers.1.mlp.experts.gate_up_proj", gate_up),
            ("model.layers.1.mlp.experts.gate_up_proj_bias", bias),
            ("model.norm.weight", sinks),
        ]
    )
    assert copied == {"model.layers.1.attn.sinks": sinks}
    assert [name for name, _ in reloaded] == [
        "model.layers.1.mlp.experts.0.w13_weight",
        "model.layers.1.mlp.experts.1.w13_weight",
        "model.layers.1.mlp.experts.0.w13_bias",
        "model.layers.1.mlp.experts.1.w13_bias",
        "model.norm.weight",
    ]
    assert torch.equal(reloaded[1][1], gate_up[1]) and torch.equal(reloaded[3][1], bias[1])
    # Other families reload everything under HF's names.
    qwen3_moe = [("model.layers.1.mlp.experts.gate_up_proj", gate_up)]
    assert PolicyNames(tie_word_embeddings=False).for_loader(qwen3_moe) == (qwen3_moe, {})
