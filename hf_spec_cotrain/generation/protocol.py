"""The wire protocol of ``hf-spec-cotrain vllm-serve``, shared by its server and its client: routes, headers, the API
key's environment variable, and the error every refusal answers. Standard library only: the trainer's client
(``requests`` and no web framework) imports it.

Endpoints (JSON; every error is ``{"error": "<message>"}`` with a 4xx/5xx status, `ServerError`):
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
"""

__all__ = [
    "API_KEY_ENV",
    "CHECK_ROUTE",
    "CHUNK_ROUTE",
    "COMMIT_ROUTE",
    "GENERATE_ROUTE",
    "HEALTH_ROUTE",
    "INSTANCE_HEADER",
    "NCCL_CHUNK_ROUTE",
    "NCCL_INIT_ROUTE",
    "SHA256_HEADER",
    "TRANSACTIONS_ROUTE",
    "TRANSACTION_ROUTE",
    "VERSION_ROUTE",
    "ServerError",
]

# The SHA-256 (hex) of a chunk's bytes, checked by the server: a truncated or altered chunk is refused.
SHA256_HEADER = "X-Content-SHA256"
# An id the server draws at every start, on every answer: a new one means the pushed weights were lost.
INSTANCE_HEADER = "X-Server-Instance"
# The API key of server and client when none is given (an environment variable stays out of `ps` and of saved
# arguments).
API_KEY_ENV = "HF_SPEC_COTRAIN_API_KEY"

# Routes; those with fields are filled in with `str.format` by the client and matched as path parameters by the server.
HEALTH_ROUTE = "/health"
VERSION_ROUTE = "/weights/version"
GENERATE_ROUTE = "/generate"
CHECK_ROUTE = "/weights/check"
TRANSACTIONS_ROUTE = "/weights/transactions"
TRANSACTION_ROUTE = TRANSACTIONS_ROUTE + "/{transaction_id}"
CHUNK_ROUTE = TRANSACTION_ROUTE + "/chunks/{index}"
NCCL_CHUNK_ROUTE = TRANSACTION_ROUTE + "/nccl_chunks/{index}"
COMMIT_ROUTE = TRANSACTION_ROUTE + "/commit"
NCCL_INIT_ROUTE = "/nccl/init"


class ServerError(Exception):
    """An error answered as ``{"error": message}`` with `status_code`."""

    def __init__(self, status_code: int, message: str):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
