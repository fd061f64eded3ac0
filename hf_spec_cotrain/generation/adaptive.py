"""How many tokens the draft should propose: K in {0, ..., K_max} from an online cost model (K = 0: plain decoding).

Speculation pays when the tokens a round emits outweigh what the round costs. Both sides move during RL: the
cost of verifying ``K + 1`` tokens per row grows with the live batch (a forward over many rows is compute-bound,
one over few rows is overhead-bound), and the acceptance moves with the policy and the co-trained draft. So the
choice is made per decoding round, from what the generator itself measured on this machine and this policy:

* ``target(b, n)``: seconds of a round's non-draft part (the target's forward over ``n = K + 1`` tokens per row,
  verification and bookkeeping) at batch-size bucket ``b`` (the batch rounded up to a power of two): a line in
  ``n`` fitted to the moving averages of every K run there, each weighted by how often it was run, so that every
  round refines the prediction for every K and one noisy round of a rarely run K cannot steer the choice;
* ``draft(b)``: seconds of the draft per proposed token (its chain steps and its pass over the verified
  positions), measured on rounds with ``K > 0``;
* ``alpha_i``: acceptance of draft position ``i`` given that positions ``< i`` were accepted, from the
  generator's own counters, exponentially forgotten (each position's estimate shrinks towards the one before it,
  so a position never drafted yet borrows its neighbour's rate).

Both times are kept at a reference speed of the machine, and a fast moving average ``speed(b)`` of how much
slower or faster each round ran than predicted tracks the machine's drift (a loaded or throttled CPU slows every K
alike): so K's measured a while ago stay comparable with the one running now, and the choice depends on their
relative costs only.

The predicted tokens per second of K are ``E(K) / (speed(b) * (target(b, K + 1) + K * draft(b)))`` with
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
    """An exponential moving average that remembers when it was last fed (in rounds of its bucket) and how often."""

    value: float
    updated_at: int
    count: int = 1

    def update(self, sample: float, weight: float, now: int) -> None:
        self.value += weight * (sample - self.value)
        self.updated_at = now
        self.count += 1


@dataclass
class _Bucket:
    rounds: int = 0
    speed: float = 1.0  # seconds now per second at the reference speed
    target: dict[int, _Smoothed] = field(default_factory=dict)  # K + 1 -> seconds at the reference speed
    draft: _Smoothed | None = None  # seconds per drafted token at the reference speed
    tokens: dict[int, _Smoothed] = field(default_factory=dict)  # K -> tokens emitted per row per round
    seconds: dict[int, _Smoothed] = field(default_factory=dict)  # K -> seconds per round, as measured


class AdaptiveSpeculation:
    """Chooses K per round (`SpeculationPolicy`) to maximise predicted tokens per second.

    Args:
        max_speculative_tokens: ``K_max``; K ranges over ``0 .. K_max``.
        explore_interval: every this many rounds of a batch-size bucket, run the K measured longest ago.
        smoothing: weight of a new timing in its moving average.
        drift_smoothing: weight of a round in the moving average of the machine's speed.
        acceptance_memory: acceptance counts are multiplied by this at every observation (about
            ``1 / (1 - acceptance_memory)`` rounds are remembered).
        prior_strength: pseudo-drafts by which a position's acceptance leans towards the position before it
            (the first position towards ``prior_acceptance``).
        plain_calls_between_probes: of the calls `prefers_plain` sends to plain decoding in a row, every one after
            this many goes to the speculative generator instead, to re-measure.
    """

    def __init__(
        self,
        max_speculative_tokens: int,
        *,
        explore_interval: int = 50,
        smoothing: float = 0.1,
        drift_smoothing: float = 0.3,
        acceptance_memory: float = 0.98,
        prior_acceptance: float = 0.5,
        prior_strength: float = 2.0,
        plain_calls_between_probes: int = 8,
    ):
        self.max_speculative_tokens = check_int(max_speculative_tokens, "max_speculative_tokens")
        self.explore_interval = check_int(explore_interval, "explore_interval")
        for name, value in (
            ("smoothing", smoothing),
            ("drift_smoothing", drift_smoothing),
            ("acceptance_memory", acceptance_memory),
        ):
            if not 0 < value <= 1:
                raise ValueError(f"`{name}`={value!r} is not allowed: it must be in (0, 1].")
        if not 0 <= prior_acceptance <= 1 or not prior_strength > 0:
            raise ValueError(
                f"`prior_acceptance`={prior_acceptance!r} must be in [0, 1] and `prior_strength`={prior_strength!r} "
                "> 0."
            )
        self.smoothing, self.drift_smoothing, self.acceptance_memory = smoothing, drift_smoothing, acceptance_memory
        self.prior_acceptance, self.prior_strength = prior_acceptance, prior_strength
        self._reached = [0.0] * max_speculative_tokens
        self._accepted = [0.0] * max_speculative_tokens
        self._buckets: dict[int, _Bucket] = {}
        self.plain_calls_between_probes = check_int(plain_calls_between_probes, "plain_calls_between_probes")
        self._plain_calls_in_a_row = 0

    # ------------------------------------------------------------------ the choice

    def choose(self, batch_size: int) -> int:
        bucket = self._bucket(batch_size)
        explore = self._exploration(bucket)
        return self.best(batch_size) if explore is None else explore

    def best(self, batch_size: int) -> int:
        """The K of the highest predicted throughput (the smallest one on a tie); K_max while nothing is measured."""
        tokens = self._expected_tokens_per_k()  # once per choice: it runs before every decoding round
        rates = [tokens[k] / self.predicted_round_seconds(batch_size, k) for k in self._ks()]
        if all(math.isnan(rate) for rate in rates):
            return self.max_speculative_tokens
        return max(range(len(rates)), key=lambda k: (-math.inf if math.isnan(rates[k]) else rates[k], -k))

    def prefers_plain(self, batch_size: int) -> bool:
        """Whether a whole call of ``batch_size`` rows should decode plainly (``generate``, whose steps cost less
        than the speculative generator's K = 0 rounds): K = 0 predicted best, except every
        ``plain_calls_between_probes + 1``-th such call in a row, which speculates and so re-measures the Ks (a
        co-trained draft may come to pay)."""
        if self.best(batch_size) != 0:
            self._plain_calls_in_a_row = 0
            return False
        self._plain_calls_in_a_row += 1
        if self._plain_calls_in_a_row > self.plain_calls_between_probes:
            self._plain_calls_in_a_row = 0
            return False
        return True

    def observe_plain_call(self, batch_size: int, *, seconds: float, steps: int) -> None:
        """A call decoded plainly in ``steps`` decoding steps: the cost of K = 0 at this batch."""
        if steps:
            self.observe_round(batch_size, 0, seconds=seconds / steps, draft_seconds=0.0, tokens_per_row=1.0)

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
        return self._expected_tokens_per_k()[k]

    def _expected_tokens_per_k(self) -> list[float]:
        """`expected_tokens` of K = 0 .. K_max: running sums of the chance that the first j drafts survive."""
        totals, survive = [1.0], 1.0
        for rate in self.acceptance_rates():
            survive *= rate
            totals.append(totals[-1] + survive)
        return totals

    def predicted_round_seconds(self, batch_size: int, k: int) -> float:
        """Seconds of one round of K drafts at this batch size (NaN until something is measured there)."""
        bucket = self._buckets.get(batch_bucket(batch_size))
        if bucket is None:
            return math.nan
        return bucket.speed * _reference_round_seconds(bucket, k)

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
        expected = _reference_round_seconds(bucket, k)
        if expected > 0:  # NaN (nothing to compare with yet) fails this too
            bucket.speed += self.drift_smoothing * (seconds / expected - bucket.speed)
        _feed(bucket.target, k + 1, (seconds - draft_seconds) / bucket.speed, weight, now)
        if k:
            per_token = draft_seconds / k / bucket.speed
            if bucket.draft is None:
                bucket.draft = _Smoothed(per_token, now)
            else:
                bucket.draft.update(per_token, weight, now)
        _feed(bucket.seconds, k, seconds, weight, now)
        _feed(bucket.tokens, k, tokens_per_row, weight, now)

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


def _reference_round_seconds(bucket: _Bucket, k: int) -> float:
    """A round of K drafts at the bucket's reference speed (NaN until its parts were measured)."""
    if not bucket.target or (k and bucket.draft is None):
        return math.nan
    return _fitted_line(bucket.target, k + 1) + (k * bucket.draft.value if k else 0.0)


def _fitted_line(points: dict[int, _Smoothed], n: int, *, max_weight: int = 20) -> float:
    """The line ``a + b * n`` (``b >= 0``: a forward over more tokens costs no less) fitted by least squares to the
    measured points, each weighted by its number of observations (at most ``max_weight``); flat through a single
    point."""
    weights = {x: min(point.count, max_weight) for x, point in points.items()}
    total = sum(weights.values())
    mean_x = sum(w * x for x, w in weights.items()) / total
    mean_y = sum(w * points[x].value for x, w in weights.items()) / total
    spread = sum(w * (x - mean_x) ** 2 for x, w in weights.items())
    slope = 0.0
    if spread > 0:
        slope = max(sum(w * (x - mean_x) * (points[x].value - mean_y) for x, w in weights.items()) / spread, 0.0)
    return mean_y + slope * (n - mean_x)
