"""Tiny, locally built models and tokenizers for tests, examples and benchmarks.

Nothing here downloads: the tokenizer is made with the `tokenizers` library and the targets are
random transformers models built from configs. The weights are seeded and scaled so that the
logits are far from uniform (greedy decoding is stable across kernels) and every tensor, norms and
biases included, differs from its default initialisation (weight-sync tests see every tensor).
"""

import string
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    CONFIG_MAPPING,
    GenerationConfig,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)
from transformers.models.auto import modeling_auto


__all__ = [
    "SUPPORTED_FAMILIES",
    "TOOL_CALLING_CHARACTERS",
    "build_char_tokenizer",
    "build_pass_through_draft",
    "build_tiny_target",
    "decoder_only_families",
    "fill_seeded",
    "left_padded_prompts",
    "recorded_checkpoint_reads",
    "save_tiny_target",
    "storage_bytes",
]

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "gpt_oss", "qwen3_5", "qwen3_next")
_FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "gpt_oss": (GptOssConfig, GptOssForCausalLM),
    "qwen3_5": (Qwen3_5TextConfig, Qwen3_5ForCausalLM),
    "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM),
}
_EXPERTS, _EXPERTS_PER_TOKEN = 4, 2


def _hybrid_layer_types(layers: int) -> list[str]:
    """Qwen3.5's and Qwen3-Next's layout: a full-attention layer after every three linear-attention ones, and last
    (the real models' depths are multiples of 4; transformers needs one full-attention layer)."""
    return ["full_attention" if i % 4 == 3 or i == layers - 1 else "linear_attention" for i in range(layers)]


# What makes each family itself at a tiny size: experts, gpt-oss's alternating sliding-window layers, and the
# linear-attention layers of Qwen3.5 and Qwen3-Next.
_FAMILY_OPTIONS = {
    "mistral": lambda layers, intermediate, positions: {"sliding_window": None},
    "qwen3_moe": lambda layers, intermediate, positions: {
        "num_experts": _EXPERTS,
        "num_experts_per_tok": _EXPERTS_PER_TOKEN,
        "moe_intermediate_size": intermediate // 2,
    },
    "gpt_oss": lambda layers, intermediate, positions: {
        # gpt-oss's YaRN scaling (factor 32), its original context scaled down with the tiny one
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": max(positions // 32, 1),
            "rope_theta": 150000.0,
        },
        "num_local_experts": _EXPERTS,
        "num_experts_per_tok": _EXPERTS_PER_TOKEN,
        "sliding_window": 16,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
    },
    "qwen3_5": lambda layers, intermediate, positions: {"layer_types": _hybrid_layer_types(layers)},
    "qwen3_next": lambda layers, intermediate, positions: {
        "num_experts": _EXPERTS,
        "num_experts_per_tok": _EXPERTS_PER_TOKEN,
        "moe_intermediate_size": intermediate // 2,
        "shared_expert_intermediate_size": intermediate // 2,
        "layer_types": _hybrid_layer_types(layers),
    },
}
# Families with linear-attention (Gated DeltaNet) layers, whose heads get the attention heads' sizes.
_LINEAR_ATTENTION_FAMILIES = ("qwen3_5", "qwen3_next")
# Where each family puts a sliding window of `sliding_window` tokens: every other layer for gpt-oss, every layer for
# Mistral, and Gemma-style interleaving (a full-attention layer after every sliding one) for Qwen3.
_SLIDING_WINDOW_OPTIONS = {
    "gpt_oss": lambda window, layers: {"sliding_window": window},
    "mistral": lambda window, layers: {"sliding_window": window},
    "qwen3": lambda window, layers: {
        "use_sliding_window": True,
        "sliding_window": window,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
    },
}
# vLLM's CPU attention kernels refuse smaller heads.
_MIN_HEAD_DIM = 32
# Logits with a standard deviation of about 3: peaked enough for a stable greedy argmax and for a
# draft to have something to learn, while sampling at temperature 1 still varies.
_LM_HEAD_GAIN = 3.0

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<s>", "</s>", "<unk>"
_SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
DEFAULT_ALPHABET = string.printable.replace("\t", "").replace("\r", "").replace("\x0b", "").replace("\x0c", "")

# Plain-text roles keep the template inside the character alphabet.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


