"""Adaptive speculation: the cost model's choice of K (asserted on injected costs, never on timings), and the
generator's rounds of varying K (including K = 0, plain decoding) staying lossless."""

import copy
import itertools
import math

import pytest
import torch
from statistics_utils import g_test
from test_speculative import EOS, P_VALUE_THRESHOLD, _exact, _reference_counts, _sample, _setup, _small_vocab_setup

from hf_spec_cotrain import AdaptiveSpeculation, SpecCoTrainConfig
from hf_spec_cotrain.draft import DFlashDraftModel
from hf_spec_cotrain.draft.eagle3_proposer import Eagle3Proposer
from hf_spec_cotrain.generation.adaptive import FixedSpeculation, batch_bucket
from hf_spec_cotrain.generation.decoder import SpeculativeDecoder
from hf_spec_cotrain.generation.speculative import speculative_generate


class ScriptedSpeculation:
    """K from a fixed cycle, whatever the batch: every switch between K values the generator must survive."""

    def __init__(self, ks, max_speculative_tokens=5):
        self.max_speculative_tokens = max_speculative_tokens
        self.ks = itertools.cycle(ks)

    def choose(self, batch_size):
        return next(self.ks)

    def observe_round(self, batch_size, k, *, seconds, draft_seconds, tokens_per_row):
        pass

    def observe_acceptance(self, reached, accepted):
        pass


def _check_round_counters(out, k_max):
    drafted = [(live, k) for live, k in out.rounds if k]
    assert out.num_draft_tokens == sum(live * k for live, k in drafted)
    assert out.num_drafts == int(out.num_drafts_per_row.sum()) == sum(live for live, _ in drafted)
    assert len(out.accepted_per_position) == k_max
    assert all(a >= b for a, b in itertools.pairwise(out.accepted_per_position))
    assert sum(out.accepted_per_position) == out.num_accepted_tokens == int(out.num_accepted_per_row.sum())
    assert out.num_target_forwards == 1 + len(out.rounds)
    assert all(later <= earlier for (earlier, _), (later, _) in itertools.pairwise(out.rounds))  # rows only leave


# ---------------------------------------------------------------------------------------------- lossless


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt_oss", "qwen3_5"])
@pytest.mark.parametrize("ks", [(0, 3, 0, 0, 1, 5, 2), (2, 0), (0,)])
def test_rounds_of_any_k_keep_greedy_equal_to_generate(family, ks):
    """Plain steps between speculative rounds leave the draft's inputs pending; it must catch up exactly (gpt-oss:
    plain steps through its sliding windows and sinks too; Qwen3.5: one-token verifications of its linear-attention
    layers between rounds that roll their states back)."""
    target, random_draft, trained, input_ids, attention_mask = _setup(family)
    max_new_tokens = 29
    want = target.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=max_new_tokens)
    for draft in (random_draft, trained):
        out = speculative_generate(
            target,
            draft,
            input_ids,
            attention_mask,
            max_new_tokens=max_new_tokens,
            num_speculative_tokens=ScriptedSpeculation(ks),
        )
        assert torch.equal(out.sequences, want)
        _check_round_counters(out, 5)
        assert {k for _, k in out.rounds} == set(ks)
    if ks != (0,):
        assert out.acceptance_length > 1.5  # the trained draft, proposing from caught-up inputs, is accepted


@pytest.mark.parametrize("ks", [(0, 3, 0, 0, 2), (0, 0, 0, 0, 0, 0, 0, 0, 4)])
def test_the_draft_catches_up_exactly_after_plain_steps(ks):
    """Per-row draft and acceptance counts equal chain drafting rebuilt from scratch every round (float64): the
    draft, when it drafts again, has seen every verified position, including those of plain steps."""
    target, _, trained, input_ids, attention_mask = _setup("llama")
    target, draft = copy.deepcopy(target).double(), copy.deepcopy(trained).double()
    with torch.no_grad():
        want_drafts, want_accepted = _reference_counts(
            target, draft, input_ids[:4], attention_mask[:4], k=ks, max_new_tokens=25, eos=EOS
        )
    out = speculative_generate(
        target,
        draft,
        input_ids[:4],
        attention_mask[:4],
        max_new_tokens=25,
        num_speculative_tokens=ScriptedSpeculation(ks),
        eos_token_id=EOS,
    )
    assert out.num_drafts_per_row.tolist() == want_drafts
    assert out.num_accepted_per_row.tolist() == want_accepted


