"""The trainer's side of ``hf-spec-cotrain vllm-serve``: rollouts and transactional weight updates over HTTP.

Weights travel as safetensors bytes (never pickle), in chunks of about `chunk_bytes` that form one transaction on
the server: nothing is applied until every chunk has arrived and the commit succeeds, and a failed commit leaves
the server on its previous weights. After `init_nccl` (GPU only, untested here) the tensors of each chunk travel
over NCCL instead, in the same transaction.

Requests that cannot connect are sent again, with backoff, for up to `reconnect_timeout` seconds, then raise
`EngineUnavailableError`. A server that restarted (its ``X-Server-Instance`` header changed) holds the weights of its
folders again: the call that finds it raises `EngineRestartedError`, so that the caller pushes its weights again.
"""

import functools
import hashlib
import math
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar

import requests
import torch
from safetensors.torch import save as save_safetensors

from .engine import (
    EngineRestartedError,
    EngineUnavailableError,
    RolloutOutput,
    SpecDecodeStats,
    WeightSet,
    check_weight_set,
)
from .protocol import (
    API_KEY_ENV,
    CHECK_ROUTE,
    CHUNK_ROUTE,
    COMMIT_ROUTE,
    GENERATE_ROUTE,
    HEALTH_ROUTE,
    INSTANCE_HEADER,
    NCCL_CHUNK_ROUTE,
    NCCL_INIT_ROUTE,
    SHA256_HEADER,
    TRANSACTION_ROUTE,
    TRANSACTIONS_ROUTE,
    VERSION_ROUTE,
)


__all__ = [
    "BadRolloutRequestError",
    "SentChunks",
    "ServerRolloutOutput",
    "VLLMServerClient",
    "VLLMServerError",
    "WeightUpdate",
    "WeightsVersion",
]

DEFAULT_CHUNK_BYTES = 256 * 2**20
# Backoff between attempts to reach a server that refuses connections (restarting): doubling up to the cap.
_FIRST_RETRY_DELAY = 0.5
_MAX_RETRY_DELAY = 8.0
# vLLM's default geometry for packed NCCL broadcasts; both sides must use the same.
_NCCL_BUFFER_BYTES = 2**30
_NCCL_NUM_BUFFERS = 2


class VLLMServerError(RuntimeError):
    """The server refused a request or failed; `status_code` is its HTTP status and the message its reason."""

    def __init__(self, message: str, *, status_code: int):
        super().__init__(message)
        self.status_code = status_code

    def __reduce__(self):
        # Picklable with its status (the pipeline's stages share a sync's errors as objects).
        return functools.partial(type(self), status_code=self.status_code), self.args


class BadRolloutRequestError(VLLMServerError, ValueError):
    """The server refused a generate request as the caller's mistake (400 or 422: a sampling value vLLM refuses, an
    empty or too long prompt, ids outside the vocabulary), not a server fault: sent again, it fails the same way."""


@dataclass
class WeightsVersion:
    """Versions of the weights the server holds (0: loaded from the folders at start; None: no draft)."""

    policy: int
    draft: int | None


@dataclass
class WeightUpdate:
    """What one committed weight update did (seconds measured on the server)."""

    target: str
    version: int
    num_tensors: int
    num_chunks: int
    num_bytes: int
    load_seconds: float
    verify_seconds: float | None


@dataclass
class SentChunks:
    """What one `send_chunks` call staged: its chunks and their bytes."""

    num_chunks: int
    num_bytes: int


@dataclass
class ServerRolloutOutput(RolloutOutput):
    """`RolloutOutput` plus the weights versions that produced it. Logprobs the server could not put in JSON
    (non-finite) are NaN."""

    versions: WeightsVersion


