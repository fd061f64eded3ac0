"""Pipeline-parallel GRPO with the draft co-trained on the last stage, on gloo with 2 and 4 stages.

The pool has 4 ranks: a 2-stage case runs two identical pipelines side by side (every rank must create the
same process groups in the same order, or the hashed names of later groups diverge), and the first is checked.

Every pipelined step is compared with the single-process step on the whole model (`pipeline_cases`): the GRPO
loss, every policy gradient, the draft's loss and every draft gradient, over GPipe and 1F1B, both tap transports
and the model families (dense, MoE, gpt-oss's sliding layers and sinks). `TapChannel` is tested on its own too: variable shapes, the wrong micro-batch,
and 1F1B ordering.
"""

import numpy as np
import pytest
import torch
import torch.distributed as dist
from pipeline_cases import (
    AUX_LAYER_IDS,
    BETA,
    DRAFT_SEED,
    TEMPERATURE,
    build_draft,
    build_policy,
    build_reference,
    draft_taps,
    grads_of,
    make_batch,
    reference_step,
)
from process_pool import subgroup

from hf_spec_cotrain.parallel.pipeline import stream_pipeline_weights
from hf_spec_cotrain.parallel.tap_channel import TapChannel, TapMismatchError
from hf_spec_cotrain.testing import build_tiny_target
from hf_spec_cotrain.training.pipeline_step import PipelineCoTrainStep


pytestmark = pytest.mark.distributed
BATCH_SHAPES = [dict(prompt_length=5, completion_length=7), dict(prompt_length=3, completion_length=10)]
# (rtol, atol): in float64 only the order of the micro-batches' gradient sums differs from the reference.
TOLERANCES = {torch.float64: (1e-10, 1e-12), torch.float32: (1e-4, 1e-6)}


