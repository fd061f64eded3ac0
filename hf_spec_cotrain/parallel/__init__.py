"""Parallelism, the base layer that `attention/` and the training step build on: context parallelism on the zigzag
layout (docs/design.md section 5) and the pipeline stages with taps sent to the draft's stage (section 6).

`ParallelDims` holds a run's pipeline, data- and context-parallel sizes, checked once (against the run's options and
policy too, by the rules of `parallel.compatibility`), and builds its one device mesh with those named axes;
`apply_fsdp2` shards a policy over it where accelerate does not (on CPU).

`zigzag_shard` / `zigzag_unshard` / `zigzag_position_ids` / `pad_documents` implement the layout; `ZigzagHalo`
shifts the TTT inputs across shards; `pack_rows` / `policy_log_probs` run TRL's rows as zigzag-sharded documents;
`all_reduce_gradients` is the reduction the caller applies to the draft's gradients after a context-parallel
`ttt_loss`. The ring attention itself is `hf_spec_cotrain.attention.branch_attention(..., cp_group=...)`.

`stage_layer_ranges`, `pipeline_stage_class` (a model class that loads one stage of a checkpoint),
`stream_pipeline_weights` and `TapChannel` are the pipeline's pieces (the co-training step
that uses them is `hf_spec_cotrain.training.pipeline_step.PipelineCoTrainStep`). Those names, and `ParallelDims`
(whose rules read the pipeline's schedules), are imported lazily: the pipeline pulls in transformers and
`torch.distributed.pipelining`, which context parallelism does not need.
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_exports
from .comm import all_reduce_gradients
from .halo import ZigzagHalo
from .packed_rows import PackedRows, pack_rows, policy_log_probs
from .zigzag import (
    DocumentPadding,
    pad_documents,
    zigzag_bounds,
    zigzag_indices,
    zigzag_owner,
    zigzag_position_ids,
    zigzag_shard,
    zigzag_unshard,
)


__all__ = [
    "DocumentPadding",
    "PackedRows",
    "ParallelDims",
    "TapChannel",
    "TapMismatchError",
    "ZigzagHalo",
    "all_reduce_gradients",
    "apply_fsdp2",
    "pack_rows",
    "pad_documents",
    "policy_log_probs",
    "pipeline_stage_class",
    "stage_layer_ranges",
    "stream_pipeline_weights",
    "zigzag_bounds",
    "zigzag_indices",
    "zigzag_owner",
    "zigzag_position_ids",
    "zigzag_shard",
    "zigzag_unshard",
]

_MODULE_OF = {
    "ParallelDims": "dims",
    "apply_fsdp2": "fsdp",
    "TapChannel": "tap_channel",
    "TapMismatchError": "tap_channel",
    "pipeline_stage_class": "pipeline",
    "stage_layer_ranges": "pipeline",
    "stream_pipeline_weights": "pipeline",
}

if TYPE_CHECKING:
    from .dims import ParallelDims
    from .fsdp import apply_fsdp2
    from .pipeline import pipeline_stage_class, stage_layer_ranges, stream_pipeline_weights
    from .tap_channel import TapChannel, TapMismatchError


__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF, __all__)
