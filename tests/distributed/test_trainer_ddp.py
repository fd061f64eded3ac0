"""Co-training under DDP and FSDP2: 2 processes on gloo via torchrun.

Under FSDP2 the policy is sharded and the draft is replicated: it is small, its optimizer steps outside the
policy's, and the rollout engine needs it whole every step; its gradients are averaged like DDP's.
"""

import json
import math
from pathlib import Path

import pytest
from torchrun_launch import run_torchrun


pytestmark = pytest.mark.distributed
SCRIPT = Path(__file__).with_name("ddp_cotrain_script.py")


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_draft_gradients_are_averaged_and_draft_identical_on_every_rank(tmp_path, mode, tiny_policy_dir):
    run_torchrun(SCRIPT, mode, tiny_policy_dir, tmp_path / "out", log=tmp_path / "torchrun.log")
    ranks = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(rank["world_size"] == 2 for rank in ranks)
    assert all(rank["fsdp"] == (mode == "fsdp2") for rank in ranks)
    if mode == "fsdp2":  # the policy really is sharded: each rank holds different halves of its parameters
        assert ranks[0]["policy_param_types"] == ["DTensor"]
        assert ranks[0]["policy_checksums"][0] != ranks[1]["policy_checksums"][0]
    else:
        assert ranks[0]["policy_checksums"] == ranks[1]["policy_checksums"]
    # the policy trained (its GRPO loss had reward variance) and the draft's loss was logged and finite
    assert ranks[0]["policy_checksums"][0] != ranks[0]["policy_checksums"][-1]
    assert len(ranks[0]["draft_loss"]) == 3 and all(math.isfinite(loss) for loss in ranks[0]["draft_loss"])
    # The ranks saw different rollouts, so their local draft gradients differ...
    local = [rank["local_grad_sums"] for rank in ranks]
    assert local[0].keys() == local[1].keys() and local[0]
    assert any(abs(local[0][name] - local[1][name]) > 1e-9 for name in local[0])
    # ...yet after every step the draft is bitwise the same on both ranks: the gradients were averaged.
    assert len(ranks[0]["checksums"]) == 3
    assert ranks[0]["checksums"] == ranks[1]["checksums"]
    # and it moved
    assert ranks[0]["checksums"][0] != ranks[0]["checksums"][-1]
