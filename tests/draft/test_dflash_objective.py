"""DFlash's training objective: its anchors, the loss and its gradients against a plain per-anchor loop, where the
gradients go, and a tiny draft that learns its target's continuations."""

import math

import pytest
import torch
import torch.nn.functional as F
from dflash_test_utils import per_anchor_block

from hf_spec_cotrain.draft import DFlashDraftModel, DraftTrainingBatch
from hf_spec_cotrain.draft.dflash_objective import (
    DEFAULT_LOSS_DECAY_GAMMA,
    DFlashTrainingOptions,
    block_position_weights,
    sample_anchors,
)
from hf_spec_cotrain.policy_head import PolicyHead
from hf_spec_cotrain.taps import TapRecorder
from hf_spec_cotrain.testing import build_tiny_target


BLOCK_SIZE = 5


def tiny_draft(*, dtype=torch.float32, num_layers=1, block_size=BLOCK_SIZE, seed=0, **target_kwargs):
    target = build_tiny_target("qwen3", num_layers=6, seed=seed, dtype=dtype, **target_kwargs)
    torch.manual_seed(seed)
    draft = DFlashDraftModel.from_target(target, mask_token_id=3, num_layers=num_layers, block_size=block_size)
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return target, draft


def test_anchors_are_distinct_candidates_at_most_n_per_row_or_document_and_reproducible():
    loss_mask = torch.zeros(3, 12, dtype=torch.bool)
    loss_mask[0, 4:] = True  # anchors 3..10 (a + 1 counted, inside the row)
    loss_mask[1, 2:7] = True  # anchors 1..5
    # row 2: nothing counted, no anchor
    anchors, mask = sample_anchors(loss_mask, 3, generator=torch.Generator().manual_seed(0))
    assert mask.sum(1).tolist() == [3, 3, 0]
    assert set(anchors[0][mask[0]].tolist()) <= set(range(3, 11))
    assert set(anchors[1][mask[1]].tolist()) <= set(range(1, 6))
    again, _ = sample_anchors(loss_mask, 3, generator=torch.Generator().manual_seed(0))
    assert torch.equal(anchors, again)
    everything, mask = sample_anchors(loss_mask, 100)
    assert everything[0][mask[0]].tolist() == list(range(3, 11))
    # Packed documents [0, 3), [3, 4), [4, 12): a >= 1 inside its document, a + 1 in it too; N per document.
    cu_seqlens = torch.tensor([0, 3, 4, 12])
    packed, mask = sample_anchors(torch.ones(1, 12, dtype=torch.bool), 100, cu_seqlens=cu_seqlens)
    assert packed[mask].tolist() == [1, 5, 6, 7, 8, 9, 10]
    packed, mask = sample_anchors(torch.ones(1, 12, dtype=torch.bool), 2, cu_seqlens=cu_seqlens)
    chosen = packed[mask].tolist()
    assert len(chosen) == 3 and chosen[0] == 1 and all(5 <= a <= 10 for a in chosen[1:])
    # Uniform over the candidates: every one is drawn in some seed.
    seen = set()
    for seed in range(60):
        drawn, mask = sample_anchors(loss_mask[:1], 2, generator=torch.Generator().manual_seed(seed))
        seen |= set(drawn[0][mask[0]].tolist())
    assert seen == set(range(3, 11))


def reference_loss(draft, aux, embeds, teacher, loss_mask, anchors, anchor_mask, starts, ends, gamma):
    """The objective written as a loop: per anchor the block of `per_anchor_block`, per block position the soft
    cross-entropy to the teacher one column earlier, averaged over the counted pairs, weighted exp(-(i-1)/gamma)."""
    size = draft.config.block_size
    sums = [0.0] * size
    hits, counts = [0] * size, [0] * size
    for row in range(anchors.shape[0]):
        positions = torch.arange(aux.shape[1])
        for slot in range(anchors.shape[1]):
            if not anchor_mask[row, slot]:
                continue
            anchor, start, end = int(anchors[row, slot]), starts[row][slot], ends[row][slot]
            block = per_anchor_block(draft, aux[row], embeds[row], anchor, start, positions - start)
            for i in range(1, size):
                if anchor + i < end and loss_mask[row, anchor + i]:
                    logits = draft.compute_logits(block[i])
                    p = F.softmax(teacher[row, anchor + i - 1], -1)
                    sums[i] = sums[i] - (p * F.log_softmax(logits, -1)).sum()
                    hits[i] += int(logits.argmax() == teacher[row, anchor + i - 1].argmax())
                    counts[i] += 1
    losses = [sums[i] / max(counts[i], 1) for i in range(1, size)]
    total = sum(math.exp(-(i - 1) / gamma) * losses[i - 1] for i in range(1, size))
    return total, losses, [hits[i] / max(counts[i], 1) for i in range(1, size)], counts[1:]


