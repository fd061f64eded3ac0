"""The whole-step memory model of scripts/cp_memory_model.py: how each term scales with the layout."""

import sys
from pathlib import Path

import pytest


sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import cp_memory_model as model  # noqa: E402


SIZES = dict(layers=6, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, vocab=1000)
SHAPES = model.Shapes(**SIZES)
DRAFTERS = {"eagle3": SHAPES, "dflash": model.Shapes(**SIZES, drafter="dflash", dflash_layers=2)}


def bytes_at(shard, cp, shapes=SHAPES, **options):
    return model.per_device_bytes(shapes, length=4096, shard=shard, cp=cp, **options)


@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("shard, cp", [(1, 2), (2, 1), (2, 2), (4, 8)])
def test_states_shard_over_the_whole_mesh_and_positions_over_cp(shard, cp, drafter):
    shapes = DRAFTERS[drafter]
    one, split = bytes_at(1, 1, shapes), bytes_at(shard, cp, shapes)
    draft = 16 * shapes.draft_parameters  # replicated
    assert split["run_long"] - draft == pytest.approx((one["run_long"] - draft) / (shard * cp))
    fixed = bytes_at(1, 10**9, shapes)  # what does not hold a position: gathered layers, the lm_head, DFlash's blocks
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
    # DFlash: its layers are the target's, fc takes one tap per layer, and it has no head of its own
    assert DRAFTERS["dflash"].draft_parameters == 2 * (SHAPES.layer_parameters + h * h)


def test_dflash_teaches_over_the_whole_vocabulary_and_keeps_no_per_step_queries():
    """Its teacher rows span the target's vocabulary (the default full-vocabulary draft), and what grows with the
    positions is the context, not queries: its blocks are a fixed number of anchors."""
    eagle3, dflash = (model.per_device_bytes(DRAFTERS[d], length=8192, shard=1, cp=1) for d in DRAFTERS)
    wider = model.Shapes(**{**SIZES, "vocab": 2000}, drafter="dflash", dflash_layers=2)
    grown = model.per_device_bytes(wider, length=8192, shard=1, cp=1)["draft_step"] - dflash["draft_step"]
    assert grown == pytest.approx((2 * 8192 * 4 + 256 * 4) * 1000)  # the teacher's rows and the gathered head
    teacher = {d: 2 * 8192 * DRAFTERS[d].teacher_vocab * 4 for d in DRAFTERS}
    assert dflash["draft_step"] - teacher["dflash"] < (eagle3["draft_step"] - teacher["eagle3"]) / 2  # no TTT queries


def test_the_evaluation_lists_every_power_of_two_layout():
    rows = model.main(["--devices", "8", "--length", "8192"])
    assert [(r["shard"], r["cp"]) for r in rows] == [(8, 1), (4, 2), (2, 4), (1, 8)]
    assert all(r["peak_sharded"] < r["peak"] for r in rows)
    assert [r["peak"] for r in rows] == sorted((r["peak"] for r in rows), reverse=True)
