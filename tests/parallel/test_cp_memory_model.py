"""The whole-step memory model of scripts/cp_memory_model.py: how each term scales with the layout."""

import sys
from pathlib import Path

import pytest


sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import cp_memory_model as model  # noqa: E402


SHAPES = model.Shapes(layers=6, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, vocab=1000)


def bytes_at(shard, cp, **options):
    return model.per_device_bytes(SHAPES, length=4096, shard=shard, cp=cp, **options)


@pytest.mark.parametrize("shard, cp", [(1, 2), (2, 1), (2, 2), (4, 8)])
def test_states_shard_over_the_whole_mesh_and_positions_over_cp(shard, cp):
    one, split = bytes_at(1, 1), bytes_at(shard, cp)
    draft = 16 * SHAPES.draft_parameters  # replicated
    assert split["run_long"] - draft == pytest.approx((one["run_long"] - draft) / (shard * cp))
    fixed = bytes_at(1, 10**9)  # what does not hold a position: gathered layers, the lm_head for the teacher
    for part in ("policy_backward", "draft_step"):
        assert split[part] - fixed[part] == pytest.approx((one[part] - fixed[part]) / cp, rel=1e-6)
    assert split["peak"] == split["run_long"] + max(split["policy_backward"], split["draft_step"])


def test_a_sharded_draft_and_no_reference_model_hold_less():
    base = bytes_at(2, 2)
    sharded = bytes_at(2, 2, draft_sharded=True)
    assert base["run_long"] - sharded["run_long"] == pytest.approx(16 * SHAPES.draft_parameters * (1 - 1 / 4))
    no_reference = bytes_at(2, 2, reference_model=False)
    assert base["run_long"] - no_reference["run_long"] == pytest.approx(2 * SHAPES.policy_parameters / 4)


def test_parameter_counts_follow_the_shapes():
    h, q, kv, i = 256, 4 * 64, 2 * 64, 512
    assert SHAPES.layer_parameters == 2 * h * q + 2 * h * kv + 3 * h * i
    assert SHAPES.policy_parameters == 6 * SHAPES.layer_parameters + 2 * 1000 * h


def test_the_evaluation_lists_every_power_of_two_layout():
    rows = model.main(["--devices", "8", "--length", "8192"])
    assert [(r["shard"], r["cp"]) for r in rows] == [(8, 1), (4, 2), (2, 4), (1, 8)]
    assert all(r["peak_sharded"] < r["peak"] for r in rows)
    assert [r["peak"] for r in rows] == sorted((r["peak"] for r in rows), reverse=True)
