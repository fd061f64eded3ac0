"""The parallel strategies without a trainer: each runs or replaces TRL's behaviour through the callables it is given
(`TRLHooks`), and the factory picks data parallelism where no other parallelism is enabled."""

from types import SimpleNamespace

import pytest
import torch

from hf_spec_cotrain.training.data_parallel import DataParallel, OwnTrainingStep, TRLHooks
from hf_spec_cotrain.training.pipeline_parallel import PipelineParallel
from hf_spec_cotrain.training.strategy import GRPOLoss, build_parallel_strategy


class Calls(list):
    def hook(self, name, value=None):
        def record(*args, **kwargs):
            self.append((name, args, kwargs))
            return value

        return record


def hooks(calls: Calls, **overrides) -> TRLHooks:
    names = TRLHooks.__dataclass_fields__
    values = {name: calls.hook(name) for name in names}
    values.update(draft_loss_divisor=lambda: 4, gradient_accumulation_steps=lambda: 2, global_step=lambda: 7)
    values.update(overrides)
    return TRLHooks(**values)


class Cotrainer:
    settings = SimpleNamespace(bf16=False)

    def __init__(self, calls: Calls):
        self.calls = calls

    def train_recorded(self, **kwargs):
        self.calls.append(("train_recorded", (), kwargs))

    def record_metrics(self, out):
        self.calls.append(("record_metrics", (out,), {}))


def common(calls: Calls, **overrides):
    values = dict(
        accelerator=SimpleNamespace(device=torch.device("cpu"), num_processes=2, process_index=1),
        draft_cotrainer=Cotrainer(calls),
        args=SimpleNamespace(max_grad_norm=1.0),
        distributed=None,
        should_save=True,
    )
    return {**values, **overrides}


def test_data_parallel_runs_trls_step_then_the_drafts_ttt_and_delegates_the_rest():
    calls = Calls()
    strategy = DataParallel(
        hooks(calls, training_step=calls.hook("training_step", torch.tensor(2.0))), **common(calls)
    )
    assert strategy.training_step("model", {"x": 1}, 5) == torch.tensor(2.0)
    assert [name for name, *_ in calls] == ["training_step", "train_recorded"]
    assert calls[1][2] == {"loss_divisor": 4}
    calls.clear()
    strategy.clip_grad_norm("model")
    strategy.save_policy("folder", True)
    strategy.load_optimizer_and_scheduler("checkpoint")
    assert [name for name, *_ in calls] == ["clip_grad_norm", "save_model", "load_optimizer_and_scheduler"]
    assert strategy.writes_draft() and strategy.generation_pipeline() is None


def test_a_strategy_with_its_own_step_keeps_trls_bookkeeping_through_the_hooks():
    calls = Calls()
    seen = {}

    class Optimizer:
        def train(self):
            calls.append(("optimizer.train", (), {}))

    class Step(OwnTrainingStep):
        def run(self, model, inputs, num_items_in_batch):
            seen.update(inputs=inputs, num_items=num_items_in_batch)
            return torch.tensor(3.0)

    strategy = Step(
        hooks(calls, prepare_inputs=lambda inputs: {**inputs, "prepared": True}, optimizer=lambda: Optimizer()),
        **common(calls),
    )
    model = torch.nn.Linear(1, 1).eval()
    assert strategy.training_step(model, {"x": 1}, 9) == torch.tensor(3.0)
    assert model.training and seen == {"inputs": {"x": 1, "prepared": True}, "num_items": 9}
    (counted,) = [args for name, args, _ in calls if name == "count_micro_step"]
    assert counted[0] >= 0.0 and ("optimizer.train", (), {}) in calls


def test_pipeline_parallel_owns_the_norm_the_reference_scores_and_the_draft_writer():
    calls = Calls()
    norms = []
    stage = SimpleNamespace(clip_grad_norm_=lambda max_norm: norms.append(max_norm) or torch.tensor(0.5))
    reference = torch.nn.Linear(1, 1)
    strategy = PipelineParallel(
        hooks(calls),
        stage=stage,
        policy=None,
        aux_layer_ids=[0],
        reference_model=reference,
        processing_class=None,
        pad_token_id=0,
        loss_type="grpo",
        max_completion_length=8,
        **common(calls),
    )
    assert strategy.writes_draft()  # the last of 2 ranks
    assert strategy.log_probs(reference, None, None, 1, None, False) == (None, None, None)
    assert strategy.clip_grad_norm("model") == torch.tensor(0.5) and norms == [1.0]
    strategy.grad_norm("model")
    assert norms == [1.0, float("inf")] and calls[-1][0] == "grad_norm"


def test_the_factory_picks_data_parallelism_without_context_or_pipeline_parallelism():
    calls = Calls()
    dims = SimpleNamespace(pp_enabled=False, cp_enabled=False)
    kwargs = common(calls)
    kwargs.pop("should_save")
    strategy = build_parallel_strategy(
        dims,
        hooks(calls),
        model=None,
        policy=None,
        reference_model=None,
        draft=None,
        aux_layer_ids=[0],
        **kwargs | {"args": SimpleNamespace(should_save=False)},
        processing_class=None,
        pad_token_id=0,
        loss=GRPOLoss(1.0, 0.2, 0.2, "grpo", 0.0, 8),
        shards_policy_itself=False,
    )
    assert type(strategy) is DataParallel and not strategy.writes_draft()


def test_context_parallel_refuses_the_moe_auxiliary_loss_when_scoring():
    from hf_spec_cotrain.training.context_parallel import ContextParallel

    calls = Calls()
    strategy = ContextParallel(
        hooks(calls),
        group=None,
        policy=None,
        unwrapped=lambda model: model,
        ring_attention=None,
        pad_token_id=0,
        shards_policy_itself=False,
        **common(calls),
    )
    with pytest.raises(ValueError, match="text-only rows without the MoE auxiliary loss"):
        strategy.log_probs(None, None, None, 1, None, False, compute_aux_loss=True)
