"""Speculative generation: greedy output equals `generate`, sampling follows the target's distribution exactly, and
the counters equal a naive per-row re-implementation of chain drafting."""

import copy
import functools
import itertools

import pytest
import torch
from attention_variant_targets import ATTENTION_VARIANT_FAMILIES, build_attention_variant_target, build_eagle3_draft
from statistics_utils import exact_distribution, g_test
from transformers import DynamicCache

from hf_spec_cotrain import Eagle3DraftModel, TapRecorder, ttt_loss
from hf_spec_cotrain.generation import verification
from hf_spec_cotrain.generation.speculative import speculative_generate
from hf_spec_cotrain.generation.verification import greedy_verify, rejection_sample, residual_distribution
from hf_spec_cotrain.testing import build_char_tokenizer, build_tiny_target, left_padded_prompts


# Qwen3.5 and Qwen3-Next: three linear-attention (Gated DeltaNet) layers to one full-attention layer.
LINEAR_ATTENTION_FAMILIES = ("qwen3_5", "qwen3_next")
FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", *LINEAR_ATTENTION_FAMILIES)
# (family, window) of targets with sliding-window layers: gpt-oss's own 16 tokens (alternating with full layers),
# Mistral's window on every layer, Qwen3's interleaved; every window is shorter than prompt + generated tokens.
SLIDING_TARGETS = (("gpt_oss", None), ("mistral", 5), ("qwen3", 8))
EOS = 2  # the character tokenizer's </s>, the tiny targets' generation_config.eos_token_id
NUM_LAYERS = 7  # default taps (2, 3, 4) are distinct
P_VALUE_THRESHOLD = 1e-3


def _target(family, *, seed=0, sliding_window=None):
    return build_tiny_target(
        family,
        num_layers=NUM_LAYERS,
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=96,
        sliding_window=sliding_window,
        seed=seed,
    )


def _greedy_rows(target, input_ids, attention_mask, *, new_tokens=28):
    """The real tokens of each prompt + its greedy continuation, cut to a common length (unpadded: cheaper TTT)."""
    sequences = target.generate(
        input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=new_tokens, eos_token_id=[]
    )
    real = torch.cat([attention_mask.bool(), torch.ones_like(sequences[:, input_ids.shape[1] :], dtype=torch.bool)], 1)
    length = int(real.sum(1).min())
    return torch.stack([row[keep][:length] for row, keep in zip(sequences, real)])


def _fit_draft(target, rows, *, steps, draft_vocab_size=None, aux_layer_ids=None):
    """A draft trained by TTT on ``rows`` of target text, the teacher being the target itself."""
    counts = torch.bincount(rows.flatten(), minlength=target.config.vocab_size)
    draft = Eagle3DraftModel.from_target(
        target, draft_vocab_size=draft_vocab_size, aux_layer_ids=aux_layer_ids, token_counts=counts
    )
    return _train_draft(draft, target, rows, steps=steps)


def _train_draft(draft, target, rows, *, steps):
    """``draft`` trained by TTT on ``rows`` of target text, the teacher being the target itself."""
    with torch.no_grad(), TapRecorder(target, draft.resolved_aux_layer_ids(target.config.num_hidden_layers)) as rec:
        with rec.capture():
            logits = target(rows).logits
        taps = rec.pop().aux_hidden_states
    teacher = logits[..., draft.draft_to_target_ids]
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(draft.trainable_parameters(), lr=1e-2)
    for _ in range(steps):
        loss = ttt_loss(draft, aux_hidden_states=taps, input_ids=rows, teacher_logits=teacher).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return draft.eval()


@functools.cache
def _setup(family, sliding_window=None):
    """Target, a random draft, a trained draft (reduced vocabulary for qwen2) and its left-padded training prompts."""
    target = _target(family, sliding_window=sliding_window)
    input_ids, attention_mask = left_padded_prompts([6, 3, 5, 4, 6, 2, 5, 3], target.config.vocab_size, seed=1)
    rows = _greedy_rows(target, input_ids, attention_mask)
    trained = _fit_draft(target, rows, steps=60, draft_vocab_size=60 if family == "qwen2" else None)
    torch.manual_seed(2)
    random_draft = Eagle3DraftModel.from_target(
        target,
        draft_vocab_size=70 if family == "qwen3" else None,
        token_counts=torch.arange(target.config.vocab_size) % 13,
    ).eval()
    return target, random_draft, trained, input_ids, attention_mask


