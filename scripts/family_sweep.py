"""Every decoder-only causal-LM family of the installed transformers, built tiny, through the package.

For each family (found by introspection: the causal-LM auto mapping, less encoders, encoder-decoders and multimodal
models) a tiny policy is built from its default config and taken where a user takes it:

1. the trainer is built with speculative HF-native rollouts, for each drafter (EAGLE-3, DFlash): draft built from the
   policy, static checks, the trial speculative generation;
2. greedy speculative generation with the trainer's draft equals `generate`, for each drafter;
3. the draft's teacher (`PolicyHead`) equals the policy's own logits at the draft's rows;
4. one GRPO step with speculation (EAGLE-3): no fallback, acceptance logged, the draft trained;
5. for a chosen subset (`VLLM_FAMILIES`, or ``--vllm_families``), the same GRPO step with a colocated vLLM engine
   (the policy saved and loaded by name, as vLLM reads it): works, or refused when the trainer is built.

Each family ends as ``works`` (every stage passed), ``refused`` (the trainer refused it when built, with a ValueError
naming the family) or ``broken`` (anything else: a raw error, a wrong result, a fallback), which is a bug. A family
whose default config the sweep cannot shrink is ``not built`` (the sweep's limit, named). `tests/test_family_sweep.py`
runs part of it in CI; this script runs all of it, each family in its own process, and writes `docs/family_sweep.md`:

    OMP_NUM_THREADS=1 python scripts/family_sweep.py --jobs 2 --output docs/family_sweep.md
"""

import argparse
import contextlib
import importlib.util
import inspect
import io
import json
import logging
import multiprocessing
import os
import resource
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path


