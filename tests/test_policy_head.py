"""`PolicyHead`: the policy's own logits from its decoder's output, whatever the family's head applies after the
lm_head (logit scaling, soft-caps), for the draft's teacher and the pipeline's log-probs."""

import pytest
import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, LlamaForCausalLM

from hf_spec_cotrain.policy_head import PolicyHead
from hf_spec_cotrain.taps import TapRecorder


VOCAB = 96
SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,  # the lm_head's gradient is then its own
)
# Each family's post-processing of the lm_head's product, set far from the identity.
HEADS = {
    "llama": {},
    "granite": {"logits_scaling": 4.0},
    "cohere2": {"logit_scale": 0.3},
    "gemma2": {"final_logit_softcapping": 2.0},
    "gemma3_text": {"final_logit_softcapping": 3.0},
    # Decoders elsewhere than the base model: GPT-2's is `transformer`, OPT's sits inside it (`model.decoder`).
    "gpt2": {},
    "opt": {"word_embed_proj_dim": 48},  # its decoder projects out before the head
}


def tiny_policy(model_type: str, dtype=torch.float64) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIG_MAPPING[model_type](**SIZES, **HEADS[model_type]))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.5)  # logits of several units: scaling and soft-caps change them
    return model.to(dtype).eval()


def decoder_output_and_logits(model, input_ids):
    with TapRecorder(model, (0, 1), record_final_hidden=True) as recorder, recorder.capture():
        logits = model(input_ids).logits
    return recorder.pop().final_hidden, logits


@pytest.mark.parametrize("model_type", list(HEADS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_teacher_is_the_policys_own_distribution(model_type, dtype):
    model = tiny_policy(model_type, dtype)
    input_ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden, logits = decoder_output_and_logits(model, input_ids)
    head = PolicyHead(model)
    rows = torch.tensor([5, 3, 40, 95, 17])
    tolerance = 1e-10 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(head.teacher_logits(hidden, rows), logits[..., rows], rtol=0, atol=tolerance)
    torch.testing.assert_close(
        head.teacher_logits(hidden, rows, dtype=torch.float64), logits[..., rows].double(), rtol=0, atol=tolerance * 10
    )
    with torch.no_grad():
        torch.testing.assert_close(head.logits(hidden), logits, rtol=0, atol=tolerance)
    assert head.rows_first
    if HEADS[model_type] and model_type != "opt":  # the bare product is not what these policies sample from
        bare = hidden @ model.get_output_embeddings().weight[rows].T
        assert (bare - logits[..., rows]).abs().max() > 0.1


@pytest.mark.parametrize("model_type", ["granite", "gemma2"])
def test_logits_carry_the_lm_heads_gradient(model_type):
    """The pipeline's last stage scores the GRPO loss through `logits`: its gradient reaches the lm_head as the
    policy's own forward's does."""
    model = tiny_policy(model_type)
    input_ids = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hidden, _ = decoder_output_and_logits(model, input_ids)
    weights = torch.randn(2, 5, VOCAB, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    hidden = hidden.requires_grad_()
    (PolicyHead(model).logits(hidden) * weights).sum().backward()
    replayed_head, replayed_hidden = model.get_output_embeddings().weight.grad.clone(), hidden.grad
    model.zero_grad()
    _, reference_logits = decoder_output_and_logits(model, input_ids)
    (reference_logits * weights).sum().backward()
    torch.testing.assert_close(replayed_head, model.get_output_embeddings().weight.grad, rtol=0, atol=1e-10)
    assert replayed_hidden is not None and replayed_hidden.abs().sum() > 0


class NormalisingHead(LlamaForCausalLM):
    """A head whose post-processing is not elementwise (it normalises over the vocabulary): rows cannot be selected
    before it."""

    def forward(self, *args, **kwargs):
        output = super().forward(*args, **kwargs)
        output.logits = output.logits.log_softmax(-1)
        return output


def test_a_head_that_is_not_elementwise_is_computed_whole_then_selected():
    model = NormalisingHead(CONFIG_MAPPING["llama"](**SIZES)).double().eval()
    input_ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        hidden, logits = decoder_output_and_logits(model, input_ids)
    head = PolicyHead(model)
    assert not head.rows_first
    rows = torch.tensor([7, 8, 90])
    torch.testing.assert_close(head.teacher_logits(hidden, rows), logits[..., rows], rtol=0, atol=1e-10)


def test_the_policy_is_left_as_it_was():
    model = tiny_policy("gemma2")
    decoder, lm_head = model.model, model.lm_head
    head = PolicyHead(model)
    head.teacher_logits(torch.zeros(1, 2, 64, dtype=torch.float64), torch.tensor([1, 2]))
    assert model.model is decoder and model.lm_head is lm_head
    assert dict(model.named_children()).keys() == {"model", "lm_head"}
