"""The zigzag layout of context parallelism (docs/design.md section 5), as pure index arithmetic.

Each packed document of length `n` (divisible by `2W`) is cut into `2W` chunks of `c = n / (2W)`;
rank `r` holds chunks `r` and `2W-1-r` of every document, in that order, documents concatenated in
order. Pairing an early chunk with a late one balances the causal work: every rank holds `2c` queries
of each document and attends to the same number of keys. A document starting at global index `s`
starts at local index `s / W` on every rank (all lengths are multiples of `2W`).

Indices here are *global indices along the packed sequence* (what the ring's masks compare) unless
called position ids, which restart at 0 in every document (what RoPE sees).
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..validation import check_cu_seqlens, check_int


def _last_boundary(cu_seqlens) -> int:
    """The last entry of a would-be `cu_seqlens` (0 for anything malformed: `check_cu_seqlens` then says why)."""
    if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.numel() and not cu_seqlens.dtype.is_floating_point:
        return int(cu_seqlens.flatten()[-1])
    return 0


def _check_rank(rank: int, world_size: int) -> None:
    check_int(world_size, "world_size")
    check_int(rank, "rank", minimum=0, below=world_size)


def zigzag_bounds(
    world_size: int, *, cu_seqlens: torch.Tensor | None = None, length: int | None = None
) -> torch.Tensor:
    """Validated global document boundaries (int64, on the CPU): `cu_seqlens`, or one document `[0, length]`.

    Every document length must be a multiple of `2 * world_size`; `pad_documents` pads them.
    """
    check_int(world_size, "world_size")
    if cu_seqlens is None:
        check_int(length, "length", minimum=0, hint=" (the sequence length, needed without cu_seqlens)")
        bounds = torch.tensor([0, length], dtype=torch.int64)
    else:
        check_cu_seqlens(cu_seqlens, length=_last_boundary(cu_seqlens) if length is None else length, batch_size=1)
        bounds = cu_seqlens.to("cpu", torch.int64)
    lengths = torch.diff(bounds)
    bad = torch.nonzero(lengths % (2 * world_size)).flatten()
    if bad.numel():
        index = int(bad[0])
        raise ValueError(
            f"Every document length must be a multiple of 2 * world_size = {2 * world_size} for the zigzag layout, "
            f"got length {int(lengths[index])} for document {index}; pad them first with "
            "`hf_spec_cotrain.parallel.pad_documents`."
        )
    return bounds


def _concatenated_ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """`cat([arange(s, s + n) for s, n in zip(starts, lengths)])` without a Python loop."""
    segment = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
    first_of_segment = torch.cumsum(lengths, 0) - lengths
    return starts[segment] + torch.arange(segment.numel(), device=lengths.device) - first_of_segment[segment]


def _chunk_starts(bounds: torch.Tensor, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global starts of this rank's two chunks of every document, interleaved, and the chunk lengths."""
    doc_starts = bounds[:-1]
    chunk = torch.diff(bounds) // (2 * world_size)
    starts = torch.stack([doc_starts + rank * chunk, doc_starts + (2 * world_size - 1 - rank) * chunk], dim=1)
    return starts.flatten(), chunk.repeat_interleave(2)


def zigzag_indices(
    rank: int, world_size: int, *, cu_seqlens: torch.Tensor | None = None, length: int | None = None
) -> torch.Tensor:
    """Global indices (int64, increasing) of the positions rank `rank` holds, `[length / world_size]`.

    `cu_seqlens` gives the packed documents; without it the sequence (of global `length`) is one document.
    """
    _check_rank(rank, world_size)
    bounds = zigzag_bounds(world_size, cu_seqlens=cu_seqlens, length=length)
    return _concatenated_ranges(*_chunk_starts(bounds, rank, world_size))


def zigzag_position_ids(
    rank: int, world_size: int, *, cu_seqlens: torch.Tensor | None = None, length: int | None = None
) -> torch.Tensor:
    """Within-document positions (RoPE positions, int64) of this rank's shard, `[length / world_size]`."""
    _check_rank(rank, world_size)
    bounds = zigzag_bounds(world_size, cu_seqlens=cu_seqlens, length=length)
    indices = _concatenated_ranges(*_chunk_starts(bounds, rank, world_size))
    doc = torch.searchsorted(bounds, indices, right=True) - 1
    return indices - bounds[doc]


