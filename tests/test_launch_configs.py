"""Every shipped accelerate config launches the main job for real: ``accelerate launch --config_file <config>`` of
the module that ``hf-spec-cotrain grpo`` launches, with the job's smallest settings, 2 steps.

The GPU-sized configs run on CPU with accelerate's command-line overrides (``--num_processes 2`` and the
``--parallelism_config_*`` sizes) plus the job's ``--context_parallel_size`` / ``--pipeline_parallel_size``, as their
comments document; everything else (mixed precision, FSDP options, rendezvous) is the file's own. Each rank records what
its trainer saw (tests/distributed/launch_recorder.py); the test checks the world size and mode, the weights every rank
started from (against the checkpoints), the steps trained and the job's outputs. The GPU sizes themselves are checked
by parsing each file and running the package's config checks on them.
"""

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.parallelism_config import ParallelismConfig
from safetensors.torch import load_file

from hf_spec_cotrain import SpecCoTrainConfig, cli
from hf_spec_cotrain.parallel.dims import ParallelDims
from hf_spec_cotrain.scripts.letters_task import embedded_assets


RECORDER = Path(__file__).resolve().parent / "distributed" / "launch_recorder.py"
# The repository's configs, which the package ships as `hf_spec_cotrain.accelerate_configs` (tests/test_cli.py).
CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "accelerate_configs"
ENTRY_MODULE = cli.GRPO_MODULE  # what `hf-spec-cotrain grpo` launches
MAX_STEPS = 2
ASSETS = {"sft_steps": 4, "warm_start_steps": 3, "warm_start_samples": 32}
JOB_ARGS = [
    *(arg for name, value in ASSETS.items() for arg in (f"--{name}", str(value))),
    *("--max_steps", str(MAX_STEPS), "--max_completion_length", "16", "--probe_prompts", "0"),
    *("--per_device_train_batch_size", "4", "--num_generations", "4"),
    *("--drafter", "eagle3"),  # one speculative run: the recorder keeps one trainer's record per rank
]
TWO_PROCESSES = ("--num_processes", "2")
# beta > 0 loads a reference model: under CPU-RAM-efficient loading it must be right on every rank too.
WITH_REFERENCE = ("--beta", "0.04")
LAUNCH_TIMEOUT_S = 600


@dataclass(frozen=True)
class Launch:
    config: str
    accelerate_args: tuple[str, ...] = ()
    job_args: tuple[str, ...] = ()
    world_size: int = 2
    context_parallel_size: int = 1
    pipeline_parallel_size: int = 1


LAUNCHES = {
    "single_device": Launch("single_device", world_size=1),
    "cpu_ddp": Launch("cpu_ddp"),
    # docs/context_parallel.md's CPU try-out
    "cpu_ddp+context_parallel": Launch("cpu_ddp", job_args=("--context_parallel_size", "2"), context_parallel_size=2),
    "multi_gpu": Launch("multi_gpu", TWO_PROCESSES),
    "fsdp2": Launch("fsdp2", TWO_PROCESSES, WITH_REFERENCE),
    "context_parallel": Launch(
        "context_parallel", TWO_PROCESSES, ("--context_parallel_size", "2"), context_parallel_size=2
    ),
    # its own shape at 4 processes: dp_shard 2 x cp 2, the policy sharded over all 4 (on CPU by the trainer, where
    # accelerate dropped FSDP) and each sequence over a context-parallel pair
    "fsdp2_context_parallel": Launch(
        "fsdp2_context_parallel",
        ("--num_processes", "4", "--parallelism_config_dp_shard_size", "2", "--parallelism_config_cp_size", "2"),
        WITH_REFERENCE,
        world_size=4,
        context_parallel_size=2,
    ),
    "pipeline_parallel": Launch(
        "pipeline_parallel", TWO_PROCESSES, ("--pipeline_parallel_size", "2"), pipeline_parallel_size=2
    ),
}


@dataclass(frozen=True)
class EmbeddedCache:
    folder: Path
    policy_sums: dict[str, float]
    draft_sums: dict[str, float]


def checkpoint_sums(folder: Path) -> dict[str, float]:
    tensors = {}
    for file in folder.glob("*.safetensors"):
        tensors.update(load_file(file))
    return {name: float(tensor.double().sum()) for name, tensor in tensors.items()}


@pytest.fixture(scope="session")
def embedded_cache(tmp_path_factory) -> EmbeddedCache:
    """The job's embedded policy and warm-start draft, built once for every launch."""
    folder = tmp_path_factory.mktemp("grpo-cache")
    with torch.random.fork_rng(devices=[]):
        policy_dir, draft_dirs, _ = embedded_assets(folder, seed=0, **ASSETS)
    return EmbeddedCache(folder, checkpoint_sums(policy_dir), checkpoint_sums(draft_dirs["eagle3"]))


