"""Generation across pipeline stages, with no rank holding the whole target (docs/pipeline_parallel.md).

The last stage holds the final norm, the lm_head and the draft, so it drives the decoding loop
(`speculative_generate(..., pipeline=...)`, the same loop as on a whole model) while the earlier stages serve its
target forwards (`PipelinedTarget.serve`), each with a KV cache of its own layers (a cut model's layer indices are
global: a stage's cache holds entries for its own layers only). The driver broadcasts every command as a header and
one int64 payload:

* ``FORWARD`` (rows, new slots, all slots; token ids, positions, slot mask): stage 0 embeds the tokens, each stage
  runs its layers over its cache with the generator's causal-by-slot masks and sends its output hidden states, with
  the taps of earlier stages and its own concatenated behind them, to the next stage; the last stage runs its layers,
  the final norm and the lm_head. A forward whose new slots are all its slots is a prefill: the stages start fresh
  caches.
* ``EMBED`` (token ids): stage 0 sends their embeddings to the driver (the draft's inputs; nothing else embeds).
* ``SELECT_ROWS`` (the rows kept) and ``COMPACT`` (the slot mask compacted): what the loop does to its own cache
  when rows finish or holes outnumber kept slots, so every stage's cache keeps the driver's slots.
* ``FINISH``: the turn is over; the stages drop their caches and return from `serve`.

Every forward is thus the whole model's arithmetic on the same inputs, stage by stage: greedy decoding and sampling
(the driver's generator) give the tokens the loop gives on the whole model.
"""

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from ..attention.decoding import compact_slots, decoding_attention
from ..taps import TapRecorder, decoder_of
from ..validation import layer_types
from .decoder import SpeculativeDecoder, eval_mode, layer_windows, target_attention_mask
from .linear_attention import LINEAR_ATTENTION, new_cache, select_rows


__all__ = ["PipelinedTarget"]

FORWARD, EMBED, SELECT_ROWS, COMPACT, FINISH = range(5)
HEADER_LENGTH = 4  # command, then up to three sizes


