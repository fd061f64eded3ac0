"""SpecCoTrainGRPOTrainer: co-training inside TRL's GRPO step, on tiny CPU models."""

import copy
import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from tiny_policy import save_tiny_policy_of_type, tiny_grpo_kwargs
from transformers import AttentionInterface, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from hf_spec_cotrain import Eagle3DraftModel, SpecCoTrainConfig, SpecCoTrainGRPOTrainer
from hf_spec_cotrain.draft import DRAFTER_FAMILIES
from hf_spec_cotrain.parallel import ParallelDims
from hf_spec_cotrain.testing import build_char_tokenizer, build_tiny_target
from hf_spec_cotrain.training.rollout_backends import check_greedy_tokens
from hf_spec_cotrain.training.timing import PARTS


PROMPTS = ["abc", "hello", "xyz!", "spec", "draft", "Q: 2+2?", "one two", "GRPO"]


def upper_reward(completions, **kwargs):
    return [sum(c.isupper() for c in text) / max(len(text), 1) for text in completions]


@pytest.fixture(scope="module")
def policy_dir(tiny_policy_dir):
    return str(tiny_policy_dir)


def _dataset():
    return Dataset.from_dict({"prompt": PROMPTS})


def _config(tmp_path, **overrides):
    spec = {"draft_learning_rate": 1e-3, "draft_warmup_steps": 0}
    spec.update({k: overrides.pop(k) for k in list(overrides) if k not in GRPOConfig.__dataclass_fields__})
    return SpecCoTrainConfig(**tiny_grpo_kwargs(tmp_path, **overrides), **spec)


def _trainer(policy_dir, config, **kwargs):
    return SpecCoTrainGRPOTrainer(
        model=policy_dir,
        reward_funcs=upper_reward,
        args=config,
        train_dataset=_dataset(),
        processing_class=build_char_tokenizer(),
        **kwargs,
    )


def _state(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_cotraining_updates_draft_and_logs_metrics(policy_dir, tmp_path):
    trainer = _trainer(policy_dir, _config(tmp_path, draft_vocab_size=60))
    draft_before, policy_before = _state(trainer.draft), _state(trainer.model)
    trainer.train()
    changed = [k for k, v in _state(trainer.draft).items() if not torch.equal(v, draft_before[k])]
    assert "fc.weight" in changed and "midlayer.self_attn.q_proj.weight" in changed
    assert any(not torch.equal(v, policy_before[k]) for k, v in _state(trainer.model).items())
    logs = [entry for entry in trainer.state.log_history if "draft/loss" in entry]
    assert len(logs) == 3
    for entry in logs:
        for key in [
            "draft/loss",
            "draft/loss_step_0",
            "draft/loss_step_2",
            "draft/accuracy_step_1",
            "draft/grad_norm",
            "draft/lr",
            "spec/acceptance_length",
            "spec/accepted_per_position_0",
            "spec/tokens_per_second",
        ]:
            assert key in entry, key
        assert entry["spec/acceptance_length"] >= 1.0
        assert 0.0 <= entry["draft/accuracy_step_0"] <= 1.0
    # the final draft is saved as a vLLM-loadable folder with its card
    folder = Path(tmp_path, "draft")
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    assert "Acceptance during RL" in (folder / "README.md").read_text()


def test_auto_speculation_logs_its_choice_and_where_the_time_goes(policy_dir, tmp_path):
    """`num_speculative_tokens="auto"`: the rollouts choose K per round (K_max, 0 and 1 first, to measure them),
    log it with the predicted and measured speed-ups, and every step logs how its time splits."""
    trainer = _trainer(policy_dir, _config(tmp_path, num_speculative_tokens="auto", max_speculative_tokens=4))
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "draft/loss" in entry]
    assert len(logs) == 3
    for entry in logs:
        assert 0 <= entry["spec/num_speculative_tokens"] <= 4
        assert entry["spec/predicted_speedup"] > 0 and entry["spec/measured_speedup"] > 0
        # A step whose rounds all decoded plainly (K = 0) logs no acceptance (tests/training/test_rollout_metrics.py).
        assert ("spec/accepted_per_position_3" in entry) == ("spec/acceptance_length" in entry)
        parts = [entry[f"time/{part}"] for part in (*PARTS, "policy_training")]
        assert all(seconds >= 0 for seconds in parts) and entry["time/weight_sync"] == 0  # HF-native: no engine
        assert entry["time/generation"] > 0 and entry["time/draft_training"] > 0
        assert sum(parts) == pytest.approx(entry["time/step"])
    model = trainer.rollouts.speculation
    assert {k for bucket in model._buckets.values() for k in bucket.seconds} >= {0, 4}


