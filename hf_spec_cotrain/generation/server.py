"""The rollout server of ``hf-spec-cotrain vllm-serve``: a `VLLMRolloutEngine` behind HTTP, with transactional weight
updates.

Why not ``vllm serve`` (TRL's server mode) with vLLM's weight-transfer endpoints: those load each tensor into the
running model as it arrives (a failure half-way leaves a half-updated policy serving rollouts), move weights only
over NCCL or CUDA IPC (nothing on a CPU machine), and the OpenAI-style endpoints do not report the speculative
counters of a call. Here the engine runs in-process inside the server (one process, no engine-core subprocess), so
the same verified sync code serves the colocated trainer and the server.

Endpoints (JSON; every error is ``{"error": "<message>"}`` with a 4xx/5xx status):
    GET    /health                                      readiness, weights versions (the only one open without a key)
    GET    /weights/version                             {"policy": int, "draft": int | null}
    POST   /generate                                    token-id prompts in; completions, logprobs, counters out
    POST   /weights/check                               {"target", "names", "shapes"}: would this set sync? (no data)
    POST   /weights/transactions                        {"target": "policy" | "draft", "version": int | null}
    PUT    /weights/transactions/{id}/chunks/{index}    body: safetensors bytes; header X-Content-SHA256 (optional)
    POST   /weights/transactions/{id}/nccl_chunks/{index}   GPU: {"names", "dtype_names", "shapes"}, tensors via NCCL
    POST   /weights/transactions/{id}/commit            {"num_chunks": N}
    DELETE /weights/transactions/{id}                   abort
    GET    /weights/transactions                        open transactions (ids, sizes, idle time; no data)
    POST   /nccl/init                                   GPU: join the trainer's 2-rank NCCL group as rank 1

Every answer carries the header ``X-Server-Instance``, an id drawn when the server starts: a client that sees it
change knows the server restarted on the weights of its folders and pushes its own again.

With an API key (``--api_key`` or the environment variable ``HF_SPEC_COTRAIN_API_KEY``), every endpoint but
``/health`` needs ``Authorization: Bearer <key>`` (401 otherwise), checked before the request's body is read. The
server refuses to listen beyond loopback without a key unless told the API is open (``allow_unauthenticated``).

Staging is bounded before memory or engine time is spent: open transactions (429 beyond ``max_open_transactions``),
bytes staged, counted from each chunk's Content-Length before its body is read (413 when one transaction would exceed
``max_staged_bytes``, 429 when the transactions together would), and chunk indices and ``num_chunks`` (413 beyond
``max_chunks``).

A weight update is one transaction: chunks are parsed, checked (names, shapes, no tensor twice) and staged in
memory; nothing reaches vLLM before commit. Commit checks that chunks 0..N-1 all arrived and that they form the
complete set, and the tensors as sent (400 otherwise): each in the engine's dtype (or float32 master weights), every
floating value finite, a draft's ``d2t`` inside the target vocabulary (`hf_spec_cotrain.draft.checks`). It then
syncs, reads every tensor back through vLLM's kernels and generates a few greedy tokens. If vLLM fails, the readback
differs or that first generation fails, the previous complete weights are synced back, the server keeps serving
them, and the commit answers 500. A transaction idle for longer than ``transaction_timeout``
is discarded. The rollback point is the last committed set (or, before the first commit, a readback of the engine),
held on the CPU: one extra copy of each model in host memory.

All engine calls (generation, syncs, NCCL receives) run on one thread, the one that built the engine (`vllm.LLM` is
not thread-safe): calls never interleave, so a rollout never sees half-loaded weights and the counters read around
a call are that call's. Chunk uploads are parsed on other threads, so a trainer can stage the next weights while
rollouts run.

The NCCL path (``/nccl/init``, ``nccl_chunks``) follows TRL's server mode with vLLM's own helpers
(`stateless_init_process_group`, `packed_nccl_broadcast_consumer`) but stages the received tensors in the same
transaction as HTTP chunks. It needs CUDA and is **untested here** (the project's test machine has no GPU).
"""

import asyncio
import hashlib
import hmac
import ipaddress
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security.utils import get_authorization_scheme_param
from pydantic import BaseModel, ConfigDict, Field
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from starlette.concurrency import run_in_threadpool

