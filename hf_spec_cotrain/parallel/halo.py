"""The training-time test under context parallelism: shifts across zigzag shards by halo exchange.

The TTT loss reads, for anchor `i`, values at `i + 1 + d` (embeddings, teacher) and `i + 2 + d` (loss mask),
d < K, within the document. On a zigzag shard the first few positions after each of this rank's chunks
live on the rank that owns the next chunk, so `ZigzagHalo` fetches exactly those (at most `halo` per chunk)
from their owners with point-to-point messages: a neighbour exchange, never an all-gather of the sequence.
With chunks of at least `halo` positions, rank r receives from r + 1 (after chunk r) and from r - 1 (after
chunk 2W-1-r); shorter chunks simply pull from further ranks. The exchange is differentiable: the gradient
of a halo value is sent back to its owner.

Gradients: each rank's loss is its share of the global loss (divided by the GLOBAL number of counted
positions), and the ring sends every key's gradient home, so summing the draft's parameter gradients over the
context-parallel group (`all_reduce_gradients`, a SUM) gives exactly the single-device gradient.
"""

import torch
import torch.distributed as dist

from ..validation import check_int
from .comm import exchange, group_rank_and_size
from .zigzag import zigzag_bounds, zigzag_indices, zigzag_owner


def _halo_indices(bounds: torch.Tensor, rank: int, world_size: int, halo: int) -> torch.Tensor:
    """Sorted global indices within `halo` positions after the end of one of `rank`'s chunks, inside the document,
    that `rank` does not hold itself."""
    doc_ends = bounds[1:]
    chunk = torch.diff(bounds) // (2 * world_size)
    chunk_ends = torch.stack([bounds[:-1] + (rank + 1) * chunk, bounds[:-1] + (2 * world_size - rank) * chunk], dim=1)
    candidates = chunk_ends.unsqueeze(-1) + torch.arange(halo)
    candidates = candidates[candidates < doc_ends.view(-1, 1, 1)]
    owner, _ = zigzag_owner(candidates, world_size, bounds)
    return torch.unique(candidates[owner != rank])


class _HaloExchange(torch.autograd.Function):
    """`x [B, L/W, ...]` -> the halo `[B, H, ...]` fetched from its owners; the backward sends gradients home."""

    @staticmethod
    def forward(ctx, x, plan):
        ctx.plan = plan
        sends = {peer: x.index_select(1, index) for peer, index in plan.send_index.items()}
        recvs = {peer: x.new_empty((x.shape[0], count, *x.shape[2:])) for peer, count in plan.recv_counts.items()}
        exchange(sends, recvs, plan.group)
        if not recvs:
            return x.new_empty((x.shape[0], 0, *x.shape[2:]))
        return torch.cat(list(recvs.values()), dim=1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_halo):
        plan = ctx.plan
        pieces = grad_halo.split(list(plan.recv_counts.values()), dim=1)
        grad_sends = dict(zip(plan.recv_counts, pieces))
        grad_recvs = {
            peer: grad_halo.new_empty((grad_halo.shape[0], index.numel(), *grad_halo.shape[2:]))
            for peer, index in plan.send_index.items()
        }
        exchange(grad_sends, grad_recvs, plan.group)
        grad_x = grad_halo.new_zeros((grad_halo.shape[0], plan.local_length, *grad_halo.shape[2:]))
        for peer, grad in grad_recvs.items():
            grad_x.index_add_(1, plan.send_index[peer], grad)
        return grad_x, None