def test_auto_uses_trls_generation_where_plain_calls_are_faster(policy_dir, tmp_path, monkeypatch):
    """Where whole plain calls measured faster than speculative ones at the call's batch, the turn is TRL's own
    generation (timed and fed back), not the speculative generator; every ninth call still speculates, to
    re-measure."""
    from hf_spec_cotrain.training import rollout_backends

    trainer = _trainer(policy_dir, _config(tmp_path, num_speculative_tokens="auto", max_speculative_tokens=2))
    model = trainer.rollouts.speculation
    batch = trainer.args.per_device_train_batch_size
    model.observe_call(batch, plain=False, seconds=2.0, num_tokens=100)
    model.observe_call(batch, plain=True, seconds=1.0, num_tokens=100)
    monkeypatch.setattr(rollout_backends, "speculative_generate", lambda *args, **kwargs: pytest.fail("speculated"))
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "spec/num_speculative_tokens" in entry]
    assert len(logs) == 3 and all(entry["spec/num_speculative_tokens"] == 0 for entry in logs)
    assert all(0 < entry["spec/measured_speedup"] < 1 for entry in logs)  # speculative calls over plain ones
    assert not any("spec/fallback" in entry for entry in trainer.state.log_history)
    assert all(entry["time/generation"] > 0 for entry in logs)
    assert [model.prefers_plain(batch) for _ in range(12)] == [True] * 5 + [False] + [True] * 6
    # Steps that never drafted log no acceptance (rather than 1.0), a plain share of 1, and NaN in the history
    # (tests/training/test_rollout_metrics.py).
    for entry in logs:
        assert "spec/acceptance_length" not in entry and "spec/accepted_per_position_0" not in entry
        assert entry["spec/plain_round_share"] == 1.0
    assert [step for step, _ in trainer.rollouts.acceptance_history] == [entry["step"] for entry in logs] == [1, 2, 3]
    assert all(math.isnan(value) for _, value in trainer.rollouts.acceptance_history)


@pytest.mark.parametrize(
    ("bf16", "draft_bf16", "draft_dtype"),
    [
        (False, None, torch.float32),
        (True, None, torch.bfloat16),
        (False, True, torch.bfloat16),
        (True, False, torch.float32),
    ],
)
def test_draft_trains_in_the_precision_asked_for(policy_dir, tmp_path, bf16, draft_bf16, draft_dtype):
    """The draft's TTT runs under bf16 autocast as `draft_bf16` says (None: as the policy), on float32 weights; the
    policy's training forward keeps its own precision, and rollouts (no gradient) run in float32."""
    trainer = _trainer(policy_dir, _config(tmp_path, bf16=bf16, draft_bf16=draft_bf16, max_steps=2))
    draft_before = _state(trainer.draft)
    dtypes = {True: set(), False: set()}  # by whether the forward records a graph (training)
    record = lambda module, args, output: dtypes[torch.is_grad_enabled()].add(output.dtype)  # noqa: E731
    handle = trainer.draft.midlayer.mlp.down_proj.register_forward_hook(record)
    policy_dtypes = set()

    def record_policy_training(module, args, output):
        if torch.is_grad_enabled():
            policy_dtypes.add(output.dtype)

    policy_handle = trainer.model.model.layers[0].mlp.down_proj.register_forward_hook(record_policy_training)
    trainer.train()
    handle.remove()
    policy_handle.remove()
    assert dtypes[True] == {draft_dtype}
    assert dtypes[False] == {torch.float32}
    assert policy_dtypes == {torch.bfloat16 if bf16 else torch.float32}
    assert {parameter.dtype for parameter in trainer.draft.parameters()} == {torch.float32}
    assert not torch.equal(_state(trainer.draft)["fc.weight"], draft_before["fc.weight"])
    losses = [entry["draft/loss"] for entry in trainer.state.log_history if "draft/loss" in entry]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))


