"""The goodness-of-fit test shared by the sampling-distribution tests (HF-native and vLLM)."""

import math
from collections import Counter

from scipy.stats import chi2


def g_test(samples, exact) -> float:
    """G-test p-value of samples against exact outcome probabilities; cells expecting < 5 are pooled.

    A sample the exact law gives probability 0 (e.g. a token top-k removed) returns 0.
    """
    counts = Counter(samples)
    if any(exact.get(outcome, 0.0) == 0.0 for outcome in counts):
        return 0.0
    n = len(samples)
    cells = sorted((outcome for outcome, p in exact.items() if n * p >= 5), key=exact.get, reverse=True)
    observed = [counts[c] for c in cells]
    expected = [n * exact[c] for c in cells]
    rest_observed, rest_expected = n - sum(observed), n - sum(expected)
    if rest_expected >= 5:
        observed.append(rest_observed)
        expected.append(rest_expected)
    else:  # too small to stand alone: merge into the smallest cell
        observed[-1] += rest_observed
        expected[-1] += rest_expected
    statistic = 2 * sum(o * math.log(o / e) for o, e in zip(observed, expected) if o > 0)
    return float(chi2.sf(statistic, len(observed) - 1))
