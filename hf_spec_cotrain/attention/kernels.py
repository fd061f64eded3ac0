"""The per-block attention kernel of the blockwise and ring drivers: a fused kernel that returns the log-sum-exp where
one fits the block, else the pure-PyTorch `block_forward` (the fallback, the CPU path and the reference).

A (query block, key block) pair is fully visible, causal (the same consecutive positions of one document on both
sides: the diagonal blocks) or needs an explicit mask (document or zigzag-chunk boundaries inside the block). Fused
kernels take the first two; the explicit-mask blocks stay on `block_forward`. On CUDA, in order of preference:

* `flash_attn`: flash-attn's `flash_attn_func` when the package is importable (never required), GQA native;
* `sdpa_flash`: PyTorch's own flash kernel (`aten._scaled_dot_product_flash_attention`), half precision, sm80+,
  head_dim <= 256 and a multiple of 8;
* `sdpa_efficient`: PyTorch's memory-efficient kernel (`aten._scaled_dot_product_efficient_attention`), also float32.

All three return the log-sum-exp in natural log and float32, `[B, H, L]` (the efficient kernel pads L to a multiple of
32). Causal is top-left aligned in PyTorch's kernels and bottom-right in flash-attn's; the causal blocks are square
with equal positions, where both agree. The backward stays on the pure-PyTorch `block_backward`, which recomputes the
probabilities from the final log-sum-exp. A CUDA block that no fused kernel takes is logged once per reason.
"""

import contextlib
import functools
import importlib.util
import logging

import torch

from .masks import BlockSpan, Visibility


logger = logging.getLogger(__name__)

BLOCKWISE, FLASH_ATTN, SDPA_FLASH, SDPA_EFFICIENT = "blockwise", "flash_attn", "sdpa_flash", "sdpa_efficient"
BACKENDS = (BLOCKWISE, FLASH_ATTN, SDPA_FLASH, SDPA_EFFICIENT)
FULL, CAUSAL, EXPLICIT = "full", "causal", "explicit"
HALF_DTYPES = (torch.float16, torch.bfloat16)
_forced_backend: str | None = None
_logged_fallbacks: set[str] = set()


def block_mask_kind(query: BlockSpan, key: BlockSpan, visibility: Visibility, window: int | None = None) -> str:
    """FULL, CAUSAL (one document, the same consecutive positions on both sides, no sliding window cutting into the
    block) or EXPLICIT, for a visible pair."""
    if visibility is Visibility.FULL:
        return FULL
    same_positions = (query.pos_min, query.pos_max) == (key.pos_min, key.pos_max)
    length = query.end - query.start
    consecutive = length == key.end - key.start == query.pos_max - query.pos_min + 1
    one_document = query.doc_min == query.doc_max == key.doc_min == key.doc_max
    within_window = window is None or window >= length  # the block's longest distance is length - 1
    return CAUSAL if same_positions and consecutive and one_document and within_window else EXPLICIT


def select_block_backend(
    *,
    device_type: str,
    dtype: torch.dtype,
    mask_kind: str,
    head_dim: int,
    cuda_capability: tuple[int, int] | None = None,
    flash_attn_available: bool = False,
    forced: str | None = None,
) -> tuple[str, str | None]:
    """The kernel for one block pair and, when a CUDA block falls back to `blockwise`, why (None otherwise).

    Pure: the caller passes what it knows of the device, so the choice is testable without one. `forced` (a name of
    `BACKENDS`, for tests and the GPU check) replaces the choice wherever a fused kernel can take the mask.
    """
    if mask_kind not in (FULL, CAUSAL, EXPLICIT):
        raise ValueError(f"mask_kind must be one of {FULL!r}, {CAUSAL!r}, {EXPLICIT!r}, got {mask_kind!r}.")
    if forced is not None and forced not in BACKENDS:
        raise ValueError(f"forced backend must be one of {BACKENDS}, got {forced!r}.")
    if mask_kind == EXPLICIT:
        reason = "blocks with a document or chunk boundary inside need an explicit mask"
        return BLOCKWISE, reason if device_type == "cuda" else None
    if forced is not None:
        return forced, None
    if device_type != "cuda":
        return BLOCKWISE, None
    if head_dim % 8 != 0:
        return BLOCKWISE, f"head_dim={head_dim} is not a multiple of 8"
    if dtype in HALF_DTYPES and head_dim <= 256:
        if flash_attn_available:
            return FLASH_ATTN, None
        if cuda_capability is not None and cuda_capability >= (8, 0):
            return SDPA_FLASH, None
    if dtype in (*HALF_DTYPES, torch.float32):
        return SDPA_EFFICIENT, None
    return BLOCKWISE, f"no fused kernel takes {dtype}"


