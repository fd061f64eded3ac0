"""Weight updates as transactions, before any of them reaches the engine: chunks staged in memory until a commit
(`WeightTransactions`), each chunk parsed and checked as it arrives (`parse_chunk`), and the checks of a complete set's
values before it is synced (`value_problems`). No web framework here: the rollout server (`rollout_server`) commits
what these stage, and the HTTP app (`server`) only routes requests to both.

Staging is bounded before memory or engine time is spent: open transactions (429 beyond ``max_open_transactions``),
bytes staged, counted from each chunk's Content-Length before its body is read (413 when one transaction would exceed
``max_staged_bytes``, 429 when the transactions together would), and chunk indices and ``num_chunks`` (413 beyond
``max_chunks``). A transaction idle for longer than its ``idle_timeout`` is discarded.
"""

import hashlib
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from ..draft.checks import draft_tensor_problems, weight_problems
from .engine import WeightSet
from .protocol import SHA256_HEADER, ServerError


__all__ = [
    "DEFAULT_MAX_CHUNKS",
    "DEFAULT_MAX_OPEN_TRANSACTIONS",
    "WeightTransaction",
    "WeightTransactions",
    "check_chunk_index",
    "parse_chunk",
    "value_problems",
]

# Ids of expired transactions remembered so that a late chunk or commit hears "expired" rather than "unknown".
_REMEMBERED_EXPIRED = 1024
DEFAULT_MAX_OPEN_TRANSACTIONS = 4
DEFAULT_MAX_CHUNKS = 10_000
# Ids listed in one error message at most (a commit may name up to `max_chunks` chunks).
_LISTED_IDS = 10


@dataclass
class WeightTransaction:
    """One weight update being staged: its chunks by index, their sizes, and when it was last touched."""

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
        self._open: dict[str, WeightTransaction] = {}
        self._expired: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def begin(self, target: WeightSet, version: int) -> WeightTransaction:
        transaction = WeightTransaction(id=uuid.uuid4().hex, target=target, version=version)
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

    def get(self, transaction_id: str) -> WeightTransaction:
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

    def take(self, transaction_id: str, num_chunks: int) -> WeightTransaction:
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

    def _get(self, transaction_id: str) -> WeightTransaction:
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


def check_chunk_index(index: int) -> None:
    if index < 0:
        raise ServerError(400, f"Chunk index {index} is negative; chunks are numbered 0, 1, ...")


def parse_chunk(index: int, body: bytes, sha256: str | None) -> dict[str, torch.Tensor]:
    """The tensors of an uploaded chunk: its bytes checked against the SHA-256 the client sent (when it sent one),
    then read as safetensors (never pickle). Refused with 400 otherwise."""
    if sha256 is not None and hashlib.sha256(body).hexdigest() != sha256.strip().lower():
        raise ServerError(
            400,
            f"Chunk {index}: the SHA-256 of the {len(body)} bytes received differs from the {SHA256_HEADER} "
            "header (truncated or altered in transit). Nothing staged; send the chunk again.",
        )
    try:
        return load_safetensors(body)
    except (SafetensorError, ValueError) as error:
        raise ServerError(
            400,
            f"Chunk {index} is not a valid safetensors file ({len(body)} bytes; truncated or corrupt?): {error}. "
            "Nothing staged.",
        ) from error


def value_problems(
    target: WeightSet, weights: dict[str, torch.Tensor], *, engine_dtypes: dict[str, torch.dtype], vocab_size: int
) -> list[str]:
    """Dtypes first (compared as sent, before the engine converts anything), then values: finite weights and, for
    a draft, `d2t`/`t2d` inside the target vocabulary (`vocab_size`). An update that passes the name and shape checks
    but fails these would pass the read-back (which converts to the engine's dtypes) or fail only at the next
    rollout."""
    problems = [
        f"`{name}` is {tensor.dtype}, the engine holds it in {engine_dtypes[name]}"
        for name, tensor in weights.items()
        if name in engine_dtypes and tensor.dtype not in _accepted_dtypes(engine_dtypes[name])
    ]
    if problems:
        return problems
    if target == "draft":
        return draft_tensor_problems(weights, vocab_size=vocab_size)
    return [
        problem
        for name, tensor in weights.items()
        if tensor.is_floating_point()
        for problem in weight_problems(name, tensor)
    ]


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
