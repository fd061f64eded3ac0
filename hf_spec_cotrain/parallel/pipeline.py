"""Pipeline stages of a HF causal LM (dense or MoE, full or sliding-window layers), the base of the pipelined GRPO
step (docs/design.md section 6; the step itself is `hf_spec_cotrain.training.pipeline_step`).

A model is cut into stages in the manner of transformers' own naive pipeline split: layers another stage owns
become identity placeholders, so parameter names and per-layer attention types keep their global indices and the
model's own decoder forward runs each stage. The first stage holds the embedding, the last the final norm and the
lm_head. A stage's module taps the inputs of the layers it owns as it runs them, and either hands them to a
callback (the ``"channel"`` transport: a `TapChannel` sends them to the draft's stage) or returns them with its
activations (``"relay"``: every stage forwards the taps of earlier stages plus its own).
"""

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe
from transformers import AutoModelForCausalLM, PreTrainedConfig, PreTrainedModel
from transformers.distributed.pipeline_parallel import PipelineIdentityLayer

from ..policy_head import PolicyHead
from ..taps import decoder_of
from ..validation import check_int


__all__ = [
    "MIN_MICROBATCHES",
    "PIPELINE_SCHEDULES",
    "TAP_TRANSPORTS",
    "StageModule",
    "cut_model_to_stage",
    "min_microbatches",
    "pipeline_stage_class",
    "stage_layer_ranges",
    "stream_pipeline_weights",
]

PIPELINE_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
"""`torch.distributed.pipelining` schedules by lower-cased name."""
TAP_TRANSPORTS = ("channel", "relay")
"""How taps reach the draft's stage: over a `TapChannel`, or riding the stage outputs."""
MIN_MICROBATCHES = 4


def min_microbatches(schedule: str, num_stages: int) -> int:
    """The fewest micro-batches per step: `MIN_MICROBATCHES` to hide the bubble, and under 1F1B one per stage."""
    return max(MIN_MICROBATCHES, num_stages if schedule.lower() == "1f1b" else 1)


def stage_layer_ranges(num_layers: int, num_stages: int, layers_per_stage: Sequence[int] | None = None) -> list[range]:
    """The decoder layers of each stage: ``layers_per_stage`` when given, else as even as possible with the
    extra layers on the earliest stages (the last stage also carries the head, the loss and the draft)."""
    check_int(num_stages, "num_stages")
    if layers_per_stage is None:
        if num_stages > num_layers:
            raise ValueError(f"{num_stages} stages cannot split {num_layers} decoder layers: at most one per layer.")
        base, extra = divmod(num_layers, num_stages)
        layers_per_stage = [base + (stage < extra) for stage in range(num_stages)]
    layers_per_stage = list(layers_per_stage)
    if (
        len(layers_per_stage) != num_stages
        or any(n < 1 for n in layers_per_stage)
        or sum(layers_per_stage) != num_layers
    ):
        raise ValueError(
            f"`layers_per_stage`={layers_per_stage} must give each of the {num_stages} stages at least one layer "
            f"and sum to the model's {num_layers} decoder layers."
        )
    bounds = [0, *torch.tensor(layers_per_stage).cumsum(0).tolist()]
    return [range(start, end) for start, end in zip(bounds[:-1], bounds[1:])]


def cut_model_to_stage(model: nn.Module, layers: range, *, is_first: bool, is_last: bool) -> list[str]:
    """Cut `model` in place to one stage: other stages' modules become identity placeholders (names and
    per-layer attention types keep their global indices). Returns the names of the modules it replaced."""
    decoder = decoder_of(model)
    prefix = next(name for name, module in model.named_modules() if module is decoder)
    prefix = f"{prefix}." if prefix else ""
    cut = []
    for index in range(len(decoder.layers)):
        if index not in layers:
            decoder.layers[index] = PipelineIdentityLayer()
            cut.append(f"{prefix}layers.{index}")
    if not is_first:
        decoder.embed_tokens = PipelineIdentityLayer()
        cut.append(f"{prefix}embed_tokens")
    if not is_last:
        decoder.norm = PipelineIdentityLayer()
        model.lm_head = PipelineIdentityLayer()
        cut += [f"{prefix}norm", "lm_head"]
    return cut


def pipeline_stage_class(
    config: PreTrainedConfig,
    stage_index: int,
    num_stages: int,
    *,
    layers_per_stage: Sequence[int] | None = None,
    trust_remote_code: bool = False,
) -> type[PreTrainedModel]:
    """The causal-LM class of `config`, cut to stage `stage_index` of `num_stages` as it is built.

    Its ``from_pretrained`` builds the model on the meta device as usual, cut, so the loader finds no parameter for
    the other stages' checkpoint tensors and leaves them unread (and unreported): a process never holds more of the
    model than its stage. Non-persistent buffers (rotary frequencies) are computed as in any load.
    """
    ranges = stage_layer_ranges(config.get_text_config().num_hidden_layers, num_stages, layers_per_stage)
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"`stage_index`={stage_index} is not a stage of {num_stages}: use 0 to {num_stages - 1}.")
    layers = ranges[stage_index]
    with torch.device("meta"):  # the class transformers' auto-loading picks, without allocating the model
        architecture = type(AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code))

    def __init__(self, config, *args, **kwargs):
        architecture.__init__(self, config, *args, **kwargs)
        cut = cut_model_to_stage(self, layers, is_first=stage_index == 0, is_last=stage_index == num_stages - 1)
        skipped = {rf"(^|\.){re.escape(name)}\." for name in cut}
        self._keys_to_ignore_on_load_unexpected = set(self._keys_to_ignore_on_load_unexpected or ()) | skipped

    return type(
        architecture.__name__,
        (architecture,),
        {"__init__": __init__, "__module__": architecture.__module__, "__doc__": architecture.__doc__},
    )


