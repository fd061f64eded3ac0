"""The tiny local models and tokenizer of `hf_spec_cotrain.testing`."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from hf_spec_cotrain.testing import (
    SUPPORTED_FAMILIES,
    build_char_tokenizer,
    build_tiny_target,
    save_tiny_target,
    storage_bytes,
)


TEXT = "def f(x):\n    return {'a': x ** 2}  # ~!@`|\\\n"


def test_char_tokenizer_round_trips_text_with_deterministic_ids():
    tokenizer = build_char_tokenizer()
    ids = tokenizer(TEXT).input_ids
    assert len(ids) == len(TEXT)
    assert tokenizer.decode(ids) == TEXT
    assert build_char_tokenizer()(TEXT).input_ids == ids
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (
        0,
        1,
        2,
        3,
    )
    assert len(set(tokenizer.get_vocab().values())) == len(tokenizer)
    assert tokenizer("a\tb").input_ids == [
        tokenizer.convert_tokens_to_ids("a"),
        3,
        tokenizer.convert_tokens_to_ids("b"),
    ]


def test_char_tokenizer_custom_alphabet_and_chat_template():
    tokenizer = build_char_tokenizer("abc :\nrestuminly")
    assert len(tokenizer) == 4 + len("abc :\nrestuminly")
    assert tokenizer("cab").input_ids == [6, 4, 5]
    messages = [{"role": "user", "content": "abc"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<s>user: abc\nassistant: "
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids[0] == tokenizer.bos_token_id and tokenizer.decode(ids[1:]) == "user: abc\nassistant: "
    with pytest.raises(ValueError, match="repeated"):
        build_char_tokenizer("abca")
    with pytest.raises(ValueError, match="non-empty ASCII"):
        build_char_tokenizer("")
    with pytest.raises(ValueError, match="non-empty ASCII"):
        build_char_tokenizer("abé")


@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_saved_target_loads_back_with_identical_logits(family, tmp_path):
    folder = save_tiny_target(tmp_path, family, num_layers=2, seed=3)
    model = build_tiny_target(family, num_layers=2, seed=3)
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert type(loaded) is type(model) and loaded.config.num_hidden_layers == 2  # Qwen3.5's is qwen3_5_text
    assert tokenizer(TEXT).input_ids == build_char_tokenizer()(TEXT).input_ids
    assert GenerationConfig.from_pretrained(folder).eos_token_id == tokenizer.eos_token_id
    ids = torch.tensor([tokenizer(TEXT).input_ids])
    with torch.no_grad():
        expected, actual = model(ids).logits, loaded(ids).logits
    assert torch.equal(expected, actual)


@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_tiny_target_weights_are_seeded_and_not_degenerate(family):
    model = build_tiny_target(family, num_layers=2)
    same = build_tiny_target(family, num_layers=2)
    other = build_tiny_target(family, num_layers=2, seed=1)
    for (name, param), twin, different in zip(model.named_parameters(), same.parameters(), other.parameters()):
        assert torch.equal(param, twin), name
        assert not torch.equal(param, different), name
        # No tensor keeps a constant default: norms are not all ones, biases not all zeros.
        assert param.std() > 0.01, name
    ids = torch.tensor([build_char_tokenizer()(TEXT).input_ids])
    with torch.no_grad():
        probs = model(ids).logits.softmax(-1)
    entropy = -(probs * probs.log()).sum(-1).mean()
    assert entropy < 0.75 * math.log(model.config.vocab_size)


def test_tiny_target_options():
    model = build_tiny_target(
        "qwen3",
        num_layers=3,
        hidden_size=96,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=48,
        intermediate_size=64,
        vocab_size=128,
        tie_word_embeddings=True,
        dtype=torch.bfloat16,
    )
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.head_dim, config.vocab_size) == (3, 96, 48, 128)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.dtype == torch.bfloat16
    assert build_tiny_target("qwen2", num_layers=1).model.layers[0].self_attn.q_proj.bias is not None


def test_tiny_target_sliding_windows():
    def layout(family, **kwargs):
        config = build_tiny_target(family, num_layers=4, **kwargs).config
        return config.sliding_window, getattr(config, "layer_types", None)

    sliding, full = "sliding_attention", "full_attention"
    assert layout("gpt_oss") == (16, [sliding, full] * 2)
    assert layout("gpt_oss", sliding_window=5) == (5, [sliding, full] * 2)
    assert layout("mistral") == (None, None)
    assert layout("mistral", sliding_window=5) == (5, None)  # a window without layer types: every layer's
    assert layout("qwen3", sliding_window=5) == (5, [sliding, full] * 2)


def test_tiny_target_rejects_bad_arguments():
    with pytest.raises(ValueError, match="family='llama' has no sliding-window variant.*gpt_oss, mistral, qwen3"):
        build_tiny_target("llama", sliding_window=8)
    with pytest.raises(ValueError, match="family='gpt2'.*llama, qwen2, qwen3"):
        build_tiny_target("gpt2")
    with pytest.raises(ValueError, match="head_dim=16.*>= 32"):
        build_tiny_target("llama", head_dim=16)
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        build_tiny_target("llama", num_key_value_heads=3)
    with pytest.raises(ValueError, match="hidden_size=256 must equal"):
        build_tiny_target("qwen2", hidden_size=256)
    with pytest.raises(ValueError, match="vocab_size=10"):
        build_tiny_target("llama", vocab_size=10)


def test_storage_bytes_counts_each_storage_once():
    weight = torch.zeros(6, 4)
    assert storage_bytes(weight, weight[:2], [weight.t()]) == 6 * 4 * 4  # views share the storage
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight  # tied
    model.register_buffer("scale", torch.ones(3, dtype=torch.float64))
    assert storage_bytes(model) == 10 * 4 * 4 + 3 * 8
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.tensor([1, 2])).sum().backward()
    optimizer.step()
    # The parameter, its gradient and its momentum, the buffer.
    assert storage_bytes(model, optimizer) == 3 * 10 * 4 * 4 + 3 * 8
    model.zero_grad(set_to_none=True)
    assert storage_bytes(model, optimizer) == 2 * 10 * 4 * 4 + 3 * 8
