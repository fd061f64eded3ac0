"""What the sampling-distribution tests (HF-native and vLLM) share: the target's exact law and a goodness-of-fit test."""

import math
from collections import Counter

import torch
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


def warped_probs_reference(logits, temperature, top_k, top_p):
    """Temperature, then top-k (ties kept), then top-p (keep tokens whose higher-ranked mass is < top_p)."""
    logits = logits / temperature
    if top_k:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if top_p < 1:
        sorted_probs, order = probs.sort(-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        keep = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, mass_before < top_p)
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def exact_distribution(target, prompt, num_tokens, *, temperature, top_k, top_p, pad, eos):
    """P(generated tokens) by enumerating every prefix of `prompt` (`[1, P]`); a sequence ends at `eos` (None: no
    token ends one) and is padded with `pad` after it."""
    finished, alive = {}, {(): 1.0}
    with torch.no_grad():
        for _ in range(num_tokens):
            prefixes = list(alive)
            tails = torch.tensor(prefixes, dtype=torch.long).view(len(prefixes), -1)
            batch = torch.cat([prompt.expand(len(prefixes), -1), tails], dim=1)
            probs = warped_probs_reference(target(batch).logits[:, -1], temperature, top_k, top_p)
            grown = {}
            for prefix, row in zip(prefixes, probs.tolist()):
                for token, p in enumerate(row):
                    if p > 0:
                        (finished if token == eos else grown)[(*prefix, token)] = alive[prefix] * p
            alive = grown
    return {seq + (pad,) * (num_tokens - len(seq)): p for seq, p in {**finished, **alive}.items()}
