"""The rollout server's state behind ``hf-spec-cotrain vllm-serve``'s HTTP API (`server`): a `VLLMRolloutEngine` on a
thread of its own, its weights versions and rollback points, and the commit of staged weight transactions
(`weight_transactions`). No web framework here: the HTTP app routes requests to it.

A commit checks that chunks 0..N-1 all arrived and that they form the complete set, and the tensors as sent (400
otherwise): each in the engine's dtype (or float32 master weights), every floating value finite, a draft's ``d2t``
inside the target vocabulary (`hf_spec_cotrain.draft.checks`). It then syncs, reads every tensor back through vLLM's
kernels and generates a few greedy tokens. If vLLM fails, the readback differs or that first generation fails, the
previous complete weights are synced back, the server keeps serving them, and the commit answers 500. The rollback
point is the last committed set (or, before the first commit, a readback of the engine), held on the CPU: one extra
copy of each model in host memory.

All engine calls (generation, syncs, NCCL receives) run on one thread, the one that built the engine (`vllm.LLM` is
not thread-safe): calls never interleave, so a rollout never sees half-loaded weights and the counters read around
a call are that call's. Chunk uploads are parsed on other threads, so a trainer can stage the next weights while
rollouts run.

The NCCL path (`init_nccl`, `stage_nccl_chunk`) follows TRL's server mode with vLLM's own helpers
(`stateless_init_process_group`, `packed_nccl_broadcast_consumer`) but stages the received tensors in the same
transaction as HTTP chunks. It needs CUDA and is **untested here** (the project's test machine has no GPU).
"""

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .engine import WeightSet, finite_or_none
from .protocol import ServerError
from .weight_transactions import (
    DEFAULT_MAX_CHUNKS,
    DEFAULT_MAX_OPEN_TRANSACTIONS,
    WeightTransaction,
    WeightTransactions,
    parse_chunk,
    value_problems,
)


if TYPE_CHECKING:
    from .vllm_engine import VLLMRolloutEngine


__all__ = ["RolloutServer"]

logger = logging.getLogger(__name__)