class _ForwardCounter:
    def __init__(self, model):
        self.count = 0
        model.get_decoder().register_forward_pre_hook(self._hook)

    def _hook(self, *args):
        self.count += 1


@pytest.mark.parametrize("draft_bf16", [None, True])
def test_no_extra_target_forward_and_policy_bitwise_unchanged(policy_dir, tmp_path, draft_bf16):
    """Same rollouts (plain generation), same seed: the policy ends bitwise equal with co-training on and off, also
    when the draft trains under bf16 autocast."""
    # Each trainer seeds the RNG when it is built: build and train one after the other.
    spec = _trainer(policy_dir, _config(tmp_path / "on", speculative_decoding=False, draft_bf16=draft_bf16))
    spec_counter = _ForwardCounter(spec.model)
    spec.train()
    plain = GRPOTrainer(
        model=policy_dir,
        reward_funcs=upper_reward,
        args=GRPOConfig(**tiny_grpo_kwargs(tmp_path / "off")),
        train_dataset=_dataset(),
        processing_class=build_char_tokenizer(),
    )
    plain_counter = _ForwardCounter(plain.model)
    plain.train()
    counters = [spec_counter, plain_counter]
    assert counters[0].count == counters[1].count > 0
    spec_state, plain_state = _state(spec.model), _state(plain.model)
    assert spec_state.keys() == plain_state.keys()
    for name, tensor in spec_state.items():
        assert torch.equal(tensor, plain_state[name]), name


@pytest.mark.parametrize("draft_train_fraction", [1.0, 0.5])
def test_resume_from_checkpoint_gives_identical_policy_and_draft(policy_dir, tmp_path, draft_train_fraction):
    # A constant schedule: a linear decay would depend on max_steps, which differs between the runs.
    constant = dict(lr_scheduler_type="constant", draft_train_fraction=draft_train_fraction)
    straight = _trainer(policy_dir, _config(tmp_path / "straight", max_steps=4, **constant))
    straight.train()
    first = _trainer(
        policy_dir, _config(tmp_path / "resumed", max_steps=2, save_strategy="steps", save_steps=2, **constant)
    )
    first.train()
    checkpoint = tmp_path / "resumed" / "checkpoint-2"
    assert (checkpoint / "draft" / "model.safetensors").exists()
    assert (checkpoint / "draft_training_state.pt").exists()
    resumed = _trainer(
        policy_dir, _config(tmp_path / "resumed", max_steps=4, save_strategy="steps", save_steps=2, **constant)
    )
    resumed.train(resume_from_checkpoint=str(checkpoint))
    for name, tensor in _state(straight.model).items():
        torch.testing.assert_close(_state(resumed.model)[name], tensor, rtol=0, atol=0, msg=name)
    for name, tensor in _state(straight.draft).items():
        torch.testing.assert_close(_state(resumed.draft)[name], tensor, rtol=0, atol=0, msg=name)


def test_draft_train_fraction_trains_on_seeded_rows_of_each_micro_batch(policy_dir, tmp_path, monkeypatch):
    """With ``draft_train_fraction=0.5`` every draft-loss call sees 2 of the micro-batch's 4 rows, exactly the taps
    the full run records for those rows; the choice changes between micro-batches and the policy is unaffected."""
    calls = {"full": [], "half": []}
    run = {"name": None}
    real_training_loss = Eagle3DraftModel.training_loss

    def recording_training_loss(draft, batch, options, **kwargs):
        calls[run["name"]].append(
            {k: getattr(batch, k).clone() for k in ("aux_hidden_states", "input_embeds", "loss_mask")}
        )
        return real_training_loss(draft, batch, options, **kwargs)

    monkeypatch.setattr(Eagle3DraftModel, "training_loss", recording_training_loss)
    chosen_rows, trainers = [], {}
    for name, fraction in (("full", 1.0), ("half", 0.5)):
        run["name"] = name
        config = _config(tmp_path / name, speculative_decoding=False, draft_train_fraction=fraction)
        trainer = trainers[name] = _trainer(policy_dir, config)
        if fraction < 1:
            real_rows = trainer.draft_cotrainer.rows_to_train

            def recording_rows(batch, *, step, real_rows=real_rows):
                rows = real_rows(batch, step=step)
                chosen_rows.append(rows)
                return rows

            trainer.draft_cotrainer.rows_to_train = recording_rows
        trainer.train()
    assert len(calls["half"]) == len(calls["full"]) == len(chosen_rows) == 3
    assert len({tuple(rows.tolist()) for rows in chosen_rows}) > 1
    for full, half, rows in zip(calls["full"], calls["half"], chosen_rows):
        assert len(rows) == 2
        for key, tensor in half.items():
            assert torch.equal(tensor, full[key][rows]), key
    for name, tensor in _state(trainers["full"].model).items():
        assert torch.equal(tensor, _state(trainers["half"].model)[name]), name


