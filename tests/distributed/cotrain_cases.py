"""What the co-training runs of the multi-process trainer tests share: the prompts, the reward, the fixed
completions, the run config of the equality runs, the recorders, `snapshot`, one strict comparison, and the checks
the CP and PP equality tests make alike.

The equality runs (`cp_cotrain_script.py`, `pp_cotrain_script.py`) train two GRPO steps either under `torchrun
--nproc_per_node 2` with the parallelism on, or in one plain process on the same 8 rows ("single"), and record per
rank (`record_training`): the second step's policy gradients (before the optimizer step, after DDP's sync where
there is one) and draft gradients (at the draft optimizer's step, after the draft co-trainer's average over the
world), both models before and after training, and each step's logged metrics; under torchrun a script writes its
record to `<out_dir>/<mode><rank>.pt` (`main`).

Rollouts are a fixed function of the prompt and of the copy's index among the prompt's generations, so both runs
train on the same rows: with 4 generations per prompt and 4 rows per rank, rank r holds prompt r's group, and the
single process holds both groups. Completion lengths depend on the copy index only, so both ranks count the same
number of draft-loss positions (data parallelism averages the ranks' draft losses; one process averages over all
positions: the two agree when the counts do).

The DDP/FSDP2 run (`ddp_cotrain_script.py`) uses `ChecksumRecorder` and `record_local_draft_gradients`.
"""

import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from datasets import Dataset
from torchrun_launch import exit_without_teardown, run_torchrun
from transformers import TrainerCallback

from hf_spec_cotrain import SpecCoTrainConfig
from hf_spec_cotrain.testing import build_char_tokenizer


PROMPTS = ["hello there", "Q: 2+2? A:"]
NUM_GENERATIONS = 4
FIRST_CHARACTER_ID = 4  # ids 0-3 are the special tokens of the character tokenizer
DRAFT_METRICS = ["draft/loss", "draft/loss_step_0", "draft/loss_step_1", "draft/accuracy_step_1", "draft/grad_norm"]


# --- The runs ----------------------------------------------------------------------------------------------------


def fixed_completions(prompt_ids: list[list[int]]) -> list[list[int]]:
    """A fixed function of each prompt and of the copy's index among the prompt's generations."""
    copies = Counter()
    completions = []
    for ids in prompt_ids:
        copy = copies[tuple(ids)]
        copies[tuple(ids)] += 1
        generator = torch.Generator().manual_seed(1000 * sum(ids) + copy)
        length = 3 + 2 * copy
        completions.append(torch.randint(FIRST_CHARACTER_ID, 60, (length,), generator=generator).tolist())
    return completions


def reward(completions, **kwargs):
    return [text.count("a") + 0.1 * len(text) + 0.01 * sum(map(ord, text)) for text in completions]


def equality_run_config(out_dir: str, *, per_device_train_batch_size: int, **options) -> SpecCoTrainConfig:
    """Two steps whose updates compare at float32 precision between a parallel run and one process (`options` add
    to or override these)."""
    defaults = dict(
        use_cpu=True,
        bf16=False,
        report_to="none",
        per_device_train_batch_size=per_device_train_batch_size,
        num_generations=NUM_GENERATIONS,
        max_completion_length=10,
        max_steps=2,
        optim="sgd",  # the policy's update is then proportional to its gradient: comparable at float32 precision
        learning_rate=0.05,
        logging_steps=1,
        save_strategy="no",
        save_draft=False,
        seed=5,
        shuffle_dataset=False,
        max_grad_norm=0.0,
        draft_max_grad_norm=0.0,
        draft_warmup_steps=0,
        ttt_steps=2,
        disable_tqdm=True,
    )
    return SpecCoTrainConfig(output_dir=out_dir, **{**defaults, **options})


def equality_trainer(trainer_class, policy_dir: str, config: SpecCoTrainConfig, *, prompts: list[str] = PROMPTS):
    """`trainer_class` (a `SpecCoTrainGRPOTrainer` with fixed rollouts) on `prompts`, rewarded by `reward`."""
    return trainer_class(
        model=policy_dir,
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=build_char_tokenizer(),
    )