# A compact tool-calling template for the character tokenizer (few tokens per turn, so multi-turn rollouts stay cheap on
# a CPU): the user's turn is "u:<content>\n", the assistant's ">" then its text, then each tool call as
# "[name key=value ...]", then EOS; a tool's result "|<content>\n". The tools are not rendered into the prompt.
TOOL_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    ">{{ message['content'] or '' }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "[{{ call['function']['name'] }}"
    "{% for key, value in call['function']['arguments'].items() %} {{ key }}={{ value }}{% endfor %}]"
    "{% endfor %}{{ eos_token }}"
    "{% elif message['role'] == 'tool' %}|{{ message['content'] }}\n"
    "{% else %}{{ message['role'][0] }}:{{ message['content'] }}\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}>{% endif %}"
)
# How transformers' `parse_response` reads the assistant's turn back (tool calls with their arguments, typed by the
# tool's schema), as TRL's tool loop needs it.
TOOL_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": ">",
    "fields": {
        "tool_calls": {
            "open_pattern": r"\[(?P<name>\w+)",
            "close_pattern": r"\]",
            "repeats": True,
            "content": "xml-inline",
            "content_args": {
                "tag_pattern": r" (?P<key>\w+)=(?P<value>[^ \]]*)",
                "value_parser": {"name": "json", "args": {"allow_non_json": True}},
            },
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
        "content": {"close_pattern": EOS_TOKEN, "content": "text"},
    },
}
# What the tool-calling template writes besides the messages (an alphabet needs them, and the tools' names).
TOOL_CALLING_CHARACTERS = "u:>[]=| \n"


