"""The EAGLE-3 draft: construction from a target, vocabulary maps, checkpoint files, loading, validation."""

import json
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import DynamicCache, PreTrainedModel

from hf_spec_cotrain import Eagle3DraftConfig, Eagle3DraftModel, default_aux_layer_ids
from hf_spec_cotrain.draft import (
    DRAFTER_FAMILIES,
    DFlashDraftModel,
    count_tokens,
    load_draft,
    select_draft_vocab,
    vocab_maps,
)
from hf_spec_cotrain.testing import SUPPORTED_FAMILIES, build_tiny_target


def _target(family="llama", num_layers=8, **kwargs):
    return build_tiny_target(family, num_layers=num_layers, **kwargs)


def _counts(vocab_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    return count_tokens([torch.randint(0, vocab_size, (3000,), generator=g)], vocab_size)


@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_from_target_copies_sizes_and_lm_head_rows(family):
    target = _target(family)
    tcfg = target.config
    counts = _counts(tcfg.vocab_size)
    draft = Eagle3DraftModel.from_target(target, draft_vocab_size=40, token_counts=counts)
    cfg = draft.config
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        tcfg.hidden_size,
        tcfg.num_attention_heads,
        tcfg.num_key_value_heads,
        tcfg.head_dim,
    )
    # The draft rotates whole heads: a partial rotation (Qwen3.5's, Qwen3-Next's) is the policy's alone.
    assert cfg.rope_parameters == {k: v for k, v in tcfg.rope_parameters.items() if k != "partial_rotary_factor"}
    assert cfg.rms_norm_eps == tcfg.rms_norm_eps
    assert cfg.max_position_embeddings == tcfg.max_position_embeddings
    assert cfg.vocab_size == tcfg.vocab_size and cfg.draft_vocab_size == 40
    assert cfg.aux_layer_ids == default_aux_layer_ids(tcfg.num_hidden_layers) == (2, 4, 5)
    assert draft.fc.in_features == 3 * tcfg.hidden_size
    ids = draft.draft_to_target_ids
    torch.testing.assert_close(draft.lm_head.weight, target.lm_head.weight[ids])
    assert draft.t2d.sum() == 40 and draft.t2d[ids].all()


def test_draft_vocab_is_most_frequent_with_ties_to_lower_id():
    counts = torch.tensor([5, 9, 9, 1, 7, 9, 0, 7])
    ids = select_draft_vocab(8, 5, counts)
    # counts 9 at ids 1, 2, 5; then 7 at ids 4 and 7 (tie: 4 before 7); 5 at id 0 is left out
    assert ids.tolist() == [1, 2, 4, 5, 7]
    d2t, t2d = vocab_maps(ids, 8)
    assert (torch.arange(5) + d2t).tolist() == ids.tolist()
    assert t2d.tolist() == [False, True, True, False, True, True, False, True]
    assert select_draft_vocab(8).tolist() == list(range(8))


def test_count_tokens_rejects_out_of_range_ids():
    assert count_tokens([[1, 1, 3], [0]], 4).tolist() == [1, 2, 0, 1]
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        count_tokens([[1, 4]], 4)


@pytest.mark.parametrize("draft_vocab_size", [40, None])
def test_checkpoint_files_are_what_vllm_loads(tmp_path, draft_vocab_size):
    target = _target()
    draft = Eagle3DraftModel.from_target(
        target, draft_vocab_size=draft_vocab_size, token_counts=_counts(target.config.vocab_size)
    )
    draft.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1
    assert config["target_hidden_size"] == target.config.hidden_size
    assert config["vocab_size"] == target.config.vocab_size
    assert config["draft_vocab_size"] == (draft_vocab_size or target.config.vocab_size)
    assert config["max_position_embeddings"] >= target.config.max_position_embeddings
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [2, 4, 5], "use_aux_hidden_state": True}
    assert not list(tmp_path.glob("*.bin")) and not list(tmp_path.glob("*.pt"))
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        names = set(f.keys())
        t2d = f.get_tensor("t2d")
    layer = {
        f"midlayer.{n}.weight"
        for n in [
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
            "input_layernorm",
            "hidden_norm",
            "post_attention_layernorm",
        ]
    }
    expected = {"fc.weight", "norm.weight", "lm_head.weight", "t2d", *layer}
    if draft_vocab_size is not None:
        expected.add("d2t")  # vLLM 0.31 refuses d2t when the two vocabularies are equal
    assert names == expected
    assert t2d.dtype == torch.bool and t2d.shape == (target.config.vocab_size,)


