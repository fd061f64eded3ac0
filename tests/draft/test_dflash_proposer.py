"""HF-native drafting with a DFlash draft: the proposer's blocks equal the training forward's (holes, row drops and
compaction included), and `speculative_generate` with it is lossless: greedy equals `generate`, sampling keeps the
target's law, rounds of K = 0 mix in."""

import functools

import pytest
import torch
from statistics_utils import exact_distribution, g_test

from hf_spec_cotrain.draft import DFlashDraftModel, DraftTrainingBatch
from hf_spec_cotrain.draft.dflash_objective import DFlashTrainingOptions
from hf_spec_cotrain.generation.adaptive import FixedSpeculation
from hf_spec_cotrain.generation.speculative import speculative_generate
from hf_spec_cotrain.taps import TapRecorder
from hf_spec_cotrain.testing import build_char_tokenizer, build_tiny_target, left_padded_prompts


MASK_TOKEN_ID = 3  # the character tokenizer's <unk>: never generated from these prompts' alphabet
EOS = 2
P_VALUE_THRESHOLD = 1e-3


def recording_sampler(record: list):
    def sample(logits):
        record.append(logits)
        return logits.argmax(-1), None

    return sample


def training_block(draft, taps, positions, last_token, k):
    """The training forward's block logits ``[k, vocab]`` for one row: context = ``taps [n, T]`` at ``positions``,
    the anchor one column after them."""
    n = taps.shape[0]
    aux = torch.cat([taps, taps[-1:]])[None]  # the anchor's own column: never context of its block
    anchor_position = positions[-1:] + 1 if n else torch.zeros(1, dtype=torch.long)
    position_ids = torch.cat([positions, anchor_position])[None]
    anchor_embeds = draft.embed_input_ids(last_token.view(1, 1))
    hidden = draft.block_logits(aux, anchor_embeds, torch.tensor([[n]]), position_ids=position_ids, block_size=k + 1)
    return draft.compute_logits(hidden[0, 0, 1:])


def test_proposer_blocks_equal_the_training_forward_after_holes_row_drops_and_compaction():
    target = build_tiny_target("qwen3", num_layers=6, seed=5, dtype=torch.float64)
    draft = DFlashDraftModel.from_target(target, mask_token_id=MASK_TOKEN_ID, num_layers=2, block_size=5).double()
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    width = 2 * target.config.hidden_size
    generator = torch.Generator().manual_seed(0)

    def taps(rows, length):
        return torch.randn(rows, length, width, generator=generator, dtype=torch.float64)

    proposer = draft.new_proposer(draft.embed_input_ids)
    # Prefill: row 0 a prompt of 5 tokens, row 1 of 3 (left-padded: 2 padding slots, positions clamped to 0).
    prompt_taps = taps(2, 5)
    valid = torch.tensor([[True] * 5, [False, False, True, True, True]])
    positions = torch.tensor([[0, 1, 2, 3, 4], [0, 0, 0, 1, 2]])
    proposer.catch_up(torch.zeros(2, 5, dtype=torch.long), prompt_taps, positions, valid)
    verified = [(prompt_taps[r][valid[r]], positions[r][valid[r]]) for r in range(2)]

    def check_round(rows, last_token, next_position, k):
        record = []
        proposer.propose(last_token, next_position, k, recording_sampler(record))
        got = torch.stack(record, dim=1)  # [R, k, vocab]
        for index, row in enumerate(rows):
            context, context_positions = verified[row]
            assert int(next_position[index]) == int(context_positions[-1]) + 1
            expected = training_block(draft, context, context_positions, last_token[index], k)
            torch.testing.assert_close(got[index], expected, rtol=0, atol=1e-10)

    last_token, next_position = torch.tensor([17, 42]), torch.tensor([5, 3])
    check_round([0, 1], last_token, next_position, 3)

    # The target verified [x_n, d_1, d_2, d_3]: row 0 accepts 1 draft, row 1 none; rejected slots become holes.
    round_taps = taps(2, 4)
    round_positions = next_position[:, None] + torch.arange(4)
    accepted = torch.tensor([1, 0])
    round_valid = torch.arange(4) <= accepted[:, None]
    proposer.catch_up(torch.zeros(2, 4, dtype=torch.long), round_taps, round_positions, round_valid)
    for r in range(2):
        keep = round_valid[r]
        verified[r] = (
            torch.cat([verified[r][0], round_taps[r][keep]]),
            torch.cat([verified[r][1], round_positions[r][keep]]),
        )
    next_position = next_position + accepted + 1
    check_round([0, 1], torch.tensor([9, 30]), next_position, 4)

    # A round of K = 0 (nothing proposed), then row 0 finishes and leaves; compaction drops the holes.
    plain_taps = taps(2, 1)
    proposer.catch_up(
        torch.zeros(2, 1, dtype=torch.long), plain_taps, next_position[:, None], torch.ones(2, 1, dtype=torch.bool)
    )
    verified[1] = (torch.cat([verified[1][0], plain_taps[1]]), torch.cat([verified[1][1], next_position[1:]]))
    next_position = next_position + 1
    proposer.keep_rows(torch.tensor([1]))
    check_round([1], torch.tensor([11]), next_position[1:], 2)
    slots_before = proposer.slot_mask.shape[1]
    for _ in range(3):  # rounds that reject everything: holes pile up until they outnumber the kept slots
        position = next_position[1:]
        proposer.catch_up(
            torch.zeros(1, 4, dtype=torch.long),
            taps(1, 4),
            position[:, None] + torch.arange(4),
            torch.tensor([[True, False, False, False]]),
        )
        verified[1] = (
            torch.cat([verified[1][0], proposer.pending[-1][0][0, :1]]),
            torch.cat([verified[1][1], position]),
        )
        next_position = next_position + 1
        proposer.propose(torch.tensor([5]), next_position[1:], 3, recording_sampler([]))
        proposer.compact()
    assert proposer.slot_mask.shape[1] < slots_before + 12  # compaction ran
    check_round([1], torch.tensor([8]), next_position[1:], 4)