@pytest.mark.parametrize("layout", ["padded-rows", "packed"])
def test_loss_and_gradients_equal_a_per_anchor_loop(layout):
    target, draft = tiny_draft(dtype=torch.float64, num_layers=2)
    hidden, vocab, taps = target.config.hidden_size, target.config.vocab_size, 2
    generator = torch.Generator().manual_seed(1)
    if layout == "padded-rows":
        # Row 0: 3 left-padding columns, 14 real tokens; row 1: 17 real tokens; completions from column 8.
        batch, length = 2, 17
        attention_mask = torch.ones(batch, length, dtype=torch.bool)
        attention_mask[0, :3] = False
        cu_seqlens = None
    else:
        batch, length = 1, 23
        attention_mask = None
        cu_seqlens = torch.tensor([0, 9, 10, 23])
    aux = torch.randn(batch, length, taps * hidden, generator=generator, dtype=torch.float64)
    embeds = torch.randn(batch, length, hidden, generator=generator, dtype=torch.float64)
    teacher = 3 * torch.randn(batch, length, vocab, generator=generator, dtype=torch.float64)
    loss_mask = torch.rand(batch, length, generator=generator) < 0.7
    batch_in = DraftTrainingBatch(
        aux, embeds, teacher, loss_mask, attention_mask=attention_mask, cu_seqlens=cu_seqlens
    )
    options = DFlashTrainingOptions(anchors_per_row=4, loss_decay_gamma=3.0)
    out = draft.training_loss(batch_in, options, generator=torch.Generator().manual_seed(5))
    got_grads = torch.autograd.grad(out.loss, list(draft.parameters()))

    # The same anchors, drawn as the objective draws them: on the rows moved to start at column 0.
    if layout == "padded-rows":
        real = attention_mask.sum(1)
        shift = [int(length - n) for n in real]  # left padding only
        aligned = [torch.roll(x, -s, dims=0) for x, s in zip(loss_mask & attention_mask, shift, strict=True)]
        aligned_mask = torch.stack(aligned)[:, : int(real.max())] & (torch.arange(int(real.max())) < real[:, None])
        anchors, anchor_mask = sample_anchors(aligned_mask, 4, generator=torch.Generator().manual_seed(5))
        rows = [slice(s, None) for s in shift]
        ref_aux = torch.nn.utils.rnn.pad_sequence([aux[r, rows[r]] for r in range(batch)], batch_first=True)
        ref_embeds = torch.nn.utils.rnn.pad_sequence([embeds[r, rows[r]] for r in range(batch)], batch_first=True)
        ref_teacher = torch.nn.utils.rnn.pad_sequence([teacher[r, rows[r]] for r in range(batch)], batch_first=True)
        starts = [[0] * anchors.shape[1]] * batch
        ends = [[int(real[r])] * anchors.shape[1] for r in range(batch)]
        ref_mask = aligned_mask
    else:
        anchors, anchor_mask = sample_anchors(
            loss_mask, 4, cu_seqlens=cu_seqlens, generator=torch.Generator().manual_seed(5)
        )
        bounds = cu_seqlens.tolist()
        starts = [[max(b for b in bounds if b <= a) for a in anchors[0].tolist()]]
        ends = [[min(b for b in bounds if b > a) for a in anchors[0].tolist()]]
        ref_aux, ref_embeds, ref_teacher, ref_mask = aux, embeds, teacher, loss_mask
    assert anchor_mask.sum() >= 6
    total, losses, accuracies, counts = reference_loss(
        draft, ref_aux, ref_embeds, ref_teacher, ref_mask, anchors, anchor_mask, starts, ends, gamma=3.0
    )
    expected_grads = torch.autograd.grad(total, list(draft.parameters()))

    torch.testing.assert_close(out.loss, total, rtol=0, atol=1e-10)
    torch.testing.assert_close(out.step_losses, torch.stack(losses), rtol=0, atol=1e-10)
    assert out.step_counts.tolist() == counts and min(counts) > 0
    torch.testing.assert_close(out.step_accuracies, torch.tensor(accuracies, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(out.step_weights, block_position_weights(BLOCK_SIZE, 3.0), rtol=0, atol=0)
    # Qwen3's RMSNorm computes in float32 whatever its input, so its backward rounds to float32 in both computations
    # (in a different order): the gradients agree to float32 precision of their scale.
    for (name, _), got, expected in zip(draft.named_parameters(), got_grads, expected_grads, strict=True):
        scale = float(expected.abs().max())
        assert scale > 0, name
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * scale, msg=lambda m, name=name: f"{name}: {m}")


def target_batch(target, draft, input_ids, completion_start):
    """What the trainer hands the objective: the taps, embeddings and teacher of one target forward."""
    with TapRecorder(target, draft.tap_layer_ids(6), record_embeddings=True, record_final_hidden=True) as recorder:
        with recorder.capture():
            target(input_ids)
        taps = recorder.pop()
    teacher = PolicyHead(target).teacher_logits(taps.final_hidden, draft.draft_to_target_ids)
    loss_mask = torch.zeros_like(input_ids, dtype=torch.bool)
    loss_mask[:, completion_start:] = True
    return DraftTrainingBatch(taps.aux_hidden_states, taps.embeddings, teacher, loss_mask)


@pytest.mark.parametrize("reduced", [False, True], ids=["full-vocab", "reduced-vocab"])
def test_gradients_reach_every_draft_weight_and_never_the_target(reduced):
    target = build_tiny_target("qwen3", num_layers=6, seed=3)
    options = dict(draft_vocab_size=50, token_counts=torch.arange(100)) if reduced else {}
    draft = DFlashDraftModel.from_target(target, mask_token_id=3, num_layers=2, block_size=4, **options)
    input_ids = torch.randint(4, 100, (2, 20), generator=torch.Generator().manual_seed(0))
    batch = target_batch(target, draft, input_ids, completion_start=6)
    for gradient_checkpointing in (False, True):
        draft.zero_grad(set_to_none=True)
        out = draft.training_loss(
            batch,
            DFlashTrainingOptions(),
            generator=torch.Generator().manual_seed(0),
            gradient_checkpointing=gradient_checkpointing,
        )
        out.loss.backward()
        for name, param in draft.named_parameters():
            assert param.grad is not None and param.grad.abs().sum() > 0, name
        assert all(param.grad is None for param in target.parameters())
    assert ("lm_head.weight" in dict(draft.named_parameters())) == reduced


def test_bf16_autocast_trains_close_to_float32():
    """Under bf16 autocast (`bf16=True`, `draft_bf16=True`, a warm start's `bf16=True`) the projections come out in
    bfloat16 and the normed, rotated queries and keys in float32: the objective still runs, its loss and gradients
    close to float32's, every gradient in the weights' float32."""
    target = build_tiny_target("qwen3", num_layers=6, seed=3)
    draft = DFlashDraftModel.from_target(target, mask_token_id=3, num_layers=2, block_size=4)
    input_ids = torch.randint(4, 100, (2, 20), generator=torch.Generator().manual_seed(0))
    batch = target_batch(target, draft, input_ids, completion_start=6)
    results = []
    for bf16 in (False, True):
        draft.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = draft.training_loss(batch, DFlashTrainingOptions(), generator=torch.Generator().manual_seed(0))
        out.loss.backward()
        results.append((out.loss.detach().float(), [p.grad.clone() for p in draft.parameters()]))
    (loss, grads), (bf16_loss, bf16_grads) = results
    torch.testing.assert_close(bf16_loss, loss, rtol=2e-2, atol=0)
    for got, want in zip(bf16_grads, grads):
        assert got.dtype == torch.float32
        assert (got - want).norm() <= 0.1 * want.norm() + 1e-6


def test_options_defaults_fields_and_refusals():
    class Args:
        pass

    assert DFlashTrainingOptions.from_args(Args()) == DFlashTrainingOptions(8, DEFAULT_LOSS_DECAY_GAMMA)
    args = Args()
    args.dflash_anchors_per_row, args.dflash_loss_decay_gamma = 3, 7.0
    assert DFlashDraftModel.training_options(args) == DFlashTrainingOptions(3, 7.0)
    with pytest.raises(ValueError, match="dflash_loss_decay_gamma`=0"):
        DFlashTrainingOptions(loss_decay_gamma=0)
    with pytest.raises(ValueError, match="dflash_anchors_per_row"):
        DFlashTrainingOptions(anchors_per_row=0)


def test_a_tiny_draft_learns_its_targets_greedy_continuations():
    """Trained on a pool of the target's own greedy continuations (what co-training sees every step), at 32 random
    anchors per row, the draft's blocks come to agree with the target's argmax at every position, on blocks at all
    anchors of those sequences (most of them never drawn together). EAGLE-3's TTT reaches about the same (0.8) in as
    many steps on this setup."""
    torch.manual_seed(0)
    target = build_tiny_target("qwen3", num_layers=6, hidden_size=64, num_attention_heads=2, seed=4)
    draft = DFlashDraftModel.from_target(target, mask_token_id=3, num_layers=2, block_size=4)
    prompts = torch.randint(4, 100, (16, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        sequences = target.generate(prompts, max_new_tokens=26, do_sample=False, pad_token_id=0)
    optimizer = torch.optim.AdamW(draft.trainable_parameters(), lr=3e-3)
    options = DFlashTrainingOptions(anchors_per_row=32)
    generator = torch.Generator().manual_seed(2)

    def accuracy():
        with torch.no_grad():
            batch = target_batch(target, draft, sequences, 6)
            out = draft.training_loss(batch, DFlashTrainingOptions(anchors_per_row=100), generator=generator)
        return float((out.step_accuracies * out.step_counts).sum() / out.step_counts.sum())

    before = accuracy()
    for _ in range(300):
        rows = torch.randint(0, len(sequences), (8,), generator=generator)
        batch = target_batch(target, draft, sequences[rows], 6)
        loss = draft.training_loss(batch, options, generator=generator).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = accuracy()
    assert before < 0.3 and after > 0.75, (before, after)
