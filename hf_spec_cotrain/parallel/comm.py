"""Point-to-point and collective helpers of the parallelisms, on any backend (gloo on CPU, NCCL on GPU).

`RingComm` posts the ring's sends and receives asynchronously so that the next key/value shard is in flight
while the current one is computed on. It enforces its protocol, `send_recv` (once or more) -> `commit` ->
`wait`, because a receive buffer read before `wait` holds garbage and an unmatched send hangs every rank.
"""

from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist


def group_rank_and_size(group: dist.ProcessGroup) -> tuple[int, int]:
    """This process's rank in `group` and the group's size; a ValueError when the process is not a member."""
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("This process is not a member of the context-parallel group it was given.")
    return rank, dist.get_world_size(group)


class RingComm:
    """Asynchronous exchange along a ring of a group: send to rank + offset, receive from rank - offset (offset 1:
    the neighbours; a larger one skips ranks, as a sliding window lets the ring do).

    One round: call `send_recv` for each tensor to pass on (each returns the buffer its counterpart lands in),
    then `commit` to post them all at once, compute, and `wait` before reading the buffers. The sent tensors
    must not be modified before `wait`. `tag` keeps the messages of two rings over the same group apart.
    """

    def __init__(self, group: dist.ProcessGroup, *, tag: int = 0):
        self.group = group
        self.tag = tag
        self.rank, self.world_size = group_rank_and_size(group)
        self._ops: list[dist.P2POp] = []
        self._requests: list | None = None
        self._in_flight: list[torch.Tensor] = []

    def send_recv(
        self, tensor: torch.Tensor, recv_buffer: torch.Tensor | None = None, *, offset: int = 1
    ) -> torch.Tensor:
        """Queue sending `tensor` to rank + `offset` and receiving its twin from rank - `offset`; returns the
        buffer."""
        if self._requests is not None:
            raise RuntimeError("RingComm.send_recv called while a round is in flight: call wait() first.")
        if not tensor.is_contiguous():
            raise RuntimeError("RingComm.send_recv needs a contiguous tensor (call .contiguous()).")
        if recv_buffer is None:
            recv_buffer = torch.empty_like(tensor)
        elif recv_buffer.shape != tensor.shape or recv_buffer.dtype != tensor.dtype:
            raise RuntimeError(
                f"RingComm.send_recv: recv_buffer {tuple(recv_buffer.shape)} {recv_buffer.dtype} does not match the "
                f"sent tensor {tuple(tensor.shape)} {tensor.dtype}."
            )
        send_peer = dist.get_global_rank(self.group, (self.rank + offset) % self.world_size)
        recv_peer = dist.get_global_rank(self.group, (self.rank - offset) % self.world_size)
        self._ops.append(dist.P2POp(dist.isend, tensor, send_peer, self.group, self.tag))
        self._ops.append(dist.P2POp(dist.irecv, recv_buffer, recv_peer, self.group, self.tag))
        self._in_flight += [tensor, recv_buffer]
        return recv_buffer

    def commit(self) -> None:
        """Post every queued send and receive."""
        if self._requests is not None:
            raise RuntimeError("RingComm.commit called twice: call wait() before starting another round.")
        if not self._ops:
            raise RuntimeError("RingComm.commit called with nothing queued: call send_recv() first.")
        self._requests = dist.batch_isend_irecv(self._ops)
        self._ops = []

    def wait(self) -> None:
        """Block until the round is complete; the receive buffers are then valid."""
        if self._requests is None:
            raise RuntimeError("RingComm.wait called without a committed round: call send_recv() and commit() first.")
        for request in self._requests:
            request.wait()
        self._requests = None
        self._in_flight = []


def exchange(
    sends: Mapping[int, torch.Tensor], recvs: Mapping[int, torch.Tensor], group: dist.ProcessGroup, *, tag: int = 0
) -> None:
    """Send `sends[peer]` to and receive `recvs[peer]` from each listed peer (ranks in `group`), all at once.

    Both sides must agree on which pairs exchange (they derive it from the same layout); empty tensors are skipped.
    """
    ops = []
    for peer, tensor in sends.items():
        if tensor.numel():
            ops.append(dist.P2POp(dist.isend, tensor.contiguous(), dist.get_global_rank(group, peer), group, tag))
    for peer, tensor in recvs.items():
        if tensor.numel():
            ops.append(dist.P2POp(dist.irecv, tensor, dist.get_global_rank(group, peer), group, tag))
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()


def is_context_parallel(group: dist.ProcessGroup | None) -> bool:
    """Whether `group` spreads the sequence over more than one rank."""
    return group is not None and dist.get_world_size(group) > 1


def all_gather_stacked(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`[W, *tensor.shape]`: every rank's `tensor`, in rank order."""
    world_size = dist.get_world_size(group)
    tensor = tensor.contiguous()
    # The concatenated form (along dim 0) is the one every backend accepts.
    output = tensor.new_empty((world_size * tensor.shape[0], *tensor.shape[1:]))
    # torch >= 2.13 renamed all_gather_into_tensor (which now warns) to all_gather_single.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor, group=group)
    return output.view(world_size, *tensor.shape)


def reduce_scatter_stacked(stacked: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum `[W, ...]` over the ranks and keep this rank's slice `[...]` (the adjoint of `all_gather_stacked`)."""
    output = stacked.new_empty(stacked.shape[1:])
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    reduce_scatter(output, stacked.contiguous().flatten(0, 1), group=group)
    return output


def all_reduce_gradients(
    parameters: Iterable[torch.nn.Parameter], group: dist.ProcessGroup | None = None, *, average: bool = False
) -> None:
    """Sum (or with `average`, average) the gradients of replicated parameters over `group`, in place, in one
    collective.

    After `ttt_loss(..., cp_group=group).loss.backward()` on every rank, the SUM over the context-parallel group is
    the single-device gradient (each rank's loss is its share of the global loss). Over data-parallel replicas,
    each holding its own batch's gradient, `average=True` gives the gradient of the mean loss, as DDP does.
    Parameters without a gradient are skipped, and all ranks must skip the same ones. `group` None: the world.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([grad.flatten() for grad in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    if average:
        flat.div_(dist.get_world_size(group))
    for grad, reduced in zip(grads, flat.split([grad.numel() for grad in grads])):
        grad.copy_(reduced.view_as(grad))