# ---------------------------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("family, sliding_window", [(family, None) for family in FAMILIES] + list(SLIDING_TARGETS))
@pytest.mark.parametrize("num_speculative_tokens", [1, 3, 5])
def test_greedy_equals_generate(family, sliding_window, num_speculative_tokens):
    """Sliding windows included: rejected drafts stay in the cache as holes, which must not count towards them.
    Linear-attention layers must keep the states of each row's accepted tokens only (their states fold in every
    token they read, and the left-padded prompts' padding must leave them as `generate` does)."""
    _check_greedy_equals_generate(*_setup(family, sliding_window), num_speculative_tokens)


@functools.cache
def _attention_variant_setup(family):
    """`_setup` for the targets of tests/attention_variant_targets.py, two layers deep (so two taps), their drafts
    built by hand."""
    target = build_attention_variant_target(family)
    input_ids, attention_mask = left_padded_prompts([6, 3, 5, 4, 6, 2, 5, 3], target.config.vocab_size, seed=1)
    rows = _greedy_rows(target, input_ids, attention_mask)
    taps = (0, 1)
    trained = _train_draft(build_eagle3_draft(target, aux_layer_ids=taps, seed=1), target, rows, steps=60)
    random_draft = build_eagle3_draft(target, aux_layer_ids=taps, seed=2)
    return target, random_draft, trained, input_ids, attention_mask


@pytest.mark.parametrize("family", ATTENTION_VARIANT_FAMILIES)
@pytest.mark.parametrize("num_speculative_tokens", [1, 3, 5])
def test_greedy_equals_generate_through_attention_variants(family, num_speculative_tokens):
    """Gemma2's attention logit soft-cap (which changes these targets' greedy continuations), its final soft-cap and
    alternating 8-token windows, and DeepSeek-V3's multi-head latent attention (values narrower than queries and
    keys; its cache holds the compressed latents) verify as `generate` decodes."""
    _check_greedy_equals_generate(*_attention_variant_setup(family), num_speculative_tokens)


def test_the_gemma2_targets_soft_cap_changes_its_greedy_continuations():
    """What makes the test above catch a kernel that ignores the soft-cap."""
    target, _, _, input_ids, attention_mask = _attention_variant_setup("gemma2")
    uncapped = copy.deepcopy(target)
    for layer in uncapped.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    want, other = (
        model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=29)
        for model in (target, uncapped)
    )
    assert (want != other).any(1).sum() >= len(input_ids) // 2


def _check_greedy_equals_generate(target, random_draft, trained, input_ids, attention_mask, num_speculative_tokens):
    max_new_tokens = 29  # not a multiple of K + 1 for K in {1, 3, 5}
    want = target.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=max_new_tokens)
    for draft in (random_draft, trained):
        out = speculative_generate(
            target,
            draft,
            input_ids,
            attention_mask,
            max_new_tokens=max_new_tokens,
            num_speculative_tokens=num_speculative_tokens,
        )
        assert torch.equal(out.sequences, want)
        _check_counters(out, num_speculative_tokens)
    # the trained draft makes multi-token acceptance common
    assert out.acceptance_length > (1.5 if num_speculative_tokens == 1 else 1.9)
    if num_speculative_tokens > 1:
        assert out.accepted_per_position[1] > 0