class StageModule(nn.Module):
    """One stage: the cut model's own decoder forward, plus the taps of the layers this stage owns."""

    def __init__(self, model: nn.Module, *, is_first: bool, is_last: bool, tap_layers: Sequence[int], relay: bool):
        super().__init__()
        self.model = model
        self.is_first, self.is_last, self.relay = is_first, is_last, relay
        self.logits_to_keep = 0
        self.on_tap = None  # (micro-batch, tap id, tensor) -> None, set by the pipelined step
        self.final_hidden: dict[int, torch.Tensor] = {}
        self.relayed_taps: dict[int, tuple[torch.Tensor, ...]] = {}
        self._capturing: tuple[int, list[torch.Tensor]] | None = None
        self._policy_head: PolicyHead | None = None
        decoder = decoder_of(model)
        for layer_id in tap_layers:
            decoder.layers[layer_id].register_forward_pre_hook(self._tap_hook(layer_id), with_kwargs=True)

    def _tap_hook(self, layer_id: int):
        def hook(module, args, kwargs):
            # Only inside this stage's forward: not in gradient-checkpointing recomputation during backward.
            if self._capturing is not None:
                microbatch, own = self._capturing
                hidden = (args[0] if args else kwargs["hidden_states"]).detach()
                if self.relay:
                    own.append(hidden)
                else:
                    self.on_tap(microbatch, layer_id, hidden)

        return hook

    def forward(self, x: torch.Tensor, *relayed: torch.Tensor, attention_mask: torch.Tensor, microbatch: torch.Tensor):
        index = int(microbatch[0])
        decoder = decoder_of(self.model)
        inputs = {"input_ids": x} if self.is_first else {"inputs_embeds": x}
        own: list[torch.Tensor] = []
        self._capturing = (index, own)
        try:
            hidden = decoder(**inputs, attention_mask=attention_mask, use_cache=False).last_hidden_state
        finally:
            self._capturing = None
        if not self.is_last:
            if self.relay:
                return (hidden, *(t.detach() for t in relayed), *own)
            return hidden
        if self.on_tap is not None:  # co-training: keep what the draft needs from this micro-batch
            self.final_hidden[index] = hidden.detach()
            if self.relay:
                self.relayed_taps[index] = (*(t.detach() for t in relayed), *own)
        # TRL scores position p's prediction of token p + 1: the completion tokens are predicted by [-C-1, -1).
        return self.policy_head.logits(hidden[:, -self.logits_to_keep - 1 : -1])

    @property
    def policy_head(self) -> PolicyHead:
        """The last stage's output head, the policy's own (logit scaling and soft-caps included), read once the
        stage holds its weights."""
        if self._policy_head is None:
            self._policy_head = PolicyHead(self.model)
        return self._policy_head


def stream_pipeline_weights(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    *,
    group: dist.ProcessGroup | None = None,
    dst: int = 0,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream every rank's named tensors to group rank `dst`, stage by stage, one tensor at a time.

    Every rank of `group` calls it with its own tensors (a stage's `state_dict()`, the draft's on the last
    stage, nothing elsewhere) and must exhaust the iterator. On `dst` it yields ``(name, tensor)`` for the union
    (the full model), in stage order, so a rollout engine can load them as they arrive without holding two
    copies; elsewhere it yields nothing and only sends.
    """
    group = group if group is not None else dist.group.WORLD
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if not 0 <= dst < size:
        raise ValueError(f"`dst`={dst} is not a rank of the {size}-rank group.")
    items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
    ranks = dist.get_process_group_ranks(group)
    for src in range(size):
        if src == dst:
            if rank == dst:
                for name, tensor in items:
                    yield name, tensor.detach()
            continue
        if rank not in (src, dst):
            continue
        if rank == src:
            listing = [[(name, tuple(t.shape), t.dtype) for name, t in items]]
            dist.send_object_list(listing, dst=ranks[dst], group=group)
            for _, tensor in items:
                dist.send(tensor.detach().contiguous(), dst=ranks[dst], group=group)
        else:
            listing = [None]
            dist.recv_object_list(listing, src=ranks[src], group=group)
            for name, shape, dtype in listing[0]:
                buffer = torch.empty(shape, dtype=dtype, device=_device_of(group))
                dist.recv(buffer, src=ranks[src], group=group)
                yield name, buffer


def _device_of(group: dist.ProcessGroup) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