class ZigzagHalo:
    """Shifts `out[i] = x[i + s]` within documents (0 < s <= `halo`) on zigzag shards, for every rank of `group`.

    Build it once per layout: `extend(x)` fetches the halo of a shard `[B, L/W, ...]` (one exchange per tensor),
    then `shift(extended, s)` reads the shifted shard for any `s <= halo` locally. Positions whose `i + s`
    leaves the document read zero (False), as the single-device `_shift_within_documents`.

    Args:
        group: the context-parallel group (world W); every rank builds the same plan.
        local_length: L / W, the length of this rank's shard.
        halo: the largest shift that will be asked for.
        cu_seqlens: global document boundaries (every length a multiple of 2W); None: each row is one document.
        device: where the index tensors live (the shards' device).
    """

    def __init__(
        self,
        *,
        group: dist.ProcessGroup,
        local_length: int,
        halo: int,
        cu_seqlens: torch.Tensor | None = None,
        device: torch.device | str | None = None,
    ):
        check_int(halo, "halo", minimum=0, hint=" (the largest shift that will be asked for)")
        self.group = group
        self.rank, self.world_size = group_rank_and_size(group)
        self.local_length = local_length
        self.halo = halo
        bounds = zigzag_bounds(self.world_size, cu_seqlens=cu_seqlens, length=local_length * self.world_size)
        local_indices = zigzag_indices(self.rank, self.world_size, cu_seqlens=bounds)
        documents = torch.searchsorted(bounds, local_indices, right=True) - 1
        self.position_ids = (local_indices - bounds[documents]).to(device)
        """Within-document (RoPE) positions of this rank's shard, `[L/W]`."""

        needed = _halo_indices(bounds, self.rank, self.world_size, halo)
        needed_owner, _ = zigzag_owner(needed, self.world_size, bounds)
        self.send_index: dict[int, torch.Tensor] = {}
        self.recv_counts: dict[int, int] = {}
        received = []
        for peer in range(self.world_size):
            if peer == self.rank:
                continue
            from_peer = needed[needed_owner == peer]
            if from_peer.numel():
                self.recv_counts[peer] = from_peer.numel()
                received.append(from_peer)
            peer_needs = _halo_indices(bounds, peer, self.world_size, halo)
            owner, local = zigzag_owner(peer_needs, self.world_size, bounds)
            if bool((owner == self.rank).any()):
                self.send_index[peer] = local[owner == self.rank].to(device)
        extended_indices = torch.cat([local_indices, *received])
        self._sorted_indices, self._order = torch.sort(extended_indices)
        self._local_indices = local_indices
        self._doc_ends = bounds[1:][documents]
        self._device = device
        self._sources: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def extend(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(x, halo)`: the shard `[B, L/W, ...]` and the `[B, H, ...]` values fetched for it (one exchange).

        Every rank must call (with the same dtype); the halo is differentiable.
        """
        if x.shape[1] != self.local_length:
            raise ValueError(
                f"Expected a shard of length {self.local_length} along dim 1, got shape {tuple(x.shape)}."
            )
        return x, _HaloExchange.apply(x, self)

    def shift(
        self, extended: tuple[torch.Tensor, torch.Tensor], shift: int, index: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`out[:, i] = x[:, i + shift]` within the document, zero (False) outside, from an `extend`ed shard; only at
        the local positions `index` (int64 `[n]`) when given, e.g. DFlash's anchors.

        One copy of what is read, no concatenation with the halo (teacher logits are large).
        """
        check_int(shift, "shift", minimum=0, below=self.halo + 1, hint=f" (this halo has {self.halo} positions)")
        if shift not in self._sources:
            self._sources[shift] = self._source_plan(shift)
        source, outside = self._sources[shift]
        if index is not None:
            source, outside = source[index], outside[index]
        x, halo = extended
        from_halo = source >= self.local_length
        shifted = x.index_select(1, torch.where(from_halo, 0, source))
        halo_targets = torch.nonzero(from_halo).flatten()
        # Even when nothing is read from the halo: its exchange must join every rank's backward.
        shifted.index_copy_(1, halo_targets, halo.index_select(1, source[halo_targets] - self.local_length))
        return shifted.masked_fill_(outside.view(1, -1, *([1] * (x.dim() - 2))), 0)

    def _source_plan(self, shift: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Where each shifted value comes from (a local index, or the local length plus a halo slot) and whether it
        leaves the document."""
        target = self._local_indices + shift
        inside = target < self._doc_ends
        slot = torch.searchsorted(self._sorted_indices, target).clamp(max=self._sorted_indices.numel() - 1)
        assert bool((self._sorted_indices[slot] == target)[inside].all()), "the halo plan misses a shifted position"
        source = torch.where(inside, self._order[slot], 0)
        return source.to(self._device), (~inside).to(self._device)