def test_round_trip_is_exact_and_binds_target(tmp_path):
    target = _target("qwen3")
    draft = Eagle3DraftModel.from_target(
        target, num_layers=2, draft_vocab_size=50, token_counts=_counts(target.config.vocab_size, seed=3)
    )
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p))
    draft.save_pretrained(tmp_path)
    loaded = Eagle3DraftModel.from_pretrained(tmp_path, target=target)
    assert loaded.state_dict().keys() == draft.state_dict().keys()
    for name, tensor in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    ids = torch.randint(0, target.config.vocab_size, (2, 6))
    taps = torch.randn(2, 6, draft.fc.in_features)
    torch.testing.assert_close(
        loaded(input_ids=ids, aux_hidden_states=taps).logits,
        draft(input_ids=ids, aux_hidden_states=taps).logits,
        rtol=0,
        atol=0,
    )


def _foreign_checkpoint(folder, draft, *, keep=("d2t", "t2d"), extra=None, config_updates=None):
    """A checkpoint as another tool (EAGLE, SpecForge) writes it: maybe no t2d/d2t, maybe an embedding."""
    tensors = {k: v.contiguous() for k, v in draft.state_dict().items() if k not in {"d2t", "t2d"} or k in keep}
    if "d2t" in keep and "d2t" not in tensors:
        tensors["d2t"] = draft.d2t.clone()
    tensors.update(extra or {})
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = draft.config.to_dict()
    config.pop("target_num_hidden_layers")
    config.update(config_updates or {})
    (folder / "config.json").write_text(json.dumps(config))


def test_loads_foreign_checkpoints_without_vocab_maps_or_with_embeddings(tmp_path):
    target = _target()
    full = Eagle3DraftModel.from_target(target)
    _foreign_checkpoint(
        tmp_path / "eagle",
        full,
        keep=(),
        extra={"embed_tokens.weight": torch.randn(target.config.vocab_size, 128)},
        config_updates={"eagle_config": None},
    )
    loaded = Eagle3DraftModel.from_pretrained(tmp_path / "eagle", target=target)
    assert loaded.t2d.all() and (loaded.d2t == 0).all()
    assert loaded.config.aux_layer_ids is None  # EAGLE-3's defaults for the bound target
    assert loaded.resolved_aux_layer_ids(8) == (2, 4, 5)
    torch.testing.assert_close(loaded.fc.weight, full.fc.weight)

    reduced = Eagle3DraftModel.from_target(
        target, draft_vocab_size=30, token_counts=_counts(target.config.vocab_size, seed=7)
    )
    _foreign_checkpoint(tmp_path / "specforge", reduced, keep=("d2t",))
    loaded = Eagle3DraftModel.from_pretrained(tmp_path / "specforge")
    assert torch.equal(loaded.t2d, reduced.t2d) and torch.equal(loaded.d2t, reduced.d2t)

    _foreign_checkpoint(tmp_path / "broken", reduced, keep=())
    with pytest.raises(ValueError, match="no `d2t` tensor"):
        Eagle3DraftModel.from_pretrained(tmp_path / "broken")


def test_refuses_pickled_checkpoints(tmp_path):
    target = _target()
    draft = Eagle3DraftModel.from_target(target)
    draft.config.save_pretrained(tmp_path)
    torch.save(draft.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(OSError, match="safetensors"):
        Eagle3DraftModel.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="use_safetensors=False"):
        Eagle3DraftModel.from_pretrained(tmp_path, use_safetensors=False)


def test_a_path_that_is_neither_a_folder_nor_a_hub_id_is_named_as_such(tmp_path):
    missing = tmp_path / "no-such-draft"
    with pytest.raises(FileNotFoundError, match=rf"no such folder: {re.escape(str(missing))}\).*nor a Hub repo id"):
        Eagle3DraftModel.from_pretrained(missing)
    (tmp_path / "model.safetensors").touch()
    with pytest.raises(FileNotFoundError, match="is a file, not a folder"):
        Eagle3DraftModel.from_pretrained(tmp_path / "model.safetensors")


def _escaped(path) -> str:
    return re.escape(str(path))


def _saved_draft(drafter, folder):
    target = _target()
    family = DRAFTER_FAMILIES[drafter]
    draft = family.from_target(target, **({"mask_token_id": 0} if family is DFlashDraftModel else {}))
    draft.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("drafter", list(DRAFTER_FAMILIES))