# --- Recorders ---------------------------------------------------------------------------------------------------


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A detached copy of `tensor`, gathered whole when FSDP2 shards it (a DTensor; collective over its mesh)."""
    tensor = tensor.detach()
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.clone()


def snapshot(model) -> dict[str, torch.Tensor]:
    """A copy of every parameter of `model`, by name (whole, when FSDP2 shards it)."""
    return {name: full(p) for name, p in model.named_parameters()}


class GradientRecorder(TrainerCallback):
    """The policy's gradients before each optimizer step and the draft's at each draft optimizer step (the last
    step's remain)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.policy_grads = {}
        self.draft_grads = {}
        trainer.draft_optimizer.register_step_pre_hook(self._record_draft)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        self.policy_grads = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}

    def _record_draft(self, optimizer, args, kwargs):
        draft = self.trainer.draft
        self.draft_grads = {n: full(p.grad) for n, p in draft.named_parameters() if p.grad is not None}


def record_training(trainer, *, after_training: Callable[[], None] | None = None) -> dict:
    """Train `trainer`; this rank's record (see the module docstring). `after_training` runs right after training,
    before the final snapshots."""
    recorder = GradientRecorder(trainer)
    trainer.add_callback(recorder)
    policy = trainer.accelerator.unwrap_model(trainer.model)
    draft_start, policy_start = snapshot(trainer.draft), snapshot(policy)
    trainer.train()
    if after_training is not None:
        after_training()
    return {
        "world_size": trainer.accelerator.num_processes,
        "rank": trainer.accelerator.process_index,
        "policy_grads": recorder.policy_grads,
        "draft_grads": recorder.draft_grads,
        "policy_start": policy_start,
        "policy_params": snapshot(policy),
        "draft_start": draft_start,
        "draft_params": snapshot(trainer.draft),
        "step_logs": [entry for entry in trainer.state.log_history if "draft/loss" in entry],
    }