def zigzag_owner(
    global_indices: torch.Tensor, world_size: int, bounds: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank that holds each global index and its local index there (`bounds` from `zigzag_bounds`)."""
    doc = torch.searchsorted(bounds, global_indices, right=True) - 1
    start = bounds[doc]
    chunk = (bounds[doc + 1] - start) // (2 * world_size)
    chunk_index = (global_indices - start) // chunk
    late = chunk_index >= world_size
    owner = torch.where(late, 2 * world_size - 1 - chunk_index, chunk_index)
    local = start // world_size + torch.where(late, chunk, 0) + (global_indices - start - chunk_index * chunk)
    return owner, local


def ring_steps(
    world_size: int, window: int | None, *, cu_seqlens: torch.Tensor | None = None, length: int | None = None
) -> list[int]:
    """The ring steps `s` (rank r attending to the keys of rank r - s) at which some rank sees some key, increasing.

    Full causal attention needs all W. With a sliding window of `w`, the first query of a chunk reaches furthest
    back, `w - 1` positions, so chunk `c` of a document with chunks of `m` sees key chunks `c - j` for
    `j <= ceil((w - 1) / m)` only, and the document with the shortest chunks decides. A window of 2 to m + 1
    thus leaves steps 0, 1 and W - 1 whatever W (the ranks of the neighbouring chunks: r - 1 for the early one,
    r + 1 for the late one), and a window of 1 step 0 alone.
    """
    bounds = zigzag_bounds(world_size, cu_seqlens=cu_seqlens, length=length)
    chunks = torch.diff(bounds) // (2 * world_size)
    chunks = chunks[chunks > 0]
    if window is None or not chunks.numel():
        return list(range(world_size))
    reach = min(-(-(window - 1) // int(chunks.min())), 2 * world_size - 1)  # chunks back, ceil division

    def owner(chunk: int) -> int:
        return chunk if chunk < world_size else 2 * world_size - 1 - chunk

    steps = {
        (owner(chunk) - owner(chunk - back)) % world_size
        for chunk in range(2 * world_size)
        for back in range(min(reach, chunk) + 1)
    }
    return sorted(steps)


def _check_dim(x: torch.Tensor, dim: int) -> int:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"Expected a torch.Tensor, got {type(x).__name__}.")
    return check_int(dim, "dim", minimum=-x.dim(), below=x.dim(), hint=f" for a {x.dim()}-D tensor") % x.dim()


def zigzag_shard(
    x: torch.Tensor, dim: int, rank: int, world_size: int, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    """This rank's zigzag shard of `x` along `dim` (the sequence dimension, of the global length).

    `cu_seqlens` (global) gives packed documents, each of a length divisible by `2 * world_size`;
    without it the whole dimension is one document (each row of a batch, when `dim` is not 0).
    Differentiable (a gather), and a copy.
    """
    dim = _check_dim(x, dim)
    indices = zigzag_indices(rank, world_size, cu_seqlens=cu_seqlens, length=x.shape[dim])
    return x.index_select(dim, indices.to(x.device))


def zigzag_unshard(shards: Sequence[torch.Tensor], dim: int, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Reassemble the full sequence from the shards of all ranks, given in rank order (the inverse of `zigzag_shard`).

    The world size is `len(shards)`. Across processes, gather the shards first (e.g. `dist.all_gather`); this
    function does no communication, so it also serves tests and single-process tools.
    """
    if not isinstance(shards, Sequence) or not shards:
        raise ValueError("shards must be a non-empty sequence of tensors, one per rank in rank order.")
    world_size = len(shards)
    dim = _check_dim(shards[0], dim)
    shapes = {tuple(shard.shape) for shard in shards}
    if len(shapes) != 1:
        raise ValueError(f"All shards must have the same shape, got {sorted(shapes)}.")
    length = shards[0].shape[dim] * world_size
    order = torch.cat(
        [zigzag_indices(rank, world_size, cu_seqlens=cu_seqlens, length=length) for rank in range(world_size)]
    )
    return torch.cat(list(shards), dim=dim).index_select(dim, torch.argsort(order).to(shards[0].device))


@dataclass(frozen=True)
class DocumentPadding:
    """Documents padded at their ends to a multiple of `2 * world_size`, so that they can be zigzag-sharded.

    Real tokens keep their within-document positions, and the padding trails each document, so causal
    attention never lets a real token see it: mask the padded positions out of the loss (`real_mask`) and
    the result at real positions is unchanged. In the TTT loss, a target in the padding never counts when the
    padded loss mask is False there (`pad(loss_mask, value=False)`).

    Attributes:
        cu_seqlens: int64 boundaries of the padded documents.
        real_mask: bool `[padded length]`, True at the original tokens.
        index: int64 `[original length]`, where each original token lands in the padded sequence.
    """

    cu_seqlens: torch.Tensor
    real_mask: torch.Tensor
    index: torch.Tensor

    def pad(self, x: torch.Tensor, dim: int = 1, value: float | bool = 0) -> torch.Tensor:
        """`x` with its sequence dimension `dim` padded (differentiable in `x`)."""
        dim = _check_dim(x, dim)
        if x.shape[dim] != self.index.numel():
            raise ValueError(f"x has length {x.shape[dim]} along dim {dim}; the documents hold {self.index.numel()}.")
        shape = list(x.shape)
        shape[dim] = self.real_mask.numel()
        return torch.full(shape, value, dtype=x.dtype, device=x.device).index_copy(dim, self.index.to(x.device), x)

    def unpad(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The original positions of a padded tensor."""
        dim = _check_dim(x, dim)
        if x.shape[dim] != self.real_mask.numel():
            raise ValueError(
                f"x has length {x.shape[dim]} along dim {dim}; the padded documents hold {self.real_mask.numel()}."
            )
        return x.index_select(dim, self.index.to(x.device))


def pad_documents(cu_seqlens: torch.Tensor, *, world_size: int) -> DocumentPadding:
    """Pad every packed document to the next multiple of `2 * world_size` (the zigzag layout's requirement)."""
    check_int(world_size, "world_size")
    check_cu_seqlens(cu_seqlens, length=_last_boundary(cu_seqlens), batch_size=1)
    bounds = cu_seqlens.to(torch.int64)
    lengths = torch.diff(bounds)
    multiple = 2 * world_size
    padded_bounds = torch.nn.functional.pad(torch.cumsum((lengths + multiple - 1) // multiple * multiple, 0), (1, 0))
    doc = torch.searchsorted(bounds, torch.arange(int(bounds[-1]), device=bounds.device), right=True) - 1
    index = torch.arange(doc.numel(), device=bounds.device) + (padded_bounds - bounds)[doc]
    real_mask = torch.zeros(int(padded_bounds[-1]), dtype=torch.bool, device=bounds.device)
    real_mask[index] = True
    return DocumentPadding(cu_seqlens=padded_bounds, real_mask=real_mask, index=index)