def test_a_folder_without_a_drafts_config_is_refused_before_a_draft_is_built(tmp_path, drafter, monkeypatch):
    """Without config.json transformers built the config class's default draft (EAGLE-3: 32 layers of 4096, minutes
    and ~17 GB), and from another model's config.json a draft of that model's sizes, before finding none of its
    weights (the draft is built on the meta device, but every weight it lacks is then materialised and initialised).
    Every family refuses them before transformers' loader runs, naming the folder and what it lacks."""
    family = DRAFTER_FAMILIES[drafter]
    weights_only = _saved_draft(drafter, tmp_path / "weights-only")
    (weights_only / "config.json").unlink()
    checkpoint = tmp_path / "checkpoint-3"  # a training checkpoint: the draft is in its draft/ folder
    _saved_draft(drafter, checkpoint / "draft")
    (tmp_path / "empty").mkdir()
    policy = tmp_path / "policy"
    _target("qwen3" if family.config_class.model_type == "llama" else "llama").config.save_pretrained(policy)
    (tmp_path / "no-type").mkdir()
    (tmp_path / "no-type" / "config.json").write_text(json.dumps({"hidden_size": 4096}))
    same_type = tmp_path / "policy-of-the-drafts-type"  # a valid draft config (EAGLE-3), or one without its fields
    build_tiny_target(family.config_class.model_type, num_layers=8).save_pretrained(same_type)
    loaded = []  # transformers' loader builds the draft and fills every weight the checkpoint lacks
    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(lambda cls, *args, **kwargs: loaded.append(1)))
    expected, display = family.config_class.model_type, family.display_name
    policy_of_the_same_type = {
        "eagle3": r"has no fc.weight, .* \(\d+ of the \d+ weights of the draft its config.json describes",
        "dflash": r"is no usable DFlash draft: `dflash_config.mask_token_id`=None is not allowed",
    }
    for folder, error, message in (
        (
            tmp_path / "empty",
            FileNotFoundError,
            rf"has no config.json: the folder {_escaped(tmp_path / 'empty')} holds nothing",
        ),
        (weights_only, FileNotFoundError, r"has no config.json: the folder .* holds model.safetensors\. Pass a"),
        (checkpoint, FileNotFoundError, rf"holds draft; {_escaped(checkpoint / 'draft')} has one\."),
        (policy, ValueError, rf"is no {display} draft: its config.json has model_type='[a-z0-9]+', where"),
        (tmp_path / "no-type", ValueError, rf"model_type=None, where {display} drafts have '{expected}'"),
        (same_type, ValueError, policy_of_the_same_type[drafter]),
    ):
        for load in (family.from_pretrained, lambda name: load_draft(name, drafter)):
            with pytest.raises(error, match=rf"The draft checkpoint {_escaped(folder)}\b(.|\n)*{message}"):
                load(folder)
    assert loaded == []


def test_bad_construction_arguments():
    target = _target()
    with pytest.raises(ValueError, match=r"Tap id 8 .* out of range"):
        Eagle3DraftModel.from_target(target, aux_layer_ids=[1, 8])
    with pytest.raises(ValueError, match="duplicates"):
        Eagle3DraftModel.from_target(target, aux_layer_ids=[1, 3, 1])
    with pytest.raises(ValueError, match="do not fit a target with 4 decoder layers"):
        Eagle3DraftModel.from_target(_target(num_layers=4))
    with pytest.raises(ValueError, match="draft_vocab_size`=0"):
        Eagle3DraftModel.from_target(target, draft_vocab_size=0, token_counts=_counts(target.config.vocab_size))
    vocab = target.config.vocab_size
    with pytest.raises(ValueError, match=f"draft_vocab_size`={vocab + 1}"):
        Eagle3DraftModel.from_target(target, draft_vocab_size=vocab + 1, token_counts=_counts(vocab))
    with pytest.raises(ValueError, match="pass `token_counts`"):
        Eagle3DraftModel.from_target(target, draft_vocab_size=10)
    with pytest.raises(ValueError, match="num_layers`=0"):
        Eagle3DraftModel.from_target(target, num_layers=0)
    with pytest.raises(ValueError, match="draft_vocab_size`=300"):
        Eagle3DraftConfig(vocab_size=128, draft_vocab_size=300)


def test_draft_that_does_not_fit_its_target_is_refused(tmp_path):
    draft = Eagle3DraftModel.from_target(_target())
    draft.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="target_hidden_size=128 but the target's hidden_size=64"):
        Eagle3DraftModel.from_pretrained(tmp_path, target=_target(hidden_size=64, num_attention_heads=2))
    with pytest.raises(ValueError, match=f"vocab_size={draft.config.vocab_size} but the target's vocab_size=200"):
        draft.bind_target(_target(vocab_size=200))
    with pytest.raises(ValueError, match="Tap id 5 .* out of range"):
        draft.bind_target(_target(num_layers=5))


def test_unbound_draft_says_how_to_bind(tmp_path):
    Eagle3DraftModel.from_target(_target()).save_pretrained(tmp_path)
    draft = Eagle3DraftModel.from_pretrained(tmp_path)
    with pytest.raises(RuntimeError, match="bind_target"):
        draft(input_ids=torch.tensor([[1, 2]]), aux_hidden_states=torch.randn(1, 2, 384))


