"""Online EAGLE-3 draft co-training for TRL's GRPO, with speculative rollouts that track the policy.

Public names are imported lazily so that `import hf_spec_cotrain` stays cheap (TRL and vLLM take
seconds to import) and the vLLM extra stays optional.
"""

import importlib
from typing import TYPE_CHECKING


__version__ = "0.1.0.dev0"

__all__ = [
    "Eagle3DraftConfig",
    "Eagle3DraftModel",
    "TTTOutput",
    "TapRecorder",
    "__version__",
    "branch_attention",
    "default_aux_layer_ids",
    "ttt_loss",
]

_MODULE_OF = {
    "Eagle3DraftConfig": "draft",
    "Eagle3DraftModel": "draft",
    "TapRecorder": "taps",
    "default_aux_layer_ids": "taps",
    "TTTOutput": "ttt",
    "ttt_loss": "ttt",
    "branch_attention": "attention",
}

if TYPE_CHECKING:
    from .attention import branch_attention
    from .draft import Eagle3DraftConfig, Eagle3DraftModel
    from .taps import TapRecorder, default_aux_layer_ids
    from .ttt import TTTOutput, ttt_loss


def __getattr__(name: str):
    if name in _MODULE_OF:
        value = getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
