"""How many tokens the draft should propose: K in {0, ..., K_max} from an online cost model (K = 0: plain decoding).

Speculation pays when the tokens a round emits outweigh what the round costs. Both sides move during RL: the
cost of verifying ``K + 1`` tokens per row grows with the live batch (a forward over many rows is compute-bound,
one over few rows is overhead-bound), and the acceptance moves with the policy and the co-trained draft. So the
choice is made per decoding round, from what the generator itself measured on this machine and this policy:

* ``target(b, n)``: seconds of a round's non-draft part (the target's forward over ``n = K + 1`` tokens per row,
  verification and bookkeeping) at batch-size bucket ``b`` (the batch rounded up to a power of two), measured
  for the K actually run and interpolated linearly in ``n`` for the others;
* ``draft(b)``: seconds of the draft per proposed token (its chain steps and its pass over the verified
  positions), measured on rounds with ``K > 0``;
* ``alpha_i``: acceptance of draft position ``i`` given that positions ``< i`` were accepted, from the
  generator's own counters, exponentially forgotten (each position's estimate shrinks towards the one before it,
  so a position never drafted yet borrows its neighbour's rate).

The predicted tokens per second of K are ``E(K) / (target(b, K + 1) + K * draft(b))`` with
``E(K) = 1 + sum_{j=1..K} prod_{i<j} alpha_i`` tokens per round; K = 0 gives ``1 / target(b, 1)``. A new bucket
first runs ``K_max`` and then 0 (the two ends of the line), and every ``explore_interval`` rounds a bucket runs the
K measured longest ago, so a stale estimate corrects itself.
"""

import math
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from ..validation import check_int


__all__ = ["AdaptiveSpeculation", "FixedSpeculation", "SpeculationPolicy", "batch_bucket"]


@runtime_checkable
class SpeculationPolicy(Protocol):
    """What the speculative generator asks before each round and tells after it."""

    max_speculative_tokens: int

    def choose(self, batch_size: int) -> int:
        """K for the next round of ``batch_size`` live rows, in ``[0, max_speculative_tokens]``."""

    def observe_round(
        self, batch_size: int, k: int, *, seconds: float, draft_seconds: float, tokens_per_row: float
    ) -> None:
        """A round's wall time, the draft's share of it, and the tokens it emitted per row."""

    def observe_acceptance(self, reached: list[int], accepted: list[int]) -> None:
        """Per draft position: how many drafts reached it (all earlier positions accepted), and how many of those
        were accepted."""


@dataclass(frozen=True)
class FixedSpeculation:
    """Always ``K`` (the classic fixed-K speculative decoding)."""

    max_speculative_tokens: int

    def __post_init__(self):
        check_int(self.max_speculative_tokens, "num_speculative_tokens")

    def choose(self, batch_size: int) -> int:
        return self.max_speculative_tokens

    def observe_round(self, batch_size, k, *, seconds, draft_seconds, tokens_per_row) -> None:
        pass

    def observe_acceptance(self, reached, accepted) -> None:
        pass


def batch_bucket(batch_size: int) -> int:
    """The power of two at or above ``batch_size``: batches whose forwards cost about the same."""
    return 1 << (batch_size - 1).bit_length()


@dataclass
class _Smoothed:
    """An exponential moving average that remembers when it was last fed (in rounds of its bucket)."""

    value: float
    updated_at: int

    def update(self, sample: float, weight: float, now: int) -> None:
        self.value += weight * (sample - self.value)
        self.updated_at = now


@dataclass
class _Bucket:
    rounds: int = 0
    target: dict[int, _Smoothed] = field(default_factory=dict)  # tokens per row verified (K + 1) -> seconds
    tokens: dict[int, _Smoothed] = field(default_factory=dict)  # K -> tokens emitted per row per round
    seconds: dict[int, _Smoothed] = field(default_factory=dict)  # K -> seconds per round
    draft: _Smoothed | None = None  # seconds per drafted token


