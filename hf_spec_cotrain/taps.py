"""Tapping the target's hidden states (DESIGN.md section 2).

A tap id ``a`` is the *input* of decoder layer ``a``: the residual stream after ``a`` layers, which is
``hidden_states[a]`` of a HF forward with ``output_hidden_states=True`` and vLLM's
``eagle_aux_hidden_state_layer_ids`` numbering.
"""

from collections.abc import Sequence


MIN_LAYERS_FOR_DEFAULT_TAPS = 6


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default taps: an early, a middle and a late layer, ``(2, L // 2, L - 3)``."""
    ids = (2, num_layers // 2, num_layers - 3)
    if num_layers < MIN_LAYERS_FOR_DEFAULT_TAPS or len(set(ids)) != len(ids):
        raise ValueError(
            f"The default tap ids (2, L//2, L-3) = {ids} do not fit a target with {num_layers} decoder layers: "
            f"they need at least {MIN_LAYERS_FOR_DEFAULT_TAPS} layers and must be distinct. Pass explicit "
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