def _numpy(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {name: tensor.detach().numpy().copy() for name, tensor in tensors.items()}


# ---------------------------------------------------------------------------------------------------- the step


def run_pipeline_steps(
    size: int,
    family: str,
    schedule: str,
    transport: str,
    num_microbatches: int,
    co_train: bool,
    dtype: torch.dtype,
    with_reference: bool = False,
    drafter: str = "eagle3",
):
    """Two steps (two batch shapes) on a fresh pipeline; per step this stage's gradients and, on the last stage,
    the losses and the draft's gradients. `with_reference`: a KL term of weight `BETA` to `build_reference`'s
    model; `drafter`: the draft's family."""
    group = subgroup(size)
    policy = build_policy(family, dtype)
    is_last = dist.get_rank(group) == size - 1
    draft = build_draft(policy, drafter) if co_train else None
    step = PipelineCoTrainStep(
        policy,
        group=group,
        draft=draft if is_last else None,
        aux_layer_ids=draft_taps(drafter) if co_train else None,
        embedded_token_ids=draft.embedded_token_ids()
        if co_train
        else (),  # every rank: the first stage sends their rows
        draft_generator=torch.Generator().manual_seed(DRAFT_SEED),
        schedule=schedule,
        num_microbatches=num_microbatches,
        tap_transport=transport,
        temperature=TEMPERATURE,
        beta=BETA if with_reference else 0.0,
        reference_model=build_reference(family, dtype) if with_reference else None,
    )
    results = []
    for seed, shape in enumerate(BATCH_SHAPES):
        policy.zero_grad(set_to_none=True)
        if draft is not None:
            draft.zero_grad(set_to_none=True)
        out = step.step(make_batch(seed, **shape))
        result = {"grads": _numpy({n: p.grad for n, p in step.named_parameters() if p.grad is not None})}
        if is_last:
            result["loss"] = out.policy_loss.item()
            if co_train:
                result["draft_loss"] = out.draft.loss.item()
                result["draft_step_losses"] = out.draft.step_losses.tolist()
                result["draft_grads"] = _numpy(grads_of(draft))
        results.append(result)
    return results


@pytest.mark.parametrize(
    "size, family, schedule, transport, num_microbatches, dtype",
    [
        (2, "llama", "1F1B", "channel", 4, torch.float64),
        (2, "qwen2", "GPipe", "relay", 4, torch.float64),
        (2, "qwen3", "1F1B", "channel", 8, torch.float32),
        # MoE layers; gpt-oss's experts, sinks and alternating sliding/full layers (the mask dict by layer type)
        (2, "qwen3_moe", "1F1B", "channel", 4, torch.float64),
        (2, "gpt_oss", "GPipe", "relay", 4, torch.float64),
        (2, "gpt_oss", "1F1B", "channel", 4, torch.float32),
        (4, "llama", "1F1B", "channel", 4, torch.float64),
        (4, "qwen3", "GPipe", "channel", 4, torch.float64),
        (4, "qwen2", "1F1B", "relay", 8, torch.float32),
    ],
)
def test_pipeline_step_equals_single_process(cp_pool, size, family, schedule, transport, num_microbatches, dtype):
    args = (size, family, schedule, transport, num_microbatches, True, dtype)
    per_rank = cp_pool.run(run_pipeline_steps, *args)[:size]
    assert_pipeline_steps_equal_single_process(per_rank, family, dtype)


@pytest.mark.parametrize(
    "size, family, schedule, transport",
    [(2, "llama", "1F1B", "channel"), (4, "qwen3", "GPipe", "relay")],
)
def test_pipeline_step_with_a_dflash_draft_equals_single_process(cp_pool, size, family, schedule, transport):
    """DFlash's target layers lie on several stages; its blocks embed its mask token, whose row the first stage
    sends over the channel each step (under relay too), and its anchors are drawn as one process draws them."""
    args = (size, family, schedule, transport, 4, True, torch.float64, False, "dflash")
    per_rank = cp_pool.run(run_pipeline_steps, *args)[:size]
    assert_pipeline_steps_equal_single_process(per_rank, family, torch.float64, drafter="dflash")


def assert_pipeline_steps_equal_single_process(per_rank, family: str, dtype: torch.dtype, drafter: str = "eagle3"):
    """`run_pipeline_steps`' losses and gradients on every stage are one process's on the whole model."""
    rtol, atol = TOLERANCES[dtype]
    generator = torch.Generator().manual_seed(DRAFT_SEED)  # the draft's stream, over both steps as the stage's
    for seed, shape in enumerate(BATCH_SHAPES):
        policy = build_policy(family, dtype)
        draft = build_draft(policy, drafter)
        loss, draft_out = reference_step(policy, draft, make_batch(seed, **shape), generator=generator)
        last = per_rank[-1][seed]
        assert last["loss"] == pytest.approx(loss.item(), rel=rtol, abs=atol)
        assert last["draft_loss"] == pytest.approx(draft_out.loss.item(), rel=rtol, abs=atol)
        assert last["draft_step_losses"] == pytest.approx(draft_out.step_losses.tolist(), rel=rtol, abs=atol)
        # Each parameter lives on exactly one stage and its gradient is the whole model's.
        stage_grads = [rank[seed]["grads"] for rank in per_rank]
        names = [name for grads in stage_grads for name in grads]
        assert sorted(names) == sorted(name for name, _ in policy.named_parameters())
        reference_grads = grads_of(policy)
        for grads in stage_grads:
            for name, grad in grads.items():
                assert np.abs(grad).sum() > 0, name
                torch.testing.assert_close(torch.from_numpy(grad), reference_grads[name], rtol=rtol, atol=atol)
        reference_draft = grads_of(draft)
        assert last["draft_grads"].keys() == reference_draft.keys() and len(reference_draft) >= 10
        for name, grad in last["draft_grads"].items():
            assert np.abs(grad).sum() > 0, name
            torch.testing.assert_close(torch.from_numpy(grad), reference_draft[name], rtol=rtol, atol=atol)


def assert_stage_grads_equal(per_rank: list[list[dict]], seed: int, reference_grads: dict, *, rtol, atol) -> None:
    """The stages' gradients of batch ``seed`` are, together, exactly the whole model's."""
    names = [name for rank in per_rank for name in rank[seed]["grads"]]
    assert sorted(names) == sorted(reference_grads)
    for rank in per_rank:
        for name, grad in rank[seed]["grads"].items():
            torch.testing.assert_close(torch.from_numpy(grad), reference_grads[name], rtol=rtol, atol=atol)


def test_pipeline_without_cotraining_equals_single_process(cp_pool):
    per_rank = cp_pool.run(run_pipeline_steps, 4, "llama", "1F1B", "channel", 4, False, torch.float64)
    rtol, atol = TOLERANCES[torch.float64]
    for seed, shape in enumerate(BATCH_SHAPES):
        policy = build_policy("llama", torch.float64)
        loss, _ = reference_step(policy, None, make_batch(seed, **shape))
        assert per_rank[-1][seed]["loss"] == pytest.approx(loss.item(), rel=rtol, abs=atol)
        assert "draft_loss" not in per_rank[-1][seed]
        assert_stage_grads_equal(per_rank, seed, grads_of(policy), rtol=rtol, atol=atol)


@pytest.mark.parametrize("size, schedule", [(2, "GPipe"), (4, "1F1B")])
def test_pipeline_step_with_kl_to_a_reference_equals_single_process(cp_pool, size, schedule):
    """`beta` > 0: the reference model, cut the same way, runs forward-only through the stages, and the last stage
    adds TRL's KL term; loss and gradients equal one process's on the whole models."""
    per_rank = cp_pool.run(run_pipeline_steps, size, "llama", schedule, "channel", 4, False, torch.float64, True)
    per_rank = per_rank[:size]
    rtol, atol = TOLERANCES[torch.float64]
    for seed, shape in enumerate(BATCH_SHAPES):
        policy = build_policy("llama", torch.float64)
        reference = build_reference("llama", torch.float64)
        loss, _ = reference_step(policy, None, make_batch(seed, **shape), reference=reference)
        without_kl = reference_step(build_policy("llama", torch.float64), None, make_batch(seed, **shape))[0]
        assert abs(loss.item() - without_kl.item()) > 1e-3  # the KL term weighs in
        assert per_rank[-1][seed]["loss"] == pytest.approx(loss.item(), rel=rtol, abs=atol)
        assert_stage_grads_equal(per_rank, seed, grads_of(policy), rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------------------------------- weights


def run_stream_weights(size: int, dst: int):
    group = subgroup(size)
    policy = build_policy("llama")
    is_last = dist.get_rank(group) == size - 1
    draft = build_draft(policy) if is_last else None
    step = PipelineCoTrainStep(policy, group=group, draft=draft, aux_layer_ids=AUX_LAYER_IDS, tap_transport="relay")
    local_names = sorted(step.state_dict())
    full = [(name, t.numpy().copy()) for name, t in stream_pipeline_weights(step.state_dict(), group=group, dst=dst)]
    drafts = dict(stream_pipeline_weights(draft.state_dict() if is_last else {}, group=group, dst=dst))
    return {"local_names": local_names, "full": full, "draft": _numpy(drafts)}


@pytest.mark.parametrize("size, dst", [(2, 0), (4, 2)])
def test_full_policy_and_draft_stream_to_the_rollout_rank(cp_pool, size, dst):
    per_rank = cp_pool.run(run_stream_weights, size, dst)[:size]
    policy = build_policy("llama")
    expected = policy.state_dict()
    expected_draft = build_draft(policy).state_dict()
    for rank, result in enumerate(per_rank):
        if rank != dst:
            assert result["full"] == [] and result["draft"] == {}
    received = per_rank[dst]
    # Stage by stage: the names arrive in stage order, each stage's block as that stage holds it.
    blocks = [result["local_names"] for result in per_rank]
    assert sorted(name for name, _ in received["full"]) == sorted(name for block in blocks for name in block)
    arrived = [name for name, _ in received["full"]]
    stage_of = {name: stage for stage, block in enumerate(blocks) for name in block}
    assert [stage_of[name] for name in arrived] == sorted(stage_of[name] for name in arrived)
    assert sorted(name for name, _ in received["full"]) == sorted(expected)
    for name, value in received["full"]:
        assert np.array_equal(value, expected[name].numpy()), name
    assert received["draft"].keys() == expected_draft.keys()
    for name, value in received["draft"].items():
        assert np.array_equal(value, expected_draft[name].numpy()), name


# ---------------------------------------------------------------------------------------------------- validation


def run_bad_arguments() -> list[str]:
    group = subgroup(2)
    messages = []
    bad = [
        dict(num_microbatches=2),
        dict(schedule="interleaved"),
        dict(tap_transport="carrier-pigeon"),
        dict(layers_per_stage=[7, 2]),
        dict(aux_layer_ids=(2, 4, 8), tap_transport="relay"),
    ]
    for kwargs in bad:
        with pytest.raises(ValueError) as info:
            PipelineCoTrainStep(build_policy("llama"), group=group, **kwargs)
        messages.append(str(info.value))
    tied = build_tiny_target("qwen3", num_layers=4, hidden_size=64, head_dim=32, tie_word_embeddings=True)
    with pytest.raises(ValueError, match="tied input/output embeddings"):
        PipelineCoTrainStep(tied, group=group)
    too_deep = build_tiny_target("llama", num_layers=1, hidden_size=64, head_dim=32)
    with pytest.raises(ValueError, match="2 stages cannot split 1 decoder layers"):
        PipelineCoTrainStep(too_deep, group=group)
    if dist.get_rank(group) == 1:  # the draft's stage (relay: no channel to set up, so only this rank raises)
        with pytest.raises(ValueError, match="pass `draft=`"):
            PipelineCoTrainStep(build_policy("llama"), group=group, aux_layer_ids=AUX_LAYER_IDS, tap_transport="relay")
        policy = build_policy("llama")
        with pytest.raises(ValueError, match=r"`aux_layer_ids`=\[1, 3, 6\] differ from the draft's taps \[2, 4, 5\]"):
            PipelineCoTrainStep(
                policy, group=group, draft=build_draft(policy), aux_layer_ids=(1, 3, 6), tap_transport="relay"
            )
        dflash = build_draft(policy, "dflash")
        with pytest.raises(ValueError, match=r"`embedded_token_ids`=\[\] differ .* the draft embeds itself, \[7\]"):
            PipelineCoTrainStep(policy, group=group, draft=dflash, aux_layer_ids=draft_taps("dflash"))
    step = PipelineCoTrainStep(build_policy("llama"), group=group, num_microbatches=4)
    with pytest.raises(ValueError, match="not a multiple of `num_microbatches`=4"):
        step.step(make_batch(0, rows=6))
    return messages


def test_bad_arguments_are_value_errors(cp_pool):
    messages = cp_pool.run(run_bad_arguments)[0]
    assert "num_microbatches`=2 is too few" in messages[0]
    assert "'interleaved' is not supported" in messages[1]
    assert "'carrier-pigeon' is not supported" in messages[2]
    assert "sum to the model's 8 decoder layers" in messages[3]
    assert "Tap id 8 in `aux_layer_ids`=[2, 4, 8] is out of range" in messages[4]


# ---------------------------------------------------------------------------------------------------- TapChannel


def _tap_value(source: int, microbatch: int, tap_id: int, shape, dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * source + 10 * microbatch + tap_id)
    return torch.randn(shape, generator=generator).to(dtype)


def _variable_taps(source: int, step: int):
    """Sender `source`'s taps of one step, in sending order: (micro-batch, tap id, shape, dtype); the shapes
    change with the micro-batch and the step, and so do dtype and rank. Tap ids are unique to their sender."""
    taps = []
    for mb in range(3):
        taps.append((mb, 10 * source, (4, mb + 2 + step), torch.bfloat16))
        taps.append((mb, 10 * source + 5, (mb + 1 + step, 2 + source, 3), torch.float32))
    return taps


def run_channel_variable_shapes(size: int) -> int:
    group = subgroup(size)
    rank = dist.get_rank(group)
    channel = TapChannel(group)
    checked = 0
    for step in range(2):
        channel.begin_step()
        if channel.is_receiver:
            for source in range(size - 1):
                channel.expect(source=source, keys=[(mb, a) for mb, a, _, _ in _variable_taps(source, step)])
            # Read in an order of our own (last first): a sender's earlier buffers are posted as needed.
            wanted = [(source, *tap) for source in range(size - 1) for tap in _variable_taps(source, step)]
            for source, mb, tap_id, shape, dtype in reversed(wanted):
                got = channel.receive(microbatch=mb, tap_id=tap_id)
                assert got.dtype == dtype and tuple(got.shape) == shape
                assert torch.equal(got, _tap_value(source, mb, tap_id, shape, dtype))
                checked += 1
        else:
            for mb, tap_id, shape, dtype in _variable_taps(rank, step):
                channel.send(_tap_value(rank, mb, tap_id, shape, dtype), microbatch=mb, tap_id=tap_id)
            channel.wait_sends()
    return checked


@pytest.mark.parametrize("size", [2, 4])
def test_tap_channel_variable_shapes(cp_pool, size):
    checked = cp_pool.run(run_channel_variable_shapes, size)
    assert checked[size - 1] == 2 * 6 * (size - 1)


def run_channel_wrong_microbatch() -> str:
    """The sender swaps two micro-batches (same shapes): the receiver refuses the first slot it reads."""
    group = subgroup(2)
    channel = TapChannel(group)
    channel.begin_step()
    shape = (2, 3)
    if channel.is_receiver:
        channel.expect(source=0, keys=[(0, 7), (1, 7)], shapes=[shape, shape], dtype=torch.float32)
        with pytest.raises(TapMismatchError) as info:
            channel.receive(microbatch=0, tap_id=7)
        return str(info.value)
    for mb in (1, 0):
        channel.send(_tap_value(0, mb, 7, shape, torch.float32), microbatch=mb, tap_id=7)
    channel.wait_sends()  # the receiver's buffers were posted ahead: the bytes did land, in the wrong slots
    return ""


def test_tap_channel_refuses_a_tap_of_the_wrong_microbatch(cp_pool):
    message = cp_pool.run(run_channel_wrong_microbatch)[1]
    assert "micro-batch 1, tap 7) into the landing buffer of (step 0, micro-batch 0, tap 7)" in message


def run_channel_wrong_tap_and_shape() -> list[str]:
    """A sender sends a tap id the receiver expects from another stage, then a tap of another shape with the same
    number of elements (so the bytes fit the buffer): both are refused."""
    group = subgroup(2)
    channel = TapChannel(group)
    channel.begin_step()
    if channel.is_receiver:
        channel.expect(source=0, keys=[(0, 7), (1, 7)], shapes=[(2, 3), (2, 3)], dtype=torch.float32)
        messages = []
        for mb in (0, 1):
            with pytest.raises(TapMismatchError) as info:
                channel.receive(microbatch=mb, tap_id=7)
            messages.append(str(info.value))
        return messages
    channel.send(_tap_value(0, 0, 8, (2, 3), torch.float32), microbatch=0, tap_id=8)
    channel.send(_tap_value(0, 1, 7, (3, 2), torch.float32), microbatch=1, tap_id=7)
    channel.wait_sends()
    return []


def test_tap_channel_refuses_a_wrong_tap_id_or_shape(cp_pool):
    wrong_tap, wrong_shape = cp_pool.run(run_channel_wrong_tap_and_shape)[1]
    assert "(step 0, micro-batch 0, tap 8) into the landing buffer of (step 0, micro-batch 0, tap 7)" in wrong_tap
    assert "tap 7 is torch.float32 [3, 2]; its landing buffer was posted as torch.float32 [2, 3]" in wrong_shape


def run_channel_stale_step() -> str:
    """A sender one step ahead of the receiver: the step number in the header catches it."""
    group = subgroup(2)
    channel = TapChannel(group)
    channel.begin_step()
    if channel.is_receiver:
        channel.expect(source=0, keys=[(0, 3)], shapes=[(5,)], dtype=torch.float32)
        with pytest.raises(TapMismatchError) as info:
            channel.receive(microbatch=0, tap_id=3)
        return str(info.value)
    channel.begin_step()
    channel.send(torch.ones(5), microbatch=0, tap_id=3)
    channel.wait_sends()
    return ""


def test_tap_channel_refuses_a_tap_of_another_step(cp_pool):
    message = cp_pool.run(run_channel_stale_step)[1]
    assert "(step 1, micro-batch 0, tap 3) into the landing buffer of (step 0," in message


def _one_f_one_b(stage: int, num_stages: int, num_microbatches: int) -> list[tuple[str, int]]:
    """The order of forward and backward micro-batches of one stage under 1F1B."""
    warmup = min(num_microbatches, num_stages - stage)
    actions = [("F", mb) for mb in range(warmup)]
    forward, backward = warmup, 0
    while backward < num_microbatches:
        actions.append(("B", backward))
        backward += 1
        if forward < num_microbatches:
            actions.append(("F", forward))
            forward += 1
    return actions


def run_channel_under_1f1b(size: int, num_microbatches: int) -> int:
    """A hand-run 1F1B schedule on the pipeline group (activations forward, gradients backward, same shapes as
    the taps) while every stage sends its tap over the channel at each forward, and the last stage reads each
    micro-batch's taps right in its own forward, inside the schedule: the tightest consumer there is."""
    group = subgroup(size)
    stage = dist.get_rank(group)
    ranks = dist.get_process_group_ranks(group)
    last = size - 1
    channel = TapChannel(group)
    channel.begin_step()
    shape = (2, 3)
    if channel.is_receiver:
        for source in range(last):
            keys = [(mb, source) for mb in range(num_microbatches)]
            channel.expect(source=source, keys=keys, shapes=[shape] * len(keys), dtype=torch.float32)
    schedule_sends, checked = [], 0
    for kind, mb in _one_f_one_b(stage, size, num_microbatches):
        if kind == "F":
            activation = torch.zeros(shape)
            if stage > 0:
                dist.recv(activation, src=ranks[stage - 1], group=group)
                assert torch.equal(activation, torch.full(shape, float(100 * mb + stage - 1)))
            if stage < last:
                channel.send(_tap_value(stage, mb, stage, shape, torch.float32), microbatch=mb, tap_id=stage)
                schedule_sends.append(
                    dist.isend(torch.full(shape, float(100 * mb + stage)), dst=ranks[stage + 1], group=group)
                )
            else:
                for source in range(last):
                    got = channel.receive(microbatch=mb, tap_id=source)
                    assert torch.equal(got, _tap_value(source, mb, source, shape, torch.float32))
                    checked += 1
        else:
            grad = torch.zeros(shape)
            if stage < last:
                dist.recv(grad, src=ranks[stage + 1], group=group)
                assert torch.equal(grad, torch.full(shape, float(-100 * mb - stage - 1)))
            if stage > 0:
                schedule_sends.append(
                    dist.isend(torch.full(shape, float(-100 * mb - stage)), dst=ranks[stage - 1], group=group)
                )
    for work in schedule_sends:
        work.wait()
    if not channel.is_receiver:
        channel.wait_sends()
    return checked


@pytest.mark.parametrize("size, num_microbatches", [(2, 4), (4, 4), (4, 7)])
def test_tap_channel_under_1f1b_ordering(cp_pool, size, num_microbatches):
    checked = cp_pool.run(run_channel_under_1f1b, size, num_microbatches)
    assert checked[size - 1] == (size - 1) * num_microbatches


def run_channel_misuse() -> list[str]:
    group = subgroup(2)
    with pytest.raises(ValueError, match="not a rank of the 2-rank"):
        TapChannel(group, receiver=2)
    channel = TapChannel(group, receiver=0)
    channel.begin_step()
    errors = []
    if channel.is_receiver:
        for call in (
            lambda: channel.send(torch.ones(2), microbatch=0, tap_id=0),
            lambda: channel.expect(source=0, keys=[(0, 0)]),
            lambda: channel.receive(microbatch=9, tap_id=9),
            lambda: channel.expect(source=1, keys=[(0, 0)], shapes=[(2,)]),
        ):
            with pytest.raises((RuntimeError, ValueError, KeyError)) as info:
                call()
            errors.append(f"{type(info.value).__name__}: {info.value}")
        channel.expect(source=1, keys=[(0, 1)])
        with pytest.raises(RuntimeError, match="still unread"):
            channel.begin_step()
        assert torch.equal(channel.receive(microbatch=0, tap_id=1), torch.arange(3.0))
        channel.begin_step()
    else:
        with pytest.raises(RuntimeError, match="Only the receiving stage"):
            channel.expect(source=0, keys=[(0, 0)])
        with pytest.raises(ValueError, match="dtype torch.int64 is not supported"):
            channel.send(torch.ones(2, dtype=torch.int64), microbatch=0, tap_id=1)
        channel.send(torch.arange(3.0), microbatch=0, tap_id=1)
        with pytest.raises(RuntimeError, match=r"call `wait_sends\(\)` first"):
            channel.begin_step()
        channel.wait_sends()
        channel.begin_step()
    return errors


def test_tap_channel_misuse_is_refused(cp_pool):
    errors = cp_pool.run(run_channel_misuse)[0]
    assert errors[0].startswith("RuntimeError: The receiving stage keeps its own taps")
    assert errors[1].startswith("ValueError: `source`=0 must be another rank")
    assert errors[2].startswith("KeyError") and "micro-batch 9, tap 9" in errors[2]
    assert errors[3].startswith("ValueError: `shapes` needs one shape per key, and `dtype`")
