"""`stage_sync.sync_stages` on 4 gloo ranks against a recording stand-in of the server's client: one transaction,
chunk indices running on across stages, one commit, and a failure anywhere raised on every stage with the transaction
aborted; and the pipelined server backend's push (`PipelinedServerBackend.prepare`) through a server restart. The real server takes such
updates in tests/distributed/test_trainer_pp_vllm.py (`-m vllm`)."""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hf_spec_cotrain.generation.adaptive import FixedSpeculation
from hf_spec_cotrain.generation.client import SentChunks, VLLMServerError, WeightUpdate
from hf_spec_cotrain.generation.engine import EngineRestartedError, RolloutOutput, SpecDecodeStats, WeightSyncError
from hf_spec_cotrain.generation.stage_sync import sync_stages
from hf_spec_cotrain.training.pipelined_rollouts import PipelinedServerBackend
from hf_spec_cotrain.training.rollout_backends import RolloutSampling, merged_weights
from hf_spec_cotrain.training.timing import StepTimes


pytestmark = pytest.mark.distributed
STAGES = 4
TENSORS_PER_STAGE = [2, 1, 0, 3]  # stage 2 holds nothing of this set


class RecordingClient:
    """What `sync_stages` calls on the client, each tensor sent as a chunk of its own; `fail` names the call that
    raises, and on which stage."""

    def __init__(self, fail: tuple[str, int] | None):
        self.calls: list[tuple] = []
        self.fail = fail

    def _maybe_fail(self, method: str) -> None:
        if self.fail == (method, dist.get_rank()):
            if method == "commit_update":
                raise VLLMServerError("HTTP 400: `lm_head.weight` holds 1 non-finite value", status_code=400)
            raise OSError(f"{method} failed on stage {dist.get_rank()}")

    def begin_update(self, which, *, version=None):
        self.calls.append(("begin", which))
        self._maybe_fail("begin_update")
        return "t1"

    def send_chunks(self, transaction_id, named_tensors, *, first_index=0, chunk_bytes):
        names = [name for name, _ in named_tensors]
        self.calls.append(("send", transaction_id, first_index, names))
        self._maybe_fail("send_chunks")
        return SentChunks(num_chunks=len(names), num_bytes=100 * len(names))

    def commit_update(self, transaction_id, *, num_chunks, num_bytes):
        self.calls.append(("commit", transaction_id, num_chunks, num_bytes))
        self._maybe_fail("commit_update")
        return WeightUpdate("policy", 7, num_chunks, num_chunks, num_bytes, 0.0, None)

    def abort_update(self, transaction_id):
        self.calls.append(("abort", transaction_id))


def run_sync(fail: tuple[str, int] | None) -> tuple[list[tuple], object]:
    """One stage's calls and its outcome (the update, or the error's type, message and status)."""
    rank = dist.get_rank()
    client = RecordingClient(fail)
    tensors = [(f"stage{rank}.w{i}", torch.ones(2)) for i in range(TENSORS_PER_STAGE[rank])]
    try:
        outcome = sync_stages(client, "policy", tensors, chunk_bytes=1)
    except Exception as error:
        outcome = (type(error).__name__, str(error), getattr(error, "status_code", None))
    return client.calls, outcome


def test_stages_send_in_turn_into_one_transaction(cp_pool):
    results = cp_pool.run(run_sync, None)
    assert len(results) == STAGES
    calls = [rank_calls for rank_calls, _ in results]
    total = sum(TENSORS_PER_STAGE)
    assert calls[0] == [
        ("begin", "policy"),
        ("send", "t1", 0, ["stage0.w0", "stage0.w1"]),
        ("commit", "t1", total, 600),
    ]
    assert calls[1] == [("send", "t1", 2, ["stage1.w0"])]
    assert calls[2] == [("send", "t1", 3, [])]
    assert calls[3] == [("send", "t1", 3, ["stage3.w0", "stage3.w1", "stage3.w2"])]
    assert all(outcome == WeightUpdate("policy", 7, total, total, 600, 0.0, None) for _, outcome in results)