def test_more_tokens_than_the_trained_block_are_refused():
    target = build_tiny_target("qwen3", num_layers=6)
    draft = DFlashDraftModel.from_target(target, mask_token_id=MASK_TOKEN_ID, block_size=4)
    proposer = draft.new_proposer(draft.embed_input_ids)
    with pytest.raises(ValueError, match="at most 3 tokens per round, but up to 4 were asked"):
        proposer.propose(torch.tensor([5]), torch.tensor([3]), 4, recording_sampler([]))


# ---------------------------------------------------------------------------------------------- speculative_generate


def fit_dflash(target, rows, *, steps, num_layers=2, block_size=6, draft_vocab_size=None, seed=0):
    """A DFlash draft trained by its objective on ``rows`` of target text, the teacher being the target itself."""
    counts = torch.bincount(rows.flatten(), minlength=target.config.vocab_size)
    torch.manual_seed(seed)
    draft = DFlashDraftModel.from_target(
        target,
        mask_token_id=MASK_TOKEN_ID,
        num_layers=num_layers,
        block_size=block_size,
        draft_vocab_size=draft_vocab_size,
        token_counts=counts,
    )
    recorder = TapRecorder(target, draft.tap_layer_ids(target.config.num_hidden_layers), record_embeddings=True)
    with torch.no_grad(), recorder, recorder.capture():
        logits = target(rows).logits
        taps = recorder.pop()
    teacher = logits[..., draft.draft_to_target_ids].to(draft.dtype)
    batch = DraftTrainingBatch(
        taps.aux_hidden_states, taps.embeddings, teacher, torch.ones_like(rows, dtype=torch.bool)
    )
    optimizer = torch.optim.AdamW(draft.trainable_parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(seed)
    options = DFlashTrainingOptions(anchors_per_row=32)
    for _ in range(steps):
        loss = draft.training_loss(batch, options, generator=generator).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return draft.eval()


@functools.cache
def greedy_setup(family):
    target = build_tiny_target(
        family, num_layers=6, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32, seed=1
    )
    input_ids, attention_mask = left_padded_prompts([6, 3, 5, 4, 6, 2], target.config.vocab_size, seed=1)
    with torch.no_grad():
        sequences = target.generate(
            input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=30, eos_token_id=[]
        )
    real = torch.cat([attention_mask.bool(), torch.ones_like(sequences[:, input_ids.shape[1] :], dtype=torch.bool)], 1)
    length = int(real.sum(1).min())
    rows = torch.stack([row[keep][:length] for row, keep in zip(sequences, real, strict=True)])
    trained = fit_dflash(target, rows, steps=150, draft_vocab_size=50 if family == "llama" else None)
    torch.manual_seed(3)
    random_draft = DFlashDraftModel.from_target(target, mask_token_id=MASK_TOKEN_ID, block_size=6).eval()
    return target, random_draft, trained, input_ids, attention_mask


class AlternatingSpeculation(FixedSpeculation):
    """K cycles through ``schedule`` (0: a plain decoding round), whatever the batch."""

    def __init__(self, schedule):
        super().__init__(max(schedule))
        self.schedule, self.calls = schedule, 0

    def choose(self, batch_size: int) -> int:
        self.calls += 1
        return self.schedule[(self.calls - 1) % len(self.schedule)]


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("speculation", [1, 3, 5, (0, 2, 0, 0, 5, 1)], ids=["K1", "K3", "K5", "K-mixed-with-0"])
def test_greedy_equals_generate(family, speculation):
    target, random_draft, trained, input_ids, attention_mask = greedy_setup(family)
    max_new_tokens = 29
    want = target.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=max_new_tokens)
    for draft in (random_draft, trained):
        policy = AlternatingSpeculation(speculation) if isinstance(speculation, tuple) else speculation
        out = speculative_generate(
            target, draft, input_ids, attention_mask, max_new_tokens=max_new_tokens, num_speculative_tokens=policy
        )
        assert torch.equal(out.sequences, want)
        if isinstance(speculation, tuple):
            assert {k for _, k in out.rounds} == set(speculation)
    if speculation == 3:
        assert out.acceptance_length > 2.0  # the trained draft's blocks are accepted several tokens deep
        assert out.accepted_per_position[2] > 0


