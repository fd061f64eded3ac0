"""How many tokens the draft should propose: K in {0, ..., K_max} from an online cost model (K = 0: plain decoding).

Speculation pays when the tokens a round emits outweigh what the round costs. Both sides move during RL: the
cost of verifying ``K + 1`` tokens per row grows with the live batch (a forward over many rows is compute-bound,
one over few rows is overhead-bound), and the acceptance moves with the policy and the co-trained draft. So the
choice is made per decoding round, from what the generator itself measured on this machine and this policy:

* ``target(b, n)``: seconds of a round's non-draft part (the target's forward over ``n = K + 1`` tokens per row,
  verification and bookkeeping) at batch-size bucket ``b`` (the batch rounded up to a power of two): the average
  of each K run there, made non-decreasing in ``n`` with every point weighted by how often it was run (so one
  noisy round of a rarely run K cannot steer the choice), and joined by straight lines between the Ks run (the
  cost is flat in ``n`` while the forward is overhead-bound and steepens once it is compute-bound, so one line
  over every K would overprice the small Ks);
* ``draft(b)``: seconds of one draft forward (with its share of the pass over the verified positions), measured
  on rounds with ``K > 0``; a round of K drafts runs ``forwards(K)`` of them: K for a chain drafter (EAGLE-3), one
  for a block drafter (DFlash), whose cost per token thus falls as K grows;
* ``alpha_i``: acceptance of draft position ``i`` given that positions ``< i`` were accepted, from the
  generator's own counters, exponentially forgotten (each position's estimate shrinks towards the one before it,
  so a position never drafted yet borrows its neighbour's rate).

Both times are kept at a reference speed of the machine, and a fast moving average ``speed(b)`` of how much
slower or faster each round ran than predicted tracks the machine's drift (a loaded or throttled CPU slows every K
alike): so K's measured a while ago stay comparable with the one running now, and the choice depends on their
relative costs only.

The predicted tokens per second of K are ``E(K) / (speed(b) * (target(b, K + 1) + forwards(K) * draft(b)))`` with
``E(K) = 1 + sum_{j=1..K} prod_{i<j} alpha_i`` tokens per round; K = 0 gives ``1 / target(b, 1)``. A new bucket
first runs ``K_max``, 0 and 1 (the ends of the curve and its first step); then now and then it runs the K
measured longest ago, so a stale estimate corrects itself: ``explore_interval`` rounds later, then at gaps that
double while explorations take the time the model predicted, and that start over at a surprise.
"""

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from ..validation import check_int


__all__ = ["AdaptiveSpeculation", "FixedSpeculation", "PlainDecoding", "SpeculationPolicy", "batch_bucket"]


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


@dataclass(frozen=True)
class PlainDecoding:
    """K = 0 every round: the speculative generator decodes one token per forward and never runs the draft (plain
    decoding where `generate` cannot run the target whole: a pipeline's last stage)."""

    max_speculative_tokens: int = 1  # the protocol's bound; never chosen

    def choose(self, batch_size: int) -> int:
        return 0

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

    def update(self, sample: float, weight: float, now: int, *, average_first: int = 1) -> None:
        """The first ``average_first`` samples count alike (a new K's first rounds: one noisy round must not fix
        its estimate), later ones by ``weight``."""
        self.count += 1
        if self.count <= average_first:
            weight = max(weight, 1.0 / self.count)
        self.value += weight * (sample - self.value)
        self.updated_at = now


@dataclass
class _Bucket:
    rounds: int = 0
    last_k: int | None = None
    speed: float = 1.0  # seconds now per second at the reference speed
    target: dict[int, _Smoothed] = field(default_factory=dict)  # K + 1 -> seconds at the reference speed
    draft: _Smoothed | None = None  # seconds per draft forward at the reference speed
    tokens: dict[int, _Smoothed] = field(default_factory=dict)  # K -> tokens emitted per row per round
    seconds: dict[int, _Smoothed] = field(default_factory=dict)  # K -> seconds per round, as measured
    calls: dict[bool, _Smoothed] = field(default_factory=dict)  # plain? -> tokens per second of whole calls
    calls_since_probe: int = 0
    calls_between_probes: int = 8  # the current gap between two probes of the slower route
    next_exploration: int | None = None  # the round at which this bucket next runs its stalest K
    rounds_between_explorations: int = 0  # the current gap
    exploring: int | None = None  # the K of an exploration round under way
    surprised: int | None = None  # the K whose last exploration did not take the predicted time