def test_nonfinite_draft_loss_skips_the_draft_step_only(policy_dir, tmp_path, monkeypatch):
    trainer = _trainer(policy_dir, _config(tmp_path, max_steps=2))
    original = trainer.draft_cotrainer.teacher_logits

    def poisoned(final_hidden):
        logits = original(final_hidden)
        return logits.fill_(float("nan")) if trainer.state.global_step == 0 else logits

    monkeypatch.setattr(trainer.draft_cotrainer, "teacher_logits", poisoned)
    draft_before = _state(trainer.draft)
    policy_before = _state(trainer.model)
    trainer.train()
    assert trainer.draft_skipped_steps == 1
    logs = [e for e in trainer.state.log_history if "draft/skipped_steps" in e]
    assert [e["draft/skipped_steps"] for e in logs] == [1.0, 1.0]
    assert any(not torch.equal(v, draft_before[k]) for k, v in _state(trainer.draft).items())  # step 2 trained
    assert all(torch.isfinite(v).all() for v in _state(trainer.draft).values() if v.is_floating_point())
    assert any(not torch.equal(v, policy_before[k]) for k, v in _state(trainer.model).items())


def test_failed_speculative_rollout_falls_back_to_plain_generation(policy_dir, tmp_path, monkeypatch, caplog):
    """Each failed turn falls back (and is counted); a streak of them is an error in the log, once per streak."""
    trainer = _trainer(policy_dir, _config(tmp_path, max_steps=4, num_speculative_tokens=2))

    def broken(*args, **kwargs):
        raise RuntimeError("draft exploded")

    monkeypatch.setattr("hf_spec_cotrain.training.rollout_backends.speculative_generate", broken)
    with caplog.at_level("WARNING", logger="hf_spec_cotrain.training.rollouts"):
        trainer.train()
    assert trainer.state.global_step == 4
    assert [entry.get("spec/fallback") for entry in trainer.state.log_history[:4]] == [1.0] * 4
    errors = [record for record in caplog.records if record.levelname == "ERROR"]
    assert len(errors) == 1 and "WITHOUT speculation" in errors[0].getMessage()


def test_a_draft_of_another_family_than_drafter_is_refused_at_build(policy_dir, tmp_path, monkeypatch):
    class OtherDraft(Eagle3DraftModel):
        drafter_name = "other"
        checkpoint_architecture = "OtherDraftModel"

    monkeypatch.setitem(DRAFTER_FAMILIES, "other", OtherDraft)
    draft = Eagle3DraftModel.from_target(build_tiny_target("llama", num_layers=8))
    with pytest.raises(ValueError, match=r"`draft_model` is a 'eagle3' draft .*, but `drafter`='other'"):
        _trainer(policy_dir, _config(tmp_path, drafter="other"), draft_model=draft)
    OtherDraft(draft.config).save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match=r"is a 'other' draft, but `drafter`='eagle3'"):
        _trainer(policy_dir, _config(tmp_path, draft_model_name_or_path=str(tmp_path / "other")))


