"""`SpecCoTrainConfig`'s checks, by topic: the draft, training-time test (TTT), speculative rollouts, context
parallelism (CP) and pipeline parallelism (PP).

Every check here runs when the config is built. Those that need the world size or the run (DeepSpeed, FSDP, PEFT,
tools) are `ParallelDims.from_config`'s, in tests/parallel/test_parallel_dims.py; the trainer's own refusals under CP are in
tests/parallel/test_packed_rows.py.
"""

import copy
import dataclasses
import io
import math
import pickle
import warnings

import pytest
import torch
from tiny_policy import tiny_grpo_kwargs
from trl import GRPOConfig

from hf_spec_cotrain import SpecCoTrainConfig, SpecCoTrainGRPOTrainer
from hf_spec_cotrain.config import FLOAT_OPTION_RANGES
from hf_spec_cotrain.validation import is_float_field


def _config(tmp_path, **overrides) -> SpecCoTrainConfig:
    return SpecCoTrainConfig(
        **tiny_grpo_kwargs(tmp_path) | {"draft_learning_rate": 1e-3, "draft_warmup_steps": 0} | overrides
    )


def _rejected(tmp_path, options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _config(tmp_path, **options)


# --- The draft ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "match"),
    [
        pytest.param({"draft_model_name_or_path": "x", "draft_vocab_size": 10}, "draft_model_name_or_path", id="path"),
        *[
            pytest.param({"draft_train_fraction": fraction}, "draft_train_fraction", id=f"fraction={fraction!r}")
            for fraction in (0.0, 1.5, "half")
        ],
        pytest.param({"draft_learning_rate": 0.0}, "draft_learning_rate", id="lr"),
        *[pytest.param({"draft_bf16": value}, f"draft_bf16`={value!r}", id=f"bf16={value!r}") for value in ("yes", 1)],
    ],
)
def test_config_rejects_bad_draft_options(tmp_path, options, match):
    _rejected(tmp_path, options, match)


def test_config_rejects_a_drafter_that_is_no_registered_family(tmp_path):
    _rejected(tmp_path, {"drafter": "medusa"}, r"`drafter`='medusa' is not a drafter family: use one of 'eagle3'")


def test_trainer_rejects_a_config_that_is_not_a_spec_cotrain_config(tmp_path):
    with pytest.raises(ValueError, match="SpecCoTrainConfig"):
        SpecCoTrainGRPOTrainer(
            model="x",
            reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
            args=GRPOConfig(**tiny_grpo_kwargs(tmp_path)),
        )


# --- Float options ------------------------------------------------------------------------------------------------

FLOAT_FIELDS = [field.name for field in dataclasses.fields(SpecCoTrainConfig) if is_float_field(field)]
TRL_FIELDS = {field.name for field in dataclasses.fields(GRPOConfig)}


def test_every_float_option_the_package_adds_has_a_range():
    """A float option added later without its range in `FLOAT_OPTION_RANGES` fails here (it would be checked for
    finiteness only)."""
    own = [name for name in FLOAT_FIELDS if name not in TRL_FIELDS]
    assert "draft_learning_rate" in own and "draft_max_grad_norm" in own
    assert [name for name in own if name not in FLOAT_OPTION_RANGES] == []
    assert set(FLOAT_OPTION_RANGES) <= set(FLOAT_FIELDS)


@pytest.mark.parametrize("name", FLOAT_FIELDS)
def test_every_float_option_refuses_nan_and_infinities_naming_itself(tmp_path, name):
    """`draft_max_grad_norm=nan` turned the draft's clipping off (`nan > 0` is false), `ttt_step_weight_decay=inf`
    skipped every draft update, `draft_learning_rate=inf` restored the draft every step: every float option, the
    package's and TRL's, is refused when not finite, naming the field, the value and the range."""
    for value in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError, match=rf"`{name}`={value!r} is not allowed: {name} must be .*, got {value!r}"):
            _config(tmp_path, **{name: value})