NUM_SAMPLES = 3000
NUM_NEW_TOKENS = 3


@functools.cache
def sampling_setup():
    tokenizer = build_char_tokenizer("abcdefghijklmnop")  # 20 ids, EOS among them
    target = build_tiny_target(
        "qwen3",
        tokenizer=tokenizer,
        num_layers=4,
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=96,
        seed=3,
        dtype=torch.float64,
    )
    with torch.no_grad():
        target.lm_head.weight.mul_(0.3)  # broad next-token laws: many outcomes
    prompt = torch.tensor([[1, 7, 12, 5, 9]])
    torch.manual_seed(0)
    samples = target.generate(prompt.expand(64, -1), do_sample=True, max_new_tokens=10, eos_token_id=[])
    # Drafts that are neither random nor exact, so that both acceptance and rejection happen; their logits sharpened
    # (x3) so that q is far from uniform and a q that is not the law a draft was drawn from shows in the samples.
    drafts = {
        reduced: fit_dflash(
            target, samples, steps=15, num_layers=1, block_size=4, draft_vocab_size=12 if reduced else None
        )
        for reduced in (False, True)
    }
    with torch.no_grad():
        for draft in drafts.values():
            draft.norm.weight.mul_(3.0)
    return target, drafts, prompt


@pytest.mark.parametrize(
    "temperature, top_p, reduced, draft_sampling, k",
    [(1.0, 1.0, False, "probabilistic", 3), (0.7, 0.9, True, "probabilistic", 2), (1.0, 1.0, True, "greedy", 2)],
)
def test_sampling_follows_the_target_distribution(temperature, top_p, reduced, draft_sampling, k):
    """The joint law of 3 generated tokens (EOS included) equals sampling from the target, by enumeration."""
    target, drafts, prompt = sampling_setup()
    out = speculative_generate(
        target,
        drafts[reduced],
        prompt.expand(NUM_SAMPLES, -1),
        max_new_tokens=NUM_NEW_TOKENS,
        do_sample=True,
        temperature=temperature,
        top_p=top_p,
        num_speculative_tokens=k,
        draft_sampling=draft_sampling,
        pad_token_id=0,
        generator=torch.Generator().manual_seed(k),
    )
    generated = out.sequences[:, prompt.shape[1] :]
    generated = torch.nn.functional.pad(generated, (0, NUM_NEW_TOKENS - generated.shape[1]), value=0)
    exact = exact_distribution(
        target, prompt, NUM_NEW_TOKENS, temperature=temperature, top_k=0, top_p=top_p, pad=0, eos=EOS
    )
    assert g_test([tuple(row) for row in generated.tolist()], exact) > P_VALUE_THRESHOLD
    assert 0 < out.num_accepted_tokens < out.num_draft_tokens  # both acceptance and rejection happened
