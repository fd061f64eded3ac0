"""Weight updates of a rollout server from a policy cut into pipeline stages, with no rank holding the whole policy.

Every stage pushes its own weights (`PipelineCoTrainStep.state_dict()`: the full model's names, so the server's HF
names) into ONE transaction of the server (`VLLMServerClient`): stage 0 begins it, the stages stage their chunks in
turn (chunk indices run on across stages), stage 0 commits, and the server checks, applies and reads back the whole
set at once. A rank holds its own stage plus the one chunk being sent. Every step is run on one stage and its result,
or its exception, shared with all (`on_one_stage`), so the stages raise together or not at all, and a failed update
is aborted, leaving the server on its previous weights.
"""

import pickle
from collections.abc import Callable, Iterable
from typing import TypeVar

import torch
import torch.distributed as dist

from .client import DEFAULT_CHUNK_BYTES, VLLMServerClient, WeightUpdate
from .engine import WeightSet


__all__ = ["on_one_stage", "sync_stages"]

T = TypeVar("T")


def on_one_stage(function: Callable[[], T], *, src: int, group: dist.ProcessGroup | None = None) -> T:
    """``function()`` on group rank `src`, its result (or exception) on every rank of `group`: every rank returns
    the same value or raises the same error, so a collective protocol never leaves a rank behind."""
    group = group if group is not None else dist.group.WORLD
    outcome = [None]
    if dist.get_rank(group) == src:
        try:
            outcome = [(True, function())]
        except Exception as error:
            outcome = [(False, _shareable(error))]
            dist.broadcast_object_list(outcome, src=dist.get_global_rank(group, src), group=group)
            raise
    dist.broadcast_object_list(outcome, src=dist.get_global_rank(group, src), group=group)
    succeeded, value = outcome[0]
    if succeeded:
        return value
    raise value


def _shareable(error: Exception) -> Exception:
    """The error itself when it survives pickling (its class is then kept on every rank: a stopped engine stays
    `EngineUnavailableError`), else a RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def sync_stages(
    client: VLLMServerClient,
    which: WeightSet,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    group: dist.ProcessGroup | None = None,
    version: int | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> WeightUpdate:
    """Replace every weight of `which` on the server with the union of every stage's `named_tensors`, as one
    transaction; called on every rank of `group` (stage i is group rank i), each with its own tensors (none is
    fine: the draft lives on the last stage only). Returns the commit on every rank, or raises the same error on
    every rank after the transaction was aborted (the server keeps its previous weights)."""
    group = group if group is not None else dist.group.WORLD
    transaction_id = on_one_stage(lambda: client.begin_update(which, version=version), src=0, group=group)
    try:
        sent = (0, 0)  # chunks and bytes staged by the stages before
        for stage in range(dist.get_world_size(group)):

            def send(first_index=sent[0], num_bytes=sent[1]) -> tuple[int, int]:
                chunks = client.send_chunks(
                    transaction_id, named_tensors, first_index=first_index, chunk_bytes=chunk_bytes
                )
                return first_index + chunks.num_chunks, num_bytes + chunks.num_bytes

            sent = on_one_stage(send, src=stage, group=group)
        num_chunks, num_bytes = sent
        return on_one_stage(
            lambda: client.commit_update(transaction_id, num_chunks=num_chunks, num_bytes=num_bytes),
            src=0,
            group=group,
        )
    except Exception:
        if dist.get_rank(group) == 0:
            client.abort_update(transaction_id)
        raise