def _check_counters(out, k):
    assert out.num_draft_tokens == k * out.num_drafts
    assert 0 <= out.num_accepted_tokens <= out.num_draft_tokens
    assert len(out.accepted_per_position) == k
    assert all(a >= b for a, b in itertools.pairwise(out.accepted_per_position))
    assert sum(out.accepted_per_position) == out.num_accepted_tokens
    assert int(out.num_drafts_per_row.sum()) == out.num_drafts
    assert int(out.num_accepted_per_row.sum()) == out.num_accepted_tokens
    assert (out.num_accepted_per_row <= k * out.num_drafts_per_row).all()
    if out.num_drafts:
        assert out.acceptance_length == pytest.approx(1 + out.num_accepted_tokens / out.num_drafts)
    assert out.num_target_forwards == 1 + int(out.num_drafts_per_row.max())


@pytest.mark.parametrize("family", ["llama", *LINEAR_ATTENTION_FAMILIES])
def test_eos_mid_row_and_budget_per_row(family):
    """Rows stop at their own EOS (padded after it, as `generate` does) while the others go on (and leave the
    linear-attention layers' states with the caches)."""
    target, _, trained, input_ids, attention_mask = _setup(family)
    plain = target.generate(
        input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=23, eos_token_id=[]
    )
    generated = plain[:, input_ids.shape[1] :]
    eos = int(generated[1, 9])  # a token that some rows emit mid-way, and others later or never
    first_hit = [(row == eos).nonzero()[0].item() if (row == eos).any() else None for row in generated]
    assert first_hit[1] <= 9 and len(set(first_hit)) > 2
    want = target.generate(
        input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=23, eos_token_id=eos, pad_token_id=0
    )
    for k in (2, 4):
        out = speculative_generate(
            target,
            trained,
            input_ids,
            attention_mask,
            max_new_tokens=23,
            num_speculative_tokens=k,
            eos_token_id=eos,
            pad_token_id=0,
        )
        assert torch.equal(out.sequences, want)
        assert out.acceptance_length > 1.5
        _check_counters(out, k)


def test_first_token_budget_and_eos():
    """``max_new_tokens=1`` never drafts; a prompt whose first token is EOS stops at once."""
    target, draft, _, input_ids, attention_mask = _setup("qwen3")
    out = speculative_generate(target, draft, input_ids, attention_mask, max_new_tokens=1)
    assert torch.equal(out.sequences, target.generate(input_ids, attention_mask=attention_mask, max_new_tokens=1))
    assert out.num_drafts == 0 and out.num_target_forwards == 1
    first = out.sequences[:, -1]
    out = speculative_generate(target, draft, input_ids, attention_mask, max_new_tokens=9, eos_token_id=int(first[0]))
    assert (out.num_drafts_per_row[first == first[0]] == 0).all()


def test_rows_are_independent():
    """Each row accepts its own prefix: batched counts and tokens equal each row decoded alone."""
    target, _, trained, input_ids, attention_mask = _setup("qwen2")
    batched = speculative_generate(target, trained, input_ids, attention_mask, max_new_tokens=17)
    assert len(set(batched.num_accepted_per_row.tolist())) > 1
    for row in (0, 2, 5):
        keep = attention_mask[row].bool()
        alone = speculative_generate(target, trained, input_ids[row : row + 1, keep], max_new_tokens=17)
        alone_tokens = alone.sequences[0, int(keep.sum()) :]
        batched_tokens = batched.sequences[row, input_ids.shape[1] :]
        assert torch.equal(batched_tokens[: alone_tokens.numel()], alone_tokens)
        assert (batched_tokens[alone_tokens.numel() :] == target.generation_config.pad_token_id).all()
        assert alone.num_accepted_tokens == batched.num_accepted_per_row[row]
        assert alone.num_drafts == batched.num_drafts_per_row[row]


