"""TTT loss against a naive reference that runs the draft over explicitly concatenated keys with an explicit mask."""

import pytest
import torch

from hf_spec_cotrain import Eagle3DraftModel, ttt_loss
from hf_spec_cotrain.draft import count_tokens
from hf_spec_cotrain.testing import build_tiny_target


def _draft(*, num_layers=1, draft_vocab_size=None, dtype=torch.float64, seed=0, family="llama"):
    target = build_tiny_target(
        family,
        num_layers=8,
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=96,
        seed=seed,
    )
    counts = count_tokens([torch.randint(0, target.config.vocab_size, (4000,))], target.config.vocab_size)
    draft = Eagle3DraftModel.from_target(
        target, num_layers=num_layers, draft_vocab_size=draft_vocab_size, token_counts=counts
    )
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        for p in draft.parameters():  # move every weight away from its init so no path is trivial
            p.add_(0.05 * torch.randn_like(p))
    return target.to(dtype), draft.to(dtype)


def _inputs(draft, batch, length, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    cfg = draft.config
    aux = torch.randn(batch, length, cfg.target_hidden_size * cfg.num_aux_hidden_states, generator=g, dtype=dtype)
    embeds = torch.randn(batch, length, cfg.hidden_size, generator=g, dtype=dtype)
    teacher = 3 * torch.randn(batch, length, cfg.draft_vocab_size, generator=g, dtype=dtype)
    loss_mask = torch.rand(batch, length, generator=g) < 0.8
    return aux.requires_grad_(), embeds.requires_grad_(), teacher, loss_mask


def reference_ttt(draft, aux, embeds, teacher, loss_mask, doc_lengths, steps, decay):
    """One packed row; every mask entry and shift spelled out position by position."""
    length = aux.shape[1]
    doc, pos, end = [], [], []
    start = 0
    for index, n in enumerate(doc_lengths):
        doc += [index] * n
        pos += list(range(n))
        end += [start + n] * n
        start += n
    position_ids = torch.tensor(pos).unsqueeze(0)
    hidden = draft.fc(aux)
    keys: dict[int, list] = {}
    total = 0.0
    losses, accuracies = [], []
    for d in range(steps):
        step_embeds = torch.zeros_like(embeds)
        for i in range(length):
            if i + 1 + d < end[i]:
                step_embeds[:, i] = embeds[:, i + 1 + d]

        def attend(layer, q, k, v):
            keys.setdefault(layer, []).append((k, v))
            all_k = torch.cat([kk for kk, _ in keys[layer]], dim=2)
            all_v = torch.cat([vv for _, vv in keys[layer]], dim=2)
            mask = torch.zeros(length, all_k.shape[2], dtype=torch.bool)
            for i in range(length):
                for j in range(length):
                    mask[i, j] = doc[j] == doc[i] and j <= i
                for s in range(1, len(keys[layer])):
                    mask[i, s * length + i] = True
            groups = q.shape[1] // k.shape[1]
            all_k = all_k.repeat_interleave(groups, dim=1)
            all_v = all_v.repeat_interleave(groups, dim=1)
            scores = (q @ all_k.transpose(-1, -2)) * q.shape[-1] ** -0.5
            return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ all_v

        hidden = draft.backbone(step_embeds, hidden, position_ids + d, attend)
        logits = draft.compute_logits(hidden)
        step_loss, hits, count = 0.0, 0, 0
        for i in range(length):
            t = i + 2 + d
            if t < end[i] and loss_mask[0, t]:
                p = torch.softmax(teacher[0, i + 1 + d].double(), -1)
                step_loss = step_loss - (p * torch.log_softmax(logits[0, i].double(), -1)).sum()
                hits += int(logits[0, i].argmax() == teacher[0, i + 1 + d].argmax())
                count += 1
        step_loss = step_loss / max(count, 1)
        total = total + decay**d * step_loss
        losses.append(float(step_loss.detach()) if torch.is_tensor(step_loss) else step_loss)
        accuracies.append(hits / max(count, 1))
    return total, losses, accuracies


def _completion_mask(doc_lengths):
    """``[1, L]``: True on the second half of every document (its "completion")."""
    return torch.cat([torch.arange(n) >= n // 2 for n in doc_lengths]).unsqueeze(0)


def _grads(loss, tensors):
    return torch.autograd.grad(loss, tensors, allow_unused=False)


@pytest.mark.parametrize(
    "doc_lengths, steps, num_layers, draft_vocab_size",
    [
        ([13], 3, 1, None),
        ([5, 1, 9, 2], 3, 1, 40),
        ([7, 11], 4, 2, 40),
        ([3, 6], 1, 1, None),
        ([2, 3, 4], 5, 1, 40),  # more steps than the documents can count: the last steps count nothing
    ],
)
@pytest.mark.parametrize("gradient_checkpointing", [False, True])
@pytest.mark.parametrize("counted", ["random", "completions"])
def test_ttt_matches_naive_reference_float64(
    doc_lengths, steps, num_layers, draft_vocab_size, gradient_checkpointing, counted
):
    """`counted="completions"` counts only each document's second half, as GRPO does: the later steps then run
    on fewer positions."""
    _, draft = _draft(num_layers=num_layers, draft_vocab_size=draft_vocab_size)
    length = sum(doc_lengths)
    aux, embeds, teacher, loss_mask = _inputs(draft, 1, length, torch.float64, seed=len(doc_lengths))
    if counted == "completions":
        loss_mask = _completion_mask(doc_lengths)
    cu_seqlens = torch.tensor([0, *torch.tensor(doc_lengths).cumsum(0).tolist()])
    out = ttt_loss(
        draft,
        aux_hidden_states=aux,
        input_embeds=embeds,
        teacher_logits=teacher,
        loss_mask=loss_mask,
        cu_seqlens=cu_seqlens,
        ttt_steps=steps,
        step_weight_decay=0.7,
        gradient_checkpointing=gradient_checkpointing,
    )
    ref, ref_losses, ref_acc = reference_ttt(draft, aux, embeds, teacher, loss_mask, doc_lengths, steps, 0.7)
    torch.testing.assert_close(out.loss, ref.to(out.loss.dtype), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(
        out.step_losses.double(), torch.tensor(ref_losses, dtype=torch.float64), rtol=1e-10, atol=1e-10
    )
    torch.testing.assert_close(out.step_accuracies.double(), torch.tensor(ref_acc, dtype=torch.float64))
    params = [p for p in draft.parameters() if p.requires_grad]
    got = _grads(out.loss, [aux, embeds, *params])
    want = _grads(ref, [aux, embeds, *params])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10)


def test_ttt_float32_close_to_float64():
    _, draft64 = _draft(draft_vocab_size=40)
    draft32 = Eagle3DraftModel(draft64.config).to(torch.float32)
    draft32.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in draft64.state_dict().items()})
    aux, embeds, teacher, loss_mask = _inputs(draft64, 1, 37, torch.float64)
    cu = torch.tensor([0, 20, 37])
    want = ttt_loss(
        draft64, aux_hidden_states=aux, input_embeds=embeds, teacher_logits=teacher, loss_mask=loss_mask, cu_seqlens=cu
    )
    got = ttt_loss(
        draft32,
        aux_hidden_states=aux.detach().float(),
        input_embeds=embeds.detach().float(),
        teacher_logits=teacher.float(),
        loss_mask=loss_mask,
        cu_seqlens=cu,
    )
    torch.testing.assert_close(got.loss.double(), want.loss, rtol=1e-5, atol=1e-6)
    want.loss.backward()
    got.loss.backward()
    for p32, p64 in zip(draft32.parameters(), draft64.parameters()):
        torch.testing.assert_close(p32.grad.double(), p64.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("counted", ["random", "completions"])
def test_padded_rows_equal_packed_documents(counted):
    """Rows padded on both sides (TRL's left-padded prompt + right-padded completion) give the loss of the
    packed documents (with completions only counted, the later steps skip columns no row needs)."""
    _, draft = _draft(draft_vocab_size=40)
    lengths, left_pads = [11, 9, 12], [3, 0, 2]
    batch, length = len(lengths), 15
    aux, embeds, teacher, loss_mask = _inputs(draft, batch, length, torch.float64)
    attention_mask = torch.zeros(batch, length, dtype=torch.bool)
    for row, (n, pad) in enumerate(zip(lengths, left_pads)):
        attention_mask[row, pad : pad + n] = True
        if counted == "completions":  # the last 3 tokens: steps 1.. need no row's first two columns
            loss_mask[row] = False
            loss_mask[row, pad + n - 3 : pad + n] = True
    padded = ttt_loss(
        draft,
        aux_hidden_states=aux,
        input_embeds=embeds,
        teacher_logits=teacher,
        loss_mask=loss_mask,
        attention_mask=attention_mask,
    )
    p_aux, p_embeds, p_teacher, p_mask = (t[attention_mask].unsqueeze(0) for t in (aux, embeds, teacher, loss_mask))
    cu = torch.tensor([0, 11, 20, 32])
    packed = ttt_loss(
        draft,
        aux_hidden_states=p_aux,
        input_embeds=p_embeds,
        teacher_logits=p_teacher,
        loss_mask=p_mask,
        cu_seqlens=cu,
    )
    torch.testing.assert_close(padded.loss, packed.loss, rtol=1e-12, atol=1e-12)
    # and the packed loss is the reference's
    ref, _, _ = reference_ttt(draft, p_aux, p_embeds, p_teacher, p_mask, lengths, 3, 0.8)
    torch.testing.assert_close(packed.loss, ref, rtol=1e-10, atol=1e-10)


def test_unpacked_batch_rows_are_independent_documents():
    _, draft = _draft()
    aux, embeds, teacher, loss_mask = _inputs(draft, 3, 10, torch.float64, seed=5)
    batched = ttt_loss(draft, aux_hidden_states=aux, input_embeds=embeds, teacher_logits=teacher, loss_mask=loss_mask)
    packed = ttt_loss(
        draft,
        aux_hidden_states=aux.reshape(1, 30, -1),
        input_embeds=embeds.reshape(1, 30, -1),
        teacher_logits=teacher.reshape(1, 30, -1),
        loss_mask=loss_mask.reshape(1, 30),
        cu_seqlens=torch.tensor([0, 10, 20, 30]),
    )
    torch.testing.assert_close(batched.step_losses, packed.step_losses, rtol=1e-12, atol=1e-12)


def test_input_ids_path_uses_target_embeddings_without_training_them():
    target, draft = _draft(draft_vocab_size=40)
    ids = torch.randint(0, target.config.vocab_size, (2, 11))
    aux, _, teacher, loss_mask = _inputs(draft, 2, 11, torch.float64)
    out = ttt_loss(draft, aux_hidden_states=aux, input_ids=ids, teacher_logits=teacher, loss_mask=loss_mask)
    embeds = target.get_input_embeddings()(ids)
    same = ttt_loss(
        draft, aux_hidden_states=aux, input_embeds=embeds.detach(), teacher_logits=teacher, loss_mask=loss_mask
    )
    torch.testing.assert_close(out.loss, same.loss, rtol=1e-12, atol=1e-12)
    out.loss.backward()
    assert target.get_input_embeddings().weight.grad is None
    assert draft.fc.weight.grad is not None and draft.fc.weight.grad.abs().sum() > 0


def test_nothing_counted_gives_zero_loss_not_nan():
    _, draft = _draft()
    aux, embeds, teacher, _ = _inputs(draft, 1, 6, torch.float64)
    out = ttt_loss(
        draft,
        aux_hidden_states=aux,
        input_embeds=embeds,
        teacher_logits=teacher,
        loss_mask=torch.zeros(1, 6, dtype=torch.bool),
    )
    assert out.loss.item() == 0.0 and out.step_counts.sum() == 0
    out.loss.backward()
    assert torch.isfinite(draft.fc.weight.grad).all()


def test_bad_arguments_raise_clear_errors():
    _, draft = _draft(draft_vocab_size=40)
    aux, embeds, teacher, loss_mask = _inputs(draft, 1, 8, torch.float64)
    kwargs = dict(aux_hidden_states=aux, input_embeds=embeds, teacher_logits=teacher, loss_mask=loss_mask)
    with pytest.raises(ValueError, match="ttt_steps`=0"):
        ttt_loss(draft, **kwargs, ttt_steps=0)
    with pytest.raises(ValueError, match="draft vocabulary has 40"):
        ttt_loss(draft, **{**kwargs, "teacher_logits": teacher[..., :30]})
    with pytest.raises(ValueError, match="cu_seqlens` must start at 0 and end at L=8"):
        ttt_loss(draft, **kwargs, cu_seqlens=torch.tensor([0, 3, 7]))
    with pytest.raises(ValueError, match="exactly one of `input_embeds` and `input_ids`"):
        ttt_loss(draft, aux_hidden_states=aux, teacher_logits=teacher)
    holes = torch.tensor([[True, False, True, True, True, True, True, True]])
    with pytest.raises(ValueError, match="not contiguous"):
        ttt_loss(draft, **kwargs, attention_mask=holes)
    with pytest.raises(ValueError, match="loss_mask"):
        ttt_loss(draft, **{**kwargs, "loss_mask": loss_mask[:, :5]})


def test_later_steps_run_only_where_a_loss_is_still_counted():
    """With only completions counted, steps 1.. skip the prompt positions whose outputs reach no counted loss,
    and the result stays the reference's (checked above); step 0 still covers every position (the trunk)."""
    _, draft = _draft(draft_vocab_size=40)
    doc_lengths = [12, 20]
    aux, embeds, teacher, _ = _inputs(draft, 1, sum(doc_lengths), torch.float64)
    lengths = []
    hook = draft.decoder_layers[0].register_forward_pre_hook(lambda module, args: lengths.append(args[0].shape[1]))
    try:
        ttt_loss(
            draft,
            aux_hidden_states=aux,
            input_embeds=embeds,
            teacher_logits=teacher,
            loss_mask=_completion_mask(doc_lengths),
            cu_seqlens=torch.tensor([0, 12, 32]),
            ttt_steps=3,
        )
    finally:
        hook.remove()
    # Step d keeps anchor i when i + 2 + d' is a completion position of i's document for some d' in [d, K): with
    # K = 3 that is i in [n/2 - 4, n - 3 - d], n/2 + 2 - d anchors per document of length n.
    assert lengths == [32, *(sum(n // 2 + 2 - d for n in doc_lengths) for d in (1, 2))]