# Tokens generated after every commit: enough for the draft to propose and the policy to verify.
_PROBE_TOKENS = 4


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
        build_engine: Callable[[], "VLLMRolloutEngine"],
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

    def on_engine_thread(self, function: Callable, *args, **kwargs) -> Awaitable:
        return asyncio.wrap_future(self._executor.submit(function, *args, **kwargs))

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

    def check_generate_request(
        self, prompt_token_ids: list[list[int]], *, sampling_kwargs: dict[str, Any], **sampling: Any
    ) -> None:
        """Refuse (400, naming the field) a generate request that vLLM would refuse, before it waits for the engine's
        thread: the prompts against the policy (`_prompts_problem`), the sampling fields by vLLM's own checks
        (`VLLMRolloutEngine.sampling_params`). A caller's mistake is then not a server fault, and a huge prompt is
        refused by its length without a pass over its ids."""
        problem = self._prompts_problem(prompt_token_ids)
        if problem is None:
            try:
                self.engine.sampling_params(**sampling, **sampling_kwargs)
            except (ValueError, TypeError) as error:
                problem = str(error)
        if problem is not None:
            raise ServerError(400, f"Bad generate request: {problem}")

    def _prompts_problem(self, prompts: list[list[int]]) -> str | None:
        """What vLLM would refuse in `prompt_token_ids` (no prompt, an empty one, one that leaves no room for a
        completion token in ``max_model_len``), or ids outside the policy's vocabulary, where vLLM fails inside its
        kernels. Lengths first: they cost nothing."""
        if not prompts:
            return "prompt_token_ids is empty: give at least one prompt."
        max_model_len = self.engine.max_model_len
        for row, ids in enumerate(prompts):
            if not ids:
                return f"prompt_token_ids[{row}] is empty: every prompt needs at least one token."
            if len(ids) >= max_model_len:
                return (
                    f"prompt_token_ids[{row}] holds {len(ids)} tokens, and this server's max_model_len={max_model_len} "
                    f"holds prompt and completion together (at most {max_model_len - 1} prompt tokens). Shorten the "
                    "prompt, or start the server with a larger --max_model_len."
                )
        vocab_size = self.engine.vocab_size
        bad = [
            (row, position, id_)
            for row, ids in enumerate(prompts)
            if min(ids) < 0 or max(ids) >= vocab_size
            for position, id_ in enumerate(ids)
            if not 0 <= id_ < vocab_size
        ]
        if not bad:
            return None
        row, position, id_ = bad[0]
        return (
            f"prompt_token_ids hold {len(bad)} ids outside the policy's vocabulary [0, {vocab_size}), e.g. {id_} "
            f"(prompt {row}, position {position}). Tokenize with the policy's tokenizer."
        )

    # ----------------------------------------------------------------------------------- engine thread

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        *,
        max_tokens: int,
        temperature: float,
        top_p: float,
        top_k: int,
        seed: int | None,
        n: int,
        logprobs: bool,
        sampling_kwargs: dict[str, Any],
    ) -> dict[str, Any]:
        """`VLLMRolloutEngine.generate`'s answer as JSON; `sampling_kwargs`: further `vllm.SamplingParams` fields."""
        self.health()
        try:
            output = self.engine.generate(
                prompt_token_ids,
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                seed=seed,
                n=n,
                logprobs=logprobs,
                **sampling_kwargs,
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

    def commit(self, transaction: WeightTransaction, num_chunks: int) -> dict[str, Any]:
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
        problems = value_problems(
            target, weights, engine_dtypes=self._engine_dtypes[target], vocab_size=self.engine.vocab_size
        )
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

    def begin(self, target: WeightSet, version: int | None) -> WeightTransaction:
        """Open a transaction of `target`'s weights; `version` defaults to the current one plus 1."""
        if target == "draft" and not self.engine.has_draft:
            raise ServerError(400, "This server has no draft: start it with --draft <folder> to update a draft.")
        version = version if version is not None else self.versions[target] + 1
        return self.transactions.begin(target, version)

    def stage_http_chunk(self, transaction_id: str, index: int, body: bytes, sha256: str | None) -> int:
        self.transactions.get(transaction_id)
        tensors = parse_chunk(index, body, sha256)
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

    def init_nccl(
        self, *, master_address: str, master_port: int, packed_buffer_size_bytes: int, packed_num_buffers: int
    ) -> None:
        """Join the trainer's 2-rank NCCL group as rank 1, with its packed-broadcast geometry."""
        if not torch.cuda.is_available():
            raise ServerError(
                400, "NCCL weight transfer needs a server on a CUDA device; send the weights over HTTP instead."
            )
        from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group

        device = torch.device("cuda", torch.cuda.current_device())
        # The trainer is rank 0 (the sender); this server's single worker is rank 1.
        group = stateless_init_process_group(master_address, master_port, rank=1, world_size=2, device=device.index)
        self._nccl = _NcclReceiver(group, device, packed_buffer_size_bytes, packed_num_buffers)

    def stage_nccl_chunk(
        self, transaction_id: str, index: int, *, names: list[str], dtype_names: list[str], shapes: list[list[int]]
    ) -> int:
        """Receive one chunk broadcast by the trainer, then stage it. The broadcast is drained before the transaction
        and the tensors are checked, so that a refused chunk does not leave the trainer blocked inside NCCL."""
        if self._nccl is None:
            raise ServerError(400, "No NCCL group: call /nccl/init first (the client's init_nccl).")
        if not len(names) == len(dtype_names) == len(shapes):
            raise ServerError(400, "names, dtype_names and shapes must have the same length.")
        dtypes = [getattr(torch, name, None) for name in dtype_names]
        if not all(isinstance(dtype, torch.dtype) for dtype in dtypes):
            raise ServerError(400, f"Unknown dtype in {dtype_names}.")
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_consumer

        received: dict[str, torch.Tensor] = {}

        def keep(unpacked: list[tuple[str, torch.Tensor]]) -> None:
            # The unpacked tensors are views of a receive buffer that is reused.
            received.update((name, tensor.clone()) for name, tensor in unpacked)

        packed_nccl_broadcast_consumer(
            iter(zip(names, zip(shapes, dtypes))),
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