def test_eos_rows_leave_while_k_changes():
    target, _, trained, input_ids, attention_mask = _setup("llama")
    want = target.generate(
        input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=40, eos_token_id=[5, 9, 11]
    )
    out = speculative_generate(
        target,
        trained,
        input_ids,
        attention_mask,
        max_new_tokens=40,
        num_speculative_tokens=ScriptedSpeculation((0, 4, 1, 0, 2)),
        eos_token_id=[5, 9, 11],
    )
    assert torch.equal(out.sequences, want[:, : out.sequences.shape[1]])
    assert out.rounds[-1][0] < out.rounds[0][0]  # the batch shrank mid-call
    _check_round_counters(out, 5)


@pytest.mark.parametrize(
    "ks, draft_sampling, family",
    [((0, 2, 1), "probabilistic", "llama"), ((2, 0, 0), "greedy", "llama"), ((0, 2, 1), "probabilistic", "qwen3_5")],
)
def test_rounds_of_any_k_keep_the_target_distribution(ks, draft_sampling, family):
    setup = (family, None)
    _, drafts, _ = _small_vocab_setup(*setup)
    samples, out = _sample(
        drafts[True],
        seed=len(ks),
        num_speculative_tokens=ScriptedSpeculation(ks, max_speculative_tokens=2),
        draft_sampling=draft_sampling,
        target_setup=setup,
    )
    assert g_test(samples, _exact(target_setup=setup)) > P_VALUE_THRESHOLD
    assert 0 < out.num_accepted_tokens < out.num_draft_tokens
    _check_round_counters(out, 2)


# ---------------------------------------------------------------------------------------------- the cost model


def _fed(model, batch_size, *, target, draft, acceptance, rounds=3):
    """Feed ``model`` rounds at every K with the costs ``target(n)`` (seconds for n tokens per row) and ``draft``
    (seconds per draft forward, `draft_forwards(K)` of them per round), and drafts accepted at rate ``acceptance``
    per position."""
    for _ in range(rounds):
        for k in range(model.max_speculative_tokens + 1):
            draft_seconds = model.draft_forwards(k) * draft
            model.observe_round(
                batch_size, k, seconds=target(k + 1) + draft_seconds, draft_seconds=draft_seconds, tokens_per_row=1
            )
    reached = [1000 * acceptance**i for i in range(model.max_speculative_tokens)]
    model.observe_acceptance(reached, [r * acceptance for r in reached])
    return model


def test_k_is_zero_where_speculation_cannot_pay():
    """Verification as costly as decoding every token one by one, a slow draft, a poor acceptance: plain decoding."""
    model = _fed(AdaptiveSpeculation(5), 32, target=lambda n: 0.01 * n, draft=0.004, acceptance=0.3)
    assert model.best(32) == 0
    assert model.predicted_speedup(32, 3) < 1
    assert model.choose(32) == 0


def test_k_is_positive_where_speculation_pays():
    """Verifying more tokens costs little more than one, the draft is cheap and usually right."""
    model = _fed(AdaptiveSpeculation(5), 1, target=lambda n: 0.01 + 0.0005 * n, draft=0.001, acceptance=0.9)
    assert model.best(1) >= 3
    assert model.predicted_speedup(1) > 2


def test_a_block_drafter_pays_its_forward_once_per_round_and_so_drafts_further():
    """A chain drafter (EAGLE-3) runs a forward per proposed token, a block drafter (DFlash) one per round: at the
    same cost per forward the chain stops at K = 1 where the block drafter goes to K_max. Priced per token, as for a
    chain, the block drafter's long rounds would look K times too dear and it would draft little or not at all."""
    costs = dict(target=lambda n: 0.01 + 0.001 * n, draft=0.006, acceptance=0.8)
    chain = _fed(AdaptiveSpeculation(7), 1, **costs)
    block = _fed(AdaptiveSpeculation(7, draft_forwards=DFlashDraftModel.draft_forwards), 1, **costs)
    assert chain.best(1) == 1 and block.best(1) == 7
    assert block.predicted_round_seconds(1, 7) == pytest.approx(0.01 + 0.001 * 8 + 0.006)
    assert chain.predicted_round_seconds(1, 7) == pytest.approx(0.01 + 0.001 * 8 + 7 * 0.006)


def test_k_follows_the_batch_size():
    """One machine, one draft: speculation pays at batch 1 (overhead-bound) and not at batch 64 (compute-bound)."""
    model = AdaptiveSpeculation(4)
    _fed(model, 1, target=lambda n: 0.005 + 0.0002 * n, draft=0.0005, acceptance=0.8)
    _fed(model, 64, target=lambda n: 0.02 * n, draft=0.002, acceptance=0.8)
    assert model.best(1) > 0 and model.best(64) == 0
    assert batch_bucket(50) == batch_bucket(64) == 64 and model.best(50) == 0