def test_cached_forward_equals_full_forward():
    """Decoding position by position through a DynamicCache gives the logits of one causal pass."""
    target = _target()
    draft = Eagle3DraftModel.from_target(target, num_layers=2).double()
    target.double()
    ids = torch.randint(0, target.config.vocab_size, (2, 9))
    taps = torch.randn(2, 9, draft.fc.in_features, dtype=torch.float64)
    full = draft(input_ids=ids, aux_hidden_states=taps)
    cache = DynamicCache()
    pieces = []
    for start, end in [(0, 4), (4, 5), (5, 9)]:
        pieces.append(
            draft(input_ids=ids[:, start:end], aux_hidden_states=taps[:, start:end], past_key_values=cache).logits
        )
    torch.testing.assert_close(torch.cat(pieces, 1), full.logits, rtol=1e-10, atol=1e-10)


def test_masked_cache_slots_are_invisible():
    """A slot masked out in `attention_mask` (a rejected speculative token) does not change later outputs."""
    target = _target()
    draft = Eagle3DraftModel.from_target(target).double()
    target.double()
    ids = torch.randint(0, target.config.vocab_size, (1, 6))
    taps = torch.randn(1, 6, draft.fc.in_features, dtype=torch.float64)
    keep = torch.tensor([[1, 1, 0, 1, 1, 1]])
    masked = draft(
        input_ids=ids, aux_hidden_states=taps, attention_mask=keep, position_ids=torch.tensor([[0, 1, 9, 2, 3, 4]])
    )
    kept = torch.tensor([0, 1, 3, 4, 5])
    alone = draft(input_ids=ids[:, kept], aux_hidden_states=taps[:, kept])
    torch.testing.assert_close(masked.logits[:, kept], alone.logits, rtol=1e-10, atol=1e-10)


def _reduced_draft():
    target = _target()
    return Eagle3DraftModel.from_target(
        target, draft_vocab_size=30, token_counts=_counts(target.config.vocab_size, seed=7)
    )


def _corrupt(tensors, name):
    """The draft's tensors with ``name`` made unusable as the issue's bad updates were."""
    tensors = dict(tensors)
    if name == "d2t":
        tensors["d2t"] = tensors["d2t"].clone()
        tensors["d2t"][-1] = 10**6  # the right length, one id far outside the vocabulary
    elif name == "missing":
        del tensors["fc.weight"]
    elif name == "int32":
        tensors = {k: v if k in ("d2t", "t2d") else (v * 100).to(torch.int32) for k, v in tensors.items()}
    elif name == "int32_fc":  # the loader would cast it to float32 without a word
        tensors["fc.weight"] = (tensors["fc.weight"] * 100).to(torch.int32)
    elif name == "float16_fc":
        tensors["fc.weight"] = tensors["fc.weight"].half()
    else:
        tensors["fc.weight"] = tensors["fc.weight"].clone()
        tensors["fc.weight"][0, 0] = float("nan")
    return tensors


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("d2t", r"`d2t` maps 1 draft ids outside the target vocabulary \[0, 100\) \(e.g. to 1000029\)"),
        ("nan", r"`fc.weight` holds 1 non-finite values"),
        ("missing", r"has no fc.weight \(1 of the \d+ weights .*\): a draft is loaded whole"),
        ("int32", r"not a floating-point dtype"),
        ("int32_fc", r"`fc.weight` has dtype torch.int32, not a floating-point dtype"),
        ("float16_fc", r"`fc.weight` has dtype torch.float16, but the declared dtype is torch.float32"),
    ],
)
def test_loading_refuses_an_unusable_draft(tmp_path, fault, message):
    draft = _reduced_draft()
    draft.save_pretrained(tmp_path)  # the config declares float32
    tensors = {k: v.contiguous() for k, v in draft.state_dict().items()}
    save_file(_corrupt(tensors, fault), tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=message):
        Eagle3DraftModel.from_pretrained(tmp_path)


def test_check_weights_names_inconsistent_vocab_maps():
    draft = _reduced_draft()
    draft.validate_weights()
    draft.t2d[draft.draft_to_target_ids[0]] = False
    with pytest.raises(ValueError, match="`t2d` does not mark exactly the target ids"):
        draft.validate_weights()
    draft.t2d[draft.draft_to_target_ids[0]] = True
    draft.d2t[1] = draft.d2t[0] - 1  # draft ids 0 and 1 both map to one target id
    with pytest.raises(ValueError, match="several draft ids to the same target id"):
        draft.validate_weights()