@pytest.mark.parametrize(
    ("name", "value", "allowed"),
    [
        ("draft_learning_rate", 0.0, "a finite number > 0"),
        ("draft_learning_rate", -1e-4, "a finite number > 0"),
        ("draft_weight_decay", -0.1, "a finite number >= 0"),
        ("draft_max_grad_norm", -1.0, r"a finite number >= 0 \(0 turns the draft's gradient clipping off\)"),
        ("ttt_step_weight_decay", 0.0, r"a finite number > 0 \(TTT step d's loss"),
        ("dflash_loss_decay_gamma", -4.0, "a finite number > 0"),
        ("draft_train_fraction", 0.0, r"a number in \(0, 1\]"),
        ("draft_train_fraction", 1.5, r"a number in \(0, 1\]"),
        ("draft_train_fraction", "half", r"a number in \(0, 1\]"),
        ("temperature", 0.0, "a finite number > 0"),
        ("top_p", 0.0, r"a number in \(0, 1\]"),
        ("min_p", 1.5, r"a number in \[0, 1\]"),
        ("max_grad_norm", -1.0, "a finite number >= 0"),
    ],
)
def test_float_options_outside_their_range_are_refused_with_it(tmp_path, name, value, allowed):
    _rejected(tmp_path, {name: value}, rf"`{name}`={value!r} is not allowed: {name} must be {allowed}")


def test_float_options_take_the_ends_of_their_ranges(tmp_path):
    ends = {"draft_max_grad_norm": 0.0, "draft_weight_decay": 0, "draft_train_fraction": 1.0, "top_p": 1.0}
    config = _config(tmp_path, **ends, min_p=0.0, max_grad_norm=0.0, draft_learning_rate=1)
    assert (config.draft_max_grad_norm, config.draft_learning_rate, config.min_p) == (0.0, 1, 0.0)


# --- Training-time test ------------------------------------------------------------------------------------------


def test_config_rejects_bad_ttt_options(tmp_path):
    _rejected(tmp_path, {"ttt_steps": 0}, "ttt_steps`=0")


# --- Speculative rollouts ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"num_speculative_tokens": 0}, "num_speculative_tokens`=0"),
        ({"draft_sampling": "eager"}, "draft_sampling`='eager'"),
        ({"vllm_mode": "bogus"}, r"vllm_mode`='bogus'.*take it for 'colocate'.*'colocate'.*'server'"),
        # HF-native speculative rollouts sample with temperature, top_p and top_k only.
        ({"repetition_penalty": 1.2}, "repetition_penalty=1.2"),
    ],
)
def test_config_rejects_bad_speculative_rollout_options(tmp_path, options, match):
    _rejected(tmp_path, options, match)


def test_auto_speculation_proposes_at_most_the_trained_positions_by_default(tmp_path):
    assert _config(tmp_path, num_speculative_tokens="auto").max_speculative_tokens == 3
    assert _config(tmp_path, num_speculative_tokens="auto", ttt_steps=6).max_speculative_tokens == 6
    assert _config(tmp_path, num_speculative_tokens="auto", max_speculative_tokens=2).max_speculative_tokens == 2


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"num_speculative_tokens": 4}, "`num_speculative_tokens`=4"),
        ({"num_speculative_tokens": "auto", "max_speculative_tokens": 5}, "`max_speculative_tokens`=5"),
        ({"num_speculative_tokens": 3}, None),
        ({"num_speculative_tokens": "auto", "max_speculative_tokens": 3}, None),
        ({"num_speculative_tokens": "auto"}, None),  # K_max defaults to ttt_steps
        ({"num_speculative_tokens": "auto", "ttt_steps": 5}, None),
        ({"num_speculative_tokens": 5, "ttt_steps": 5}, None),
    ],
)
def test_config_warns_once_when_the_draft_proposes_past_its_ttt_steps(tmp_path, options, named):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _config(tmp_path, **options)
    about_ttt = [str(w.message) for w in caught if "ttt_steps" in str(w.message)]
    if named is None:
        assert about_ttt == []
    else:
        assert len(about_ttt) == 1 and named in about_ttt[0] and "only `ttt_steps`=3" in about_ttt[0]