from ..draft.checks import draft_tensor_problems, weight_problems
from .client import API_KEY_ENV, INSTANCE_HEADER, SHA256_HEADER
from .engine import WeightSet, finite_or_none
from .vllm_engine import VLLMRolloutEngine


__all__ = ["RolloutServer", "ServerError", "WeightTransactions", "build_app", "serve"]

logger = logging.getLogger(__name__)

# Ids of expired transactions remembered so that a late chunk or commit hears "expired" rather than "unknown".
_REMEMBERED_EXPIRED = 1024
DEFAULT_MAX_OPEN_TRANSACTIONS = 4
DEFAULT_MAX_CHUNKS = 10_000
# Ids listed in one error message at most (a commit may name up to `max_chunks` chunks).
_LISTED_IDS = 10
# Tokens generated after every commit: enough for the draft to propose and the policy to verify.
_PROBE_TOKENS = 4


class ServerError(Exception):
    """An error answered as ``{"error": message}`` with `status_code`."""

    def __init__(self, status_code: int, message: str):
        super().__init__(message)
        self.status_code = status_code
        self.message = message


# --------------------------------------------------------------------------------------- request bodies


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GenerateRequest(_Body):
    prompt_token_ids: list[list[int]]
    max_tokens: int = Field(gt=0)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    n: int = Field(default=1, gt=0)
    logprobs: bool = False
    # Further `vllm.SamplingParams` fields (JSON values only), e.g. {"ignore_eos": true}.
    sampling_kwargs: dict[str, Any] = Field(default_factory=dict)


class BeginRequest(_Body):
    target: WeightSet
    version: int | None = Field(default=None, ge=0)


class CheckRequest(_Body):
    target: WeightSet
    names: list[str]
    shapes: list[list[int]]


class CommitRequest(_Body):
    num_chunks: int = Field(gt=0)


class NcclInitRequest(_Body):
    master_address: str
    master_port: int = Field(gt=0, lt=65536)
    packed_buffer_size_bytes: int = Field(gt=0)
    packed_num_buffers: int = Field(gt=0)


class NcclChunkRequest(_Body):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


# --------------------------------------------------------------------------------------- transactions


@dataclass
class _Transaction:
    id: str
    target: WeightSet
    version: int
    chunks: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    chunk_bytes: dict[int, int] = field(default_factory=dict)
    # Bytes of chunks being received: counted against the limits before their bodies are read.
    reserved_bytes: int = 0
    last_activity: float = field(default_factory=time.monotonic)

    @property
    def num_bytes(self) -> int:
        return sum(self.chunk_bytes.values()) + self.reserved_bytes

    def merged(self, num_chunks: int) -> dict[str, torch.Tensor]:
        """All staged tensors, after checking that exactly the chunks 0..num_chunks-1 arrived."""
        missing = sorted(set(range(num_chunks)) - set(self.chunks))
        extra = sorted(set(self.chunks) - set(range(num_chunks)))
        problems = []
        if missing:
            problems.append(f"chunks {_listed(missing)} never arrived")
        if extra:
            problems.append(f"chunks {_listed(extra)} arrived beyond num_chunks={num_chunks}")
        if problems:
            raise ServerError(
                400,
                f"Transaction {self.id} is incomplete: {'; '.join(problems)}. Nothing was applied; it is discarded.",
            )
        return {name: tensor for index in range(num_chunks) for name, tensor in self.chunks[index].items()}