class VLLMServerClient:
    """Client of one ``hf-spec-cotrain vllm-serve`` server.

    Args:
        base_url: The server, e.g. ``http://127.0.0.1:8000``.
        timeout: Seconds to wait for any answer (a generation or a commit can take a while).
        connect_timeout: Seconds to wait for a connection.
        api_key: The server's API key; defaults to the ``HF_SPEC_COTRAIN_API_KEY`` environment variable. Sent as a
            bearer token, kept nowhere else.
        reconnect_timeout: Seconds during which a request that cannot connect is sent again, with backoff.
    """

    # One server serves every training process: only the main process pushes weights (`RolloutEngine`).
    shared_across_processes: ClassVar[bool] = True

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        *,
        timeout: float = 600.0,
        connect_timeout: float = 10.0,
        api_key: str | None = None,
        reconnect_timeout: float = 60.0,
    ):
        if timeout <= 0 or connect_timeout <= 0 or reconnect_timeout < 0:
            raise ValueError(
                f"timeout={timeout} and connect_timeout={connect_timeout} must be positive, reconnect_timeout="
                f"{reconnect_timeout} at least 0 (seconds)."
            )
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.reconnect_timeout = reconnect_timeout
        self.session = requests.Session()
        api_key = api_key or os.environ.get(API_KEY_ENV)
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"
        self._instance: str | None = None
        self._nccl_group = None
        self._nccl_device: torch.device | None = None

    # ----------------------------------------------------------------------------------- status

    def health(self) -> dict[str, Any]:
        """The server's status; raises `VLLMServerError` (503) when it cannot serve rollouts. A probe: not retried."""
        return self._request("GET", HEALTH_ROUTE, timeout=self.connect_timeout, retry=False)

    def wait_until_ready(self, timeout: float = 300.0, *, poll_interval: float = 1.0) -> dict[str, Any]:
        """Poll `health` until the server answers 200; raise TimeoutError with the last problem after `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.health()
            except (requests.ConnectionError, requests.Timeout, VLLMServerError) as error:
                problem = error
            if time.monotonic() + poll_interval > deadline:
                raise TimeoutError(f"The server at {self.base_url} was not ready within {timeout:g} s: {problem}")
            time.sleep(poll_interval)

    def weights_version(self) -> WeightsVersion:
        return WeightsVersion(**self._request("GET", VERSION_ROUTE))

    def check_weights(self, which: WeightSet, named_shapes: Iterable[tuple[str, Sequence[int]]]) -> None:
        """Raise the ValueError a sync of tensors of these names and shapes would meet on the server (unknown,
        missing, repeated or mis-shaped tensors), sending no data."""
        named_shapes = list(named_shapes)
        body = {
            "target": which,
            "names": [name for name, _ in named_shapes],
            "shapes": [[int(size) for size in shape] for _, shape in named_shapes],
        }
        try:
            self._request("POST", CHECK_ROUTE, json=body)
        except VLLMServerError as error:
            if error.status_code != 400:
                raise
            raise ValueError(str(error)) from error

    # ----------------------------------------------------------------------------------- rollouts

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        n: int = 1,
        logprobs: bool = False,
        **sampling_kwargs: Any,
    ) -> ServerRolloutOutput:
        """`VLLMRolloutEngine.generate` on the server: `n` completions per prompt, prompt-major, with the
        speculative counters of this call. `sampling_kwargs` (JSON values) go to `vllm.SamplingParams`. A request the
        server refuses as bad raises `BadRolloutRequestError` (a ValueError) naming the field."""
        body = {
            "prompt_token_ids": [list(map(int, ids)) for ids in prompt_token_ids],
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "seed": seed,
            "n": n,
            "logprobs": logprobs,
            "sampling_kwargs": sampling_kwargs,
        }
        try:
            answer = self._request("POST", GENERATE_ROUTE, json=body)
        except VLLMServerError as error:
            if error.status_code not in (400, 422):
                raise
            raise BadRolloutRequestError(
                f"{error} The request was bad, not the server: nothing was generated; fix the field named above.",
                status_code=error.status_code,
            ) from error
        completion_logprobs = answer["logprobs"]
        if completion_logprobs is not None:
            completion_logprobs = [[math.nan if x is None else x for x in row] for row in completion_logprobs]
        return ServerRolloutOutput(
            completion_ids=answer["completion_ids"],
            logprobs=completion_logprobs,
            spec_decode=SpecDecodeStats.from_json(answer["spec_decode"]),
            versions=WeightsVersion(**answer["versions"]),
        )

    # ----------------------------------------------------------------------------------- weights

    def sync_weights(
        self,
        which: WeightSet,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        version: int | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> WeightUpdate:
        """Replace every weight of `which` as one transaction: the policy in HF names (e.g.
        `model.state_dict().items()`), the draft in its checkpoint names (e.g. `draft.state_dict().items()`).

        `version` (default: the server's current one plus 1) is what `weights_version` reports afterwards.
        Raises `VLLMServerError` naming the problem if the server refuses or fails; the server then keeps its
        previous weights. The same as `begin_update`, `send_chunks` and `commit_update`, aborted on any failure.
        """
        _check_chunk_bytes(chunk_bytes)
        transaction_id = self.begin_update(which, version=version)
        try:
            sent = self.send_chunks(transaction_id, named_tensors, chunk_bytes=chunk_bytes)
            return self.commit_update(transaction_id, num_chunks=sent.num_chunks, num_bytes=sent.num_bytes)
        except BaseException:
            self.abort_update(transaction_id)
            raise

    def begin_update(self, which: WeightSet, *, version: int | None = None) -> str:
        """Open a weight-update transaction of `which` on the server; returns its id. Chunks may then come from
        several senders (each pipeline stage its own weights, `stage_sync.sync_stages`) before one commit."""
        check_weight_set(which)
        begun = self._request("POST", TRANSACTIONS_ROUTE, json={"target": which, "version": version})
        return begun["transaction_id"]

    def send_chunks(
        self,
        transaction_id: str,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        first_index: int = 0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> SentChunks:
        """Stage `named_tensors` in the transaction as chunks of about `chunk_bytes`, numbered from `first_index`
        (a later sender continues where the previous one stopped). One chunk is held in memory at a time. Nothing is
        applied before `commit_update`."""
        _check_chunk_bytes(chunk_bytes)
        device = self._nccl_device if self._nccl_group is not None else torch.device("cpu")
        num_chunks = num_bytes = 0
        for index, chunk in enumerate(iter_chunks(named_tensors, chunk_bytes=chunk_bytes, device=device), first_index):
            if self._nccl_group is None:
                num_bytes += self._send_http_chunk(transaction_id, index, chunk)
            else:
                num_bytes += self._send_nccl_chunk(transaction_id, index, chunk)
            num_chunks += 1
        return SentChunks(num_chunks=num_chunks, num_bytes=num_bytes)

    def commit_update(self, transaction_id: str, *, num_chunks: int, num_bytes: int) -> WeightUpdate:
        """Apply the transaction's chunks 0..`num_chunks`-1 (`num_bytes`: their size, reported back) as one update:
        checked, synced and read back by the server, or refused with the previous weights kept."""
        if num_chunks == 0:
            raise ValueError("No tensors were sent: an update replaces every weight of its set.")
        committed = self._request(
            "POST", COMMIT_ROUTE.format(transaction_id=transaction_id), json={"num_chunks": num_chunks}
        )
        return WeightUpdate(
            target=committed["target"],
            version=committed["version"],
            num_tensors=committed["num_tensors"],
            num_chunks=num_chunks,
            num_bytes=num_bytes,
            load_seconds=committed["load_seconds"],
            verify_seconds=committed["verify_seconds"],
        )

    def abort_update(self, transaction_id: str) -> None:
        """Free the server's staged chunks of a transaction that will not be committed. Quiet: a commit that was
        reached has already discarded them (404), and an unreachable server drops them when they expire."""
        try:
            self._request(
                "DELETE",
                TRANSACTION_ROUTE.format(transaction_id=transaction_id),
                timeout=self.connect_timeout,
                retry=False,
            )
        except (requests.RequestException, VLLMServerError):
            pass

    def _send_http_chunk(self, transaction_id: str, index: int, chunk: list[tuple[str, torch.Tensor]]) -> int:
        data = save_safetensors(dict(chunk))
        self._request(
            "PUT",
            CHUNK_ROUTE.format(transaction_id=transaction_id, index=index),
            data=data,
            headers={"Content-Type": "application/octet-stream", SHA256_HEADER: hashlib.sha256(data).hexdigest()},
        )
        return len(data)

    # ----------------------------------------------------------------------------------- NCCL (GPU, untested here)

    def init_nccl(
        self, *, device: torch.device | str | int = 0, master_address: str = "127.0.0.1", master_port: int = 51217
    ) -> None:
        """Open a 2-rank NCCL group with the server (this trainer is rank 0); later updates send tensors over it.

        `master_address` must be an address of this machine that the server can reach. GPU only: the server must
        run on CUDA. Untested in this project's CI (no GPU).
        """
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if device.type != "cuda":
            raise NotImplementedError(
                f"NCCL weight transfer needs a CUDA device, got {device}; without it updates go over HTTP."
            )
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        if device.index is not None:
            torch.cuda.set_device(device)
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "packed_buffer_size_bytes": _NCCL_BUFFER_BYTES,
            "packed_num_buffers": _NCCL_NUM_BUFFERS,
        }
        # The server blocks in the rendezvous while answering, so both sides must enter it at the same time.
        with ThreadPoolExecutor(max_workers=1) as executor:
            joined = executor.submit(self._request, "POST", NCCL_INIT_ROUTE, json=body)
            group = trainer_init({"master_address": master_address, "master_port": master_port, "world_size": 2})
            joined.result()
        self._nccl_group = group
        self._nccl_device = torch.device("cuda", torch.cuda.current_device())

    def _send_nccl_chunk(self, transaction_id: str, index: int, chunk: list[tuple[str, torch.Tensor]]) -> int:
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        body = {
            "names": [name for name, _ in chunk],
            "dtype_names": [str(tensor.dtype).removeprefix("torch.") for _, tensor in chunk],
            "shapes": [list(tensor.shape) for _, tensor in chunk],
        }
        # The server receives while answering the request, so the broadcast runs at the same time.
        with ThreadPoolExecutor(max_workers=1) as executor:
            staged = executor.submit(
                self._request, "POST", NCCL_CHUNK_ROUTE.format(transaction_id=transaction_id, index=index), json=body
            )
            packed_nccl_broadcast_producer(
                iter(chunk),
                group=self._nccl_group,
                src=0,
                post_iter_func=lambda item: item[1],
                buffer_size_bytes=_NCCL_BUFFER_BYTES,
                num_buffers=_NCCL_NUM_BUFFERS,
            )
            staged.result()
        return sum(tensor.numel() * tensor.element_size() for _, tensor in chunk)

    # ----------------------------------------------------------------------------------- plumbing

    def _request(
        self, method: str, path: str, *, timeout: float | None = None, retry: bool = True, **kwargs
    ) -> dict[str, Any]:
        deadline = time.monotonic() + self.reconnect_timeout
        delay, attempts = _FIRST_RETRY_DELAY, 0
        while True:
            attempts += 1
            try:
                response = self.session.request(
                    method, self.base_url + path, timeout=(self.connect_timeout, timeout or self.timeout), **kwargs
                )
                break
            except requests.ConnectionError as error:
                if not retry:
                    raise
                if time.monotonic() + delay > deadline:
                    raise EngineUnavailableError(
                        f"{method} {path}: the rollout server at {self.base_url} could not be reached in {attempts} "
                        f"attempts over {self.reconnect_timeout:g} s (last: {type(error).__name__}: {error}). Is "
                        "`hf-spec-cotrain vllm-serve` running at that address?"
                    ) from error
                time.sleep(delay)
                delay = min(2 * delay, _MAX_RETRY_DELAY)
        self._check_instance(response.headers.get(INSTANCE_HEADER), f"{method} {path}")
        if response.ok:
            return response.json()
        try:
            answer = response.json()
            reason = answer.get("error") or answer.get("detail") or response.text
        except ValueError:
            reason = response.text[:500] or response.reason
        raise VLLMServerError(
            f"{method} {path} on {self.base_url} failed with HTTP {response.status_code}: {reason}",
            status_code=response.status_code,
        )

    def _check_instance(self, instance: str | None, request: str) -> None:
        """Raise `EngineRestartedError` once when the server's instance differs from the one seen before."""
        if instance is None:
            return
        seen, self._instance = self._instance, instance
        if seen is not None and seen != instance:
            raise EngineRestartedError(
                f"The rollout server at {self.base_url} restarted (instance {seen[:8]} is now {instance[:8]}): it holds "
                f"the weights of its folders again, not those pushed into it. {request} was not served; push the "
                "policy and the draft again."
            )

    def close(self) -> None:
        self.session.close()

    def __enter__(self) -> "VLLMServerClient":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _check_chunk_bytes(chunk_bytes: int) -> None:
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes={chunk_bytes} must be positive.")


def iter_chunks(
    named_tensors: Iterable[tuple[str, torch.Tensor]], *, chunk_bytes: int, device: torch.device
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors, moved to `device`, detached and contiguous, into lists of about `chunk_bytes` (a tensor larger
    than that is a chunk of its own). Tensors sharing storage (tied weights) are copied: safetensors refuses them."""
    chunk: list[tuple[str, torch.Tensor]] = []
    size = 0
    storages: set[int] = set()
    for name, tensor in named_tensors:
        tensor = tensor.detach().to(device).contiguous()
        tensor_bytes = tensor.numel() * tensor.element_size()
        if chunk and size + tensor_bytes > chunk_bytes:
            yield chunk
            chunk, size, storages = [], 0, set()
        storage = tensor.untyped_storage().data_ptr()
        if storage in storages:
            tensor = tensor.clone()
        storages.add(tensor.untyped_storage().data_ptr())
        chunk.append((name, tensor))
        size += tensor_bytes
    if chunk:
        yield chunk