def test_prediction_is_the_expected_tokens_over_the_round_cost():
    model = _fed(AdaptiveSpeculation(2), 4, target=lambda n: 0.01 * (1 + n), draft=0.002, acceptance=0.5, rounds=1)
    rates = model.acceptance_rates()
    assert model.expected_tokens(2) == pytest.approx(1 + rates[0] + rates[0] * rates[1])
    round_seconds = 0.01 * (1 + 3) + 2 * 0.002
    assert model.predicted_tokens_per_second(4, 2) == pytest.approx(model.expected_tokens(2) / round_seconds)
    assert model.predicted_speedup(4, 2) == pytest.approx(model.expected_tokens(2) / round_seconds * 0.02)


def test_acceptance_rates_come_from_the_counters_and_borrow_unseen_positions():
    model = AdaptiveSpeculation(4, prior_strength=1.0)
    assert model.acceptance_rates() == [0.5] * 4  # the prior
    model.observe_acceptance([1000, 800], [800, 400])
    first, second, third, fourth = model.acceptance_rates()
    assert first == pytest.approx(0.8, abs=1e-3) and second == pytest.approx(0.5, abs=1e-3)
    assert third == fourth == pytest.approx(second)  # never drafted: the last measured position's rate


def test_a_new_bucket_measures_the_ends_and_k1_then_exploits_then_explores():
    model = AdaptiveSpeculation(3, explore_interval=10, first_rounds=2)
    first = []
    for _ in range(6):  # nothing measured: the longest drafts first (they also measure acceptance), then 0 and 1
        k = model.choose(8)
        first.append(k)
        model.observe_round(8, k, seconds=0.01 + 0.003 * k, draft_seconds=0.002 * k, tokens_per_row=1 + k * 0.8)
    assert first == [3, 3, 0, 0, 1, 1]
    model.observe_acceptance([100, 90, 80], [90, 80, 70])
    explored = []
    for round_index in range(7, 91):
        best, k = model.best(8), model.choose(8)
        if k != best:
            explored.append((round_index, k))
        model.observe_round(8, k, seconds=0.01 + 0.003 * k, draft_seconds=0.002 * k, tokens_per_row=1 + k * 0.8)
    # 10 rounds after the first ones, first the K never run; the model predicted its time (the costs are exact
    # here), so the gaps double: then the stalest, 20 rounds later, then 40
    assert [index for index, _ in explored] == [17, 37, 77]
    assert explored[0][1] == 2
    assert model.choose(16) == 3  # another bucket starts over


def test_explorations_come_rarer_while_they_confirm_the_model_and_often_again_after_a_surprise():
    model = AdaptiveSpeculation(2, explore_interval=4, max_explore_interval=16, first_rounds=1)
    model.observe_acceptance([1000, 1000], [900, 900])
    cost = {0: 0.010, 1: 0.011, 2: 0.012}  # K = 2 pays most
    explored_at = []
    for round_index in range(120):
        if round_index == 60:  # plain rounds get cheaper, and only an exploration of K = 0 can see it
            cost[0] = 0.004
        best, k = model.best(1), model.choose(1)
        if k != best and round_index >= 3:  # after the first rounds (K = 2, 0, 1)
            explored_at.append(round_index)
        model.observe_round(1, k, seconds=cost[k], draft_seconds=0.0, tokens_per_row=1 + 0.9 * k)
    gaps = {at: b - at for at, b in itertools.pairwise(explored_at)}
    before = [gap for at, gap in gaps.items() if at < 60]
    assert before[0] == 8 and before[-1] == 16 and before == sorted(before)  # doubling, up to the longest gap
    surprise = next(at for at in explored_at if at >= 60)
    assert gaps[surprise] == 4  # the surprise started the gaps over


def test_a_stale_estimate_corrects_itself():
    """K = 3 looked bad once (a hiccup); exploration re-measures it and the choice moves back."""
    model = AdaptiveSpeculation(3, explore_interval=5, smoothing=0.5)
    model.observe_acceptance([1000] * 3, [900] * 3)
    for k, seconds in ((3, 0.5), (0, 0.01), (1, 0.012), (2, 0.014)):
        model.observe_round(1, k, seconds=seconds, draft_seconds=0.001 * k, tokens_per_row=1)
    assert model.best(1) < 3
    for _ in range(200):  # every 5th round explores the stalest K: K = 3 comes back every 20 rounds
        k = model.choose(1)
        model.observe_round(1, k, seconds=0.01 + 0.001 * k, draft_seconds=0.001 * k, tokens_per_row=1 + 0.9 * k)
    assert model.best(1) == 3