class AdaptiveSpeculation:
    """Chooses K per round (`SpeculationPolicy`) to maximise predicted tokens per second.

    Args:
        max_speculative_tokens: ``K_max``; K ranges over ``0 .. K_max``.
        explore_interval: every this many rounds of a batch-size bucket, run the K measured longest ago.
        smoothing: weight of a new timing in its moving average.
        acceptance_memory: acceptance counts are multiplied by this at every observation (about
            ``1 / (1 - acceptance_memory)`` rounds are remembered).
        prior_strength: pseudo-drafts by which a position's acceptance leans towards the position before it
            (the first position towards ``prior_acceptance``).
    """

    def __init__(
        self,
        max_speculative_tokens: int,
        *,
        explore_interval: int = 50,
        smoothing: float = 0.2,
        acceptance_memory: float = 0.98,
        prior_acceptance: float = 0.5,
        prior_strength: float = 2.0,
    ):
        self.max_speculative_tokens = check_int(max_speculative_tokens, "max_speculative_tokens")
        self.explore_interval = check_int(explore_interval, "explore_interval")
        for name, value in (("smoothing", smoothing), ("acceptance_memory", acceptance_memory)):
            if not 0 < value <= 1:
                raise ValueError(f"`{name}`={value!r} is not allowed: it must be in (0, 1].")
        if not 0 <= prior_acceptance <= 1 or not prior_strength > 0:
            raise ValueError(
                f"`prior_acceptance`={prior_acceptance!r} must be in [0, 1] and `prior_strength`={prior_strength!r} "
                "> 0."
            )
        self.smoothing, self.acceptance_memory = smoothing, acceptance_memory
        self.prior_acceptance, self.prior_strength = prior_acceptance, prior_strength
        self._reached = [0.0] * max_speculative_tokens
        self._accepted = [0.0] * max_speculative_tokens
        self._buckets: dict[int, _Bucket] = {}

    # ------------------------------------------------------------------ the choice

    def choose(self, batch_size: int) -> int:
        bucket = self._bucket(batch_size)
        explore = self._exploration(bucket)
        return self.best(batch_size) if explore is None else explore

    def best(self, batch_size: int) -> int:
        """The K of the highest predicted throughput (the smallest one on a tie); K_max while nothing is measured."""
        rates = [self.predicted_tokens_per_second(batch_size, k) for k in range(self.max_speculative_tokens + 1)]
        if all(math.isnan(rate) for rate in rates):
            return self.max_speculative_tokens
        return max(range(len(rates)), key=lambda k: (-math.inf if math.isnan(rates[k]) else rates[k], -k))

    def _exploration(self, bucket: _Bucket) -> int | None:
        """The two ends of the line first, then, every ``explore_interval`` rounds, the stalest K."""
        for k in (self.max_speculative_tokens, 0):
            if k + 1 not in bucket.target:
                return k
        if bucket.rounds and bucket.rounds % self.explore_interval == 0:
            measured_at = {k: bucket.target[k + 1].updated_at if k + 1 in bucket.target else -1 for k in self._ks()}
            return min(measured_at, key=measured_at.get)
        return None

    # ------------------------------------------------------------------ the model

    def acceptance_rates(self) -> list[float]:
        """``alpha_i``: acceptance of draft position ``i`` once positions ``< i`` were accepted."""
        rates, previous = [], self.prior_acceptance
        for reached, accepted in zip(self._reached, self._accepted):
            previous = (accepted + self.prior_strength * previous) / (reached + self.prior_strength)
            rates.append(previous)
        return rates

    def expected_tokens(self, k: int) -> float:
        """Tokens one round of K drafts emits per row, on average (accepted drafts plus one)."""
        total, survive = 1.0, 1.0
        for rate in self.acceptance_rates()[:k]:
            survive *= rate
            total += survive
        return total

    def predicted_round_seconds(self, batch_size: int, k: int) -> float:
        """Seconds of one round of K drafts at this batch size (NaN until something is measured there)."""
        bucket = self._buckets.get(batch_bucket(batch_size))
        if bucket is None or not bucket.target:
            return math.nan
        seconds = _interpolate({n: s.value for n, s in bucket.target.items()}, k + 1)
        if k:
            if bucket.draft is None:
                return math.nan
            seconds += k * bucket.draft.value
        return seconds

    def predicted_tokens_per_second(self, batch_size: int, k: int) -> float:
        return self.expected_tokens(k) / self.predicted_round_seconds(batch_size, k)

    def predicted_speedup(self, batch_size: int, k: int | None = None) -> float:
        """Predicted throughput of K (default: the best) over plain decoding's, at this batch size."""
        k = self.best(batch_size) if k is None else k
        return self.predicted_tokens_per_second(batch_size, k) / self.predicted_tokens_per_second(batch_size, 0)

    def measured_speedup(self, batch_size: int, k: int) -> float:
        """Measured throughput of K over plain decoding's at this bucket (NaN until both were run)."""
        bucket = self._buckets.get(batch_bucket(batch_size))
        if bucket is None or k not in bucket.seconds or 0 not in bucket.seconds:
            return math.nan
        return (bucket.tokens[k].value / bucket.seconds[k].value) / (1.0 / bucket.seconds[0].value)

    # ------------------------------------------------------------------ observations

    def observe_round(
        self, batch_size: int, k: int, *, seconds: float, draft_seconds: float, tokens_per_row: float
    ) -> None:
        bucket = self._bucket(batch_size)
        bucket.rounds += 1
        now, weight = bucket.rounds, self.smoothing
        _feed(bucket.target, k + 1, seconds - draft_seconds, weight, now)
        _feed(bucket.seconds, k, seconds, weight, now)
        _feed(bucket.tokens, k, tokens_per_row, weight, now)
        if k:
            per_token = draft_seconds / k
            if bucket.draft is None:
                bucket.draft = _Smoothed(per_token, now)
            else:
                bucket.draft.update(per_token, weight, now)

    def observe_acceptance(self, reached: list[int], accepted: list[int]) -> None:
        memory = self.acceptance_memory
        for i, (r, a) in enumerate(zip(reached, accepted)):
            self._reached[i] = memory * self._reached[i] + r
            self._accepted[i] = memory * self._accepted[i] + a

    def _bucket(self, batch_size: int) -> _Bucket:
        return self._buckets.setdefault(batch_bucket(batch_size), _Bucket())

    def _ks(self) -> range:
        return range(self.max_speculative_tokens + 1)


def _feed(table: dict[int, _Smoothed], key: int, sample: float, weight: float, now: int) -> None:
    if key in table:
        table[key].update(sample, weight, now)
    else:
        table[key] = _Smoothed(sample, now)


def _interpolate(points: dict[int, float], n: int) -> float:
    """``points[n]`` if measured; else the least-squares line through the measured points (flat through a single
    one), never below the nearest measured point under ``n`` (a forward over more tokens costs no less)."""
    if n in points:
        return points[n]
    xs = sorted(points)
    if len(xs) == 1:
        return points[xs[0]]
    mean_x = sum(xs) / len(xs)
    mean_y = sum(points[x] for x in xs) / len(xs)
    slope = sum((x - mean_x) * (points[x] - mean_y) for x in xs) / sum((x - mean_x) ** 2 for x in xs)
    estimate = mean_y + slope * (n - mean_x)
    below = [points[x] for x in xs if x < n]
    return max(estimate, below[-1]) if below else estimate
