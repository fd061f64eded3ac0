"""The rollout server of ``hf-spec-cotrain vllm-serve``: a `VLLMRolloutEngine` behind HTTP, with transactional weight
updates. This module is the FastAPI app and `serve`; the routes, headers and errors are `protocol`'s, the staging of
weight updates `weight_transactions`', the engine and the commits `rollout_server`'s.

Why not ``vllm serve`` (TRL's server mode) with vLLM's weight-transfer endpoints: those load each tensor into the
running model as it arrives (a failure half-way leaves a half-updated policy serving rollouts), move weights only
over NCCL or CUDA IPC (nothing on a CPU machine), and the OpenAI-style endpoints do not report the speculative
counters of a call. Here the engine runs in-process inside the server (one process, no engine-core subprocess), so
the same verified sync code serves the colocated trainer and the server.

With an API key (``--api_key`` or the environment variable ``HF_SPEC_COTRAIN_API_KEY``), every endpoint but
``/health`` needs ``Authorization: Bearer <key>`` (401 otherwise), checked before the request's body is read. The
server refuses to listen beyond loopback without a key unless told the API is open (``allow_unauthenticated``).
"""

import asyncio
import hmac
import ipaddress
import logging
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security.utils import get_authorization_scheme_param
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from .engine import WeightSet
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
    ServerError,
)
from .rollout_server import RolloutServer
from .vllm_engine import VLLMRolloutEngine
from .vllm_support import check_vllm_server_can_serve
from .weight_transactions import (
    DEFAULT_MAX_CHUNKS,
    DEFAULT_MAX_OPEN_TRANSACTIONS,
    WeightTransactions,
    check_chunk_index,
)


__all__ = ["build_app", "build_engine", "serve"]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------- request bodies


class _Body(BaseModel):
    """A JSON body of one of `protocol`'s routes, validated here (pydantic comes with the server's extra, not with the
    client's): unknown fields are refused."""

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


# --------------------------------------------------------------------------------------- HTTP app


def build_app(server: RolloutServer, *, api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving `server` (`protocol`'s docstring lists the endpoints); with `api_key`, every endpoint
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
        if expected is not None and request.url.path != HEALTH_ROUTE:
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

    @app.get(HEALTH_ROUTE)
    async def health() -> dict:
        return server.health()

    @app.get(VERSION_ROUTE)
    async def weights_version() -> dict:
        return dict(server.versions)

    @app.post(GENERATE_ROUTE)
    async def generate(request: GenerateRequest) -> dict:
        fields = request.model_dump()
        server.check_generate_request(**fields)
        return await server.on_engine_thread(server.generate, **fields)

    @app.post(CHECK_ROUTE)
    async def check(request: CheckRequest) -> dict:
        if len(request.names) != len(request.shapes):
            raise ServerError(400, f"{len(request.names)} names but {len(request.shapes)} shapes.")
        try:  # the layouts are read only: no need for the engine thread
            server.engine.check_weights(request.target, list(zip(request.names, request.shapes)))
        except ValueError as error:
            raise ServerError(400, str(error)) from error
        return {"target": request.target, "num_tensors": len(request.names)}

    @app.post(TRANSACTIONS_ROUTE, status_code=201)
    async def begin(request: BeginRequest) -> dict:
        transaction = server.begin(request.target, request.version)
        return {
            "transaction_id": transaction.id,
            "target": transaction.target,
            "version": transaction.version,
            "idle_timeout_seconds": server.transactions.idle_timeout,
        }

    @app.get(TRANSACTIONS_ROUTE)
    async def open_transactions() -> dict:
        return {"transactions": server.transactions.describe()}

    @app.put(CHUNK_ROUTE)
    async def put_chunk(transaction_id: str, index: int, request: Request) -> dict:
        check_chunk_index(index)
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

    @app.post(NCCL_CHUNK_ROUTE)
    async def nccl_chunk(transaction_id: str, index: int, request: NcclChunkRequest) -> dict:
        check_chunk_index(index)
        num_tensors = await server.on_engine_thread(
            server.stage_nccl_chunk, transaction_id, index, **request.model_dump()
        )
        return {"index": index, "num_tensors": num_tensors}

    @app.post(COMMIT_ROUTE)
    async def commit(transaction_id: str, request: CommitRequest) -> dict:
        transaction = server.transactions.take(transaction_id, request.num_chunks)
        return await server.on_engine_thread(server.commit, transaction, request.num_chunks)

    @app.delete(TRANSACTION_ROUTE)
    async def abort(transaction_id: str) -> dict:
        server.transactions.abort(transaction_id)
        return {"aborted": transaction_id}

    @app.post(NCCL_INIT_ROUTE)
    async def init_nccl(request: NcclInitRequest) -> dict:
        await server.on_engine_thread(server.init_nccl, **request.model_dump())
        return {"status": "ok"}

    return app


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve beyond this machine
        return False


async def _sweep_expired(transactions: WeightTransactions) -> None:
    """Free the memory of abandoned transactions even when no request comes to trigger the lazy check."""
    interval = min(transactions.idle_timeout / 4, 5.0)
    while True:
        await asyncio.sleep(interval)
        for transaction_id in transactions.discard_expired():
            logger.warning("Discarded transaction %s: idle for over %g s", transaction_id, transactions.idle_timeout)


def build_engine(engine_kwargs: dict[str, Any]) -> VLLMRolloutEngine:
    """`VLLMRolloutEngine(**engine_kwargs)`, once vLLM's registry says it can serve the policy with the draft's taps
    (`check_vllm_server_can_serve`: the trainer's colocated engine passes the same check, and also refuses vLLM's
    Transformers backend, harmless in a server's own process)."""
    check_vllm_server_can_serve(
        engine_kwargs["model"],
        engine_kwargs.get("draft_model"),
        trust_remote_code=engine_kwargs.get("trust_remote_code", False),
    )
    return VLLMRolloutEngine(**engine_kwargs)


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
    """Build the engine (`build_engine`), then serve it until SIGINT/SIGTERM.

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
        lambda: build_engine(engine_kwargs),
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