def build_char_tokenizer(alphabet: str | None = None, *, tool_calling: bool = False) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: ids 0-3 are `<pad>`, `<s>`, `</s>`, `<unk>`, then one id per character.

    `alphabet` (ASCII) defaults to printable ASCII plus newline, without other whitespace control
    characters. Ids follow the alphabet's order, so the same alphabet always gives the same ids.
    Characters outside the alphabet map to `<unk>` (one per UTF-8 byte; a folder that transformers
    reloads as a Qwen2 tokenizer drops them instead). No special token is added on encoding; the chat
    template starts with `<s>`.

    ``tool_calling``: a chat template that renders tool calls and tool results compactly, and the response template
    that parses the assistant's tool calls back (what TRL's ``tools`` and ``environment_factory`` rollouts need); the
    alphabet must hold `TOOL_CALLING_CHARACTERS` and the tools' names.

    It is a byte-level BPE without merges: for ASCII that is one token per character, and it is the
    pipeline transformers rebuilds when it forces its own tokenizer class on a saved folder (it does
    for Qwen2), so the ids survive `AutoTokenizer.from_pretrained` for every family.
    """
    alphabet = DEFAULT_ALPHABET if alphabet is None else alphabet
    if not alphabet or not alphabet.isascii():
        raise ValueError(f"alphabet must be a non-empty ASCII string, got {alphabet!r}.")
    if len(set(alphabet)) != len(alphabet):
        raise ValueError(f"alphabet has repeated characters: {alphabet!r}; give each character once.")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    # The byte-level symbol of each character (a space is "Ġ", a newline "Ċ").
    symbols = [byte_level.pre_tokenize_str(character)[0][0] for character in alphabet]
    vocab = {token: index for index, token in enumerate((*_SPECIAL_TOKENS, *symbols))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN))
    backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    if tool_calling:
        missing = sorted(set(TOOL_CALLING_CHARACTERS) - set(alphabet))
        if missing:
            raise ValueError(f"A tool-calling tokenizer's alphabet needs the template's characters {missing}.")
        tokenizer.chat_template, tokenizer.response_template = TOOL_CHAT_TEMPLATE, TOOL_RESPONSE_TEMPLATE
    return tokenizer


def build_tiny_target(
    family: str = "llama",
    *,
    num_layers: int = 6,
    hidden_size: int = 128,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 32,
    intermediate_size: int = 256,
    vocab_size: int | None = None,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = False,
    sliding_window: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    tokenizer: PreTrainedTokenizerFast | None = None,
) -> PreTrainedModel:
    """A random causal LM of `family` (one of `SUPPORTED_FAMILIES`) with seeded, non-degenerate weights.

    MoE families get 4 experts, 2 per token (Qwen3-MoE's and Qwen3-Next's of half `intermediate_size`); gpt-oss
    alternates sliding-window (16 tokens) and full-attention layers, as the real models do; Qwen3.5 (its text model)
    and Qwen3-Next put a full-attention layer after every three linear-attention (Gated DeltaNet) layers and last, the
    linear heads of the attention heads' sizes. `sliding_window` sets another window for gpt-oss, and gives one to
    Mistral (every layer) or Qwen3 (every other layer, Gemma-style); other families have none.

    `vocab_size` defaults to the size of `tokenizer` (the character tokenizer when None). Matrices
    are drawn with standard deviation `1/sqrt(fan_in)` (embeddings: 1; lm_head: 3 times that), norm weights around 1 and
    biases around 0, all from one generator seeded with `seed`, so the same arguments always give
    the same model.
    """
    if family not in _FAMILIES:
        raise ValueError(f"family={family!r} is not supported; choose one of {', '.join(SUPPORTED_FAMILIES)}.")
    if head_dim < _MIN_HEAD_DIM:
        raise ValueError(f"head_dim={head_dim} is too small: vLLM's CPU attention needs head_dim >= {_MIN_HEAD_DIM}.")
    if num_attention_heads % num_key_value_heads != 0:
        raise ValueError(
            f"num_attention_heads={num_attention_heads} must be a multiple of num_key_value_heads={num_key_value_heads}."
        )
    if family == "qwen2" and hidden_size != num_attention_heads * head_dim:
        raise ValueError(
            f"family='qwen2' derives head_dim from hidden_size / num_attention_heads in vLLM, so hidden_size="
            f"{hidden_size} must equal num_attention_heads * head_dim = {num_attention_heads * head_dim}."
        )
    if sliding_window is not None and family not in _SLIDING_WINDOW_OPTIONS:
        raise ValueError(
            f"family={family!r} has no sliding-window variant; sliding_window needs one of "
            f"{', '.join(_SLIDING_WINDOW_OPTIONS)}."
        )
    tokenizer = build_char_tokenizer() if tokenizer is None else tokenizer
    vocab_size = len(tokenizer) if vocab_size is None else vocab_size
    if vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens.")

    config_class, model_class = _FAMILIES[family]
    options = _FAMILY_OPTIONS.get(family, lambda *sizes: {})(num_layers, intermediate_size, max_position_embeddings)
    if sliding_window is not None:
        options.update(_SLIDING_WINDOW_OPTIONS[family](sliding_window, num_layers))
    if family in _LINEAR_ATTENTION_FAMILIES:
        options.update(
            linear_key_head_dim=head_dim,
            linear_value_head_dim=head_dim,
            linear_num_key_heads=num_key_value_heads,
            linear_num_value_heads=num_attention_heads,
        )
    config = config_class(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **options,
    )
    model = model_class(config)
    fill_seeded(model, seed=seed)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model.to(dtype).eval()


def decoder_only_families() -> list[str]:
    """The model types of the installed transformers' causal-LM auto mapping that are decoder-only language models:
    not in the masked-LM, sequence-to-sequence or image-text-to-text mappings (encoders with a decoder head,
    encoder-decoders, multimodal models whose text part has its own type) and not a decoder made to sit under an
    encoder (Whisper's config says so; MusicGen's holds its text encoder, audio encoder and decoder)."""
    others = (
        set(modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES)
        | set(modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)
        | set(modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    )

    def under_an_encoder(config_class) -> bool:
        sub_configs = getattr(config_class, "sub_configs", {})
        return config_class.is_encoder_decoder or (
            "decoder" in sub_configs and any("encoder" in n for n in sub_configs)
        )

    return sorted(
        model_type
        for model_type in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        if model_type not in others and not under_an_encoder(CONFIG_MAPPING[model_type])
    )


@torch.no_grad()
def fill_seeded(model: PreTrainedModel, *, seed: int) -> None:
    """Fill `model`'s parameters as `build_tiny_target` does (seeded, logits of several units), for a model of a family
    it does not build."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
        if name.endswith("norm.weight"):
            values = 1.0 + 0.1 * noise
        elif name.endswith("bias"):
            values = 0.1 * noise
        elif "embed_tokens" in name:
            values = noise
        elif name == "lm_head.weight":
            values = _LM_HEAD_GAIN * noise / param.shape[-1] ** 0.5
        else:
            values = noise / param.shape[-1] ** 0.5
        param.copy_(values)