class WeightTransactions:
    """Open weight-update transactions: chunks staged in memory until commit, dropped after `idle_timeout` seconds
    without activity, within limits on their number, their bytes (all together; default: half of this machine's
    memory) and their chunks. Thread-safe."""

    def __init__(
        self,
        *,
        idle_timeout: float,
        max_open: int = DEFAULT_MAX_OPEN_TRANSACTIONS,
        max_staged_bytes: int | None = None,
        max_chunks: int = DEFAULT_MAX_CHUNKS,
    ):
        max_staged_bytes = _half_of_memory() if max_staged_bytes is None else max_staged_bytes
        for name, value in (
            ("idle_timeout", idle_timeout),
            ("max_open_transactions", max_open),
            ("max_staged_bytes", max_staged_bytes),
            ("max_chunks", max_chunks),
        ):
            if value <= 0:
                raise ValueError(f"{name}={value} must be positive.")
        self.idle_timeout = idle_timeout
        self.max_open = max_open
        self.max_staged_bytes = max_staged_bytes
        self.max_chunks = max_chunks
        self._open: dict[str, _Transaction] = {}
        self._expired: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def begin(self, target: WeightSet, version: int) -> _Transaction:
        transaction = _Transaction(id=uuid.uuid4().hex, target=target, version=version)
        with self._lock:
            self._discard_expired()
            if len(self._open) >= self.max_open:
                raise ServerError(
                    429,
                    f"{len(self._open)} weight updates are open, this server's limit (max_open_transactions="
                    f"{self.max_open}). Nothing was begun: commit or abort one (GET /weights/transactions lists them) "
                    f"or wait for abandoned ones to expire ({self.idle_timeout:g} s without activity).",
                )
            self._open[transaction.id] = transaction
        return transaction

    @contextmanager
    def reserving(self, transaction_id: str, index: int, num_bytes: int) -> Iterator[None]:
        """Count a chunk of `num_bytes` (as declared before it is received) against the limits while it is received
        and staged; refused with 413 or 429 when it does not fit, before any of it is read."""
        with self._lock:
            transaction = self._get(transaction_id)
            if index >= self.max_chunks:
                raise ServerError(
                    413, f"Chunk index {index} is beyond this server's max_chunks={self.max_chunks}. Nothing staged."
                )
            own = transaction.num_bytes + num_bytes
            others = sum(other.num_bytes for other in self._open.values() if other is not transaction)
            if own > self.max_staged_bytes:
                raise ServerError(
                    413,
                    f"Chunk {index} ({num_bytes} bytes) would bring transaction {transaction_id} to {own} bytes, over "
                    f"this server's max_staged_bytes={self.max_staged_bytes}. Nothing staged; the server cannot hold "
                    "this update (start it with a larger --max_staged_bytes).",
                )
            if own + others > self.max_staged_bytes:
                raise ServerError(
                    429,
                    f"Chunk {index} ({num_bytes} bytes) does not fit: other open transactions hold {others} of this "
                    f"server's max_staged_bytes={self.max_staged_bytes}. Nothing staged; send it again once they are "
                    "committed or aborted.",
                )
            transaction.reserved_bytes += num_bytes
        try:
            yield
        finally:
            with self._lock:
                transaction.reserved_bytes -= num_bytes

    def get(self, transaction_id: str) -> _Transaction:
        with self._lock:
            return self._get(transaction_id)

    def add_chunk(self, transaction_id: str, index: int, tensors: dict[str, torch.Tensor], num_bytes: int) -> None:
        """Stage a chunk; sending an index again replaces that chunk (a retry), a tensor in two chunks is refused."""
        with self._lock:
            transaction = self._get(transaction_id)
            repeated = {
                name: other
                for other, chunk in transaction.chunks.items()
                if other != index
                for name in chunk.keys() & tensors.keys()
            }
            if repeated:
                described = ", ".join(f"{name} (chunk {other})" for name, other in sorted(repeated.items()))
                raise ServerError(400, f"Chunk {index} repeats tensors already staged: {described}. Nothing staged.")
            transaction.chunks[index] = tensors
            transaction.chunk_bytes[index] = num_bytes
            transaction.last_activity = time.monotonic()

    def take(self, transaction_id: str, num_chunks: int) -> _Transaction:
        """Remove the transaction for a commit of `num_chunks` chunks: from now on it cannot expire, be aborted or take
        more chunks. A `num_chunks` over the limit is refused (413) and the transaction stays open."""
        with self._lock:
            transaction = self._get(transaction_id)
            if num_chunks > self.max_chunks:
                raise ServerError(
                    413,
                    f"num_chunks={num_chunks} is beyond this server's max_chunks={self.max_chunks}; nothing was "
                    f"applied and transaction {transaction_id} stays open.",
                )
            del self._open[transaction_id]
            return transaction

    def abort(self, transaction_id: str) -> None:
        with self._lock:
            self._get(transaction_id)
            del self._open[transaction_id]

    def discard_expired(self) -> list[str]:
        with self._lock:
            return self._discard_expired()

    def describe(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        with self._lock:
            self._discard_expired()
            return [
                {
                    "transaction_id": transaction.id,
                    "target": transaction.target,
                    "version": transaction.version,
                    "chunks": sorted(transaction.chunks),
                    "bytes": transaction.num_bytes,
                    "idle_seconds": now - transaction.last_activity,
                }
                for transaction in self._open.values()
            ]

    def _get(self, transaction_id: str) -> _Transaction:
        self._discard_expired()
        transaction = self._open.get(transaction_id)
        if transaction is None:
            if transaction_id in self._expired:
                raise ServerError(
                    404,
                    f"Transaction {transaction_id} expired after {self.idle_timeout:g} s without activity and was "
                    "discarded; nothing was applied. Begin a new one.",
                )
            raise ServerError(404, f"No open transaction {transaction_id} (never begun, committed or aborted).")
        transaction.last_activity = time.monotonic()
        return transaction

    def _discard_expired(self) -> list[str]:
        deadline = time.monotonic() - self.idle_timeout
        expired = [id_ for id_, transaction in self._open.items() if transaction.last_activity < deadline]
        for transaction_id in expired:
            del self._open[transaction_id]
            self._expired[transaction_id] = time.monotonic()
        while len(self._expired) > _REMEMBERED_EXPIRED:
            self._expired.popitem(last=False)
        return expired


# --------------------------------------------------------------------------------------- server state


@dataclass
class _NcclReceiver:
    group: Any
    device: torch.device
    buffer_size_bytes: int
    num_buffers: int


class RolloutServer:
    """The engine, its weights versions and rollback points, and the open transactions.

    `build_engine` runs on the engine thread, which then runs every engine call. `instance_id` is new at every start.
    """

    def __init__(
        self,
        build_engine: Callable[[], VLLMRolloutEngine],
        *,
        transaction_timeout: float,
        max_chunk_bytes: int,
        max_open_transactions: int = DEFAULT_MAX_OPEN_TRANSACTIONS,
        max_staged_bytes: int | None = None,
        max_chunks: int = DEFAULT_MAX_CHUNKS,
    ):
        if max_chunk_bytes <= 0:
            raise ValueError(f"max_chunk_bytes={max_chunk_bytes} must be positive.")
        self.transactions = WeightTransactions(
            idle_timeout=transaction_timeout,
            max_open=max_open_transactions,
            max_staged_bytes=max_staged_bytes,
            max_chunks=max_chunks,
        )
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-engine")
        self.engine = self._executor.submit(build_engine).result()
        self.instance_id = uuid.uuid4().hex
        self.max_chunk_bytes = max_chunk_bytes
        self.versions: dict[str, int | None] = {"policy": 0, "draft": 0 if self.engine.has_draft else None}
        self._rollback_points: dict[str, dict[str, torch.Tensor]] = {}
        self._engine_dtypes: dict[str, dict[str, torch.dtype]] = {}
        self._broken: dict[str, str] = {}
        self._nccl: _NcclReceiver | None = None

    def on_engine_thread(self, function: Callable, *args) -> Awaitable:
        return asyncio.wrap_future(self._executor.submit(function, *args))

    def close(self) -> None:
        self._executor.submit(self.engine.close).result()
        self._executor.shutdown()

    def health(self) -> dict[str, Any]:
        if self._broken:
            raise ServerError(503, "The server cannot serve rollouts: " + "; ".join(self._broken.values()))
        return {
            "status": "ok",
            "has_draft": self.engine.has_draft,
            "versions": dict(self.versions),
            "instance": self.instance_id,
        }

    def check_prompts(self, prompts: list[list[int]]) -> None:
        """Refuse token ids outside the policy's vocabulary (400) before they reach the engine, where they fail
        inside vLLM's kernels."""
        vocab_size = self.engine.vocab_size
        bad = [
            (row, position, id_)
            for row, ids in enumerate(prompts)
            for position, id_ in enumerate(ids)
            if not 0 <= id_ < vocab_size
        ]
        if bad:
            row, position, id_ = bad[0]
            raise ServerError(
                400,
                f"Bad generate request: prompt_token_ids hold {len(bad)} ids outside the policy's vocabulary "
                f"[0, {vocab_size}), e.g. {id_} (prompt {row}, position {position}). Tokenize with the policy's "
                "tokenizer.",
            )

    # ----------------------------------------------------------------------------------- engine thread

    def generate(self, request: GenerateRequest) -> dict[str, Any]:
        self.health()
        try:
            output = self.engine.generate(
                request.prompt_token_ids,
                max_tokens=request.max_tokens,
                temperature=request.temperature,
                top_p=request.top_p,
                top_k=request.top_k,
                seed=request.seed,
                n=request.n,
                logprobs=request.logprobs,
                **request.sampling_kwargs,
            )
        except (ValueError, TypeError) as error:
            raise ServerError(400, f"Bad generate request: {error}") from error
        logprobs = None if output.logprobs is None else [[finite_or_none(x) for x in row] for row in output.logprobs]
        return {
            "completion_ids": output.completion_ids,
            "logprobs": logprobs,
            "spec_decode": output.spec_decode.to_json(),
            "versions": dict(self.versions),
        }

    def commit(self, transaction: _Transaction, num_chunks: int) -> dict[str, Any]:
        target = transaction.target
        weights = transaction.merged(num_chunks)
        try:
            self.engine.check_weights(target, [(name, tensor.shape) for name, tensor in weights.items()])
        except ValueError as error:
            raise ServerError(400, f"Transaction {transaction.id} refused: {error}") from error
        if target not in self._rollback_points:
            self._rollback_points[target] = self.engine.read_weights(target)
            self._engine_dtypes[target] = {
                name: tensor.dtype for name, tensor in self._rollback_points[target].items()
            }
        problems = self._value_problems(target, weights)
        if problems:
            raise ServerError(
                400,
                f"Transaction {transaction.id} refused, nothing was applied: {'; '.join(problems)}. Send finite weights "
                f"in the engine's dtypes (float32 master weights are accepted and rounded) and a draft whose `d2t` maps "
                f"into the target vocabulary.",
            )
        try:
            stats = self.engine.sync_weights(target, weights.items())
            self._probe_generation()
        except Exception as error:
            raise self._roll_back(target, error) from error
        self._rollback_points[target] = {name: tensor.to("cpu") for name, tensor in weights.items()}
        self._broken.pop(target, None)
        self.versions[target] = transaction.version
        logger.info("%s weights version %d committed (%d tensors)", target, transaction.version, len(weights))
        return {
            "target": target,
            "version": transaction.version,
            "num_tensors": stats.num_tensors,
            "load_seconds": stats.load_seconds,
            "verify_seconds": stats.verify_seconds,
        }

    def _value_problems(self, target: WeightSet, weights: dict[str, torch.Tensor]) -> list[str]:
        """Dtypes first (compared as sent, before the engine converts anything), then values: finite weights and, for
        a draft, `d2t`/`t2d` inside the target vocabulary. An update that passes the name and shape checks but fails
        these would pass the read-back (which converts to the engine's dtypes) or fail only at the next rollout."""
        engine_dtypes = self._engine_dtypes[target]
        problems = [
            f"`{name}` is {tensor.dtype}, the engine holds it in {engine_dtypes[name]}"
            for name, tensor in weights.items()
            if name in engine_dtypes and tensor.dtype not in _accepted_dtypes(engine_dtypes[name])
        ]
        if problems:
            return problems
        if target == "draft":
            return draft_tensor_problems(weights, vocab_size=self.engine.vocab_size)
        return [
            problem
            for name, tensor in weights.items()
            if tensor.is_floating_point()
            for problem in weight_problems(name, tensor)
        ]

    def _probe_generation(self) -> None:
        """A few greedy tokens right after a sync, so that weights vLLM cannot run are rolled back within the commit
        rather than found by the next rollout."""
        self.engine.generate([[0]], max_tokens=_PROBE_TOKENS, temperature=0.0, ignore_eos=True)

    def _roll_back(self, target: str, error: Exception) -> ServerError:
        version = self.versions[target]
        failure = f"Applying the {target} update failed ({type(error).__name__}: {error})"
        try:
            self.engine.sync_weights(target, self._rollback_points[target].items())
        except Exception as rollback_error:
            self._broken[target] = (
                f"{failure}, and restoring {target} version {version} failed too "
                f"({type(rollback_error).__name__}: {rollback_error}); commit a complete {target} update"
            )
            logger.error(self._broken[target])
            return ServerError(500, self._broken[target] + ".")
        logger.warning("%s; rolled back to version %s", failure, version)
        return ServerError(
            500, f"{failure}. The server restored the previous {target} weights (version {version}) and serves them."
        )

    # ----------------------------------------------------------------------------------- staging

    def begin(self, request: BeginRequest) -> _Transaction:
        if request.target == "draft" and not self.engine.has_draft:
            raise ServerError(400, "This server has no draft: start it with --draft <folder> to update a draft.")
        version = request.version if request.version is not None else self.versions[request.target] + 1
        return self.transactions.begin(request.target, version)

    def stage_http_chunk(self, transaction_id: str, index: int, body: bytes, sha256: str | None) -> int:
        self.transactions.get(transaction_id)
        if sha256 is not None and hashlib.sha256(body).hexdigest() != sha256.strip().lower():
            raise ServerError(
                400,
                f"Chunk {index}: the SHA-256 of the {len(body)} bytes received differs from the {SHA256_HEADER} "
                "header (truncated or altered in transit). Nothing staged; send the chunk again.",
            )
        try:
            tensors = load_safetensors(body)
        except (SafetensorError, ValueError) as error:
            raise ServerError(
                400,
                f"Chunk {index} is not a valid safetensors file ({len(body)} bytes; truncated or corrupt?): {error}. "
                "Nothing staged.",
            ) from error
        return self._stage(transaction_id, index, tensors, len(body))

    def _stage(self, transaction_id: str, index: int, tensors: dict[str, torch.Tensor], num_bytes: int) -> int:
        if not tensors:
            raise ServerError(400, f"Chunk {index} holds no tensor. Nothing staged.")
        target = self.transactions.get(transaction_id).target
        try:
            self.engine.check_weights(
                target, [(name, tensor.shape) for name, tensor in tensors.items()], complete=False
            )
        except ValueError as error:
            raise ServerError(400, f"Chunk {index} refused: {error}") from error
        self.transactions.add_chunk(transaction_id, index, tensors, num_bytes)
        return len(tensors)

    # ----------------------------------------------------------------------------------- NCCL (GPU, untested here)

    def init_nccl(self, request: NcclInitRequest) -> None:
        if not torch.cuda.is_available():
            raise ServerError(
                400, "NCCL weight transfer needs a server on a CUDA device; send the weights over HTTP instead."
            )
        from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group

        device = torch.device("cuda", torch.cuda.current_device())
        # The trainer is rank 0 (the sender); this server's single worker is rank 1.
        group = stateless_init_process_group(
            request.master_address, request.master_port, rank=1, world_size=2, device=device.index
        )
        self._nccl = _NcclReceiver(group, device, request.packed_buffer_size_bytes, request.packed_num_buffers)

    def stage_nccl_chunk(self, transaction_id: str, index: int, request: NcclChunkRequest) -> int:
        """Receive one chunk broadcast by the trainer, then stage it. The broadcast is drained before the transaction
        and the tensors are checked, so that a refused chunk does not leave the trainer blocked inside NCCL."""
        if self._nccl is None:
            raise ServerError(400, "No NCCL group: call /nccl/init first (the client's init_nccl).")
        if not len(request.names) == len(request.dtype_names) == len(request.shapes):
            raise ServerError(400, "names, dtype_names and shapes must have the same length.")
        dtypes = [getattr(torch, name, None) for name in request.dtype_names]
        if not all(isinstance(dtype, torch.dtype) for dtype in dtypes):
            raise ServerError(400, f"Unknown dtype in {request.dtype_names}.")
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_consumer

        received: dict[str, torch.Tensor] = {}

        def keep(unpacked: list[tuple[str, torch.Tensor]]) -> None:
            # The unpacked tensors are views of a receive buffer that is reused.
            received.update((name, tensor.clone()) for name, tensor in unpacked)

        packed_nccl_broadcast_consumer(
            iter(zip(request.names, zip(request.shapes, dtypes))),
            group=self._nccl.group,
            src=0,
            post_unpack_func=keep,
            buffer_size_bytes=self._nccl.buffer_size_bytes,
            num_buffers=self._nccl.num_buffers,
            device=self._nccl.device,
        )
        num_bytes = sum(tensor.numel() * tensor.element_size() for tensor in received.values())
        # Checked once received: refusing earlier would leave the trainer blocked inside the broadcast.
        with self.transactions.reserving(transaction_id, index, num_bytes):
            return self._stage(transaction_id, index, received, num_bytes)


# --------------------------------------------------------------------------------------- HTTP app


def build_app(server: RolloutServer, *, api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving `server` (see the module docstring for the endpoints); with `api_key`, every endpoint
    but ``/health`` needs it as a bearer token."""
    if api_key == "":
        raise ValueError("api_key is empty: give a key, or None for an API without authentication.")
    expected = None if api_key is None else api_key.encode()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        sweeper = asyncio.create_task(_sweep_expired(server.transactions))
        try:
            yield
        finally:
            sweeper.cancel()

    app = FastAPI(title="hf-spec-cotrain rollout server", lifespan=lifespan)

    # A middleware, not a dependency: FastAPI reads a request's body before solving its dependencies, and an
    # unauthenticated client must not make the server hold a body in memory.
    @app.middleware("http")
    async def authenticate(request: Request, call_next) -> Any:
        if expected is not None and request.url.path != "/health":
            scheme, credentials = get_authorization_scheme_param(request.headers.get("Authorization"))
            if scheme.lower() != "bearer" or not hmac.compare_digest(credentials.encode(), expected):
                return JSONResponse(
                    {
                        "error": "This server needs its API key: send `Authorization: Bearer <key>` (the client's "
                        f"api_key, or the {API_KEY_ENV} environment variable)."
                    },
                    status_code=401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
        response = await call_next(request)
        response.headers[INSTANCE_HEADER] = server.instance_id
        return response

    @app.exception_handler(ServerError)
    async def server_error(request: Request, error: ServerError) -> JSONResponse:
        if error.status_code >= 500:
            logger.error("%s %s: %s", request.method, request.url.path, error.message)
        return JSONResponse({"error": error.message}, status_code=error.status_code)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in problem['loc'])}: {problem['msg']}" for problem in error.errors()
        )
        return JSONResponse({"error": f"Invalid request: {problems}"}, status_code=422)

    # Starlette logs the traceback of anything that reaches this handler.
    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, error: Exception) -> JSONResponse:
        return JSONResponse({"error": f"{type(error).__name__}: {error}"}, status_code=500)

    @app.get("/health")
    async def health() -> dict:
        return server.health()

    @app.get("/weights/version")
    async def weights_version() -> dict:
        return dict(server.versions)

    @app.post("/generate")
    async def generate(request: GenerateRequest) -> dict:
        server.check_prompts(request.prompt_token_ids)
        return await server.on_engine_thread(server.generate, request)

    @app.post("/weights/check")
    async def check(request: CheckRequest) -> dict:
        if len(request.names) != len(request.shapes):
            raise ServerError(400, f"{len(request.names)} names but {len(request.shapes)} shapes.")
        try:  # the layouts are read only: no need for the engine thread
            server.engine.check_weights(request.target, list(zip(request.names, request.shapes)))
        except ValueError as error:
            raise ServerError(400, str(error)) from error
        return {"target": request.target, "num_tensors": len(request.names)}

    @app.post("/weights/transactions", status_code=201)
    async def begin(request: BeginRequest) -> dict:
        transaction = server.begin(request)
        return {
            "transaction_id": transaction.id,
            "target": transaction.target,
            "version": transaction.version,
            "idle_timeout_seconds": server.transactions.idle_timeout,
        }

    @app.get("/weights/transactions")
    async def open_transactions() -> dict:
        return {"transactions": server.transactions.describe()}

    @app.put("/weights/transactions/{transaction_id}/chunks/{index}")
    async def put_chunk(transaction_id: str, index: int, request: Request) -> dict:
        _check_index(index)
        length = request.headers.get("content-length")
        if length is None:
            raise ServerError(411, "A chunk needs a Content-Length header.")
        if not length.isdigit():
            raise ServerError(400, f"Content-Length {length!r} is not a number of bytes.")
        if int(length) > server.max_chunk_bytes:
            raise ServerError(
                413, f"Chunk {index} has {length} bytes, over this server's max_chunk_bytes={server.max_chunk_bytes}."
            )
        with server.transactions.reserving(transaction_id, index, int(length)):
            body = await request.body()
            num_tensors = await run_in_threadpool(
                server.stage_http_chunk, transaction_id, index, body, request.headers.get(SHA256_HEADER)
            )
        return {"index": index, "num_tensors": num_tensors, "bytes": len(body)}

    @app.post("/weights/transactions/{transaction_id}/nccl_chunks/{index}")
    async def nccl_chunk(transaction_id: str, index: int, request: NcclChunkRequest) -> dict:
        _check_index(index)
        num_tensors = await server.on_engine_thread(server.stage_nccl_chunk, transaction_id, index, request)
        return {"index": index, "num_tensors": num_tensors}

    @app.post("/weights/transactions/{transaction_id}/commit")
    async def commit(transaction_id: str, request: CommitRequest) -> dict:
        transaction = server.transactions.take(transaction_id, request.num_chunks)
        return await server.on_engine_thread(server.commit, transaction, request.num_chunks)

    @app.delete("/weights/transactions/{transaction_id}")
    async def abort(transaction_id: str) -> dict:
        server.transactions.abort(transaction_id)
        return {"aborted": transaction_id}

    @app.post("/nccl/init")
    async def init_nccl(request: NcclInitRequest) -> dict:
        await server.on_engine_thread(server.init_nccl, request)
        return {"status": "ok"}

    return app


def _accepted_dtypes(engine_dtype: torch.dtype) -> set[torch.dtype]:
    """The engine's own dtype, or float32 for a floating weight: a trainer's master weights, which vLLM rounds."""
    return {engine_dtype, torch.float32} if engine_dtype.is_floating_point else {engine_dtype}


def _listed(ids: list[int]) -> str:
    """`ids` in an error message: the first few and how many more."""
    more = len(ids) - _LISTED_IDS
    return f"{ids}" if more <= 0 else f"{ids[:_LISTED_IDS]} and {more} more"


def _half_of_memory() -> int:
    """The default limit on staged bytes: half of this machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve beyond this machine
        return False


def _check_index(index: int) -> None:
    if index < 0:
        raise ServerError(400, f"Chunk index {index} is negative; chunks are numbered 0, 1, ...")


async def _sweep_expired(transactions: WeightTransactions) -> None:
    """Free the memory of abandoned transactions even when no request comes to trigger the lazy check."""
    interval = min(transactions.idle_timeout / 4, 5.0)
    while True:
        await asyncio.sleep(interval)
        for transaction_id in transactions.discard_expired():
            logger.warning("Discarded transaction %s: idle for over %g s", transaction_id, transactions.idle_timeout)


def serve(
    *,
    engine_kwargs: dict[str, Any],
    host: str = "127.0.0.1",
    port: int = 8000,
    transaction_timeout: float = 600.0,
    max_chunk_bytes: int = 2**31,
    max_open_transactions: int = DEFAULT_MAX_OPEN_TRANSACTIONS,
    max_staged_bytes: int | None = None,
    max_chunks: int = DEFAULT_MAX_CHUNKS,
    api_key: str | None = None,
    allow_unauthenticated: bool = False,
    log_level: str = "info",
) -> None:
    """Build the engine (`VLLMRolloutEngine(**engine_kwargs)`), then serve it until SIGINT/SIGTERM.

    Without `api_key`, listening beyond loopback is refused unless `allow_unauthenticated` says the API is open."""
    import uvicorn

    open_beyond_loopback = api_key is None and not _is_loopback(host)
    if open_beyond_loopback and not allow_unauthenticated:
        raise ValueError(
            f"--host {host} listens beyond this machine, and without an API key anyone who reaches the port can "
            f"replace the policy. Set the {API_KEY_ENV} environment variable (or --api_key), or pass "
            "--allow_unauthenticated to serve an open API on a network you trust."
        )
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    if open_beyond_loopback:
        logger.warning(
            "Listening on %s without an API key (--allow_unauthenticated): anyone can update weights.", host
        )
    server = RolloutServer(
        lambda: VLLMRolloutEngine(**engine_kwargs),
        transaction_timeout=transaction_timeout,
        max_chunk_bytes=max_chunk_bytes,
        max_open_transactions=max_open_transactions,
        max_staged_bytes=max_staged_bytes,
        max_chunks=max_chunks,
    )
    try:
        uvicorn.run(build_app(server, api_key=api_key), host=host, port=port, log_level=log_level)
    finally:
        server.close()