@pytest.mark.parametrize(
    ("fail", "error", "senders", "committed"),
    [
        (("begin_update", 0), ("OSError", "begin_update failed on stage 0", None), [], False),
        (("send_chunks", 2), ("OSError", "send_chunks failed on stage 2", None), [0, 1, 2], False),
        (
            ("commit_update", 0),
            ("VLLMServerError", "HTTP 400: `lm_head.weight` holds 1 non-finite value", 400),
            [0, 1, 2, 3],
            True,
        ),
    ],
)
def test_a_failure_on_any_stage_is_raised_on_every_stage_and_aborts(cp_pool, fail, error, senders, committed):
    """The same error (its class and status kept) on every stage; stage 0 aborts what was begun; no stage sends after
    the failing one, and nothing is committed before every stage has sent."""
    results = cp_pool.run(run_sync, fail)
    assert [outcome for _, outcome in results] == [error] * STAGES
    calls = [rank_calls for rank_calls, _ in results]
    assert [rank for rank in range(STAGES) if any(call[0] == "send" for call in calls[rank])] == senders
    assert any(call[0] == "commit" for call in calls[0]) == committed
    began = fail[0] != "begin_update"
    assert (calls[0][-1] == ("abort", "t1")) == began  # nothing to abort when nothing was begun
    assert not any(call[0] == "abort" for rank_calls in calls[1:] for call in rank_calls)


class RestartedServerClient(RecordingClient):
    """A client of a server that restarted before the test: its first request of any kind raises
    `EngineRestartedError` (it then knows the new instance), as `VLLMServerClient` does. `restart_again()`: the
    next request meets a second restart."""

    shared_across_processes = True

    def __init__(self):
        super().__init__(fail=None)
        self.knows_instance = False

    def restart_again(self) -> None:
        self.knows_instance = False

    def _maybe_fail(self, method: str) -> None:
        if not self.knows_instance:
            self.knows_instance = True
            raise EngineRestartedError(f"restarted (met by {method} on stage {dist.get_rank()})")

    def health(self):
        self.calls.append(("health",))
        self._maybe_fail("health")

    def generate(self, prompt_ids, **sampling):
        self.calls.append(("generate",))
        self._maybe_fail("generate")
        return RolloutOutput(completion_ids=[[5, 6]], logprobs=None, spec_decode=SpecDecodeStats())


def run_push_through_restarts() -> dict:
    """The stages' push (`prepare`) on a server that restarted: met by stage 0's begin, then (after a good push) by
    the last stage's rollout request, whose turn cannot be served; the next push of the same step pushes again
    everywhere."""
    rank = dist.get_rank()
    client = RestartedServerClient()
    backend = PipelinedServerBackend(
        client,
        nn.Linear(2, 2),  # the draft: only its state_dict is pushed
        RolloutSampling(8, 1.0, 1.0, 0, [2], 0, None),
        SimpleNamespace(device=torch.device("cpu")),
        weights=lambda: merged_weights(nn.Linear(2, 2)),
        speculation=FixedSpeculation(2),
        max_draft_tokens=2,
        output_dir="unused",
        step_times=StepTimes(defaultdict(lambda: defaultdict(list))),
        pipeline=SimpleNamespace(group=dist.group.WORLD, driver=STAGES - 1, is_driver=rank == STAGES - 1),
    )
    backend.prepare(0)
    record = {"first_push": [call[0] for call in client.calls], "synced": backend.synced_step}
    client.calls.clear()
    if backend.pipeline.is_driver:
        client.restart_again()
        with pytest.raises(WeightSyncError, match="restarted .*met by generate.* push their weights again"):
            backend.generate([[1, 2]], step=0, training=True)
    backend.prepare(0)  # the same step: pushed again, since the last stage met a restart
    record["second_push"] = [call[0] for call in client.calls]
    client.calls.clear()
    if backend.pipeline.is_driver:
        record["served"] = backend.generate([[1, 2]], step=0, training=True).completions
    backend.prepare(0)  # nothing new: no push
    record["third_push"] = [call[0] for call in client.calls if call[0] != "generate"]
    return record


def test_push_stages_pushes_again_after_a_server_restart(cp_pool):
    records = cp_pool.run(run_push_through_restarts)
    # Stage 0's begin met the restart: every stage's client took the new instance and the stages pushed both sets.
    assert records[0]["first_push"] == ["begin", "health", "begin", "send", "commit", "begin", "send", "commit"]
    for record in records[1:]:
        assert record["first_push"] == ["health", "send", "send"]
    assert all(record["synced"] == 0 for record in records)
    # The last stage's request met a second restart: that turn failed (it falls back), and the same step's next
    # the push went again on every stage; the turn after it is served, and a third call pushes nothing.
    assert records[0]["second_push"] == ["begin", "send", "commit", "begin", "send", "commit"]
    assert all(record["second_push"] == ["send", "send"] for record in records[1:-1])
    assert records[-1]["second_push"] == ["generate", "send", "send"]
    assert records[-1]["served"] == [[5, 6]]
    assert all(record["third_push"] == [] for record in records)