def _reference_counts(target, draft, input_ids, attention_mask, *, k, max_new_tokens, eos):
    """Chain drafting redone per row and round from scratch: a full target forward for the taps, a fresh draft
    cache over the verified prefix, the draft's own `forward`; greedy, so the tokens are the target's. ``k``: K of
    every round, or the Ks of successive rounds (cycled; K = 0 is a plain decoding step)."""
    ks = [k] if isinstance(k, int) else list(k)
    aux_ids = draft.resolved_aux_layer_ids(NUM_LAYERS)
    embed = target.get_input_embeddings()
    continuation = target.generate(
        input_ids,
        attention_mask=attention_mask,
        do_sample=False,
        max_new_tokens=max_new_tokens + max(ks),
        eos_token_id=[],
    )[:, input_ids.shape[1] :]
    drafts, accepted = [], []
    for row in range(input_ids.shape[0]):
        prompt = input_ids[row, attention_mask[row].bool()]
        sequence = torch.cat([prompt, continuation[row]])[None]
        states = target(sequence, output_hidden_states=True).hidden_states
        taps = torch.cat([states[a] for a in aux_ids], dim=-1)
        emitted, row_drafts, row_accepted = 1, 0, 0
        for k in itertools.cycle(ks):
            if emitted >= max_new_tokens or eos in continuation[row, :emitted]:
                break
            if not k:
                emitted += 1
                continue
            verified = prompt.numel() + emitted
            cache = DynamicCache()
            out = draft(
                inputs_embeds=embed(sequence[:, 1:verified]),
                aux_hidden_states=taps[:, : verified - 1],
                past_key_values=cache,
            )
            proposals = []
            for step in range(k):
                token = draft.draft_to_target_ids[out.logits[0, -1].argmax()]
                proposals.append(int(token))
                if step < k - 1:
                    out = draft(
                        inputs_embeds=embed(token.view(1, 1)),
                        hidden_states=out.hidden_states[:, -1:],
                        past_key_values=cache,
                    )
            truth = sequence[0, verified : verified + k].tolist()
            num = next((i for i, (a, b) in enumerate(zip(proposals, truth)) if a != b), k)
            row_drafts += 1
            row_accepted += num
            emitted += num + 1
        drafts.append(row_drafts)
        accepted.append(row_accepted)
    return drafts, accepted


@pytest.mark.parametrize("family, k", [("llama", 3), ("qwen3", 2), ("qwen3_5", 3)])
def test_counters_equal_naive_chain_drafting(family, k):
    """Proves the draft side (positions, taps, discarded speculative slots, holes, compaction): per-row draft and
    acceptance counts equal a re-implementation that rebuilds everything per round, in float64 (Qwen3.5: taps of
    verifications run token by token through its linear-attention layers)."""
    target, _, trained, input_ids, attention_mask = _setup(family)
    target, draft = copy.deepcopy(target).double(), copy.deepcopy(trained).double()
    rows = [0, 1, 3, 5]
    input_ids, attention_mask = input_ids[rows], attention_mask[rows]
    with torch.no_grad():
        want_drafts, want_accepted = _reference_counts(
            target, draft, input_ids, attention_mask, k=k, max_new_tokens=25, eos=EOS
        )
    out = speculative_generate(
        target, draft, input_ids, attention_mask, max_new_tokens=25, num_speculative_tokens=k, eos_token_id=EOS
    )
    assert out.num_drafts_per_row.tolist() == want_drafts
    assert out.num_accepted_per_row.tolist() == want_accepted
    assert out.acceptance_length > 1.8


def test_restores_modes_and_needs_no_binding():
    target, draft, _, input_ids, attention_mask = _setup("llama")
    target, draft = copy.deepcopy(target), copy.deepcopy(draft)
    target.train()
    target.model.layers[1].eval()
    draft.train()
    draft.__dict__["_target_embedding"] = None  # the generator embeds through the target it decodes
    out = speculative_generate(target, draft, input_ids, attention_mask, max_new_tokens=6)
    assert target.training and draft.training and not target.model.layers[1].training
    assert target.model.layers[2].training
    target.eval()
    assert torch.equal(out.sequences, target.generate(input_ids, attention_mask=attention_mask, max_new_tokens=6))


