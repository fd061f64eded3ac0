"""`write_streamed_safetensors`: weights written as they arrive, in `save_pretrained`'s layout."""

import json

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hf_spec_cotrain.testing import build_tiny_target
from hf_spec_cotrain.training.saving import write_streamed_safetensors


def test_streamed_shards_are_save_pretrained_shards_written_as_they_fill(tmp_path):
    model = build_tiny_target("llama", num_layers=3, hidden_size=64, intermediate_size=96, seed=1)
    model.save_pretrained(tmp_path / "reference", max_shard_size="100KB")
    state = model.state_dict()
    listing = [(name, tuple(t.shape), t.dtype) for name, t in state.items()]
    index = json.loads((tmp_path / "reference" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2

    written_when = {}  # tensor name -> the shard files on disk when it was handed over

    def stream():
        for name, tensor in state.items():
            written_when[name] = {path.name for path in (tmp_path / "streamed").glob("*.safetensors")}
            yield name, tensor.clone()

    write_streamed_safetensors(tmp_path / "streamed", listing, stream(), max_shard_size="100KB")

    assert json.loads((tmp_path / "streamed" / "model.safetensors.index.json").read_text()) == index
    for shard in shards:
        expected, written = load_file(tmp_path / "reference" / shard), load_file(tmp_path / "streamed" / shard)
        assert written.keys() == expected.keys() and all(torch.equal(written[n], expected[n]) for n in expected)
        # A shard is on disk once its last tensor arrived (not held until the end).
        last = max(expected, key=list(state).index)
        later = [name for name in state if list(state).index(name) > list(state).index(last)]
        assert all(shard in written_when[name] for name in later)
    (tmp_path / "streamed" / "config.json").write_text((tmp_path / "reference" / "config.json").read_text())
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "streamed")
    assert all(torch.equal(reloaded.state_dict()[n], t) for n, t in state.items())


def test_one_shard_is_model_safetensors(tmp_path):
    model = build_tiny_target("llama", num_layers=2, hidden_size=64, intermediate_size=96, seed=1)
    state = model.state_dict()
    listing = [(name, tuple(t.shape), t.dtype) for name, t in state.items()]
    write_streamed_safetensors(tmp_path, listing, state.items())
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model.safetensors"]
    written = load_file(tmp_path / "model.safetensors")
    assert written.keys() == state.keys() and all(torch.equal(written[n], t) for n, t in state.items())