def local_shard(param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 parameter (a DTensor), or the parameter itself."""
    return param.to_local() if hasattr(param, "to_local") else param


class ChecksumRecorder(TrainerCallback):
    """After every step: per-parameter sums and sums of squares of the draft, and the sum of squares of this rank's
    (shard of the) policy."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.checksums = []
        self.policy_checksums = []

    # Runs after `DraftUpdateCallback`, which the trainer adds first: the draft has taken this step's update.
    def on_step_end(self, args, state, control, **kwargs):
        params = [p.detach().double() for p in self.trainer.draft.parameters()]
        self.checksums.append([float(p.sum()) for p in params] + [float((p * p).sum()) for p in params])
        policy = [local_shard(p).detach().double() for p in self.trainer.model.parameters()]
        self.policy_checksums.append(sum(float((p * p).sum()) for p in policy))


def record_local_draft_gradients(trainer) -> dict[str, float]:
    """The sums of the draft's gradients on this rank at its first update, before they are averaged over the world
    (filled in while the trainer trains)."""
    local_grads = {}
    update = trainer.draft_cotrainer.update

    def recording_update(*, step):
        if not local_grads:
            local_grads.update(
                {n: p.grad.double().sum().item() for n, p in trainer.draft.named_parameters() if p.grad is not None}
            )
        update(step=step)

    trainer.draft_cotrainer.update = recording_update
    return local_grads


def main(run: Callable[[str, str, str], dict]) -> None:
    """A script's entry point under torchrun: `run(policy_dir, out_dir, mode)`, saved to `<out_dir>/<mode><rank>.pt`."""
    torch.set_num_threads(1)
    record = run(*sys.argv[1:4])
    torch.save(record, Path(sys.argv[2], f"{sys.argv[3]}{record['rank']}.pt"))
    dist.destroy_process_group()
    exit_without_teardown()


# --- The tests' side ---------------------------------------------------------------------------------------------


def run_parallel_and_single(
    script: Path,
    run: Callable[[str, str, str], dict],
    policy_dir: Path,
    tmp_path: Path,
    mode: str,
    *,
    variant: str | None = None,
    nproc: int = 2,
    env: dict[str, str] | None = None,
) -> tuple[list[dict], dict]:
    """The `nproc` ranks' records of `script` under torchrun in `mode` (`env` added to their environment), and the
    record of `run` in this process ("single"); a `variant` is passed to both as a suffix of the mode (``"pp-bnpo"``,
    ``"single-bnpo"``)."""
    suffix = "" if variant is None else f"-{variant}"
    mode = mode + suffix
    out_dir = tmp_path / mode
    run_torchrun(script, policy_dir, out_dir, mode, log=out_dir.with_suffix(".log"), nproc=nproc, env=env)
    parallel = [torch.load(out_dir / f"{mode}{rank}.pt") for rank in range(nproc)]
    threads = torch.get_num_threads()
    try:
        single = run(str(policy_dir), str(tmp_path / f"single{suffix}"), f"single{suffix}")
    finally:
        torch.set_num_threads(threads)
    return parallel, single


def assert_same_tensors(
    actual: dict, expected: dict, what: str, *, relative_to_max: bool, loosen: float = 1.0
) -> None:
    """The same names on both sides (and at least one), and tensors equal at float32 tolerance: a parallel run's
    partial sums (the ring's blockwise softmax and the shards' sums, the micro-batches') round differently from one
    whole-batch forward on one device (measured under CP: <= 5e-6 of a gradient's largest entry, <= 3e-7 on a
    parameter; under PP on a CPU with AVX-512 kernels, 8e-6 on a draft parameter whose largest entry is 0.084, since
    Adam divides by the root of tiny second moments). `relative_to_max`: the absolute tolerance is 1e-5 of the
    expected tensor's largest entry (for gradients), else 1e-6 or 2e-4 of that entry, whichever is larger; a lost or
    doubled contribution moves a parameter by about the learning rate (1e-2). `loosen` multiplies both tolerances, for
    a policy whose gradients move more than that under float32 rounding alone."""
    assert actual, f"{what}: nothing recorded"
    assert actual.keys() == expected.keys(), (
        f"{what}: only in the run: {sorted(actual.keys() - expected.keys())}; "
        f"only in the reference: {sorted(expected.keys() - actual.keys())}"
    )
    for name, tensor in expected.items():
        largest = float(tensor.abs().max())
        atol = (1e-5 * largest if relative_to_max else max(1e-6, 2e-4 * largest)) * loosen
        torch.testing.assert_close(actual[name], tensor, rtol=1e-5 * loosen, atol=atol, msg=f"{what} {name}")


def assert_single_run_learned(parallel: list[dict], single: dict) -> None:
    """The premises of an equality test: several ranks against 1, gradients that are not zero, and both models moved,
    so that equal parameters after training mean equal updates."""
    assert len(parallel) > 1 and single["world_size"] == 1
    assert [record["world_size"] for record in parallel] == [len(parallel)] * len(parallel)
    assert all(grad.abs().max() > 0 for grad in [*single["policy_grads"].values(), *single["draft_grads"].values()])
    for moved in ("policy", "draft"):
        assert any(not torch.equal(single[f"{moved}_params"][n], p) for n, p in single[f"{moved}_start"].items())


def assert_same_step_logs(record: dict, single: dict, keys: list[str]) -> None:
    """Both steps logged `keys`, equal to the single process's, and a positive draft loss."""
    assert len(record["step_logs"]) == len(single["step_logs"]) == 2
    for logged, expected in zip(record["step_logs"], single["step_logs"]):
        for key in keys:
            assert logged[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
        assert logged["draft/loss"] > 0


def assert_equal_runs(parallel: list[dict], single: dict, logged: list[str], *, loosen: float) -> None:
    """Each rank's gradients and parameters of both models after the steps, and its logged draft metrics and
    `logged`, equal the single process's."""
    assert_single_run_learned(parallel, single)
    for record in parallel:
        rank = record["rank"]
        # DDP's (or FSDP2's) average of the shards' gradients is the gradient of one process over all the rows, and so
        # is the draft's after the draft co-trainer's average over the world.
        for kind, relative_to_max in (("grads", True), ("params", False)):
            for model in ("policy", "draft"):
                assert_same_tensors(
                    record[f"{model}_{kind}"],
                    single[f"{model}_{kind}"],
                    f"rank {rank} {model} {kind}",
                    relative_to_max=relative_to_max,
                    loosen=loosen,
                )
        # Every step logged the draft's metrics and the policy's, equal to the single process's.
        assert_same_step_logs(record, single, [*DRAFT_METRICS, *logged])