def test_a_draft_folder_without_a_drafts_config_is_refused_at_build(policy_dir, tmp_path, monkeypatch):
    """`draft_model_name_or_path` loads through `DraftModel.from_pretrained`, whose config check refuses a folder
    without config.json before any draft is built (transformers built a default 32-layer draft: minutes, ~17 GB)."""
    folder = tmp_path / "weights-only"
    Eagle3DraftModel.from_target(build_tiny_target("llama", num_layers=8)).save_pretrained(folder)
    (folder / "config.json").unlink()
    monkeypatch.setattr(Eagle3DraftModel, "__init__", lambda self, config: pytest.fail("a draft was built"))
    with pytest.raises(
        FileNotFoundError,
        match=rf"checkpoint {re.escape(str(folder))} has no config.json: the folder .* holds model.safetensors\.",
    ):
        _trainer(policy_dir, _config(tmp_path, draft_model_name_or_path=str(folder)))


def test_a_policy_the_hf_native_generator_cannot_verify_is_refused_at_start(tmp_path):
    policy = build_tiny_target("qwen3", num_layers=8)
    # declared as Qwen3.5's, but a family whose linear-attention states the generator does not know
    policy.config.layer_types = ["linear_attention", "full_attention"] * 4
    with pytest.raises(ValueError, match=r"cannot serve this qwen3 policy: .*linear_attention.*vLLM.*use_vllm=True"):
        _trainer(policy, _config(tmp_path))
    _trainer(policy, _config(tmp_path, speculative_decoding=False))  # co-training alone still works


def test_a_policy_the_hf_native_generator_fails_on_is_refused_at_build_not_at_every_step(tmp_path, monkeypatch):
    """What the static check cannot see (an attention variant, a cache layout) shows in a trial generation at build."""
    calls = []

    def broken(*args, **kwargs):
        calls.append(kwargs)
        raise RuntimeError("this attention has no decoding kernel")

    monkeypatch.setattr("hf_spec_cotrain.training.rollout_backends.speculative_generate", broken)
    policy = build_tiny_target("qwen3", num_layers=8)
    with pytest.raises(
        ValueError,
        match=r"cannot serve this qwen3 policy: a trial speculative generation failed \(RuntimeError: this attention "
        r"has no decoding kernel\).*use_vllm=True.*speculative_decoding=False",
    ):
        _trainer(policy, _config(tmp_path, num_speculative_tokens=2))
    assert calls[0]["num_speculative_tokens"] == 2 and calls[0]["max_new_tokens"] > 2  # rounds after the first
    _trainer(policy, _config(tmp_path, speculative_decoding=False))  # co-training alone still works


def test_the_trial_generation_takes_the_policys_argmax_up_to_rounding():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 3.0, -1.0]])
    check_greedy_tokens(torch.tensor([1, 1]), logits)  # a tie may break either way
    check_greedy_tokens(torch.tensor([1, 0]), logits)
    with pytest.raises(ValueError, match=r"greedy token 1 \(2\) is not the argmax .*short by 1 "):
        check_greedy_tokens(torch.tensor([2, 0]), logits)
    check_greedy_tokens(torch.tensor([1]), torch.tensor([[2.0, 1.999]], dtype=torch.bfloat16))  # bf16's rounding


