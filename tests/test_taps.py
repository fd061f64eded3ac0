"""Taps on every family: the recorded layer inputs are the forward's `hidden_states`, and a draft built from the
target trains on them (TTT loss and gradients) whatever the layers (dense or MoE, full or sliding, with sinks)."""

import pytest
import torch

from hf_spec_cotrain import Eagle3DraftModel, ttt_loss
from hf_spec_cotrain.draft import count_tokens
from hf_spec_cotrain.taps import TapRecorder
from hf_spec_cotrain.testing import SUPPORTED_FAMILIES, build_tiny_target


AUX_LAYER_IDS = (1, 4, 6)


def _target(family):
    # gpt-oss's window (and Mistral's given one) shorter than the rows, so sliding layers differ from full ones
    window = {"gpt_oss": 5, "mistral": 5}.get(family)
    return build_tiny_target(
        family, num_layers=8, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, sliding_window=window
    )


def _rows(vocab_size):
    input_ids = torch.randint(4, vocab_size, (2, 11), generator=torch.Generator().manual_seed(3))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :3] = 0  # a left-padded row
    return input_ids, attention_mask


@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_taps_are_the_layer_inputs_and_a_draft_trains_on_them(family):
    target = _target(family)
    input_ids, attention_mask = _rows(target.config.vocab_size)
    with TapRecorder(target, AUX_LAYER_IDS, record_embeddings=True, record_final_hidden=True) as recorder:
        with recorder.capture():
            hidden = target(input_ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states
        taps = recorder.pop()
    torch.testing.assert_close(taps.aux_hidden_states, torch.cat([hidden[i] for i in AUX_LAYER_IDS], dim=-1))
    torch.testing.assert_close(taps.embeddings, hidden[0])
    torch.testing.assert_close(taps.final_hidden, hidden[-1])  # after the final norm: what the lm_head reads

    counts = count_tokens([input_ids.flatten()], target.config.vocab_size)
    draft = Eagle3DraftModel.from_target(
        target, aux_layer_ids=AUX_LAYER_IDS, draft_vocab_size=40, token_counts=counts
    ).train()
    rows = target.lm_head.weight.detach()[draft.draft_to_target_ids]
    loss_mask = attention_mask.bool().clone()
    loss_mask[:, :4] = False
    out = ttt_loss(
        draft,
        aux_hidden_states=taps.aux_hidden_states,
        input_embeds=taps.embeddings,
        teacher_logits=taps.final_hidden @ rows.T,
        loss_mask=loss_mask,
        attention_mask=attention_mask.bool(),
    )
    out.loss.backward()
    assert torch.isfinite(out.loss) and out.loss > 0
    trained = [name for name, p in draft.named_parameters() if p.requires_grad]
    assert trained and all(draft.get_parameter(name).grad.abs().sum() > 0 for name in trained)
