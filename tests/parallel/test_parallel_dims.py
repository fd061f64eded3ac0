"""`ParallelDims` in one process: the sizes, the checks against the world size, the data-parallel degree, the mesh's
axes, and the run-time facts the trainer adds to the config's checks, and the policies each parallelism refuses at
start (`parallel.compatibility`). The mesh itself is in tests/distributed/test_parallel_dims_groups.py."""

import math
from pathlib import Path

import pytest
from tiny_policy import tiny_grpo_kwargs

from hf_spec_cotrain import SpecCoTrainConfig
from hf_spec_cotrain.parallel import ParallelDims
from hf_spec_cotrain.testing import build_char_tokenizer, build_tiny_target, save_tiny_target


def test_sizes_default_to_plain_data_parallelism():
    dims = ParallelDims(world_size=4)
    assert (dims.cp_enabled, dims.pp_enabled, dims.dp) == (False, False, 4)
    assert ParallelDims().build_mesh("cpu") is None  # no group needed, no process group touched


@pytest.mark.parametrize(
    ("dims", "enabled", "dp"),
    [
        (ParallelDims(context_parallel_size=2, world_size=8), (True, False), 4),
        (ParallelDims(context_parallel_size=4, world_size=4), (True, False), 1),
        (ParallelDims(pipeline_parallel_size=4, world_size=4), (False, True), 1),
    ],
)
def test_data_parallel_degree(dims, enabled, dp):
    assert (dims.cp_enabled, dims.pp_enabled) == enabled
    assert dims.dp == dp


@pytest.mark.parametrize(
    ("dims", "axes"),
    [
        (ParallelDims(world_size=4), {"dp_replicate": 4}),
        (ParallelDims(world_size=4, fsdp=True), {"dp_shard": 4}),
        (ParallelDims(context_parallel_size=2, world_size=8), {"dp_replicate": 4, "cp": 2}),
        (ParallelDims(context_parallel_size=2, world_size=8, fsdp=True), {"dp_shard": 4, "cp": 2}),
        (ParallelDims(context_parallel_size=4, world_size=4, fsdp=True), {"dp_shard": 1, "cp": 4}),
        (ParallelDims(pipeline_parallel_size=4, world_size=4), {"pp": 4, "dp_replicate": 1}),
    ],
)
def test_the_mesh_axes_multiply_to_the_world_size(dims, axes):
    assert dims.mesh_axis_names == tuple(axes)  # in this order: pipeline, data, context
    assert dims.mesh_axes == axes
    assert math.prod(axes.values()) == dims.world_size
    assert (dims.dp_replicate, dims.dp_shard) == ((1, dims.dp) if dims.fsdp else (dims.dp, 1))


@pytest.mark.parametrize("name", ["context_parallel_size", "pipeline_parallel_size", "world_size"])
@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2"])
def test_sizes_are_positive_ints(name, bad):
    with pytest.raises(ValueError, match=f"`{name}`={bad!r} is not allowed"):
        ParallelDims(**{name: bad})


def test_context_and_pipeline_parallelism_are_exclusive():
    with pytest.raises(
        ValueError, match="`context_parallel_size`=2 cannot be combined with `pipeline_parallel_size`=2"
    ):
        ParallelDims(context_parallel_size=2, pipeline_parallel_size=2)


def test_world_size_checks():
    with pytest.raises(ValueError, match=r"`context_parallel_size`=4 must divide the world size \(6 processes\)"):
        ParallelDims(context_parallel_size=4, world_size=6)
    with pytest.raises(ValueError, match=r"`pipeline_parallel_size`=2 must equal the world size \(4 processes\)"):
        ParallelDims(pipeline_parallel_size=2, world_size=4)
    with pytest.raises(ValueError, match="needs the world size"):
        _ = ParallelDims(context_parallel_size=2).dp
    with pytest.raises(ValueError, match="needs the world size"):
        ParallelDims(context_parallel_size=2).build_mesh("cpu")


def _config(tmp_path, **overrides):
    return SpecCoTrainConfig(**tiny_grpo_kwargs(tmp_path, **overrides))


