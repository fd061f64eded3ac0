"""Rollout generation: the HF-native speculative generator (on one process, or through pipeline stages), the
colocated vLLM engine and the vLLM server client.

Names are imported lazily: the vLLM engine module imports vLLM only when an engine is built, and the client
never imports vLLM.
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_exports


_MODULE_OF = {
    "AdaptiveSpeculation": "adaptive",
    "FixedSpeculation": "adaptive",
    "PlainDecoding": "adaptive",
    "SpeculationPolicy": "adaptive",
    "DRAFT_SAMPLING_METHODS": "speculative",
    "SpeculativeOutput": "decoder",
    "greedy_verify": "verification",
    "rejection_sample": "verification",
    "residual_distribution": "verification",
    "speculative_generate": "speculative",
    "EngineRestartedError": "engine",
    "EngineUnavailableError": "engine",
    "RolloutEngine": "engine",
    "RolloutOutput": "engine",
    "SpecDecodeStats": "engine",
    "PipelinedTarget": "pipelined",
    "SyncStats": "engine",
    "WeightSyncError": "engine",
    "VLLM_INSTALL_HINT": "vllm_engine",
    "VLLMRolloutEngine": "vllm_engine",
    "BadRolloutRequestError": "client",
    "VLLMServerClient": "client",
    "VLLMServerError": "client",
}

__all__ = [
    "DRAFT_SAMPLING_METHODS",
    "AdaptiveSpeculation",
    "BadRolloutRequestError",
    "EngineRestartedError",
    "EngineUnavailableError",
    "FixedSpeculation",
    "PipelinedTarget",
    "PlainDecoding",
    "SpeculationPolicy",
    "VLLM_INSTALL_HINT",
    "RolloutEngine",
    "RolloutOutput",
    "SpecDecodeStats",
    "SpeculativeOutput",
    "SyncStats",
    "VLLMRolloutEngine",
    "VLLMServerClient",
    "VLLMServerError",
    "WeightSyncError",
    "greedy_verify",
    "rejection_sample",
    "residual_distribution",
    "speculative_generate",
]

if TYPE_CHECKING:
    from .adaptive import AdaptiveSpeculation, FixedSpeculation, PlainDecoding, SpeculationPolicy
    from .client import BadRolloutRequestError, VLLMServerClient, VLLMServerError
    from .decoder import SpeculativeOutput
    from .engine import (
        EngineRestartedError,
        EngineUnavailableError,
        RolloutEngine,
        RolloutOutput,
        SpecDecodeStats,
        SyncStats,
        WeightSyncError,
    )
    from .pipelined import PipelinedTarget
    from .speculative import DRAFT_SAMPLING_METHODS, speculative_generate
    from .verification import greedy_verify, rejection_sample, residual_distribution
    from .vllm_engine import VLLM_INSTALL_HINT, VLLMRolloutEngine


__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF, __all__)
