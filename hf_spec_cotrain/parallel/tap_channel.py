"""`TapChannel`: taps travel from the pipeline stages that own them to the draft's stage (docs/design.md section 6).

The draft lives whole on one stage (the last). Stages that own a tapped decoder layer (or the embedding) send
each tap the moment it exists, with non-blocking point-to-point ops, over process groups of their own: never the
pipeline schedule's communicator, so a tap can neither block nor reorder the schedule's activation and gradient
traffic. The draft's stage posts its landing buffers ahead of time, one per (micro-batch, tap), and reads them
only when the draft needs them.

Protocol. Every tap is two messages: a small int64 header (step, micro-batch, tap id, dtype, shape) and then the
tensor. Headers go over a gloo group (host values: reading them never syncs a GPU), tensors over a group of the
default backend. Both groups match messages in posting order per (sender, receiver) pair, as NCCL does, so the
receiver posts each sender's landing buffers in that sender's sending order (for GPipe and 1F1B: micro-batches
in order, taps in layer order). Each header is checked on arrival against the slot it landed in: a tap of the
wrong step, micro-batch or tap id, or of an unexpected shape or dtype, raises `TapMismatchError` instead of
silently feeding the draft the wrong data. When the receiver knows a tap's shape (the pipeline step does) the
tensor's landing buffer is posted ahead too; otherwise it is posted once the header has arrived.
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


__all__ = ["TapChannel", "TapMismatchError"]

_MAGIC = 0x7A9C_0DE5
_MAX_DIMS = 6
# magic, step, micro-batch, tap id, dtype code, ndim, shape (padded)
_HEADER_LENGTH = 6 + _MAX_DIMS
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class TapMismatchError(RuntimeError):
    """A tap landed in a slot posted for another step, micro-batch or tap, or with another shape or dtype."""


@dataclass
class _Slot:
    """One landing place: the header buffer, the tensor buffer, and their pending receives."""

    source: int
    microbatch: int
    tap_id: int
    header: torch.Tensor
    header_work: dist.Work
    shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None
    buffer: torch.Tensor | None = None
    data_work: dist.Work | None = None
    checked: bool = False
    received: bool = False


@dataclass
class _PendingSends:
    works: list[dist.Work] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)  # kept alive until the sends complete


class TapChannel:
    r"""
    Non-blocking transport of taps from pipeline stages to one receiving stage, on separate process groups.

    Args:
        group (`ProcessGroup`, *optional*):
            The pipeline's process group (default: the world). The channel builds two new groups over the same
            ranks, so it must be constructed on every rank of `group` (it is collective, like `dist.new_group`).
        receiver (`int`, *optional*, defaults to `-1`):
            Group rank of the draft's stage (negative counts from the end: the last stage by default).
        device (`torch.device`, *optional*):
            Where landing buffers live (default: CPU, or the current CUDA device with NCCL).

    Usage, once per training step on every rank::

        channel.begin_step()
        # receiver, before the schedule runs:
        channel.expect(source=0, keys=[(mb, tap) for mb in range(M) for tap in taps_of[0]], shapes=..., dtype=...)
        # senders, as each tap is produced (e.g. from a forward pre-hook):
        channel.send(hidden, microbatch=mb, tap_id=a)
        # after the schedule: senders wait for their sends, the receiver reads its slots
        channel.wait_sends()
        tap = channel.receive(microbatch=mb, tap_id=a)
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        receiver: int = -1,
        device: torch.device | str | None = None,
    ):
        group = group if group is not None else dist.group.WORLD
        ranks = dist.get_process_group_ranks(group)
        size = len(ranks)
        if not -size <= receiver < size:
            raise ValueError(f"`receiver`={receiver} is not a rank of the {size}-rank pipeline group.")
        self.group_size = size
        self.group_rank = dist.get_rank(group)
        self.receiver = receiver % size
        # Separate communicators: the schedule's own P2P never sees (or waits behind) a tap.
        self._header_group = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
        self._data_group = dist.new_group(ranks, use_local_synchronization=True)
        self._global_ranks = ranks
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
        self.device = torch.device(device)
        self.step = -1
        self._slots: dict[tuple[int, int], _Slot] = {}
        self._order: dict[int, list[_Slot]] = {}
        self._sends = _PendingSends()

    @property
    def is_receiver(self) -> bool:
        return self.group_rank == self.receiver

    # ------------------------------------------------------------------ both sides

    def begin_step(self) -> None:
        """Start a new step: every header carries the step number, so a stale tap cannot pass for a fresh one."""
        if self._sends.works:
            raise RuntimeError("`begin_step()` with sends of the previous step pending: call `wait_sends()` first.")
        unread = [key for key, slot in self._slots.items() if not slot.received]
        if unread:
            raise RuntimeError(
                f"`begin_step()` with taps {sorted(unread)} (micro-batch, tap id) of step {self.step} still unread: "
                "every expected tap must be received (their messages are already on the wire)."
            )
        self.step += 1
        self._slots.clear()
        self._order.clear()

    # ------------------------------------------------------------------ sender side

    def send(self, tensor: torch.Tensor, *, microbatch: int, tap_id: int) -> None:
        """Start sending one tap to the receiver; returns at once (the tensor must not be modified in place)."""
        if self.is_receiver:
            raise RuntimeError("The receiving stage keeps its own taps: `send` is for the other stages.")
        if tensor.dtype not in _DTYPES:
            raise ValueError(f"Tap dtype {tensor.dtype} is not supported; send one of {list(_DTYPES)}.")
        if tensor.dim() > _MAX_DIMS:
            raise ValueError(f"A tap has at most {_MAX_DIMS} dimensions; got shape {tuple(tensor.shape)}.")
        data = tensor.detach().contiguous()
        header = torch.tensor(self._header_values(microbatch, tap_id, data.dtype, data.shape), dtype=torch.int64)
        dst = self._global_ranks[self.receiver]
        self._sends.works.append(dist.isend(header, dst=dst, group=self._header_group))
        self._sends.works.append(dist.isend(data, dst=dst, group=self._data_group))
        self._sends.tensors.extend((header, data))

    def wait_sends(self) -> None:
        """Block until every tap sent this step has left (call after the pipeline schedule, off its path)."""
        for work in self._sends.works:
            work.wait()
        self._sends = _PendingSends()

    # ------------------------------------------------------------------ receiver side

    def expect(
        self,
        *,
        source: int,
        keys: Iterable[tuple[int, int]],
        shapes: Sequence[Sequence[int]] | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        """Post landing buffers for taps from group rank `source`, in the order that rank sends them.

        `keys` are (micro-batch, tap id) pairs. With `shapes` (one per key) and `dtype` the tensors' buffers are
        posted now too; without them, each is posted once its header has arrived.
        """
        if not self.is_receiver:
            raise RuntimeError("Only the receiving stage posts landing buffers.")
        if not 0 <= source < self.group_size or source == self.receiver:
            raise ValueError(f"`source`={source} must be another rank of the {self.group_size}-rank group.")
        keys = list(keys)
        if shapes is not None and (len(shapes) != len(keys) or dtype is None):
            raise ValueError("`shapes` needs one shape per key, and `dtype` with it.")
        src = self._global_ranks[source]
        order = self._order.setdefault(source, [])
        for index, (microbatch, tap_id) in enumerate(keys):
            key = (microbatch, tap_id)
            if key in self._slots:
                raise ValueError(f"A landing buffer for (micro-batch, tap id) {key} is already posted.")
            header = torch.empty(_HEADER_LENGTH, dtype=torch.int64)
            slot = _Slot(source, microbatch, tap_id, header, dist.irecv(header, src=src, group=self._header_group))
            if shapes is not None:
                self._post_data(slot, tuple(shapes[index]), dtype)
            self._slots[key] = slot
            order.append(slot)

    def receive(self, *, microbatch: int, tap_id: int) -> torch.Tensor:
        """The tap of (micro-batch, tap id), after checking its header; blocks until it has landed."""
        slot = self._slots.get((microbatch, tap_id))
        if slot is None:
            raise KeyError(f"No landing buffer was posted for micro-batch {microbatch}, tap {tap_id}.")
        # A tensor buffer can only be posted after every earlier one from the same sender (ordered matching).
        for earlier in self._order[slot.source]:
            if earlier.data_work is None:
                self._check_header(earlier)
                self._post_data(earlier, earlier.shape, earlier.dtype)
            if earlier is slot:
                break
        self._check_header(slot)
        slot.data_work.wait()
        slot.received = True
        return slot.buffer

    def _post_data(self, slot: _Slot, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        slot.shape, slot.dtype = shape, dtype
        slot.buffer = torch.empty(shape, dtype=dtype, device=self.device)
        slot.data_work = dist.irecv(slot.buffer, src=self._global_ranks[slot.source], group=self._data_group)

    def _check_header(self, slot: _Slot) -> None:
        if slot.checked:
            return
        slot.header_work.wait()
        values = slot.header.tolist()
        magic, step, microbatch, tap_id, dtype_code, ndim = values[:6]
        if magic != _MAGIC or not 0 <= dtype_code < len(_DTYPES) or not 0 <= ndim <= _MAX_DIMS:
            raise TapMismatchError(
                f"The header in the slot of micro-batch {slot.microbatch}, tap {slot.tap_id} is corrupt."
            )
        shape, dtype = tuple(values[6 : 6 + ndim]), _DTYPES[dtype_code]
        expected = (self.step, slot.microbatch, slot.tap_id)
        if (step, microbatch, tap_id) != expected:
            raise TapMismatchError(
                f"Rank {slot.source} sent the tap of (step {step}, micro-batch {microbatch}, tap {tap_id}) into the "
                f"landing buffer of (step {expected[0]}, micro-batch {expected[1]}, tap {expected[2]}): the sender's "
                "order differs from the order the receiver posted. Refusing to train the draft on the wrong data."
            )
        if slot.shape is not None and (shape, dtype) != (slot.shape, slot.dtype):
            raise TapMismatchError(
                f"The tap of micro-batch {microbatch}, tap {tap_id} is {dtype} {list(shape)}; its landing buffer was "
                f"posted as {slot.dtype} {list(slot.shape)}."
            )
        slot.shape, slot.dtype = shape, dtype
        slot.checked = True

    def _header_values(self, microbatch: int, tap_id: int, dtype: torch.dtype, shape: torch.Size) -> list[int]:
        padded = [*shape, *([0] * (_MAX_DIMS - len(shape)))]
        return [_MAGIC, self.step, microbatch, tap_id, _DTYPES.index(dtype), len(shape), *padded]