def test_a_machine_that_slows_down_keeps_the_choice():
    """Every K slows alike when the machine does; only the K being run sees it. The speed factor absorbs the drift,
    so the stale measurements of the other Ks stay comparable and the choice holds."""
    model = _fed(AdaptiveSpeculation(4), 8, target=lambda n: 0.01 + 0.003 * n, draft=0.002, acceptance=0.8)
    best = model.best(8)

    def run(slowdown):
        draft_seconds = slowdown * 0.002 * best
        seconds = slowdown * (0.01 + 0.003 * (best + 1)) + draft_seconds
        model.observe_round(8, best, seconds=seconds, draft_seconds=draft_seconds, tokens_per_row=1)

    for slowdown in [1.0] * 5 + [1.5] * 30:
        run(slowdown)
    assert model.best(8) == best
    for k in range(5):
        assert model.predicted_round_seconds(8, k) == pytest.approx(
            1.5 * (0.01 + 0.003 * (k + 1) + 0.002 * k), rel=0.01
        )


def test_measured_speedup_needs_both_plain_and_speculative_rounds():
    model = AdaptiveSpeculation(2)
    model.observe_round(2, 2, seconds=0.03, draft_seconds=0.01, tokens_per_row=2.5)
    assert math.isnan(model.measured_speedup(2, 2))
    model.observe_round(2, 0, seconds=0.02, draft_seconds=0.0, tokens_per_row=1)
    assert model.measured_speedup(2, 2) == pytest.approx((2.5 / 0.03) / (1 / 0.02))
    # once whole calls of both routes were measured, those are the comparison (they pay what rounds do not)
    model.observe_call(2, plain=False, seconds=1.0, num_tokens=300)
    assert model.measured_speedup(2, 2) == pytest.approx((2.5 / 0.03) / (1 / 0.02))
    model.observe_call(2, plain=True, seconds=1.0, num_tokens=200)
    assert model.measured_speedup(2, 2) == pytest.approx(1.5)


def test_whole_calls_go_the_way_measured_faster_and_the_other_way_now_and_then():
    model = AdaptiveSpeculation(2, calls_between_probes=3, max_calls_between_probes=12)
    routes = []
    for _ in range(40):
        plain = model.prefers_plain(4)
        routes.append(plain)
        model.observe_call(4, plain=plain, seconds=1.0, num_tokens=100 if plain else 150)  # speculation wins
    # every probe that confirms the winner doubles the gap to the next one, up to the maximum
    assert [i for i, plain in enumerate(routes) if plain] == [1, 5, 12, 25, 38]
    assert model.prefers_plain(64) is False  # another bucket starts over


def test_a_change_of_winner_restarts_the_probing_gap():
    model = AdaptiveSpeculation(2, calls_between_probes=2, max_calls_between_probes=16)
    routes = []
    for call in range(30):
        plain = model.prefers_plain(4)
        routes.append(plain)
        speculative_tokens = 150 if call < 12 else 50  # from call 12 on, the draft no longer pays
        model.observe_call(4, plain=plain, seconds=1.0, num_tokens=100 if plain else speculative_tokens)
    assert [i for i, plain in enumerate(routes[:12]) if plain] == [1, 4, 9]  # gaps 2, 4, then 8
    # the speculative calls themselves show the loss (no probe needed): plain wins from call 14, and the probes of
    # speculation start again at the smallest gap
    assert routes[12:14] == [False, False] and all(routes[14:16])
    assert [i for i, plain in enumerate(routes[14:], start=14) if not plain] == [16, 21]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="max_speculative_tokens"):
        AdaptiveSpeculation(0)
    with pytest.raises(ValueError, match="max_calls_between_probes"):
        AdaptiveSpeculation(2, calls_between_probes=8, max_calls_between_probes=4)
    with pytest.raises(ValueError, match="smoothing"):
        AdaptiveSpeculation(3, smoothing=0)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        FixedSpeculation(0)


# ---------------------------------------------------------------------------------------------- generator + model


