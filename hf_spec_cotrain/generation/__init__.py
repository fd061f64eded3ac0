"""Rollout generation. The vLLM engine module imports vLLM only when an engine is built."""

import importlib
from typing import TYPE_CHECKING


_EXPORTS = {
    "VLLM_INSTALL_HINT": "hf_spec_cotrain.generation.vllm_engine",
    "RolloutOutput": "hf_spec_cotrain.generation.vllm_engine",
    "SpecDecodeStats": "hf_spec_cotrain.generation.vllm_engine",
    "SyncStats": "hf_spec_cotrain.generation.vllm_engine",
    "VLLMRolloutEngine": "hf_spec_cotrain.generation.vllm_engine",
    "WeightSyncError": "hf_spec_cotrain.generation.vllm_engine",
}

__all__ = [
    "VLLM_INSTALL_HINT",
    "RolloutOutput",
    "SpecDecodeStats",
    "SyncStats",
    "VLLMRolloutEngine",
    "WeightSyncError",
]

if TYPE_CHECKING:
    from .vllm_engine import (
        VLLM_INSTALL_HINT,
        RolloutOutput,
        SpecDecodeStats,
        SyncStats,
        VLLMRolloutEngine,
        WeightSyncError,
    )


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hf_spec_cotrain.generation' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