def test_from_config_adds_the_run_time_facts(tmp_path):
    cp = _config(tmp_path, context_parallel_size=2)
    assert ParallelDims.from_config(cp) == ParallelDims(context_parallel_size=2)
    assert ParallelDims.from_config(cp, world_size=4).dp == 2
    with pytest.raises(ValueError, match=r"must divide the world size \(3 processes\)"):
        ParallelDims.from_config(cp, world_size=3)
    with pytest.raises(ValueError, match=r"`context_parallel_size`=2 cannot be combined with \['deepspeed'\]"):
        ParallelDims.from_config(cp, world_size=2, deepspeed=True)
    # FSDP2 composes with context parallelism on a 2-D mesh; FSDP1 does not.
    assert ParallelDims.from_config(cp, world_size=4, fsdp=True, fsdp_version=2).fsdp
    assert ParallelDims.from_config(cp, world_size=4, fsdp=True, fsdp_version=2).mesh_axis_names == ("dp_shard", "cp")
    assert ParallelDims.from_config(cp, world_size=4).mesh_axis_names == ("dp_replicate", "cp")
    with pytest.raises(ValueError, match=r"cannot be combined with \['fsdp_version=1'\]"):
        ParallelDims.from_config(cp, world_size=2, fsdp=True, fsdp_version=1)

    pp = _config(tmp_path, pipeline_parallel_size=2)
    assert ParallelDims.from_config(pp, world_size=2).dp == 1
    with pytest.raises(ValueError, match=r"must equal the world size \(1 processes\)"):
        ParallelDims.from_config(pp, world_size=1)
    with pytest.raises(ValueError, match=r"`pipeline_parallel_size`=2 cannot be combined with \['fsdp'\]"):
        ParallelDims.from_config(pp, world_size=2, fsdp=True)
    with pytest.raises(ValueError, match="not a PEFT policy"):
        ParallelDims.from_config(pp, world_size=2, peft=True)
    with pytest.raises(ValueError, match="does not support tool calls"):
        ParallelDims.from_config(pp, world_size=2, tools=True)
    # Facts that only matter to a parallelism the run does not use are not errors.
    assert ParallelDims.from_config(_config(tmp_path), world_size=3, peft=True, tools=True).dp == 3
    # Each HF-native turn gathers a sharded policy, a collective; the tool loop's turns differ between ranks.
    with pytest.raises(ValueError, match="Tool calls with HF-native speculative rollouts of an FSDP-sharded policy"):
        ParallelDims.from_config(_config(tmp_path), world_size=2, tools=True, fsdp=True)
    assert ParallelDims.from_config(_config(tmp_path, speculative_decoding=False), world_size=2, tools=True, fsdp=True)


def test_context_parallel_sizes_come_from_accelerates_parallelism_config(tmp_path, monkeypatch):
    from accelerate.parallelism_config import ParallelismConfig

    config = _config(tmp_path, parallelism_config=ParallelismConfig(dp_shard_size=2, cp_size=2))
    # The ring is the context parallelism; the shard axis asks for FSDP2, which accelerate drops on CPU (and refuses
    # any parallelism config there): the trainer shards the policy itself.
    assert (config.context_parallel_size, config.fsdp, config.parallelism_config) == (2, True, None)
    assert config.fsdp_config["version"] == 2
    # Its shard size is kept as the config's own (derived, not an argument), which the world size is checked against.
    assert config.data_parallel_shard_size == 2 and "data_parallel_shard_size" not in config.to_dict()
    assert _config(tmp_path, context_parallel_size=2).data_parallel_shard_size is None
    dims = ParallelDims.from_config(config, world_size=4)
    assert (dims.fsdp, dims.dp, dims.dp_shard, dims.data_parallel_size) == (True, 2, 2, 2)
    with pytest.raises(ValueError, match=r"world size \(6 processes\) is not the mesh's data-parallel size 2 x"):
        ParallelDims.from_config(config, world_size=6)
    # A DDP x CP mesh, and the accelerate config file's sizes (`accelerate launch` exports them).
    assert _config(tmp_path, parallelism_config=ParallelismConfig(cp_size=2)).fsdp is None
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_SIZE", "4")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "2")
    assert (_config(tmp_path).context_parallel_size, _config(tmp_path).fsdp) == (4, True)
    # Launched with an FSDP config, FSDP is accelerate's to build as the file says: `fsdp` here would have
    # transformers rebuild it from `fsdp_config`'s defaults (CPU-RAM-efficient loading off, whatever the file said).
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert _config(tmp_path).fsdp is True  # an `Accelerator` given a plugin sets that alone, in its process
    monkeypatch.setenv("FSDP_VERSION", "2")  # what `accelerate launch` exports with it
    launched = _config(tmp_path)
    assert (launched.context_parallel_size, launched.fsdp) == (4, None)
    assert (
        ParallelDims.from_config(launched, world_size=8).fsdp,
        ParallelDims.from_config(launched, world_size=8).dp,
    ) == (True, 2)
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ValueError, match=r"cannot be combined with \['fsdp_version=1'\]"):
        _config(tmp_path)
    for name in ("ACCELERATE_USE_FSDP", "FSDP_VERSION", "ACCELERATE_USE_PARALLELISM_CONFIG"):
        monkeypatch.delenv(name)

    with pytest.raises(ValueError, match="`context_parallel_size`=4 contradicts the parallelism config's `cp_size`=2"):
        _config(tmp_path, context_parallel_size=4, parallelism_config=ParallelismConfig(cp_size=2, dp_shard_size=2))
    for bad in ({"dp_replicate_size": 2}, {"tp_size": 2}):
        with pytest.raises(ValueError, match="cannot be combined with `dp_replicate_size`"):
            _config(tmp_path, parallelism_config=ParallelismConfig(cp_size=2, dp_shard_size=2, **bad))


