"""The pieces `SpecCoTrainGRPOTrainer` holds: the draft's co-training (`DraftCoTrainer`), the speculative rollouts
(`SpeculativeRollouts`), the training-step strategies of context and pipeline parallelism (`ContextParallelStep`,
`PipelineParallelStep`, the latter running `PipelineCoTrainStep`) and the time split of a step (`StepTimes`).
Imported lazily: they pull in TRL."""

from typing import TYPE_CHECKING

from .._lazy import lazy_exports


__all__ = [
    "ContextParallelStep",
    "DraftCoTrainer",
    "GRPOBatch",
    "PipelineCoTrainStep",
    "PipelineParallelStep",
    "PipelineStepOutput",
    "SpeculativeRollouts",
    "StepTimes",
    "StepTimesCallback",
]

_MODULE_OF = {
    "ContextParallelStep": "steps",
    "DraftCoTrainer": "draft_cotraining",
    "GRPOBatch": "pipeline_step",
    "PipelineCoTrainStep": "pipeline_step",
    "PipelineParallelStep": "steps",
    "PipelineStepOutput": "pipeline_step",
    "SpeculativeRollouts": "rollouts",
    "StepTimes": "timing",
    "StepTimesCallback": "timing",
}

if TYPE_CHECKING:
    from .draft_cotraining import DraftCoTrainer
    from .pipeline_step import GRPOBatch, PipelineCoTrainStep, PipelineStepOutput
    from .rollouts import SpeculativeRollouts
    from .steps import ContextParallelStep, PipelineParallelStep
    from .timing import StepTimes, StepTimesCallback


__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF, __all__)