# --- Context parallelism -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_config_checks_context_parallel_size(tmp_path, bad):
    with pytest.raises(ValueError, match="context_parallel_size"):
        SpecCoTrainConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", context_parallel_size=bad)


def test_config_rejects_options_context_parallelism_cannot_honour(tmp_path):
    with pytest.raises(ValueError, match=r"cannot be combined with \['use_liger_kernel'\]"):
        SpecCoTrainConfig(
            output_dir=str(tmp_path), use_cpu=True, report_to="none", context_parallel_size=2, use_liger_kernel=True
        )
    _rejected(
        tmp_path,
        {"draft_train_fraction": 0.5, "context_parallel_size": 2},
        "draft_train_fraction`=0.5 cannot be combined",
    )


def test_context_parallel_size_defaults_to_one(tmp_path):
    assert SpecCoTrainConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none").context_parallel_size == 1


# --- Pipeline parallelism ----------------------------------------------------------------------------------------

PP_BASE = {"output_dir": "unused", "use_cpu": True, "report_to": "none", "num_generations": 4}


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"pipeline_parallel_size": 0}, "`pipeline_parallel_size`=0"),
        ({"pipeline_parallel_size": 1.5}, "`pipeline_parallel_size`=1.5"),
        ({"pipeline_schedule": "interleaved"}, "`pipeline_schedule`='interleaved'"),
        ({"pipeline_tap_transport": "nccl"}, "`pipeline_tap_transport`='nccl'"),
        ({"pipeline_num_microbatches": 2}, "`pipeline_num_microbatches`=2"),
        ({"pipeline_parallel_size": 8, "per_device_train_batch_size": 8}, "`pipeline_num_microbatches`=4 is"),
        (
            {"per_device_train_batch_size": 6, "num_generations": 3, "pipeline_num_microbatches": 8},
            "`pipeline_num_microbatches`=8 does not divide the step's 12 rows",
        ),
        # A colocated engine would hold the whole policy on one rank; TRL's own vLLM pushes it from one process.
        ({"use_vllm": True}, r"`vllm_mode`='colocate': a colocated engine holds the whole policy.*vllm_mode='server'"),
        (
            {"use_vllm": True, "vllm_mode": "server", "speculative_decoding": False},
            r"`use_vllm=True` and `speculative_decoding=False`: .*TRL's own vLLM.*no stage holds it",
        ),
        ({"loss_type": "cispo"}, "\"loss_type='cispo'\""),
        ({"context_parallel_size": 2}, "context_parallel_size"),
        ({"steps_per_generation": 2}, "gradient_accumulation_steps not a multiple"),
        ({"eval_strategy": "steps", "eval_steps": 5}, "eval_strategy='steps'"),
        # Plain rollouts too are the package's own decoding through the stages.
        ({"speculative_decoding": False, "repetition_penalty": 1.1}, "'repetition_penalty=1.1'"),
        ({"speculative_decoding": False, "min_p": 0.1}, "'min_p=0.1'"),
        ({"use_transformers_continuous_batching": True}, "'use_transformers_continuous_batching'"),
        # The stages compute the logits in the policy's dtype; only the last one holds the head.
        ({"cast_lm_head_to_fp32": True}, "'cast_lm_head_to_fp32'"),
    ],
)
def test_config_rejects_pipeline_options_it_cannot_honour(options, named):
    kwargs = {**PP_BASE, "pipeline_parallel_size": 2, "per_device_train_batch_size": 4, **options}
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace("+", r"\+")):
        SpecCoTrainConfig(**kwargs)