def test_the_fsdp2_context_parallel_accelerate_config_reaches_the_config(tmp_path, monkeypatch):
    """`accelerate launch` exports the config file's `parallelism_config` block as accelerate's own function does."""
    import argparse

    import yaml
    from accelerate.utils.launch import prepare_extend_env_parallelism_config

    folder = Path(__file__).resolve().parents[2] / "examples" / "accelerate_configs"
    launch = yaml.safe_load((folder / "fsdp2_context_parallel.yaml").read_text())
    defaults = {f"parallelism_config_{name}_size": 1 for name in ("dp_replicate", "dp_shard", "tp", "cp", "sp")}
    args = argparse.Namespace(
        **defaults | launch["parallelism_config"],
        parallelism_config_cp_backend="torch",
        parallelism_config_cp_comm_strategy="allgather",
        parallelism_config_sp_backend="deepspeed",
    )
    for name, value in prepare_extend_env_parallelism_config(args, {}).items():
        monkeypatch.setenv(name, value)
    config = _config(tmp_path)
    assert (config.context_parallel_size, config.fsdp, config.fsdp_config["version"]) == (4, True, 2)
    assert launch["num_processes"] == 8 and launch["fsdp_config"]["fsdp_version"] == 2
    assert ParallelDims.from_config(config, world_size=launch["num_processes"]).dp == 2


CP, PP = ParallelDims(context_parallel_size=2), ParallelDims(pipeline_parallel_size=2)


def _policy(family, **kwargs):
    return build_tiny_target(
        family,
        num_layers=2,
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        **kwargs,
    )


@pytest.mark.parametrize(
    "family, window",
    # Full attention dense or MoE, sliding windows (Mistral's every layer, Qwen3's every other one) and gpt-oss's
    # windows and sinks: the ring attention computes them all (tests/distributed/test_policy_cp.py).
    [("llama", None), ("qwen2", None), ("qwen3", None), ("mistral", None), ("qwen3_moe", None)]
    + [("mistral", 5), ("qwen3", 8), ("gpt_oss", None)],
)
def test_both_parallelisms_take_the_attention_families(family, window):
    policy = _policy(family, sliding_window=window)
    CP.check_policy(policy)
    PP.check_policy(policy)


def test_linear_attention_and_the_moe_auxiliary_loss_are_refused_at_start():
    hybrid = _policy("qwen3")
    hybrid.config.layer_types = ["linear_attention", "full_attention"]  # as Qwen3.5 / Qwen3-Next declare them
    with pytest.raises(ValueError, match=r"recurrent state.*no sequence-parallel scan.*\(data parallelism\)\.$"):
        CP.check_policy(hybrid)
    with pytest.raises(
        ValueError, match=r"cannot train this qwen3 policy: its \['linear_attention'\] layers are untested"
    ):
        PP.check_policy(hybrid)
    moe = _policy("qwen3_moe")
    moe.config.output_router_logits = True
    for dims in (CP, PP):
        with pytest.raises(
            ValueError, match=r"qwen3_moe policy: .*MoE auxiliary loss .*set `router_aux_loss_coef=0` if the auxiliary"
        ):
            dims.check_policy(moe)
        dims.check_policy(_policy("qwen3_moe"))
        with pytest.raises(ValueError, match=r"TRL's `router_aux_loss_coef`, on by default for MoE policies"):
            dims.check_policy(_policy("qwen3_moe"), aux_loss=True)  # what the trainer passes unless the coef is 0
    ParallelDims().check_policy(hybrid)  # without either parallelism nothing is refused
    ParallelDims().check_policy(moe)


@pytest.mark.parametrize("coef, refused", [(None, True), (0.0, False)])
def test_the_trainer_refuses_trls_moe_auxiliary_loss_at_start(tmp_path, monkeypatch, coef, refused):
    """TRL adds the MoE auxiliary loss for any MoE policy unless `router_aux_loss_coef=0`; the parallel steps do not
    compute it, so the trainer hands TRL's decision to `check_policy` (here under a stand-in for a 2-process run)."""
    from datasets import Dataset

    from hf_spec_cotrain import SpecCoTrainGRPOTrainer

    policy_dir = save_tiny_target(tmp_path / "policy", "qwen3_moe", num_layers=8, hidden_size=64, intermediate_size=64)
    monkeypatch.setattr(ParallelDims, "from_config", classmethod(lambda cls, config, **facts: CP))
    config = SpecCoTrainConfig(
        **tiny_grpo_kwargs(
            tmp_path / "out", per_device_train_batch_size=2, num_generations=2, router_aux_loss_coef=coef
        )
    )

    def build():
        return SpecCoTrainGRPOTrainer(
            model=str(policy_dir),
            reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
            args=config,
            train_dataset=Dataset.from_dict({"prompt": ["abc", "defg"]}),
            processing_class=build_char_tokenizer(),
        )

    # Past the check, the stand-in dims (no world size) stop the construction at the group they cannot build.
    message = "its MoE auxiliary loss .* `router_aux_loss_coef=0`" if refused else "needs the world size"
    with pytest.raises(ValueError, match=message):
        build()
