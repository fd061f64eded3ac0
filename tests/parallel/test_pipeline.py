"""The stage split of a pipeline and the stage classes that load one stage (single process); the pipelined GRPO
loss is tests/test_losses.py's."""

import re

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from hf_spec_cotrain.parallel.pipeline import pipeline_stage_class, stage_layer_ranges
from hf_spec_cotrain.testing import recorded_checkpoint_reads, save_tiny_target


def test_stage_layer_ranges():
    assert stage_layer_ranges(8, 2) == [range(0, 4), range(4, 8)]
    assert stage_layer_ranges(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert stage_layer_ranges(6, 2, [2, 4]) == [range(0, 2), range(2, 6)]
    with pytest.raises(ValueError, match="at most one per layer"):
        stage_layer_ranges(3, 4)
    with pytest.raises(ValueError, match="sum to the model's 6"):
        stage_layer_ranges(6, 2, [3, 2])
    with pytest.raises(ValueError, match="at least one layer"):
        stage_layer_ranges(6, 2, [6, 0])
    with pytest.raises(ValueError, match="num_stages"):
        stage_layer_ranges(6, 0)


def _stage_of(name: str, ranges: list[range]) -> int:
    """The stage of a checkpoint tensor: its decoder layer's, else the first (embedding) or the last (norm, head)."""
    match = re.search(r"\blayers\.(\d+)\.", name)
    if match:
        return next(stage for stage, layers in enumerate(ranges) if int(match.group(1)) in layers)
    return 0 if "embed_tokens" in name else len(ranges) - 1


# Dense, MoE (the checkpoint's per-expert tensors fuse into one parameter as they load) and gpt-oss (sinks, alternating
# sliding windows, fused experts).
@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "gpt_oss"])
def test_a_stage_class_reads_only_its_stage_and_loads_it_as_the_whole_model_does(tmp_path, family):
    folder = save_tiny_target(
        tmp_path, family, num_layers=5, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32
    )
    whole = AutoModelForCausalLM.from_pretrained(folder)
    whole_state = whole.state_dict()
    with safe_open(folder / "model.safetensors", framework="pt") as checkpoint:
        checkpoint_names = list(checkpoint.keys())
    config = AutoConfig.from_pretrained(folder)
    ranges = stage_layer_ranges(5, 3)
    all_reads = []
    for stage in range(3):
        stage_class = pipeline_stage_class(config, stage, 3)
        with recorded_checkpoint_reads() as reads:
            part = stage_class.from_pretrained(folder)
        assert isinstance(part, type(whole)) and type(part).__name__ == type(whole).__name__
        assert {_stage_of(name, ranges) for name in reads} == {stage}  # nothing of another stage was read
        part_state = part.state_dict()
        assert set(part_state) == {name for name in whole_state if _stage_of(name, ranges) == stage}
        for name, tensor in part_state.items():
            assert torch.equal(tensor, whole_state[name]), name
        for (name, buffer), (_, whole_buffer) in zip(part.named_buffers(), whole.named_buffers(), strict=True):
            torch.testing.assert_close(buffer, whole_buffer, rtol=0, atol=0, msg=name)  # rotary frequencies
        all_reads += reads
    assert sorted(all_reads) == sorted(checkpoint_names)  # over the stages, every tensor read once


def test_a_stage_class_refuses_a_stage_outside_the_pipeline(tmp_path):
    config = AutoConfig.from_pretrained(save_tiny_target(tmp_path, num_layers=4))
    with pytest.raises(ValueError, match="`stage_index`=2 is not a stage of 2"):
        pipeline_stage_class(config, 2, 2)