def test_config_accepts_pipeline_options():
    config = SpecCoTrainConfig(
        **PP_BASE,
        per_device_train_batch_size=4,
        pipeline_parallel_size=4,
        pipeline_schedule="GPipe",
        pipeline_num_microbatches=8,
        pipeline_tap_transport="relay",
        beta=0.04,
        use_vllm=True,
        vllm_mode="server",  # every stage pushes its own weights into the package's server
        draft_bf16=True,  # the last stage runs the draft's micro-step under bf16 autocast, as one process does
    )
    assert (config.pipeline_parallel_size, config.pipeline_num_microbatches) == (4, 8)
    # Without pipeline parallelism, options the pipelined step cannot honour are not refused.
    assert SpecCoTrainConfig(**PP_BASE, per_device_train_batch_size=4, loss_type="cispo").pipeline_parallel_size == 1


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"pipeline_schedule": "interleaved"}, r"`pipeline_schedule`='interleaved' is not allowed: choose '1F1B'"),
        ({"pipeline_schedule": None}, r"`pipeline_schedule`=None is not allowed"),
        ({"pipeline_tap_transport": "nccl"}, r"`pipeline_tap_transport`='nccl' is not allowed: choose one of"),
        ({"pipeline_num_microbatches": 2}, r"`pipeline_num_microbatches`=2 is not allowed: .* \(at least 4"),
        ({"pipeline_num_microbatches": "4"}, r"`pipeline_num_microbatches`='4' is not allowed"),
    ],
)
def test_pipeline_option_values_are_checked_without_pipeline_parallelism_too(options, named):
    """A bogus pipeline option was accepted while pipeline parallelism was off, and only refused by the run that
    turned it on. Its value is checked either way (what PP cannot honour is still checked under PP only)."""
    with pytest.raises(ValueError, match=named):
        SpecCoTrainConfig(**PP_BASE, per_device_train_batch_size=4, **options)


# --- Secrets -----------------------------------------------------------------------------------------------------


def test_secrets_stay_out_of_repr_saved_arguments_and_pickles_but_copies_keep_them(tmp_path):
    """The rollout server's key and the Hub token: masked in `repr`/`str`, in `to_dict` (JSON arguments, loggers'
    hyperparameters) and in a pickle (transformers pickles the arguments into every checkpoint); a copy keeps them."""
    key, token = "server-key-5be1", "hf_token_9a2c"
    config = _config(tmp_path, vllm_server_api_key=key, hub_token=token)
    for text in (repr(config), str(config), config.to_json_string(), str(config.to_sanitized_dict())):
        assert key not in text and token not in text
        assert "<VLLM_SERVER_API_KEY>" in text and "<HUB_TOKEN>" in text
    assert "draft_learning_rate=0.001" in repr(config)  # the rest is shown
    pickled = pickle.dumps(config)
    assert key.encode() not in pickled and token.encode() not in pickled
    loaded = pickle.loads(pickled)
    assert (loaded.vllm_server_api_key, loaded.hub_token) == ("<VLLM_SERVER_API_KEY>", "<HUB_TOKEN>")
    assert loaded.draft_learning_rate == config.draft_learning_rate
    for copied in (copy.copy(config), copy.deepcopy(config)):
        assert copied is not config and copied.vllm_server_api_key == key and copied.hub_token == token


def test_secret_fields_are_one_list_to_extend(tmp_path, monkeypatch):
    monkeypatch.setattr("hf_spec_cotrain.config._SECRET_FIELDS", ("hub_token", "hub_model_id"))
    config = _config(tmp_path, hub_model_id="me/private-run")
    for text in (repr(config), config.to_json_string(), _pickled(config)):
        assert "me/private-run" not in text and "<HUB_MODEL_ID>" in text


def _pickled(config) -> str:
    buffer = io.BytesIO()
    torch.save(config, buffer)
    return buffer.getvalue().decode("latin-1")