def test_a_bfloat16_draft_keeps_a_float32_target_lossless():
    """The draft's precision only changes what it proposes: float32 taps and embeddings are cast into it, and the
    float32 target's verification keeps the output exactly `generate`'s."""
    target, _, trained, input_ids, attention_mask = _setup("llama")
    draft = copy.deepcopy(trained).to(torch.bfloat16)
    want = target.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=25)
    out = speculative_generate(target, draft, input_ids, attention_mask, max_new_tokens=25, num_speculative_tokens=3)
    assert torch.equal(out.sequences, want)
    assert out.acceptance_length > 1.9  # the float32 draft's bar in `test_greedy_equals_generate`
    _check_counters(out, 3)


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_target_leaves_generate_only_at_near_ties(family):
    """In bfloat16 the K + 1 token verification rounds differently from `generate`'s one-token steps, so a row may
    take another token where two logits nearly tie, and never elsewhere. Up to that point the rows are equal."""
    target, _, trained, input_ids, attention_mask = _setup(family)
    target, draft = copy.deepcopy(target).to(torch.bfloat16), copy.deepcopy(trained).to(torch.bfloat16)
    new_tokens = 25
    plain = target.generate(
        input_ids,
        attention_mask=attention_mask,
        do_sample=False,
        max_new_tokens=new_tokens,
        output_logits=True,
        return_dict_in_generate=True,
    )
    out = speculative_generate(target, draft, input_ids, attention_mask, max_new_tokens=new_tokens)
    # The tiny linear-attention targets leave their float32 selves within a few tokens in bfloat16 (and the float32
    # text the draft learnt), and their bfloat16 logits tie exactly more often.
    linear = family in LINEAR_ATTENTION_FAMILIES
    assert out.acceptance_length > (1.1 if linear else 1.9)
    start = input_ids.shape[1]
    equal_rows = 0
    for row in range(input_ids.shape[0]):
        ours, theirs = out.sequences[row, start:], plain.sequences[row, start:]
        differs = (ours != theirs).nonzero()
        if not differs.numel():
            equal_rows += 1
            continue
        at = int(differs[0])
        logits = plain.logits[at][row].float()
        # within 2.5 bfloat16 steps (2**-7 relative) of the largest logit; measured gaps are 0 to 1 step
        assert logits.max() - logits[ours[at]] < 0.02 * logits.abs().max(), (row, at)
    assert equal_rows >= (2 if linear else input_ids.shape[0] // 2)


# ---------------------------------------------------------------------------------------------- sampling


@functools.cache
def _small_vocab_setup(family="llama", sliding_window=None):
    tokenizer = build_char_tokenizer("abcdefghijklmnop")  # 20 ids, EOS among them
    target = build_tiny_target(
        family,
        tokenizer=tokenizer,
        num_layers=4,
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=96,
        sliding_window=sliding_window,
        seed=3,
        dtype=torch.float64,
    )
    if family in ("gpt_oss", "qwen3_next"):
        target.set_experts_implementation("eager")  # torch's grouped matmul takes no float64
    with torch.no_grad():
        target.lm_head.weight.mul_(0.3)  # broad next-token laws: many outcomes, top-k/top-p cut deep
    prompt = torch.tensor([[1, 7, 12, 5, 9]])
    torch.manual_seed(0)
    samples = target.generate(prompt.expand(64, -1), do_sample=True, max_new_tokens=10, eos_token_id=[])
    # a few TTT steps on sampled text: drafts that are neither random nor exact, so both paths of each test run
    drafts = {
        reduced: _fit_draft(
            target, samples, steps=15, draft_vocab_size=12 if reduced else None, aux_layer_ids=(0, 1, 3)
        )
        for reduced in (False, True)
    }
    return target, drafts, prompt


NUM_SAMPLES = 3000
NUM_NEW_TOKENS = 3


def _sample(draft, *, seed, target_setup=("llama", None), **kwargs):
    target, _, prompt = _small_vocab_setup(*target_setup)
    out = speculative_generate(
        target,
        draft,
        prompt.expand(NUM_SAMPLES, -1),
        max_new_tokens=NUM_NEW_TOKENS,
        do_sample=True,
        pad_token_id=0,
        generator=torch.Generator().manual_seed(seed),
        **kwargs,
    )
    generated = out.sequences[:, prompt.shape[1] :]
    generated = torch.nn.functional.pad(generated, (0, NUM_NEW_TOKENS - generated.shape[1]), value=0)
    return [tuple(row) for row in generated.tolist()], out


@functools.cache
def _exact(temperature=1.0, top_k=0, top_p=1.0, target_setup=("llama", None)):
    target, _, prompt = _small_vocab_setup(*target_setup)
    return exact_distribution(
        target, prompt, NUM_NEW_TOKENS, temperature=temperature, top_k=top_k, top_p=top_p, pad=0, eos=EOS
    )


SAMPLING_CASES = [
    # temperature, top_k, top_p, reduced draft vocabulary, draft_sampling, K
    (1.0, 0, 1.0, False, "probabilistic", 2),
    (0.7, 0, 0.9, True, "probabilistic", 1),
    (1.3, 5, 1.0, True, "probabilistic", 3),
    (1.0, 0, 1.0, True, "greedy", 2),
    (0.7, 6, 0.8, False, "greedy", 1),
    (1.3, 0, 0.95, False, "greedy", 2),
]


@pytest.mark.parametrize("temperature, top_k, top_p, reduced, draft_sampling, k", SAMPLING_CASES)
def test_sampling_follows_target_distribution(temperature, top_k, top_p, reduced, draft_sampling, k):
    """The joint law of 3 generated tokens (EOS included) equals sampling from the target, by enumeration."""
    _, drafts, _ = _small_vocab_setup()
    warp = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    samples, out = _sample(drafts[reduced], seed=k, num_speculative_tokens=k, draft_sampling=draft_sampling, **warp)
    assert g_test(samples, _exact(**warp)) > P_VALUE_THRESHOLD
    assert 0 < out.num_accepted_tokens < out.num_draft_tokens  # both acceptance and rejection happened
    _check_counters(out, k)


@pytest.mark.parametrize("draft_sampling", ["probabilistic", "greedy"])
def test_sampling_through_sliding_windows_follows_target_distribution(draft_sampling):
    """gpt-oss with a window of 3 (a 5-token prompt: it slides at every generated token), its sinks, and rejected
    drafts that must not take a place in the window."""
    setup = ("gpt_oss", 3)
    _, drafts, _ = _small_vocab_setup(*setup)
    samples, out = _sample(
        drafts[False], seed=4, num_speculative_tokens=2, draft_sampling=draft_sampling, target_setup=setup
    )
    assert g_test(samples, _exact(target_setup=setup)) > P_VALUE_THRESHOLD
    assert 0 < out.num_accepted_tokens < out.num_draft_tokens
    _check_counters(out, 2)


@pytest.mark.parametrize("family, draft_sampling", [("qwen3_5", "probabilistic"), ("qwen3_next", "greedy")])
def test_sampling_through_linear_attention_follows_target_distribution(family, draft_sampling):
    """Rejected drafts must leave no trace in the linear-attention layers' states, rows accepting different numbers
    of drafts."""
    setup = (family, None)
    _, drafts, _ = _small_vocab_setup(*setup)
    samples, out = _sample(
        drafts[False], seed=5, num_speculative_tokens=2, draft_sampling=draft_sampling, target_setup=setup
    )
    assert g_test(samples, _exact(target_setup=setup)) > P_VALUE_THRESHOLD
    assert 0 < out.num_accepted_tokens < out.num_draft_tokens
    _check_counters(out, 2)


def test_distribution_test_has_teeth(monkeypatch):
    """The same samples fail against a different temperature or a truncated law, and a classic sampler bug
    (resampling a rejected draft from p instead of the residual max(0, p - q)) is caught."""
    _, drafts, _ = _small_vocab_setup()
    samples, _ = _sample(drafts[True], seed=0, num_speculative_tokens=2)
    assert g_test(samples, _exact()) > P_VALUE_THRESHOLD
    assert g_test(samples, _exact(temperature=1.3)) < 1e-6
    assert g_test(samples, _exact(top_p=0.9)) < 1e-6
    monkeypatch.setattr(verification, "residual_distribution", lambda target_probs, draft_probs: target_probs)
    biased, _ = _sample(drafts[True], seed=0, num_speculative_tokens=2)
    assert g_test(biased, _exact()) < 1e-6


# ---------------------------------------------------------------------------------------------- verification maths


def _random_probs(shape, generator, *, zero_fraction=0.3):
    logits = 2 * torch.randn(shape, generator=generator, dtype=torch.float64)
    logits = logits.masked_fill(torch.rand(shape, generator=generator) < zero_fraction, float("-inf"))
    logits[..., 0] = 0.0  # every row keeps some mass
    return logits.softmax(-1)


def test_residual_restores_target_distribution_exactly():
    """Enumerating the draft token: sum_d q(d) [min(1, p/q) delta_d + (1 - min(1, p/q)) residual] = p."""
    generator = torch.Generator().manual_seed(0)
    p = _random_probs((64, 9), generator)
    q_sampled = _random_probs((64, 9), generator, zero_fraction=0.5)  # zeros: a reduced draft vocabulary
    q_greedy = torch.nn.functional.one_hot(q_sampled.argmax(-1), 9).double()
    for q in (q_sampled, q_greedy, p):
        accept = torch.where(q > 0, (p / q).clamp(max=1), 0.0)
        rejected_mass = (q * (1 - accept)).sum(-1, keepdim=True)
        law = q * accept + rejected_mass * residual_distribution(p, q)
        torch.testing.assert_close(law, p, rtol=0, atol=1e-12)
    torch.testing.assert_close(residual_distribution(p, p), p)  # no residual mass: p itself


def test_q_equal_p_accepts_everything():
    generator = torch.Generator().manual_seed(1)
    p = _random_probs((500, 4, 7), generator)
    drafts = torch.multinomial(p[:, :3].reshape(-1, 7), 1, generator=generator).view(500, 3)
    num_accepted, next_token = rejection_sample(drafts, p, p[:, :3], generator=generator)
    assert (num_accepted == 3).all()
    assert (p[:, 3].gather(1, next_token[:, None]) > 0).all()


def test_acceptance_rules_hold_row_by_row():
    """p(d) >= q(d) is always accepted, p(d) = 0 never, and a rejection never emits a token with p <= q."""
    generator = torch.Generator().manual_seed(2)
    p = _random_probs((4000, 2, 6), generator)
    q = _random_probs((4000, 1, 6), generator)
    drafts = torch.multinomial(q[:, 0], 1, generator=generator)
    num_accepted, next_token = rejection_sample(drafts, p, q, generator=generator)
    p_d, q_d = p[:, 0].gather(1, drafts).squeeze(1), q[:, 0].gather(1, drafts).squeeze(1)
    assert (num_accepted[p_d >= q_d] == 1).all()
    assert (num_accepted[p_d == 0] == 0).all()
    rejected = num_accepted == 0
    assert rejected.any() and (~rejected).any()
    p_x = p[rejected, 0].gather(1, next_token[rejected, None]).squeeze(1)
    q_x = q[rejected, 0].gather(1, next_token[rejected, None]).squeeze(1)
    assert (p_x > q_x).all()


@pytest.mark.parametrize("greedy_draft", [False, True])
def test_rejection_sample_emits_the_target_distribution(greedy_draft):
    """Monte Carlo over many rows: the first emitted token follows p_0, the second p_1 and the bonus p_K."""
    generator = torch.Generator().manual_seed(3)
    batch, vocab = 60000, 6
    p = _random_probs((1, 3, vocab), generator, zero_fraction=0.2).expand(batch, -1, -1)
    q = _random_probs((1, 2, vocab), generator, zero_fraction=0.2).expand(batch, -1, -1)
    if greedy_draft:
        drafts, draft_probs = q.argmax(-1), None
    else:
        drafts, draft_probs = torch.multinomial(q.reshape(-1, vocab), 1, generator=generator).view(batch, 2), q
    num_accepted, next_token = rejection_sample(drafts, p, draft_probs, generator=generator)
    first = torch.where(num_accepted >= 1, drafts[:, 0], next_token)
    second = torch.where(num_accepted >= 2, drafts[:, 1], next_token)[num_accepted >= 1]
    bonus = next_token[num_accepted == 2]
    for tokens, law in ((first, p[0, 0]), (second, p[0, 1]), (bonus, p[0, 2])):
        assert tokens.numel() > 1000
        exact = {(token,): prob for token, prob in enumerate(law.tolist())}
        assert g_test([(t,) for t in tokens.tolist()], exact) > P_VALUE_THRESHOLD


def test_greedy_verify():
    logits = torch.full((3, 4, 5), -1.0)
    best = torch.tensor([[1, 2, 3, 4], [0, 0, 0, 0], [4, 3, 2, 1]])
    logits.scatter_(-1, best[..., None], 1.0)
    drafts = torch.tensor([[1, 2, 3], [1, 0, 0], [4, 3, 0]])
    num_accepted, next_token = greedy_verify(drafts, logits)
    assert num_accepted.tolist() == [3, 0, 2]
    assert next_token.tolist() == [4, 0, 2]


# ---------------------------------------------------------------------------------------------- bad input


def test_bad_arguments_raise_clear_errors():
    target, draft, _, input_ids, attention_mask = _setup("llama")
    call = functools.partial(speculative_generate, target, draft, input_ids, attention_mask, max_new_tokens=4)
    with pytest.raises(ValueError, match="does not fit the target"):
        other = build_tiny_target("llama", num_layers=NUM_LAYERS, hidden_size=128, num_attention_heads=4)
        speculative_generate(other, draft, input_ids, attention_mask, max_new_tokens=4)
    with pytest.raises(ValueError, match="num_speculative_tokens`=0"):
        call(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="max_new_tokens`=0"):
        speculative_generate(target, draft, input_ids, max_new_tokens=0)
    with pytest.raises(ValueError, match="draft_sampling`='sometimes'.*probabilistic, greedy"):
        call(draft_sampling="sometimes")
    with pytest.raises(ValueError, match="temperature`=0.0 .*do_sample=True"):
        call(do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="top_p`=0"):
        call(do_sample=True, top_p=0)
    with pytest.raises(ValueError, match="top_k`=-1"):
        call(do_sample=True, top_k=-1)
    with pytest.raises(ValueError, match="at least one prompt"):
        speculative_generate(target, draft, input_ids[:, :0], max_new_tokens=4)
    empty_row = attention_mask.clone()
    empty_row[2] = 0
    with pytest.raises(ValueError, match=r"rows \[2\] have no real token"):
        speculative_generate(target, draft, input_ids, empty_row, max_new_tokens=4)
    with pytest.raises(ValueError, match="not left-padded"):
        speculative_generate(target, draft, input_ids, attention_mask.flip(1), max_new_tokens=4)
    with pytest.raises(ValueError, match=r"int64 tensor \[batch, prompt_len\]; got \(6,\)"):
        speculative_generate(target, draft, input_ids[0], max_new_tokens=4)
    hybrid = copy.deepcopy(target)  # linear attention between full-attention layers, as Qwen3.5's but not its kind
    hybrid.config.layer_types = ["linear_attention", "full_attention"] * 3 + ["full_attention"]
    with pytest.raises(
        ValueError, match=r"llama target has linear_attention layers, .*only for the Gated DeltaNet layers of qwen3_5"
    ):
        speculative_generate(hybrid, draft, input_ids, attention_mask, max_new_tokens=4)
    chunked = copy.deepcopy(target)
    chunked.config.layer_types = ["chunked_attention"] * NUM_LAYERS
    with pytest.raises(
        ValueError,
        match=r"chunked_attention layers, .*full_attention, sliding_attention and \(qwen3_5_text, qwen3_5_moe_text, qwen3_next",
    ):
        speculative_generate(chunked, draft, input_ids, attention_mask, max_new_tokens=4)
    with pytest.warns(UserWarning, match="no effect with `do_sample=False`"):
        call(draft_sampling="probabilistic")