class PipelinedTarget:
    """One stage's part of generating from a target cut into pipeline stages (one rank per stage).

    Args:
        model: this stage's cut causal LM (`hf_spec_cotrain.parallel.pipeline.cut_model_to_stage`).
        layer_ranges: the decoder layers of every stage (`stage_layer_ranges`).
        aux_layer_ids: the draft's taps (its ``fc`` order).
        group: the pipeline's process group (default: the world); stage i is group rank i, the last one drives.
        device: where this stage runs (default: the model's device).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        layer_ranges: list[range],
        aux_layer_ids: tuple[int, ...],
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
    ):
        self.group = group if group is not None else dist.group.WORLD
        self.ranks = dist.get_process_group_ranks(self.group)
        self.stage, num_stages = dist.get_rank(self.group), dist.get_world_size(self.group)
        if len(layer_ranges) != num_stages:
            raise ValueError(f"{len(layer_ranges)} layer ranges for a pipeline of {num_stages} stages.")
        self.driver = num_stages - 1
        self.is_first, self.is_driver = self.stage == 0, self.stage == self.driver
        self.model = model
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.dtype = model.dtype
        text_config = model.config.get_text_config()
        if LINEAR_ATTENTION in layer_types(text_config):
            raise ValueError(
                f"Pipelined generation does not serve this {text_config.model_type} target's linear-attention layers "
                "(their states roll back on one process only): generate with `pipeline_parallel_size=1`."
            )
        self.text_config, self.hidden_size = text_config, text_config.hidden_size
        self.layer_windows = layer_windows(text_config)
        self.aux_layer_ids = tuple(aux_layer_ids)
        # Every stage's taps in layer order: the order in which they ride behind the hidden states.
        taps = sorted(self.aux_layer_ids)
        self.relayed_taps = [a for a in taps if a < layer_ranges[self.stage].start]
        self.own_taps = [a for a in taps if a in layer_ranges[self.stage]]
        self.cache = None  # a serving stage's cache of its own layers

    def decoder(self, *args, **kwargs) -> "_PipelinedDecoder":
        """The decoding loop of `speculative_generate` (its arguments) on the driver, through this pipeline."""
        return _PipelinedDecoder(self, *args, **kwargs)

    # ------------------------------------------------------------------ the driver (the last stage)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        slot_mask: torch.Tensor,
        cache,
        *,
        logits_to_keep: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole target's logits (the last ``logits_to_keep`` slots; 0: all) and taps (``[B, L, n * hidden]``,
        in the draft's order) over new slots, ``slot_mask`` covering them already; ``cache``: the driver's own."""
        batch, length = input_ids.shape
        payload = torch.cat([input_ids.flatten(), position_ids.flatten(), slot_mask.long().flatten()])
        self._command(FORWARD, batch, length, slot_mask.shape[1], payload=payload)
        received = self._receive(batch, length, 1 + len(self.relayed_taps))
        hidden = received[..., : self.hidden_size]
        with self._tapping() as recorder:
            logits = self.model(
                inputs_embeds=hidden,
                attention_mask=target_attention_mask(slot_mask, length, self.layer_windows),
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=logits_to_keep,
            ).logits
        taps = torch.cat([received[..., self.hidden_size :], *self._own_taps(recorder)], dim=-1)
        by_layer = dict(zip(sorted(self.aux_layer_ids), taps.split(self.hidden_size, dim=-1)))
        return logits, torch.cat([by_layer[a] for a in self.aux_layer_ids], dim=-1)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The target's token embeddings of ``token_ids`` ``[B, L]``, from the first stage."""
        self._command(EMBED, *token_ids.shape, payload=token_ids.flatten())
        buffer = torch.empty(*token_ids.shape, self.hidden_size, dtype=self.dtype, device=self.device)
        dist.recv(buffer, src=self.ranks[0], group=self.group)
        return buffer

    def select_rows(self, rows: torch.Tensor) -> None:
        """Every stage keeps the batch rows ``rows`` of its cache."""
        self._command(SELECT_ROWS, rows.numel(), payload=rows)

    def compact(self, slot_mask: torch.Tensor) -> None:
        """Every stage compacts its cache as the driver compacted its own, from this slot mask."""
        self._command(COMPACT, *slot_mask.shape, payload=slot_mask.long().flatten())

    def finish(self) -> None:
        """End the turn: the serving stages return from `serve`."""
        self._command(FINISH)

    def _command(self, code: int, *sizes: int, payload: torch.Tensor | None = None) -> None:
        header = torch.tensor([code, *sizes, *[0] * (HEADER_LENGTH - 1 - len(sizes))], device=self.device)
        self._broadcast(header)
        if payload is not None:
            self._broadcast(payload.to(device=self.device, dtype=torch.long).contiguous())

    # ------------------------------------------------------------------ the serving stages

    def serve(self) -> None:
        """Serve the driver's commands until it finishes the turn (every stage but the last calls it)."""
        if self.is_driver:
            raise RuntimeError("The last stage drives the generation; the other stages serve it.")
        try:
            with eval_mode(self.model), torch.no_grad(), decoding_attention(self.model):
                while self._serve_one():
                    pass
        finally:
            self.cache = None

    def _serve_one(self) -> bool:
        header = torch.empty(HEADER_LENGTH, dtype=torch.long, device=self.device)
        self._broadcast(header)
        code, *sizes = header.tolist()
        if code == FINISH:
            return False
        if code == FORWARD:
            batch, length, slots = sizes
            payload = self._payload(batch * length * 2 + batch * slots)
            input_ids, position_ids, slot_mask = payload.split([batch * length, batch * length, batch * slots])
            self._serve_forward(
                input_ids.view(batch, length), position_ids.view(batch, length), slot_mask.view(batch, slots).bool()
            )
        elif code == EMBED:
            batch, length, _ = sizes
            token_ids = self._payload(batch * length).view(batch, length)
            if self.is_first:
                embeddings = self.model.get_input_embeddings()(token_ids)
                dist.send(embeddings.to(self.dtype).contiguous(), dst=self.ranks[self.driver], group=self.group)
        elif code == SELECT_ROWS:
            select_rows(self.cache, self._payload(sizes[0]))
        elif code == COMPACT:
            batch, slots, _ = sizes
            compact_slots(self.cache, self._payload(batch * slots).view(batch, slots).bool())
        else:
            raise RuntimeError(f"Unknown pipelined-generation command {code}: the stages are out of step.")
        return True

    def _serve_forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, slot_mask: torch.Tensor) -> None:
        batch, length = input_ids.shape
        if slot_mask.shape[1] == length:  # a prefill
            self.cache = new_cache(self.text_config)
        if self.is_first:
            inputs, relayed = {"input_ids": input_ids}, []
        else:
            received = self._receive(batch, length, 1 + len(self.relayed_taps))
            inputs = {"inputs_embeds": received[..., : self.hidden_size]}
            relayed = [received[..., self.hidden_size :]]
        with self._tapping() as recorder:
            hidden = decoder_of(self.model)(
                **inputs,
                attention_mask=target_attention_mask(slot_mask, length, self.layer_windows),
                position_ids=position_ids,
                past_key_values=self.cache,
                use_cache=True,
            ).last_hidden_state
        message = torch.cat([hidden, *relayed, *self._own_taps(recorder)], dim=-1).to(self.dtype)
        dist.send(message.contiguous(), dst=self.ranks[self.stage + 1], group=self.group)

    # ------------------------------------------------------------------ shared

    @contextmanager
    def _tapping(self):
        """Record this stage's own taps during one forward (None: it owns none)."""
        if not self.own_taps:
            yield None
            return
        with TapRecorder(self.model, self.own_taps) as recorder, recorder.capture():
            yield recorder

    @staticmethod
    def _own_taps(recorder: TapRecorder | None) -> list[torch.Tensor]:
        return [] if recorder is None else [recorder.pop().aux_hidden_states]

    def _receive(self, batch: int, length: int, num_states: int) -> torch.Tensor:
        """The previous stage's hidden states and relayed taps, ``[B, L, num_states * hidden]``."""
        buffer = torch.empty(batch, length, num_states * self.hidden_size, dtype=self.dtype, device=self.device)
        dist.recv(buffer, src=self.ranks[self.stage - 1], group=self.group)
        return buffer

    def _payload(self, numel: int) -> torch.Tensor:
        payload = torch.empty(numel, dtype=torch.long, device=self.device)
        self._broadcast(payload)
        return payload

    def _broadcast(self, tensor: torch.Tensor) -> None:
        dist.broadcast(tensor, src=self.ranks[self.driver], group=self.group)


class _PipelinedDecoder(SpeculativeDecoder):
    """`speculative_generate`'s loop on the driver: its target forwards, its cache's row selection and compaction,
    and the draft's token embeddings go through the pipeline (the draft itself runs here, on the last stage)."""

    def __init__(self, pipeline: PipelinedTarget, *args, **kwargs):
        self.pipeline = pipeline
        super().__init__(*args, **kwargs)

    def input_device(self) -> torch.device:
        return self.pipeline.device

    def target_forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, *, logits_to_keep: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pipeline.forward(
            input_ids, position_ids, self.target_mask, self.target_cache, logits_to_keep=logits_to_keep
        )

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.pipeline.embed(token_ids).to(self.draft.dtype)

    def drop_finished(self, finished, row_tensors):
        if finished.any():
            self.pipeline.select_rows((~finished).nonzero().squeeze(1))
        return super().drop_finished(finished, row_tensors)

    def compact_caches(self) -> None:
        slot_mask = self.target_mask
        super().compact_caches()
        if self.target_mask is not slot_mask:  # the driver's cache was compacted: the stages compact theirs alike
            self.pipeline.compact(slot_mask)
