"""Runs that take turns: trainers in threads of one process, one optimizer step each in turn, each timed only while
it holds the turn, so that a machine whose speed drifts during the job slows every run alike."""

import threading
import time

from transformers import TrainerCallback


class Turns:
    """A baton that trainers running in threads of one process pass to each other at the end of every step.

    Only the holder runs, and ``seconds[name]`` adds up the time each held it: its wall time, waiting excluded. A
    trainer that finishes (or fails) leaves the others to take turns without it.
    """

    def __init__(self, names: list[str]):
        self.names = list(names)
        self.seconds = dict.fromkeys(self.names, 0.0)
        self._holder, self._finished = self.names[0], set()
        self._since = time.perf_counter()
        self._condition = threading.Condition()

    def wait(self, name: str) -> None:
        with self._condition:
            self._condition.wait_for(lambda: self._holder == name)

    def pass_on(self, name: str, *, finished: bool = False) -> None:
        with self._condition:
            now = time.perf_counter()
            self.seconds[name] += now - self._since
            self._since = now
            if finished:
                self._finished.add(name)
            waiting = [n for n in self.names if n not in self._finished]
            if waiting:
                after = self.names.index(name)
                self._holder = min(waiting, key=lambda n: (self.names.index(n) - after - 1) % len(self.names))
            self._condition.notify_all()

    def take_turns(self, name: str) -> "TurnCallback":
        return TurnCallback(self, name)


class TurnCallback(TrainerCallback):
    """Hands the baton on after each optimizer step and waits for it to come back."""

    def __init__(self, turns: Turns, name: str):
        self.turns, self.name = turns, name

    def on_step_end(self, args, state, control, **kwargs):
        self.turns.pass_on(self.name)
        self.turns.wait(self.name)


def train_in_turns(trainers: dict) -> dict[str, float]:
    """Train every trainer in its own thread, one optimizer step each in turn; the seconds each spent running.

    Threads, not processes: the trainers share the process's cores and memory exactly as one run alone has them.
    """
    turns = Turns(list(trainers))
    errors: dict[str, BaseException] = {}

    def run(name: str, trainer) -> None:
        turns.wait(name)
        try:
            trainer.train()
        except BaseException as error:  # re-raised below, once the other trainers are done
            errors[name] = error
        finally:
            turns.pass_on(name, finished=True)

    for name, trainer in trainers.items():
        trainer.add_callback(turns.take_turns(name))
    threads = [threading.Thread(target=run, args=item, name=f"train-{item[0]}") for item in trainers.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for error in errors.values():
        raise error
    return turns.seconds
