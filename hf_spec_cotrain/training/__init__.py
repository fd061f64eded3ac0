"""The pieces `SpecCoTrainGRPOTrainer` holds: the draft's co-training (`DraftCoTrainer`), the speculative rollouts
(`SpeculativeRollouts`, on the rollout backends of `rollout_backends` and `pipelined_rollouts`), the parallel
strategies (`DataParallel`, `ContextParallel`, `PipelineParallel`, the latter running `PipelineCoTrainStep`; chosen
by `build_parallel_strategy`) and the time split of a step (`StepTimes`).
Imported lazily: they pull in TRL."""

from typing import TYPE_CHECKING

from .._lazy import lazy_exports


__all__ = [
    "ContextParallel",
    "DataParallel",
    "DraftCoTrainer",
    "GRPOBatch",
    "PipelineCoTrainStep",
    "PipelineParallel",
    "PipelineStepOutput",
    "SpeculativeRollouts",
    "StepTimes",
    "StepTimesCallback",
    "build_parallel_strategy",
]

_MODULE_OF = {
    "ContextParallel": "context_parallel",
    "DataParallel": "data_parallel",
    "DraftCoTrainer": "draft_cotraining",
    "GRPOBatch": "pipeline_step",
    "PipelineCoTrainStep": "pipeline_step",
    "PipelineParallel": "pipeline_parallel",
    "PipelineStepOutput": "pipeline_step",
    "SpeculativeRollouts": "rollouts",
    "StepTimes": "timing",
    "StepTimesCallback": "timing",
    "build_parallel_strategy": "strategy",
}

if TYPE_CHECKING:
    from .context_parallel import ContextParallel
    from .data_parallel import DataParallel
    from .draft_cotraining import DraftCoTrainer
    from .pipeline_parallel import PipelineParallel
    from .pipeline_step import GRPOBatch, PipelineCoTrainStep, PipelineStepOutput
    from .rollouts import SpeculativeRollouts
    from .strategy import build_parallel_strategy
    from .timing import StepTimes, StepTimesCallback


__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF, __all__)
