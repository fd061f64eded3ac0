"""The whole-step memory model of scripts/cp_memory_model.py: how each term scales with the layout."""

import sys
from pathlib import Path

import pytest


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import cp_memory_model as model  # noqa: E402


SHAPES = model.Shapes(layers=6, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, vocab=1000)
STATE_TERMS = ("policy states (sharded)", "reference model (sharded)")
SEQUENCE_TERMS = ("checkpointed block inputs", "one block recomputed", "policy logits", "draft taps and teacher")


@pytest.mark.parametrize("shard, cp", [(1, 2), (2, 1), (2, 2), (4, 8)])
def test_states_shard_over_the_whole_mesh_and_activations_over_cp_only(shard, cp):
    one = model.per_device_bytes(SHAPES, model.Step(), length=4096, shard=1, cp=1)
    split = model.per_device_bytes(SHAPES, model.Step(), length=4096, shard=shard, cp=cp)
    for term in STATE_TERMS:
        assert split[term] == pytest.approx(one[term] / (shard * cp))
    for term in (*SEQUENCE_TERMS, "draft TTT activations"):
        assert split[term] == pytest.approx(one[term] / cp)
    assert split["gathered blocks"] == one["gathered blocks"]
    assert split["draft states"] == one["draft states"]  # replicated


def test_a_sharded_draft_and_checkpointed_ttt_hold_less():
    base = model.per_device_bytes(SHAPES, model.Step(), length=4096, shard=2, cp=2)
    sharded = model.per_device_bytes(SHAPES, model.Step(draft_sharded=True), length=4096, shard=2, cp=2)
    checkpointed = model.per_device_bytes(
        SHAPES, model.Step(ttt_gradient_checkpointing=True), length=4096, shard=2, cp=2
    )
    assert sharded["draft states"] == pytest.approx(base["draft states"] / 4)
    assert checkpointed["draft TTT activations"] < base["draft TTT activations"]
    no_reference = model.per_device_bytes(SHAPES, model.Step(reference_model=False), length=4096, shard=2, cp=2)
    assert no_reference["reference model (sharded)"] == 0 < base["reference model (sharded)"]


def test_parameter_counts_follow_the_shapes():
    h, a, kv, i = 256, 4 * 64, 2 * 64, 512
    assert SHAPES.block_parameters == 2 * h * a + 2 * h * kv + 3 * h * i
    assert SHAPES.policy_parameters == 6 * SHAPES.block_parameters + 2 * 1000 * h


def test_the_evaluation_lists_every_power_of_two_layout_and_a_total():
    rows = model.main(["--devices", "8", "--length", "8192"])
    assert [(r["shard"], r["cp"]) for r in rows] == [(8, 1), (4, 2), (2, 4), (1, 8)]
    for row in rows:
        parts = sum(value for name, value in row.items() if name not in ("shard", "cp", "total"))
        assert row["total"] == pytest.approx(parts)
