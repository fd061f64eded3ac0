"""Tapping the target's hidden states (docs/design.md section 2).

A tap id ``a`` is the *input* of decoder layer ``a``: the residual stream after ``a`` layers, which is
``hidden_states[a]`` of a HF forward with ``output_hidden_states=True`` and vLLM's
``eagle_aux_hidden_state_layer_ids`` numbering.
"""

from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from .policy_head import unwrapped_policy


# Below 7 layers L // 2 and L - 3 coincide (or fall under 2).
MIN_LAYERS_FOR_DEFAULT_TAPS = 7


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default taps: an early, a middle and a late layer, ``(2, L // 2, L - 3)``."""
    ids = (2, num_layers // 2, num_layers - 3)
    if num_layers < MIN_LAYERS_FOR_DEFAULT_TAPS:
        raise ValueError(
            f"The default tap ids (2, L//2, L-3) = {ids} do not fit a target with {num_layers} decoder layers: "
            f"they are distinct from {MIN_LAYERS_FOR_DEFAULT_TAPS} layers on. Pass explicit "
            f"`aux_layer_ids` (distinct ints in [0, {num_layers}))."
        )
    return ids


def validate_aux_layer_ids(aux_layer_ids: Sequence[int] | None, num_layers: int) -> tuple[int, ...]:
    """Return the tap ids as a tuple, or the defaults when None; raise on out-of-range or duplicate ids."""
    if aux_layer_ids is None:
        return default_aux_layer_ids(num_layers)
    ids = tuple(aux_layer_ids)
    if not ids:
        raise ValueError(f"`aux_layer_ids` is empty; give at least one decoder-layer index in [0, {num_layers}).")
    for layer_id in ids:
        if isinstance(layer_id, bool) or not isinstance(layer_id, int) or not 0 <= layer_id < num_layers:
            raise ValueError(
                f"Tap id {layer_id!r} in `aux_layer_ids`={list(ids)} is out of range: a tap id is the input of a "
                f"decoder layer, an int in [0, {num_layers}) for this {num_layers}-layer target."
            )
    if len(set(ids)) != len(ids):
        raise ValueError(f"`aux_layer_ids`={list(ids)} has duplicates; each tap id may appear once.")
    return ids


@dataclass
class Taps:
    """What one target forward exposed to the draft.

    ``aux_hidden_states``: the tapped layer inputs concatenated, ``[B, L, n * hidden]``; ``embeddings``: the
    input of layer 0 (the token embeddings), ``[B, L, hidden]``; ``final_hidden``: the decoder's output
    (what the policy's head reads, `hf_spec_cotrain.policy_head.PolicyHead`), ``[B, L, hidden]``. Recorded tensors are detached.
    """

    aux_hidden_states: torch.Tensor
    embeddings: torch.Tensor | None = None
    final_hidden: torch.Tensor | None = None

    def select_rows(self, rows: torch.Tensor) -> "Taps":
        """The taps of the batch rows ``rows`` (an index tensor)."""
        return Taps(**{name: None if tap is None else tap[rows] for name, tap in vars(self).items()})


def decoder_of(model: nn.Module) -> nn.Module:
    """The decoder stack of a HF causal LM (`get_decoder()`), through DDP/PEFT wrappers."""
    model = unwrapped_policy(model)
    return model.get_decoder() if hasattr(model, "get_decoder") else model


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a HF causal LM, in order: the decoder's ``layers`` (most families), else its one list of
    as many modules as the config has layers (GPT-2's and Bloom's ``h``). A ValueError naming the family where there
    is no such list: the taps read the inputs of decoder layers."""
    decoder = decoder_of(model)
    if isinstance(getattr(decoder, "layers", None), nn.ModuleList):
        return decoder.layers
    config = unwrapped_policy(model).config.get_text_config()
    candidates = [
        child
        for child in decoder.children()
        if isinstance(child, nn.ModuleList) and len(child) == getattr(config, "num_hidden_layers", None)
    ]
    if len(candidates) != 1:
        raise ValueError(
            f"Cannot find the decoder layers of this {config.model_type} policy ({type(decoder).__name__} has no "
            "`layers` and not exactly one list of `num_hidden_layers` modules), whose inputs the draft's taps read: "
            "co-training needs a decoder of layers, as transformers' causal LMs have."
        )
    return candidates[0]


class TapRecorder:
    """Forward hooks that record the target's taps, and that are always removed on exit.

    Hooks record only inside ``capture()``, so forwards that must not feed the draft (reference or old-policy
    log-probs, gradient-checkpointing recomputation during backward) pass through untouched::

        with TapRecorder(model, (2, 16, 29)) as recorder:
            with recorder.capture():
                model(input_ids)
            taps = recorder.pop()
    """

    def __init__(
        self,
        model: nn.Module,
        aux_layer_ids: Sequence[int],
        *,
        record_embeddings: bool = False,
        record_final_hidden: bool = False,
    ):
        self.decoder, self.layers = decoder_of(model), decoder_layers(model)
        self.aux_layer_ids = validate_aux_layer_ids(aux_layer_ids, len(self.layers))
        self.record_embeddings = record_embeddings
        self.record_final_hidden = record_final_hidden
        self._hooked_layers = sorted(set(self.aux_layer_ids) | ({0} if record_embeddings else set()))
        self._handles: list = []
        self._capturing = False
        self._current: dict[str, torch.Tensor] = {}
        self._done: list[Taps] = []

    def __enter__(self) -> "TapRecorder":
        for layer_id in self._hooked_layers:
            hook = partial(self._record_layer_input, f"layer{layer_id}")
            self._handles.append(self.layers[layer_id].register_forward_pre_hook(hook, with_kwargs=True))
        if self.record_final_hidden:
            self._handles.append(self.decoder.register_forward_hook(self._record_final_hidden))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._capturing = False

    @contextmanager
    def capture(self):
        """Record the taps of the forwards run inside this block (one `Taps` per full forward)."""
        self._capturing = True
        try:
            yield self
        finally:
            self._capturing = False
            self._current = {}

    def pop(self) -> Taps:
        """The taps of the oldest recorded forward not yet popped."""
        if not self._done:
            raise RuntimeError("No recorded forward: run the target inside `recorder.capture()` first.")
        return self._done.pop(0)

    def pop_all(self) -> list[Taps]:
        done, self._done = self._done, []
        return done

    def _record_layer_input(self, name, module, args, kwargs):
        if self._capturing:
            hidden = args[0] if args else kwargs["hidden_states"]
            self._current[name] = hidden.detach()
            if not self.record_final_hidden and name == f"layer{self._hooked_layers[-1]}":
                self._finish()

    def _record_final_hidden(self, module, args, output):
        if self._capturing:
            self._current["final"] = output[0].detach()  # the last hidden state
            self._finish()

    def _finish(self) -> None:
        current, self._current = self._current, {}
        missing = [f"layer{i}" for i in self._hooked_layers if f"layer{i}" not in current]
        if missing:
            raise RuntimeError(f"A target forward skipped tapped layers {missing}; cannot build the draft's input.")
        self._done.append(
            Taps(
                aux_hidden_states=torch.cat([current[f"layer{i}"] for i in self.aux_layer_ids], dim=-1),
                embeddings=current.get("layer0") if self.record_embeddings else None,
                final_hidden=current.get("final"),
            )
        )
