"""Online EAGLE-3 draft co-training for TRL's GRPO, with speculative rollouts that track the policy.

Public names are imported lazily so that `import hf_spec_cotrain` stays cheap (TRL and vLLM take
seconds to import) and the vLLM extra stays optional.
"""

from typing import TYPE_CHECKING

from ._lazy import lazy_exports
from .version import __version__


__all__ = [
    "AdaptiveSpeculation",
    "DFlashDraftConfig",
    "DFlashDraftModel",
    "DraftLossOutput",
    "DraftModel",
    "DraftTrainingConfig",
    "Eagle3DraftConfig",
    "Eagle3DraftModel",
    "PipelineCoTrainStep",
    "PolicyHead",
    "SpecCoTrainConfig",
    "SpecCoTrainGRPOTrainer",
    "SpeculativeOutput",
    "TapChannel",
    "TapRecorder",
    "VLLMRolloutEngine",
    "__version__",
    "block_draft_attention",
    "branch_attention",
    "default_aux_layer_ids",
    "speculative_generate",
    "train_draft",
    "ttt_loss",
]

_MODULE_OF = {
    "AdaptiveSpeculation": "generation.adaptive",
    "DFlashDraftConfig": "draft",
    "DFlashDraftModel": "draft",
    "DraftLossOutput": "draft",
    "DraftModel": "draft",
    "DraftTrainingConfig": "warmstart",
    "Eagle3DraftConfig": "draft",
    "Eagle3DraftModel": "draft",
    "PipelineCoTrainStep": "training.pipeline_step",
    "PolicyHead": "policy_head",
    "SpecCoTrainConfig": "config",
    "SpecCoTrainGRPOTrainer": "trainer",
    "SpeculativeOutput": "generation.decoder",
    "TapChannel": "parallel.tap_channel",
    "TapRecorder": "taps",
    "VLLMRolloutEngine": "generation.vllm_engine",
    "block_draft_attention": "attention",
    "branch_attention": "attention",
    "default_aux_layer_ids": "taps",
    "speculative_generate": "generation.speculative",
    "train_draft": "warmstart",
    "ttt_loss": "draft",
}

if TYPE_CHECKING:
    from .attention import block_draft_attention, branch_attention
    from .config import SpecCoTrainConfig
    from .draft import (
        DFlashDraftConfig,
        DFlashDraftModel,
        DraftLossOutput,
        DraftModel,
        Eagle3DraftConfig,
        Eagle3DraftModel,
        ttt_loss,
    )
    from .generation.adaptive import AdaptiveSpeculation
    from .generation.decoder import SpeculativeOutput
    from .generation.speculative import speculative_generate
    from .generation.vllm_engine import VLLMRolloutEngine
    from .parallel.tap_channel import TapChannel
    from .policy_head import PolicyHead
    from .taps import TapRecorder, default_aux_layer_ids
    from .trainer import SpecCoTrainGRPOTrainer
    from .training.pipeline_step import PipelineCoTrainStep
    from .warmstart import DraftTrainingConfig, train_draft


__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF, __all__)