def launch_job(launch: Launch, cache: Path, folder: Path) -> float:
    """`accelerate launch` of the recorded job; its wall seconds. A failure shows the launch's stderr tail."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
    command += [str(CONFIGS / f"{launch.config}.yaml"), *launch.accelerate_args, str(RECORDER)]
    command += [str(folder / "records"), ENTRY_MODULE, "--output_dir", str(folder / "run"), "--cache_dir", str(cache)]
    command += [*JOB_ARGS, *launch.job_args]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    # Files, not pipes: a grandchild that outlives the launcher would keep a pipe open.
    with (folder / "stdout.log").open("w") as stdout, (folder / "stderr.log").open("w") as stderr:
        result = subprocess.run(command, env=environment, stdout=stdout, stderr=stderr, timeout=LAUNCH_TIMEOUT_S)
    seconds = time.perf_counter() - started
    assert result.returncode == 0, (
        f"`{' '.join(command)}` exited with {result.returncode} after {seconds:.0f} s; stderr tail:\n"
        + (folder / "stderr.log").read_text()[-6000:]
    )
    print(f"{launch.config} {' '.join(launch.accelerate_args + launch.job_args)}: {seconds:.0f} s")
    return seconds


def whole(recorded: dict[str, dict], checkpoint: dict[str, float]) -> dict[str, dict]:
    """The recorded tensors of the checkpoint that this rank holds whole (not a shard)."""
    return {name: tensor for name, tensor in recorded.items() if not tensor["sharded"] and name in checkpoint}


def assert_same_sums(recorded: dict[str, dict], checkpoint: dict[str, float], what: str) -> None:
    """Each recorded tensor that the checkpoint holds has its sum (a pipeline stage holds some of them); a sharded one
    is recorded by the sum of its shards over the ranks."""
    shared = recorded.keys() & checkpoint.keys()
    assert shared, f"{what}: no tensor in common with the checkpoint"
    wrong = [name for name in shared if recorded[name]["sum"] != pytest.approx(checkpoint[name], rel=1e-9, abs=1e-9)]
    assert not wrong, f"{what}: {len(wrong)} tensors differ from the checkpoint, e.g. {sorted(wrong)[:3]}"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", LAUNCHES)
def test_shipped_config_launches_the_main_job(name, embedded_cache, tmp_path):
    launch = LAUNCHES[name]
    file_config = load_config_from_file(str(CONFIGS / f"{launch.config}.yaml"))
    launch_job(launch, embedded_cache.folder, tmp_path)

    records = [json.loads(path.read_text()) for path in sorted((tmp_path / "records").glob("rank*.json"))]
    assert [record["rank"] for record in records] == list(range(launch.world_size))
    ram_efficient = bool((file_config.fsdp_config or {}).get("fsdp_cpu_ram_efficient_loading", False))
    models = ("policy", "reference") if WITH_REFERENCE[0] in launch.job_args else ("policy",)
    for record in records:
        rank = f"rank {record['rank']}"
        assert record["world_size"] == launch.world_size, rank
        assert record["distributed_type"] == (
            "DistributedType.MULTI_CPU" if launch.world_size > 1 else "DistributedType.NO"
        )
        assert record["mixed_precision"] == file_config.mixed_precision, rank
        assert record["loads_on_rank_zero_only"] == ram_efficient, rank
        assert record["context_parallel_size"] == launch.context_parallel_size, rank
        assert record["pipeline_parallel_size"] == launch.pipeline_parallel_size, rank
        assert record["global_step"] == MAX_STEPS, rank
        # every rank starts from the checkpoints, whatever rank read them: what it holds whole, by itself
        for model in models:
            if held := whole(record[model], embedded_cache.policy_sums):
                assert_same_sums(held, embedded_cache.policy_sums, f"{rank} {model}")
        assert_same_sums(record["draft_begin"], embedded_cache.draft_sums, f"{rank} draft")
    for model in models:  # and what FSDP2 shards over every rank of the mesh, by its shards' sum
        shards = {name for name, tensor in records[0][model].items() if tensor["sharded"]}
        assert bool(shards) == (launch.config == "fsdp2_context_parallel"), model
        if shards:
            over_ranks = {name: {"sum": sum(record[model][name]["sum"] for record in records)} for name in shards}
            assert_same_sums(over_ranks, embedded_cache.policy_sums, f"{model} sharded over the ranks")
    if launch.pipeline_parallel_size == 1:  # the draft is replicated: its averaged updates keep it so
        assert all(record["draft_end"] == records[0]["draft_end"] for record in records)

    run = tmp_path / "run"
    for output in ("summary.json", "results.csv", "draft/model.safetensors", "policy/config.json"):
        assert (run / output).is_file(), output
    assert list((run / "policy").glob("*.safetensors"))
    histories = json.loads((run / "log_history.json").read_text())
    for trained in ("eagle3", "plain"):
        assert [entry["step"] for entry in histories[trained] if "reward" in entry] == [1, 2], trained


# The job options each GPU launch documents in its config's comment.
GPU_JOB_OPTIONS = {
    "context_parallel": {"context_parallel_size": 4},
    "pipeline_parallel": {"pipeline_parallel_size": 4},
}


@pytest.mark.parametrize("name", sorted(path.stem for path in CONFIGS.glob("*.yaml")))
def test_shipped_config_parses_and_its_gpu_sizes_pass_the_package_checks(name, tmp_path):
    file_config = load_config_from_file(str(CONFIGS / f"{name}.yaml"))
    options = dict(GPU_JOB_OPTIONS.get(name, {}))
    sizes = file_config.parallelism_config or {}
    if sizes:
        options["parallelism_config"] = ParallelismConfig(
            **{key.removeprefix("parallelism_config_"): value for key, value in sizes.items()}
        )
    fsdp = str(file_config.distributed_type) == "DistributedType.FSDP"
    config = SpecCoTrainConfig(str(tmp_path), use_cpu=True, bf16=False, **options)
    ParallelDims.from_config(config, world_size=file_config.num_processes, fsdp=fsdp, fsdp_version=2 if fsdp else None)
    assert file_config.mixed_precision in ("no", "bf16")
    if name != "single_device":  # several processes, through torchrun (MULTI_CPU would need mpirun)
        assert str(file_config.distributed_type) in ("DistributedType.MULTI_GPU", "DistributedType.FSDP")
