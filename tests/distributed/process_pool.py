"""A pool of gloo ranks that stays up across tests: spawning 4 processes costs seconds, a task milliseconds.

`ProcessGroupPool(world_size).run(fn, *args)` runs the module-level function `fn(*args)` on every rank and
returns the per-rank results; an exception on any rank fails the call with every rank's traceback (and
restarts the pool, since its process group may be left mid-collective). Inside a task, `subgroup(size)` is this
rank's group among consecutive blocks of `size` ranks, so that 4 processes also run 1- and 2-rank checks.
"""

import datetime
import os
import queue
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


COLLECTIVE_TIMEOUT_S = 120  # generous: the machine may be loaded
_SUBGROUPS: dict[int, dist.ProcessGroup] = {}


def subgroup(size: int) -> dist.ProcessGroup:
    """This rank's group of `size` consecutive ranks (created once per size, collectively, by every rank)."""
    if size not in _SUBGROUPS:
        world_size, rank = dist.get_world_size(), dist.get_rank()
        if world_size % size:
            raise ValueError(f"size {size} does not divide the pool's world size {world_size}.")
        for start in range(0, world_size, size):
            group = dist.new_group(list(range(start, start + size)))
            if start <= rank < start + size:
                _SUBGROUPS[size] = group
    return _SUBGROUPS[size]


def _worker(rank: int, world_size: int, init_file: str, tasks, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    while (task := tasks.get()) is not None:
        fn, args = task
        try:
            results.put((rank, True, fn(*args)))
        except BaseException:  # noqa: B036 - reported to the parent, which fails the test
            results.put((rank, False, traceback.format_exc()))
    # No `destroy_process_group()`: with subgroups alive it can wait for peers that are already gone; the
    # process exits right after, which frees everything.


class ProcessGroupPool:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self._processes = []

    def _start(self) -> None:
        context = mp.get_context("spawn")
        self._dir = tempfile.TemporaryDirectory()
        self._tasks = [context.Queue() for _ in range(self.world_size)]
        self._results = context.Queue()
        init_file = os.path.join(self._dir.name, "init")
        self._processes = [
            context.Process(
                target=_worker, args=(rank, self.world_size, init_file, self._tasks[rank], self._results), daemon=True
            )
            for rank in range(self.world_size)
        ]
        previous = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # read by the children when they start; restored below
        try:
            for process in self._processes:
                process.start()
        finally:
            if previous is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = previous

    def run(self, fn, *args, timeout_s: float = 2.5 * COLLECTIVE_TIMEOUT_S) -> list:
        """`fn(*args)` on every rank; the list of per-rank return values (picklable)."""
        if not self._processes:
            self._start()
        for tasks in self._tasks:
            tasks.put((fn, args))
        outcomes = {}
        try:
            for _ in range(self.world_size):
                rank, ok, payload = self._results.get(timeout=timeout_s)
                outcomes[rank] = (ok, payload)
        except queue.Empty:
            self.close()
            raise TimeoutError(
                f"{fn.__name__}: ranks {sorted(set(range(self.world_size)) - set(outcomes))} hung"
            ) from None
        failures = {rank: payload for rank, (ok, payload) in outcomes.items() if not ok}
        if failures:
            self.close()
            report = "\n".join(f"--- rank {rank} ---\n{text}" for rank, text in sorted(failures.items()))
            raise AssertionError(f"{fn.__name__} failed on ranks {sorted(failures)}:\n{report}")
        return [outcomes[rank][1] for rank in range(self.world_size)]

    def close(self) -> None:
        for process, tasks in zip(self._processes, self._tasks):
            if process.is_alive():
                tasks.put(None)
        for process in self._processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
        if self._processes:
            self._dir.cleanup()
        self._processes = []