def _virtual_clock(monkeypatch, *, target_seconds, draft_seconds):
    """Time in the generator advances by a cost per forward, not by the wall clock: the test asserts choices."""
    now = [0.0]
    target_forward, run_draft = (
        SpeculativeDecoder.target_forward,
        Eagle3Proposer._run,
    )

    def timed_target(self, input_ids, *args, **kwargs):
        now[0] += target_seconds(input_ids.shape[0], input_ids.shape[1])
        return target_forward(self, input_ids, *args, **kwargs)

    def timed_draft(self, input_embeds, *args, **kwargs):
        now[0] += draft_seconds
        return run_draft(self, input_embeds, *args, **kwargs)

    monkeypatch.setattr(SpeculativeDecoder, "target_forward", timed_target)
    monkeypatch.setattr(Eagle3Proposer, "_run", timed_draft)
    monkeypatch.setattr(SpeculativeDecoder, "_clock", lambda self: now[0])


@pytest.mark.parametrize("pays", [False, True])
def test_generator_with_the_cost_model_chooses_by_cost(monkeypatch, pays):
    target, random_draft, trained, input_ids, attention_mask = _setup("llama")
    if pays:  # an overhead-bound target and a trained draft
        draft = trained
        _virtual_clock(monkeypatch, target_seconds=lambda rows, n: 0.01 + 0.0001 * rows * n, draft_seconds=0.001)
    else:  # verification costs as much as decoding token by token, and the draft is random
        draft = random_draft
        _virtual_clock(monkeypatch, target_seconds=lambda rows, n: 0.001 * rows * n, draft_seconds=0.004)
    model = AdaptiveSpeculation(4, explore_interval=1000)
    want = target.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=60)
    out = speculative_generate(
        target, draft, input_ids, attention_mask, max_new_tokens=60, num_speculative_tokens=model
    )
    assert torch.equal(out.sequences, want)
    # Each batch-size bucket the call meets (rows leave at EOS) first runs K_max, K = 0 and K = 1, two measured
    # rounds each (the last bucket may end before it has run them all); the call's first drafting round also runs
    # the draft over the prompts, so it is not a measurement and K_max runs once more.
    assert [k for _, k in out.rounds[:3]] == [4, 4, 4]
    buckets = {batch_bucket(live) for live, _ in out.rounds}
    chosen = [k for _, k in out.rounds]
    assert len(chosen) > 8 * len(buckets)
    first = 2 * len(buckets)
    if pays:
        assert chosen.count(0) <= first and model.best(8) > 0 and model.predicted_speedup(8) > 1
    else:
        assert chosen.count(4) <= first + 1 and chosen.count(1) <= first and set(chosen) == {0, 1, 4}
        assert model.best(8) == 0


def test_config_takes_auto():
    from tiny_policy import tiny_grpo_kwargs

    config = SpecCoTrainConfig(
        **tiny_grpo_kwargs("/tmp/unused"), num_speculative_tokens="auto", max_speculative_tokens=4
    )
    assert config.max_draft_tokens == 4
    assert SpecCoTrainConfig(**tiny_grpo_kwargs("/tmp/unused"), num_speculative_tokens="2").num_speculative_tokens == 2
    with pytest.raises(ValueError, match="num_speculative_tokens.*'auto'"):
        SpecCoTrainConfig(**tiny_grpo_kwargs("/tmp/unused"), num_speculative_tokens="fast")


def test_an_engine_call_is_seen_as_its_average_decoding_step():
    """vLLM reports per-call counters only: 8 rows, 40 drafts of K = 3 (5 steps), 24 accepted, 64 tokens, 1 s."""
    from hf_spec_cotrain.generation.engine import SpecDecodeStats
    from hf_spec_cotrain.training.rollout_backends import observe_engine_call

    model = AdaptiveSpeculation(3)
    counters = SpecDecodeStats(
        num_drafts=40, num_draft_tokens=120, num_accepted_tokens=24, accepted_per_position=[16, 6, 2]
    )
    observe_engine_call(model, 8, 3, counters, num_tokens=64, seconds=1.0)
    bucket = model._buckets[8]
    assert bucket.seconds[3].value == pytest.approx(1.0 / 5)  # 40 row-steps over 8 rows: 5 steps
    assert bucket.tokens[3].value == pytest.approx(64 / 40)
    rates = model.acceptance_rates()
    assert rates[0] == pytest.approx((16 + 2 * 0.5) / (40 + 2), abs=1e-9)  # 16 of 40 drafts, with the prior
    observe_engine_call(model, 8, 0, SpecDecodeStats(), num_tokens=64, seconds=0.5)  # plain: 8 steps of 8 rows
    assert model._buckets[8].seconds[0].value == pytest.approx(0.5 / 8)
    assert model.measured_speedup(8, 3) == pytest.approx((64 / 40 / 0.2) / (1 / (0.5 / 8)))