class AdaptiveSpeculation:
    """Chooses K per round (`SpeculationPolicy`) to maximise predicted tokens per second.

    Args:
        max_speculative_tokens: ``K_max``; K ranges over ``0 .. K_max``.
        draft_forwards: forwards of the draft in a round of K drafts (`DraftModel.draft_forwards`; default K, a
            chain drafter's).
        explore_interval: after this many rounds of a batch-size bucket, run the K measured longest ago. Each
            exploration whose round took what the model predicted (within ``explore_tolerance``) doubles the gap,
            up to ``max_explore_interval``; a surprise starts it over.
        max_explore_interval: the longest gap between two explorations (default: 8 x ``explore_interval``).
        explore_tolerance: how far (relative) an exploration round's time may be from its prediction and still
            confirm the model.
        first_rounds: rounds of each of ``K_max``, 0 and 1 a new bucket runs before it chooses.
        smoothing: weight of a new timing in its moving average.
        drift_smoothing: weight of a round in the moving average of the machine's speed.
        acceptance_memory: acceptance counts are multiplied by this at every observation (about
            ``1 / (1 - acceptance_memory)`` rounds are remembered).
        prior_strength: pseudo-drafts by which a position's acceptance leans towards the position before it
            (the first position towards ``prior_acceptance``).
        calls_between_probes: of the calls `prefers_plain` sends to the faster route (plain or speculative) in a
            row, every one after this many takes the other route, to re-measure it. Each probe that confirms the
            faster route doubles the gap, up to ``max_calls_between_probes``; a change of winner starts it over.
        max_calls_between_probes: the longest gap between two probes.
        call_smoothing: weight of a call's tokens per second in its route's moving average.
    """

    def __init__(
        self,
        max_speculative_tokens: int,
        *,
        draft_forwards: Callable[[int], int] | None = None,
        explore_interval: int = 25,
        max_explore_interval: int | None = None,
        explore_tolerance: float = 0.25,
        first_rounds: int = 2,
        smoothing: float = 0.1,
        drift_smoothing: float = 0.3,
        acceptance_memory: float = 0.98,
        prior_acceptance: float = 0.5,
        prior_strength: float = 2.0,
        calls_between_probes: int = 8,
        max_calls_between_probes: int = 32,
        call_smoothing: float = 0.3,
    ):
        self.max_speculative_tokens = check_int(max_speculative_tokens, "max_speculative_tokens")
        self.draft_forwards = (lambda k: k) if draft_forwards is None else draft_forwards
        self.explore_interval = check_int(explore_interval, "explore_interval")
        self.max_explore_interval = check_int(
            8 * self.explore_interval if max_explore_interval is None else max_explore_interval,
            "max_explore_interval",
            minimum=self.explore_interval,
            hint=" (at least `explore_interval`)",
        )
        if not explore_tolerance > 0:
            raise ValueError(f"`explore_tolerance`={explore_tolerance!r} is not allowed: it must be > 0.")
        self.explore_tolerance = explore_tolerance
        self.first_rounds = check_int(first_rounds, "first_rounds")
        for name, value in (
            ("smoothing", smoothing),
            ("drift_smoothing", drift_smoothing),
            ("acceptance_memory", acceptance_memory),
            ("call_smoothing", call_smoothing),
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
        self.calls_between_probes = check_int(calls_between_probes, "calls_between_probes")
        self.max_calls_between_probes = check_int(
            max_calls_between_probes,
            "max_calls_between_probes",
            minimum=self.calls_between_probes,
            hint=" (at least `calls_between_probes`)",
        )
        self.call_smoothing = call_smoothing

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
        """Whether a whole call of ``batch_size`` rows should decode plainly (``generate``) rather than speculatively.

        Decided on whole calls as measured (`observe_call`), not on the round model: a call also pays its prefill,
        cache compactions and the loop's bookkeeping, and the speculative generator's own plain rounds cost more
        than ``generate``'s steps. The first call of a bucket speculates (it measures the Ks), the second decodes
        plainly; then the route of the higher measured tokens per second wins, and after every
        ``calls_between_probes`` calls one takes the other route, so a draft that came to pay is noticed. The
        gap doubles with every probe that confirms the winner (a probe of a route measured twice as slow costs
        half a call) and starts over when the winner changes (a winner that gets slower needs no probe: its own
        calls show it)."""
        bucket = self._bucket(batch_size)
        if False not in bucket.calls or True not in bucket.calls:
            return False in bucket.calls  # speculate first, then measure plain decoding
        plain_wins = _plain_wins(bucket)
        bucket.calls_since_probe += 1
        if bucket.calls_since_probe > bucket.calls_between_probes:
            bucket.calls_since_probe = 0
            return not plain_wins
        return plain_wins

    def observe_call(self, batch_size: int, *, plain: bool, seconds: float, num_tokens: int) -> None:
        """A whole call of ``batch_size`` rows, decoded plainly or speculatively: its tokens per second."""
        if seconds > 0 and num_tokens:
            bucket = self._bucket(batch_size)
            winner = _plain_wins(bucket) if len(bucket.calls) == 2 else None
            _feed(bucket.calls, plain, num_tokens / seconds, self.call_smoothing, bucket.rounds, self.first_rounds)
            if winner is None:
                return
            if _plain_wins(bucket) != winner:  # a probe overturned the winner, or the winner's own calls did
                bucket.calls_between_probes, bucket.calls_since_probe = self.calls_between_probes, 0
            elif plain != winner:  # a probe that confirmed it
                bucket.calls_between_probes = min(2 * bucket.calls_between_probes, self.max_calls_between_probes)

    def _exploration(self, bucket: _Bucket) -> int | None:
        """``K_max``, 0 and 1 first (the ends of the curve, and the K that tells whether drafting pays at all),
        ``first_rounds`` rounds each; then, now and then, the stalest K (`_after_exploration` sets when)."""
        for k in (self.max_speculative_tokens, 0, 1):
            point = bucket.target.get(k + 1)
            if point is None or point.count < self.first_rounds:
                return k
        if bucket.next_exploration is None:  # the first rounds are done
            bucket.rounds_between_explorations = self.explore_interval
            bucket.next_exploration = bucket.rounds + self.explore_interval
        if bucket.rounds < bucket.next_exploration:
            return None
        measured_at = {k: bucket.target[k + 1].updated_at if k + 1 in bucket.target else -1 for k in self._ks()}
        bucket.exploring = bucket.surprised if bucket.surprised is not None else min(measured_at, key=measured_at.get)
        return bucket.exploring

    def _after_exploration(self, bucket: _Bucket, k: int, seconds: float) -> None:
        """The gap to the next exploration. A round of a K far from the best costs most of a round where speculation
        pays (a K = 0 round emits one token where K = 5 emits several), and a call of 128 tokens may be only 20
        rounds: one exploration every 25 rounds cost about 4% of such calls. So the gap doubles while explorations
        find the times the model predicted, and starts over at a surprise, whose K the next exploration runs again
        (a stale estimate, as one noisy round leaves, is re-measured until it holds)."""
        predicted = bucket.speed * self._reference_round_seconds(bucket, k)
        confirmed = abs(seconds / predicted - 1.0) <= self.explore_tolerance  # False while NaN
        gap = 2 * bucket.rounds_between_explorations if confirmed else self.explore_interval
        bucket.rounds_between_explorations = min(gap, self.max_explore_interval)
        bucket.next_exploration = bucket.rounds + bucket.rounds_between_explorations
        bucket.exploring, bucket.surprised = None, (None if confirmed else k)

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
        return bucket.speed * self._reference_round_seconds(bucket, k)

    def predicted_tokens_per_second(self, batch_size: int, k: int) -> float:
        return self.expected_tokens(k) / self.predicted_round_seconds(batch_size, k)

    def predicted_speedup(self, batch_size: int, k: int | None = None) -> float:
        """Predicted throughput of K (default: the best) over plain decoding's, at this batch size."""
        k = self.best(batch_size) if k is None else k
        return self.predicted_tokens_per_second(batch_size, k) / self.predicted_tokens_per_second(batch_size, 0)

    def measured_speedup(self, batch_size: int, k: int) -> float:
        """Measured throughput over plain decoding's at this bucket: of speculative calls over ``generate`` calls
        once both routes were run (`observe_call`), else of K's rounds over K = 0 rounds (NaN until both ran)."""
        bucket = self._buckets.get(batch_bucket(batch_size))
        if bucket is None:
            return math.nan
        if True in bucket.calls and False in bucket.calls:
            return bucket.calls[False].value / bucket.calls[True].value
        if k not in bucket.seconds or 0 not in bucket.seconds:
            return math.nan
        return (bucket.tokens[k].value / bucket.seconds[k].value) / (1.0 / bucket.seconds[0].value)

    # ------------------------------------------------------------------ observations

    def observe_round(
        self, batch_size: int, k: int, *, seconds: float, draft_seconds: float, tokens_per_row: float
    ) -> None:
        bucket = self._bucket(batch_size)
        if bucket.exploring is not None:
            self._after_exploration(bucket, k, seconds)
        bucket.rounds += 1
        now, weight = bucket.rounds, self.smoothing
        # A K that keeps running tells the machine's drift (it alone sees it); a K just switched to, or still in its
        # first rounds, tells its own cost relative to the others, at the speed its predecessor left. Learning both
        # from every round would let the running K's estimate absorb part of a slowdown and lose to stale rivals.
        point = bucket.target.get(k + 1)
        if k == bucket.last_k and point is not None and point.count >= self.first_rounds:
            bucket.speed += self.drift_smoothing * (seconds / self._reference_round_seconds(bucket, k) - bucket.speed)
            point.updated_at = now
        else:
            _feed(bucket.target, k + 1, (seconds - draft_seconds) / bucket.speed, weight, now, self.first_rounds)
        bucket.last_k = k
        if k:
            per_forward = draft_seconds / self.draft_forwards(k) / bucket.speed
            if bucket.draft is None:
                bucket.draft = _Smoothed(per_forward, now)
            else:
                bucket.draft.update(per_forward, weight, now)
        _feed(bucket.seconds, k, seconds, weight, now)
        _feed(bucket.tokens, k, tokens_per_row, weight, now)

    def observe_acceptance(self, reached: list[int], accepted: list[int]) -> None:
        memory = self.acceptance_memory
        for i, (r, a) in enumerate(zip(reached, accepted)):
            self._reached[i] = memory * self._reached[i] + r
            self._accepted[i] = memory * self._accepted[i] + a

    def _bucket(self, batch_size: int) -> _Bucket:
        key = batch_bucket(batch_size)
        if key not in self._buckets:
            self._buckets[key] = _Bucket(calls_between_probes=self.calls_between_probes)
        return self._buckets[key]

    def _ks(self) -> range:
        return range(self.max_speculative_tokens + 1)

    def _reference_round_seconds(self, bucket: _Bucket, k: int) -> float:
        """A round of K drafts at the bucket's reference speed (NaN until its parts were measured)."""
        if not bucket.target or (k and bucket.draft is None):
            return math.nan
        draft = self.draft_forwards(k) * bucket.draft.value if k else 0.0
        return _monotone_interpolation(bucket.target, k + 1) + draft


def _plain_wins(bucket: _Bucket) -> bool:
    return bucket.calls[True].value > bucket.calls[False].value


def _feed(
    table: dict[int, _Smoothed], key: int, sample: float, weight: float, now: int, average_first: int = 1
) -> None:
    if key in table:
        table[key].update(sample, weight, now, average_first=average_first)
    else:
        table[key] = _Smoothed(sample, now)


def _monotone_interpolation(points: dict[int, _Smoothed], n: int, *, max_weight: int = 20) -> float:
    """The measured averages made non-decreasing in ``n`` (a forward over more tokens costs no less), then joined
    by straight lines (the last one extended beyond the largest ``n`` measured, flat below the smallest).

    Monotone by weighted pool-adjacent-violators, each point weighted by its observations (at most ``max_weight``):
    a rarely run K whose few rounds were noisy gives way to its well-measured neighbour instead of steering the
    choice. Joining neighbours, not fitting one line over every K, follows the curve where it bends: the cost of
    ``n`` tokens per row is flat while the forward is overhead-bound and steepens once it is compute-bound.
    """
    blocks: list[tuple[float, int, list[int]]] = []  # pooled value, weight, the n's it covers
    for x in sorted(points):
        value, weight, xs = points[x].value, min(points[x].count, max_weight), [x]
        while blocks and blocks[-1][0] > value:
            previous_value, previous_weight, previous_xs = blocks.pop()
            value = (previous_value * previous_weight + value * weight) / (previous_weight + weight)
            weight, xs = previous_weight + weight, previous_xs + xs
        blocks.append((value, weight, xs))
    fitted = [(x, value) for value, _, xs in blocks for x in xs]
    if n <= fitted[0][0] or len(fitted) == 1:
        return fitted[0][1]
    segments = list(itertools.pairwise(fitted))
    (x0, y0), (x1, y1) = next((segment for segment in segments if n <= segment[1][0]), segments[-1])
    return y0 + (y1 - y0) * (n - x0) / (x1 - x0)