HIDDEN, LAYERS = 64, 4
# Embedding rows no token uses, as real vocabularies have: DFlash takes one as its mask token.
SPARE_ROWS = 4
TAPS = [0, 1, LAYERS - 1]
K = 3
# Sizes every family's config takes under its own field names (`attribute_map`), when its default has the field.
TINY_SIZES = {
    "hidden_size": HIDDEN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "intermediate_size": 128,
    "max_position_embeddings": 256,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 32,
    "qk_nope_head_dim": 32,
    "v_head_dim": 48,  # multi-head latent attention's value heads differ from its query heads, as in DeepSeek-V3
    "first_k_dense_replace": 1,
    "n_group": 1,  # DeepSeek-style routers pick groups of experts
    "topk_group": 1,
    "hidden_size_per_layer_input": 16,  # Gemma 3n and 4's per-layer embeddings (their vocabulary: `vocab_size`)
    "tie_word_embeddings": False,
}
# What a family's own validation needs beyond the common sizes (the sweep's knowledge, not the package's).
HYBRID_LAYERS = ["linear_attention", "full_attention"] * (LAYERS // 2)
TINY_OVERRIDES: dict[str, dict] = {
    "diffllama": {"num_key_value_heads": 2},
    "gptj": {"rotary_dim": 16},
    "codegen": {"rotary_dim": 16, "num_attention_heads": 4},
    "mamba2": {"num_heads": 4, "head_dim": 32, "n_groups": 1},
    "dots1": {"n_shared_experts": 1},
    "dbrx": {"attn_config": {"kv_n_heads": 1, "rope_theta": 10_000.0, "clip_qkv": 8.0}},
    "gemma3n_text": {
        "layer_types": ["sliding_attention", "full_attention"] * (LAYERS // 2),
        "num_kv_shared_layers": 0,
    },
    # LFM2's short convolutions among its attention layers, as its checkpoints have them
    "lfm2": {"layer_types": ["conv", "full_attention"] * (LAYERS // 2)},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"] * (LAYERS // 2), "num_dense_layers": 1},
    "gpt_neo": {"attention_types": [[["global", "local"], LAYERS // 2]]},
    "zaya": {"num_experts_per_tok": 1},
    # hybrids whose default pattern puts no attention layer among 4
    "bamba": {"attn_layer_indices": [1, 3]},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},
    "granitemoehybrid": {"layer_types": HYBRID_LAYERS},
    "kimi_linear": {"layer_types": HYBRID_LAYERS},
}
OUTCOMES = ("works", "refused", "broken", "not built")
# Families whose GRPO step also runs with a colocated vLLM engine: classes with vLLM's EAGLE-3 interface (Llama, Qwen3,
# Granite, whose logit scaling vLLM applies), one without it (Mixtral) and one vLLM runs through its Transformers
# backend (Olmo2).
VLLM_FAMILIES = ("llama", "qwen3", "granite", "mixtral", "olmo2")


@dataclass
class FamilyOutcome:
    model_type: str
    outcome: str
    stage: str = ""
    detail: str = ""
    seconds: float = 0.0
    vllm: str = ""  # the vLLM colocate stage's outcome ("": not run)
    vllm_detail: str = ""


def tiny_config(model_type: str, vocab_size: int, special_ids: dict[str, int]):
    """The family's default config with `TINY_SIZES` (and its `TINY_OVERRIDES`) where it has those fields."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    default = config_class()
    aliases = getattr(config_class, "attribute_map", {}) or {}
    accepted = set(inspect.signature(config_class).parameters) | set(getattr(config_class, "__dataclass_fields__", {}))
    sizes = {**TINY_SIZES, "vocab_size": vocab_size, "vocab_size_per_layer_input": vocab_size, **special_ids}
    if hasattr(default, "kv_lora_rank"):  # multi-head latent attention: as many key/value heads as query heads
        sizes["num_key_value_heads"] = sizes["num_attention_heads"]
    sizes.update(TINY_OVERRIDES.get(model_type, {}))
    kwargs = {aliases.get(name, name): value for name, value in sizes.items() if aliases.get(name, name) in accepted}
    return config_class(**kwargs)


def tiny_policy(model_type: str, tokenizer):
    """A tiny, seeded policy of ``model_type`` (transformers' own initialisation), its output head scaled so that
    the logits are peaked (greedy decoding far from ties)."""
    import torch
    from transformers import AutoModelForCausalLM

    special_ids = {
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    config = tiny_config(model_type, len(tokenizer) + SPARE_ROWS, special_ids)
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(config).eval()
    head = policy.get_output_embeddings().weight
    with torch.no_grad():
        head.normal_(0.0, 3.0 / head.shape[1] ** 0.5)
    policy.generation_config.update(**special_ids)
    return policy


def sweep_family(model_type: str, workdir: str, *, grpo: bool = True, vllm: bool = False) -> FamilyOutcome:
    """Take one family through the stages of the module's docstring; the first that does not pass decides."""
    import torch
    from datasets import Dataset

    from hf_spec_cotrain import PolicyHead, SpecCoTrainConfig, SpecCoTrainGRPOTrainer, TapRecorder
    from hf_spec_cotrain.generation.speculative import speculative_generate
    from hf_spec_cotrain.testing import build_char_tokenizer, left_padded_prompts

    started = time.perf_counter()

    def outcome(kind: str, stage: str = "", detail: str = "", **vllm_outcome) -> FamilyOutcome:
        return FamilyOutcome(model_type, kind, stage, detail, round(time.perf_counter() - started, 1), **vllm_outcome)

    tokenizer = build_char_tokenizer()
    try:
        policy = tiny_policy(model_type, tokenizer)
        input_ids, attention_mask = left_padded_prompts([6, 3], len(tokenizer), seed=1)
        policy(input_ids=input_ids, attention_mask=attention_mask)
    except Exception as error:
        return outcome("not built", "tiny config", f"{type(error).__name__}: {error}")

    def config(drafter: str, **overrides) -> SpecCoTrainConfig:
        return SpecCoTrainConfig(
            output_dir=os.path.join(workdir, drafter + ("-vllm" if overrides else "")),
            use_cpu=True,
            bf16=False,
            report_to="none",
            per_device_train_batch_size=4,
            num_generations=2,
            max_completion_length=8,
            max_steps=1,
            logging_steps=1,
            save_strategy="no",
            seed=7,
            drafter=drafter,
            num_speculative_tokens=K,
            aux_layer_ids=TAPS if drafter == "eagle3" else None,  # DFlash taps its default, the middle layer
            draft_warmup_steps=0,
            **overrides,
        )

    def refusal_or_bug(error: Exception) -> tuple[str, str]:
        if not isinstance(error, ValueError):
            return "broken", f"{type(error).__name__}: {error}"
        if model_type not in str(error) and type(policy).__name__ not in str(error):
            return "broken", f"a refusal that does not name the family: {error}"
        return "refused", str(error)

    def speculated_without_fallback(trainer) -> str | None:
        """What is wrong with the step's log, None if nothing."""
        (log,) = [entry for entry in trainer.state.log_history if "loss" in entry]
        if "spec/fallback" in log or "spec/acceptance_length" not in log or "draft/loss" not in log:
            keys = sorted(key for key in log if key.startswith(("spec/", "draft/loss")))
            return f"fallback or no speculation in the step's log: {keys}"
        return None

    def count_upper(completions, **kwargs):
        return [float(sum(c.isupper() for c in text)) for text in completions]

    dataset = Dataset.from_dict({"prompt": ["Say A.", "Count: 1 2", "abc", "Hello"]})
    trainers = {}
    for drafter in ("eagle3", "dflash"):
        try:
            trainers[drafter] = SpecCoTrainGRPOTrainer(
                model=policy,
                reward_funcs=count_upper,
                args=config(drafter),
                train_dataset=dataset,
                processing_class=tokenizer,
            )
        except Exception as error:
            kind, detail = refusal_or_bug(error)
            return outcome(kind, f"build ({drafter})", detail)

    for drafter, trainer in trainers.items():
        try:
            with torch.no_grad():
                expected = policy.generate(
                    input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=10, do_sample=False
                )
                got = speculative_generate(
                    policy, trainer.draft, input_ids, attention_mask, max_new_tokens=10, num_speculative_tokens=K
                ).sequences
        except Exception as error:
            return outcome("broken", f"greedy ({drafter})", f"{type(error).__name__}: {error}")
        if not torch.equal(got, expected):
            return outcome(
                "broken", f"greedy ({drafter})", f"speculative {got.tolist()} != generate {expected.tolist()}"
            )

    draft = trainers["eagle3"].draft
    try:
        with TapRecorder(policy, TAPS, record_final_hidden=True) as recorder, torch.no_grad(), recorder.capture():
            logits = policy(input_ids=input_ids, attention_mask=attention_mask).logits
        rows = draft.draft_to_target_ids
        teacher = PolicyHead(policy).teacher_logits(recorder.pop().final_hidden, rows)
        error = (teacher - logits[..., rows]).abs().max().item()
    except Exception as error:
        return outcome("broken", "teacher", f"{type(error).__name__}: {error}")
    if not error < 1e-4:
        return outcome("broken", "teacher", f"teacher differs from the policy's logits by {error:.3g}")

    if grpo:
        trainer = trainers["eagle3"]
        try:
            trainer.train()
        except Exception as error:
            return outcome("broken", "grpo step", f"{type(error).__name__}: {error}")
        wrong = speculated_without_fallback(trainer)
        if wrong:
            return outcome("broken", "grpo step", wrong)
    if not vllm:
        return outcome("works")
    folder = os.path.join(workdir, "policy")  # vLLM reads the policy from its folder
    policy.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    colocated = {"use_vllm": True, "vllm_mode": "colocate", "vllm_max_model_length": 128}
    try:
        trainer = SpecCoTrainGRPOTrainer(
            model=folder,
            reward_funcs=count_upper,
            args=config("eagle3", **colocated),
            train_dataset=dataset,
            processing_class=tokenizer,
        )
    except Exception as error:
        kind, detail = refusal_or_bug(error)
        return outcome("works", vllm=kind, vllm_detail=detail)
    try:
        trainer.train()
        wrong = speculated_without_fallback(trainer)
    except Exception as error:
        wrong = f"{type(error).__name__}: {error}"
    finally:
        trainer.rollout_engine.close()
    return outcome("works", vllm="broken" if wrong else "works", vllm_detail=wrong or "")


def _run_in_child(model_type: str, grpo: bool, vllm: bool, memory_gb: float) -> dict:
    """One family in a fresh process with bounded memory (but for a vLLM engine, which maps far more address space
    than it uses); its output swallowed (one line each in the table)."""
    if not vllm:
        resource.setrlimit(resource.RLIMIT_AS, (int(memory_gb * 2**30), resource.RLIM_INFINITY))
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    with (
        tempfile.TemporaryDirectory() as workdir,
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(io.StringIO()),
    ):
        try:
            return asdict(sweep_family(model_type, workdir, grpo=grpo, vllm=vllm))
        except MemoryError as error:
            return asdict(FamilyOutcome(model_type, "not built", "memory", f"over {memory_gb} GB: {error}"))
        except Exception:  # the sweep's own bug: keep the trace
            return asdict(FamilyOutcome(model_type, "broken", "sweep", traceback.format_exc(limit=3)))


def _run_task(task: tuple) -> dict:
    return _run_in_child(*task)


def read_outcomes(path: Path) -> list[FamilyOutcome]:
    return [FamilyOutcome(**item) for item in json.loads(path.read_text(encoding="utf-8"))]


def write_table(outcomes: list[FamilyOutcome], path: Path) -> None:
    import transformers

    counts = {kind: sum(o.outcome == kind for o in outcomes) for kind in OUTCOMES}
    vllm_families = sorted(f"`{o.model_type}`" for o in outcomes if o.vllm)
    lines = [
        "# Decoder families: what the package does with each",
        "",
        f"Generated by `scripts/family_sweep.py` with transformers {transformers.__version__} (do not edit by hand).",
        "Every decoder-only causal-LM family transformers ships, built tiny from its default config, goes through the",
        "trainer with HF-native speculative rollouts (EAGLE-3 and DFlash drafts built from it, the trial generation),",
        "greedy speculative decoding against `generate`, the teacher against the policy's logits, and one GRPO step;",
        f"for {', '.join(vllm_families) or 'none'} also that step with a colocated vLLM engine (column vLLM).",
        "**works**: every stage passed; **refused**: the trainer refuses it when built, saying why and what works",
        "instead; **not built**: the sweep could not make its default config tiny (no verdict on the package).",
        "",
        "Totals: " + ", ".join(f"{counts[kind]} {kind}" for kind in OUTCOMES),
        "",
        "| family | outcome | stage | why (refusals: the trainer's message) | vLLM | seconds |",
        "|---|---|---|---|---|---|",
    ]

    def cell(text: str) -> str:
        text = " ".join(text.split()).replace("|", "\\|")
        return text if len(text) <= 400 else text[:397] + "..."

    for o in sorted(outcomes, key=lambda o: (OUTCOMES.index(o.outcome), o.model_type)):
        vllm = f"{o.vllm}: {cell(o.vllm_detail)}" if o.vllm_detail else o.vllm
        lines.append(f"| `{o.model_type}` | {o.outcome} | {o.stage} | {cell(o.detail)} | {vllm} | {o.seconds} |")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="*", help="model types (default: every decoder-only family)")
    parser.add_argument("--jobs", type=int, default=1, help="families swept at once, each in its own process")
    parser.add_argument("--memory_gb", type=float, default=6.0, help="memory limit of each family's process")
    parser.add_argument("--no_grpo", action="store_true", help="skip the GRPO steps (the other stages only)")
    parser.add_argument(
        "--vllm_families",
        nargs="*",
        default=VLLM_FAMILIES,
        help="families whose GRPO step also runs with a colocated vLLM engine (none without vLLM installed)",
    )
    parser.add_argument("--output", type=Path, help="write the markdown table here (e.g. docs/family_sweep.md)")
    parser.add_argument("--json", type=Path, help="write the outcomes as JSON here")
    args = parser.parse_args(argv)
    from hf_spec_cotrain.testing import decoder_only_families

    families = args.families or decoder_only_families()
    vllm_families = set(args.vllm_families) if importlib.util.find_spec("vllm") and not args.no_grpo else set()
    context = multiprocessing.get_context("spawn")
    outcomes = []
    with context.Pool(args.jobs, maxtasksperchild=1) as pool:
        tasks = [(family, not args.no_grpo, family in vllm_families, args.memory_gb) for family in families]
        for result in pool.imap_unordered(_run_task, tasks):
            outcome = FamilyOutcome(**result)
            outcomes.append(outcome)
            print(
                f"{outcome.model_type:28s} {outcome.outcome:10s} {outcome.stage:18s} {outcome.detail[:150]} "
                f"{outcome.vllm} {outcome.vllm_detail[:150]}",
                flush=True,
            )
    if args.output:
        write_table(outcomes, args.output)
    if args.json:
        args.json.write_text(json.dumps([asdict(o) for o in outcomes], indent=1), encoding="utf-8")
    counts = {kind: sum(o.outcome == kind for o in outcomes) for kind in OUTCOMES}
    print(", ".join(f"{counts[kind]} {kind}" for kind in OUTCOMES))
    return 1 if counts["broken"] or any(o.vllm == "broken" for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