def left_padded_prompts(
    lengths: list[int], vocab_size: int, *, seed: int
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Random prompts of these lengths (ids from 4 up: past the char tokenizer's specials), left-padded as TRL pads
    them: ``(input_ids, attention_mask)``."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.zeros(len(lengths), width, dtype=torch.long)
    attention_mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        input_ids[row, width - length :] = torch.randint(4, vocab_size, (length,), generator=generator)
        attention_mask[row, width - length :] = 1
    return input_ids, attention_mask


def save_tiny_target(folder: str | Path, family: str = "llama", **kwargs) -> Path:
    """Build a tiny target (see `build_tiny_target`) and save model, tokenizer and generation config to `folder`.

    The folder loads with `AutoModelForCausalLM.from_pretrained`, `AutoTokenizer.from_pretrained`
    and `vllm.LLM(model=folder)`. Returns the folder.
    """
    folder = Path(folder)
    tokenizer = kwargs.pop("tokenizer", None) or build_char_tokenizer()
    model = build_tiny_target(family, tokenizer=tokenizer, **kwargs)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def build_pass_through_draft(
    target: PreTrainedModel, *, seed: int, noise: float, drafter: str | None = None, **draft_kwargs
):
    """A draft of `target` (the ``drafter`` family's `from_target(target, **draft_kwargs)`, EAGLE-3 by default) whose
    `fc` passes the last tap through, plus seeded noise of scale `noise`.

    It guesses from the target's residual stream before its last layer: a weak but real draft whose
    acceptance depends on `noise`, so two seeds or noise levels give measurably different drafts.
    """
    from .draft import DEFAULT_DRAFTER, drafter_family

    draft = drafter_family(drafter or DEFAULT_DRAFTER).from_target(target, **draft_kwargs)
    generator = torch.Generator().manual_seed(seed)
    hidden = target.config.hidden_size
    with torch.no_grad():
        for name, param in draft.named_parameters():
            values = torch.randn(param.shape, generator=generator).to(param.device, param.dtype)
            if name == "fc.weight":
                param.copy_(noise * values / param.shape[1] ** 0.5)
                param[:, -hidden:] += torch.eye(hidden, device=param.device, dtype=param.dtype)
            elif name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * values)
            elif name == "lm_head.weight":
                param.add_(0.1 * noise * values)
            else:
                param.copy_(noise * values / param.shape[1] ** 0.5)
    return draft


@contextmanager
def recorded_checkpoint_reads() -> Iterator[list[str]]:
    """The names of the safetensors tensors that transformers' ``from_pretrained`` reads inside the block, one entry
    per read: what a loader really takes from disk (opening a file or a tensor's slice reads no data; indexing the
    slice does)."""
    from transformers import modeling_utils

    reads: list[str] = []
    safe_open = modeling_utils.safe_open

    class RecordingSlice:
        def __init__(self, name, tensor_slice):
            self.name, self.tensor_slice = name, tensor_slice

        def __getitem__(self, index):
            reads.append(self.name)
            return self.tensor_slice[index]

        def __getattr__(self, attribute):
            return getattr(self.tensor_slice, attribute)

    class RecordingFile:
        def __init__(self, *args, **kwargs):
            self.file = safe_open(*args, **kwargs)

        def __enter__(self):
            self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def get_tensor(self, name):
            reads.append(name)
            return self.file.get_tensor(name)

        def get_slice(self, name):
            return RecordingSlice(name, self.file.get_slice(name))

        def __getattr__(self, attribute):
            return getattr(self.file, attribute)

    modeling_utils.safe_open = RecordingFile
    try:
        yield reads
    finally:
        modeling_utils.safe_open = safe_open


def storage_bytes(*items) -> int:
    """Bytes of the distinct storages behind `items` on this process: what a rank holds of them.

    Each item is a tensor, a module (its parameters, their gradients where set, its buffers), an optimizer (the
    tensors of its state) or an iterable of these. A DTensor (an FSDP2-sharded parameter, its gradient and optimizer
    state) counts its local shard only, padding included; a storage that several tensors share (views, tied weights)
    counts once. Benchmarks and tests count a rank's run-long memory with it, which the resident set cannot
    separate from the libraries and the activations of the moment.
    """
    from torch.distributed.tensor import DTensor

    storages: dict[int, int] = {}

    def add(item) -> None:
        if isinstance(item, DTensor):
            add(item.to_local())
        elif isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            if storage.nbytes():  # FSDP2's freed unsharded parameters keep an empty storage
                storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(item, torch.nn.Module):
            for param in item.parameters():
                add(param)
                if param.grad is not None:
                    add(param.grad)
            add(item.buffers())
        elif isinstance(item, torch.optim.Optimizer):
            add(value for state in item.state.values() for value in state.values() if isinstance(value, torch.Tensor))
        else:
            for element in item:
                add(element)

    add(items)
    return sum(storages.values())