@contextlib.contextmanager
def forced_block_backend(name: str | None):
    """Run every block that a fused kernel can take on `name` (None: the automatic choice) inside the context."""
    global _forced_backend
    if name is not None and name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}.")
    previous, _forced_backend = _forced_backend, name
    try:
        yield
    finally:
        _forced_backend = previous


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.cache
def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def backend_for(q_block: torch.Tensor, mask_kind: str) -> str:
    """`select_block_backend` for this tensor's device and dtype, logging each reason for a fallback once."""
    device = q_block.device
    backend, reason = select_block_backend(
        device_type=device.type,
        dtype=q_block.dtype,
        mask_kind=mask_kind,
        head_dim=q_block.shape[-1],
        cuda_capability=_cuda_capability(device.index or 0) if device.type == "cuda" else None,
        flash_attn_available=device.type == "cuda" and flash_attn_available(),
        forced=_forced_backend,
    )
    if reason is not None and reason not in _logged_fallbacks:
        _logged_fallbacks.add(reason)
        logger.warning("branch attention: pure-PyTorch blockwise kernel on %s for some blocks: %s.", device, reason)
    return backend


def fused_block_forward(
    backend: str, q_block: torch.Tensor, k_block: torch.Tensor, v_block: torch.Tensor, *, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`block_forward`'s contract (`q_block [B, Hkv, G, Nq, D]`, `k_block, v_block [B, Hkv, Nk, D]`, full or causal)
    on a fused kernel, in the inputs' dtype; returns the output in that dtype and the log-sum-exp in float32."""
    return _FUSED[backend](q_block, k_block, v_block, scale=scale, causal=causal)


def _sdpa(op, q_block, k_block, v_block, *, scale, causal):
    """Grouped layout through a `[B, H, L, D]` kernel: a full block folds the G query heads of a group into its query
    length (K/V are not repeated); a causal block needs them as heads, so K/V are repeated G times (one block)."""
    batch, kv_heads, group, num_queries, _ = q_block.shape
    if not causal:
        out, lse = op(q_block.flatten(2, 3), k_block, v_block, scale=scale, causal=False)
        return out.unflatten(2, (group, num_queries)), lse[..., : group * num_queries].unflatten(
            2, (group, num_queries)
        )
    key, value = (tensor.repeat_interleave(group, dim=1) for tensor in (k_block, v_block))
    out, lse = op(q_block.flatten(1, 2), key, value, scale=scale, causal=True)
    return out.unflatten(1, (kv_heads, group)), lse[..., :num_queries].unflatten(1, (kv_heads, group))


def _sdpa_flash_op(q, k, v, *, scale, causal):
    if q.device.type == "cpu":  # PyTorch's CPU flash kernel: the same contract, so CPU tests cover the layouts
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    return out, lse


def _sdpa_efficient_op(q, k, v, *, scale, causal):
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)[
        :2
    ]
    return out, lse


def _flash_attn(q_block, k_block, v_block, *, scale, causal):
    """flash-attn's `[B, L, H, D]` layout; it maps query head h to K/V head h // G, as the grouped layout does."""
    from flash_attn import flash_attn_func

    kv_heads, group = q_block.shape[1:3]
    query = q_block.flatten(1, 2).transpose(1, 2)
    key, value = k_block.transpose(1, 2), v_block.transpose(1, 2)
    out, lse, _ = flash_attn_func(query, key, value, softmax_scale=scale, causal=causal, return_attn_probs=True)
    return out.transpose(1, 2).unflatten(1, (kv_heads, group)), lse.unflatten(1, (kv_heads, group))


_FUSED = {
    FLASH_ATTN: _flash_attn,
    SDPA_FLASH: functools.partial(_sdpa, _sdpa_flash_op),
    SDPA_EFFICIENT: functools.partial(_sdpa, _sdpa_efficient_op),
}