def _causal_attention_ignoring_the_mask(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Causal attention that ignores the mask it is given, as attention outside transformers' attention interface does
    (CodeGen's, Falcon's, MPT's in transformers 5.19): right for a forward from scratch, wrong for the generator's
    verification rows over a cache with holes."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    out = F.scaled_dot_product_attention(query, key, value, is_causal=query.shape[2] > 1, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("test_causal_ignoring_the_mask", _causal_attention_ignoring_the_mask)


def test_a_policy_whose_attention_ignores_the_generators_masks_is_refused_at_build(tmp_path):
    """The generator's speculative tokens then run fine but are not the policy's own greedy ones, which the trial
    generation sees (the sweep shows it on CodeGen, Falcon, GPT-J, GPT-Neo, MPT and TrOCR)."""
    policy = build_tiny_target("qwen3", num_layers=8)
    policy.config._attn_implementation = "test_causal_ignoring_the_mask"
    with torch.no_grad():
        input_ids = torch.tensor([[5, 6, 7, 8, 9]])
        torch.testing.assert_close(policy(input_ids).logits, _reference_logits(policy, input_ids))
    with pytest.raises(ValueError, match=r"cannot serve this qwen3 policy: .*is not the argmax of the policy's own"):
        _trainer(policy, _config(tmp_path))
    _trainer(policy, _config(tmp_path, speculative_decoding=False))


def _reference_logits(policy, input_ids):
    """The policy's logits with its attention back to eager: the mask-ignoring one is right on a forward from scratch."""
    policy.config._attn_implementation = "eager"
    try:
        return policy(input_ids).logits
    finally:
        policy.config._attn_implementation = "test_causal_ignoring_the_mask"


def test_a_load_balancing_loss_trl_cannot_compute_is_refused_at_build(tmp_path):
    """TRL reads the config's `num_experts`, which Granite-MoE calls `num_local_experts`."""
    policy = save_tiny_policy_of_type(
        tmp_path / "granitemoe", "granitemoe", num_local_experts=4, num_experts_per_tok=2
    )
    config = {"gradient_checkpointing": False, "speculative_decoding": False}
    with pytest.raises(ValueError, match=r"granitemoe policy .*`num_experts`.*router_aux_loss_coef=0.0"):
        _trainer(str(policy), _config(tmp_path, **config))
    _trainer(str(policy), _config(tmp_path, router_aux_loss_coef=0.0, **config))


def test_gradient_checkpointing_on_a_policy_without_it_is_refused_at_build(tmp_path):
    """transformers raises it only at `train()`, after the draft and the rollout engine are built (CTRL, XLNet)."""
    policy = build_tiny_target("qwen3", num_layers=8)
    policy.supports_gradient_checkpointing = False
    with pytest.raises(
        ValueError, match=r"`gradient_checkpointing`=True .* qwen3 policy .*gradient_checkpointing=False"
    ):
        _trainer(policy, _config(tmp_path, gradient_checkpointing=True))
    _trainer(policy, _config(tmp_path, gradient_checkpointing=False))


@pytest.mark.parametrize("sizes", [{"context_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_a_policy_the_parallel_step_cannot_compute_is_refused_at_start(sizes, tmp_path, monkeypatch):
    # The run's dims as on 2 processes (the refusal comes before any process group is needed).
    monkeypatch.setattr(ParallelDims, "from_config", classmethod(lambda cls, config, **facts: cls(**sizes)))
    policy = build_tiny_target("gpt_oss" if "context_parallel_size" in sizes else "qwen3_moe", num_layers=8)
    policy.config.output_router_logits = True
    with pytest.raises(ValueError, match=rf"`{next(iter(sizes))}`=2 cannot train this .* policy: .*Instead, "):
        _trainer(policy, _config(tmp_path, speculative_decoding=False, **sizes))


@pytest.mark.parametrize("family", ["mistral", "qwen3_moe", "gpt_oss", "qwen3_5", "qwen3_next"])
def test_hf_native_speculative_rollouts_serve_other_families(family, tmp_path):
    trainer = _trainer(build_tiny_target(family, num_layers=8), _config(tmp_path, max_steps=1))
    trainer.train()
    (log,) = [entry for entry in trainer.state.log_history if "spec/acceptance_length" in entry]
    assert log["spec/acceptance_length"] >= 1.0 and "spec/fallback" not in log and "draft/loss" in log


def test_push_draft_to_hub_hands_the_saved_folder_to_huggingface_hub(policy_dir, tmp_path, monkeypatch):
    calls = {}

    class FakeApi:
        def __init__(self, token=None):
            calls["token"] = token

        def create_repo(self, repo_id, private=None, exist_ok=False):
            calls["repo"] = repo_id
            return type("Repo", (), {"repo_id": repo_id})()

        def upload_folder(self, repo_id, folder_path, commit_message, revision=None, create_pr=False):
            calls["files"] = sorted(p.name for p in Path(folder_path).iterdir())
            calls["card"] = (Path(folder_path) / "README.md").read_text()
            return "commit"

    monkeypatch.setattr("hf_spec_cotrain.draft.upload.HfApi", FakeApi)
    trainer = _trainer(
        policy_dir,
        _config(
            tmp_path, max_steps=2, push_draft_to_hub=True, draft_hub_model_id="me/tiny-eagle3", draft_vocab_size=60
        ),
    )
    trainer.train()
    assert calls["repo"] == "me/tiny-eagle3"
    assert calls["files"] == ["README.md", "config.json", "model.safetensors"]
    card = calls["card"]
    assert "me/tiny-eagle3" in card and "vllm serve" in card and "sglang" in card
    assert "[2, 4, 5]" in card  # tap ids
    assert "60 of" in card  # draft vocabulary
    # The acceptance trajectory: one row per training step (rollouts feeding optimizer steps 1 and 2, as the logs
    # number them) in the table under "Acceptance during RL" (the card's other tables also hold rows such as
    # "| Draft layers | 1 |").
    acceptance = card.split("## Acceptance during RL", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d+) \| (\d+\.\d{3}) \|$", acceptance, flags=re.MULTILINE)
    assert [int(step) for step, _ in rows] == [1, 2] and all(float(value) >= 1 for _, value in rows)
    assert rows == [(str(step), f"{value:.3f}") for step, value in trainer.rollouts.acceptance_history]
    assert "Training-time-test steps | 3" in card


def test_lora_policy_taps_adapted_model_and_rollouts_get_merged_weights(policy_dir, tmp_path):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    trainer = _trainer(policy_dir, _config(tmp_path, max_steps=2, learning_rate=5e-2), peft_config=lora)
    base_before = {k: v for k, v in _state(trainer.model).items() if "lora_" not in k}
    draft_before = _state(trainer.draft)
    trainer.train()
    after = _state(trainer.model)
    assert all(torch.equal(after[k], v) for k, v in base_before.items())  # only the adapters train
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in after.items())
    assert any(not torch.equal(v, draft_before[k]) for k, v in _state(trainer.draft).items())

    # Taps come from the adapted forward: they equal the PEFT model's own hidden states.
    from hf_spec_cotrain.taps import TapRecorder

    ids = torch.randint(4, 60, (2, 9))
    with TapRecorder(trainer.model, trainer.aux_layer_ids) as recorder, recorder.capture(), torch.no_grad():
        hidden = trainer.model(input_ids=ids, output_hidden_states=True).hidden_states
    taps = recorder.pop().aux_hidden_states
    torch.testing.assert_close(taps, torch.cat([hidden[a] for a in trainer.aux_layer_ids], -1), rtol=0, atol=0)

    # The rollout engine gets the merged weights, under the policy's own HF names.
    with trainer.rollouts.policy_weights() as weights:
        merged = {name: tensor.clone() for name, tensor in weights}
    reference = copy.deepcopy(trainer.model).merge_and_unload().state_dict()
    assert merged.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(merged[name], tensor, msg=name)
    assert any(
        not torch.equal(merged[k], base_before[f"base_model.model.{k}".replace(".weight", ".base_layer.weight")])
        for k in merged
        if "q_proj" in k
    )


class _PoisonDraftAtStepBegin(TrainerCallback):
    """Puts a NaN into the draft's ``fc.weight`` when step ``step`` begins (between two steps, as a bad write would),
    after keeping a copy of the last good state the trainer holds."""

    def __init__(self, trainer, step):
        self.trainer, self.step, self.last_good = trainer, step, None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.last_good = copy.deepcopy(self.trainer.draft_cotrainer._last_good)
            with torch.no_grad():
                self.trainer.draft.fc.weight[0, 0] = float("nan")


def test_a_draft_gone_nonfinite_is_restored_and_speculation_goes_on(policy_dir, tmp_path, caplog):
    """The NaN enters after step 2's update and before step 3's rollouts: the restore brings back exactly that update's
    draft and optimizer state, so the run goes on as if nothing happened (policy and draft bitwise equal)."""
    clean = _trainer(policy_dir, _config(tmp_path / "clean", max_steps=4, draft_vocab_size=60))
    clean.train()
    trainer = _trainer(policy_dir, _config(tmp_path / "poisoned", max_steps=4, draft_vocab_size=60))
    poison = _PoisonDraftAtStepBegin(trainer, step=2)
    trainer.add_callback(poison)
    trainer.callback_handler.callbacks.sort(key=lambda callback: callback is not poison)  # before the healing
    restored = []
    original_restore = trainer.draft_cotrainer._restore

    def recording_restore(step, problem):
        original_restore(step, problem)
        restored.append((_state(trainer.draft), copy.deepcopy(trainer.draft_cotrainer.optimizer.state_dict())))

    trainer.draft_cotrainer._restore = recording_restore
    with caplog.at_level("WARNING", logger="hf_spec_cotrain.training.draft_cotraining"):
        trainer.train()
    assert len(restored) == 1
    draft_state, optimizer_state = restored[0]
    for name, tensor in poison.last_good["draft"].items():
        assert torch.equal(draft_state[name], tensor), name
    for index, tensors in poison.last_good["optimizer"]["state"].items():
        for key, tensor in tensors.items():
            assert torch.equal(optimizer_state["state"][index][key], tensor), (index, key)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "`fc.weight` holds 1 non-finite values" in warnings[0]
    after = [entry for entry in trainer.state.log_history if "draft/restored" in entry][2:]
    assert [entry["draft/restored"] for entry in after] == [1.0, 1.0]
    assert all(entry["spec/acceptance_length"] > 1.0 and "spec/fallback" not in entry for entry in after)
    for name, tensor in _state(clean.model).items():
        assert torch.equal(_state(trainer.model)[name], tensor), name
    for name, tensor in _state(clean.draft).items():
        assert torch.equal(_state(trainer.draft)[name], tensor), name
    saved = Eagle3DraftModel.from_pretrained(tmp_path / "poisoned" / "draft")  # validated: finite
    assert torch.equal(saved.fc.weight, clean.draft.fc.weight)
    card = (tmp_path / "poisoned" / "draft" / "README.md").read_text()
    assert "| Restores of the last good draft (non-finite or unusable weights) | 1 |" in card
    assert "| Draft updates skipped (non-finite loss or gradient) | 0 |" in card


def test_a_draft_that_keeps_failing_stops_speculation_once(policy_dir, tmp_path, monkeypatch, caplog):
    trainer = _trainer(policy_dir, _config(tmp_path, max_steps=5))
    initial = _state(trainer.draft)
    optimizer = trainer.draft_cotrainer.optimizer
    original_step = optimizer.step

    def step_into_nan(*args, **kwargs):
        original_step(*args, **kwargs)
        with torch.no_grad():
            trainer.draft.fc.weight.fill_(float("nan"))

    monkeypatch.setattr(optimizer, "step", step_into_nan)
    with caplog.at_level("WARNING", logger="hf_spec_cotrain.training.draft_cotraining"):
        trainer.train()
    assert trainer.state.global_step == 5
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "rollouts are plain for the rest of this run" in errors[0]
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1
    logs = [entry for entry in trainer.state.log_history if "draft/restored" in entry]
    assert [entry["draft/restored"] for entry in logs] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert [entry["draft/speculation_stopped"] for entry in logs] == [0.0, 0.0, 1.0, 1.0, 1.0]
    assert all("spec/acceptance_length" not in entry for entry in logs[3:])  # plain rollouts
    for name, tensor in initial.items():  # no update ever succeeded: the draft it started from
        assert torch.equal(_state(trainer.draft)[name], tensor), name
    card = (tmp_path / "draft" / "README.md").read_text()
    assert "| Restores of the last good draft (non-finite or unusable weights) | 5 |" in card


def test_a_draft_with_an_out_of_range_d2t_is_restored_before_rollouts(policy_dir, tmp_path):
    """Such a draft used to make rollouts fall back, then crash the run with an IndexError."""
    trainer = _trainer(policy_dir, _config(tmp_path, draft_vocab_size=60))
    good = _state(trainer.draft)
    with torch.no_grad():
        trainer.draft.d2t[-1] = 10**6
    assert trainer.draft_cotrainer.heal(step=0) is False
    for name, tensor in good.items():
        assert torch.equal(_state(trainer.draft)[name], tensor), name
    assert trainer.draft_cotrainer.restored_steps == 1 and trainer.draft_cotrainer.heal(step=0) is True
