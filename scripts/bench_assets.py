"""Build once and cache the target, tokenizer and warm-started draft that the speculative-decoding benchmarks use.

Nothing can be downloaded here, so the benchmark models are trained locally on Python's own standard library:

1. ``tokenizer``: a byte-level BPE (vocabulary 512) trained with `tokenizers` on the stdlib's ``.py`` files (test
   packages skipped, files in sorted order; every 20th file is held out).
2. ``target``: a Llama causal LM (8 layers, hidden 512, 8 heads x 64, 4 key/value heads) trained with AdamW on a
   compute budget with a cosine schedule over that budget, saved with the tokenizer as a float32 safetensors
   folder that transformers and vLLM load.
3. ``generated``: the target's greedy continuations of real-text prefixes (generated once).
4. ``draft``: a 1-layer EAGLE-3 draft warm-started by `hf_spec_cotrain.warmstart.train_draft` on half real text,
   half those continuations, for as many steps as its compute budget buys (measured on a few calibration steps).
5. ``draft-dflash``: a 2-layer DFlash draft (blocks of 8, the pad token filling them) warm-started the same way, on
   the same data and compute budget.

Each stage writes a ``bench_manifest.json`` (its config, results and seconds) last; a stage is skipped when its
manifest exists and its config, which includes the configs of the stages it depends on, matches. A file lock
serialises concurrent callers. Budgets are compute, not wall clock: minutes of CPU time per torch thread (what
the wall clock shows on an idle machine), so a loaded machine takes longer but trains as much; each manifest
records the steps and wall-clock seconds.

From a benchmark (``scripts/`` is not a package, so put it on the path first)::

    sys.path.insert(0, str(Path(__file__).resolve().parent))  # a script in scripts/
    from bench_assets import ensure_bench_assets

    assets = ensure_bench_assets()  # BenchAssets(target_dir=..., draft_dir=..., ...)

From the shell (about 100 minutes the first time on an idle machine with the default budgets)::

    OMP_NUM_THREADS=2 python scripts/bench_assets.py [--cache_dir DIR] [--target_minutes 40] [--draft_minutes 40]
"""

import argparse
import fcntl
import hashlib
import json
import math
import os
import shutil
import sys
import sysconfig
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch


CACHE_ENV = "HF_SPEC_COTRAIN_BENCH_DIR"
DEFAULT_CACHE_DIR = Path("~/.cache/hf_spec_cotrain/bench")
MANIFEST = "bench_manifest.json"
PAD, BOS, EOS = "<pad>", "<s>", "</s>"
# Test packages are large, repetitive and not what a model writes; `site-packages` is not the stdlib.
SKIPPED_FOLDERS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})
HELD_OUT_EVERY = 20


@dataclass(frozen=True)
class CorpusConfig:
    held_out_every: int = HELD_OUT_EVERY


@dataclass(frozen=True)
class TokenizerConfig:
    vocab_size: int = 512


@dataclass(frozen=True)
class TargetConfig:
    num_layers: int = 8
    hidden_size: int = 512
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 64
    intermediate_size: int = 1376
    max_position_embeddings: int = 2048
    seq_len: int = 256
    batch_size: int = 8  # small batches: a CPU budget buys few steps, and early training needs steps more than tokens
    learning_rate: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0
    # bf16 autocast (float32 master weights, saved in float32): about 1.8x the steps per CPU minute on an
    # AVX512-BF16 CPU. None: on where bf16 matmuls beat float32 ones (`bf16_matmul_pays`).
    autocast_bf16: bool | None = None
    minutes: float = 40.0
    num_eval_windows: int = 64
    seed: int = 0


@dataclass(frozen=True)
class GenerationConfig:
    prefix_len: int = 64
    new_tokens: int = 192
    num_train: int = 768  # the draft trains on these and as many real windows: ~12 epochs of its budget
    num_eval: int = 16
    batch_size: int = 64
    seed: int = 1


@dataclass(frozen=True)
class WarmStartConfig:
    """What both drafts' warm starts share: the optimiser, the data's shape and the compute budget."""

    learning_rate: float = 1e-3
    warmup_steps: int = 20
    batch_size: int = 8
    max_length: int = 512
    # bf16 autocast (about 1.7x the steps per CPU minute with AVX512-BF16); None: as the target's
    bf16: bool | None = None
    minutes: float = 40.0
    seed: int = 0

    def optimisation_fields(self, folder: Path, max_steps: int) -> dict:
        """`DraftTrainingConfig` fields of a warm start of ``max_steps`` into ``folder``: a cosine schedule."""
        return dict(
            output_dir=str(folder),
            max_length=self.max_length,
            learning_rate=self.learning_rate,
            warmup_steps=min(self.warmup_steps, max_steps // 4),
            lr_scheduler_type="cosine",
            batch_size=self.batch_size,
            max_steps=max_steps,
            bf16=self.bf16,
            seed=self.seed,
        )


@dataclass(frozen=True)
class DraftConfig(WarmStartConfig):
    num_layers: int = 1
    aux_layer_ids: tuple[int, ...] = (2, 4, 5)
    draft_vocab_size: int | None = None  # None: the full vocabulary
    ttt_steps: int = 3

    def training_config(self, folder: Path, max_steps: int, tokenizer) -> dict:
        """`DraftTrainingConfig` fields of the EAGLE-3 warm start (which needs no token of the ``tokenizer``)."""
        return dict(
            **self.optimisation_fields(folder, max_steps),
            num_layers=self.num_layers,
            aux_layer_ids=list(self.aux_layer_ids),
            draft_vocab_size=self.draft_vocab_size,
            ttt_steps=self.ttt_steps,
        )


@dataclass(frozen=True)
class DFlashDraftConfig(WarmStartConfig):
    """Two layers, as the main job's DFlash warm start (one block forward reads the context once, where EAGLE-3's
    chain runs its layer K times), and more anchors per sequence than the trainer's default (blocks are few)."""

    num_layers: int = 2
    block_size: int = 8
    anchors_per_row: int = 16
    target_layer_ids: tuple[int, ...] | None = None  # None: spread over the target's depth
    mask_token: str = PAD  # fills the blocks: no training window holds it, and the vocabulary has no spare row

    def training_config(self, folder: Path, max_steps: int, tokenizer) -> dict:
        """`DraftTrainingConfig` fields of the DFlash warm start."""
        return dict(
            **self.optimisation_fields(folder, max_steps),
            drafter="dflash",
            num_layers=self.num_layers,
            dflash_block_size=self.block_size,
            dflash_anchors_per_row=self.anchors_per_row,
            dflash_target_layer_ids=None if self.target_layer_ids is None else list(self.target_layer_ids),
            dflash_mask_token_id=tokenizer.convert_tokens_to_ids(self.mask_token),
        )


@dataclass
class BenchAssets:
    """Folders of the cached assets and the metrics recorded when they were built."""

    cache_dir: Path
    target_dir: Path  # model + tokenizer + generation config: `from_pretrained` and `vllm.LLM(model=...)`
    # drafter family -> its checkpoint (`load_draft`, and vLLM's "eagle3" / "dflash" method)
    draft_dirs: dict[str, Path]
    target_metrics: dict = field(default_factory=dict)
    draft_metrics: dict[str, dict] = field(default_factory=dict)

    @property
    def tokenizer_dir(self) -> Path:
        return self.target_dir


@dataclass
class Corpus:
    train_texts: list[str]
    eval_texts: list[str]
    fingerprint: str


def stdlib_corpus(config: CorpusConfig = CorpusConfig()) -> Corpus:
    """The stdlib's non-test ``.py`` files in sorted order; every ``held_out_every``-th one is held out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        path
        for path in root.rglob("*.py")
        if not SKIPPED_FOLDERS.intersection(path.relative_to(root).parts[:-1]) and not path.name.startswith("test_")
    )
    if not files:
        raise RuntimeError(f"No standard-library sources under {root}: cannot build the benchmark corpus.")
    digest = hashlib.sha256()
    train_texts, eval_texts = [], []
    for index, path in enumerate(files):
        text = path.read_text(encoding="utf-8", errors="replace")
        digest.update(str(path.relative_to(root)).encode() + b"\0" + text.encode() + b"\0")
        (eval_texts if index % config.held_out_every == 0 else train_texts).append(text)
    return Corpus(train_texts=train_texts, eval_texts=eval_texts, fingerprint=digest.hexdigest()[:16])


# ---------------------------------------------------------------------------------------------- stages


class Stage:
    """A folder whose ``bench_manifest.json`` is written last and records the config that produced it.

    Rebuilding a stage deletes the ``downstream`` stages' folders: they were built from the old output.
    """

    def __init__(self, folder: Path, config: dict, *, downstream: tuple[Path, ...] = ()):
        self.folder = folder
        self.config = json.loads(json.dumps(config))  # tuples -> lists, as they come back from JSON
        self.downstream = downstream

    @property
    def manifest(self) -> dict | None:
        path = self.folder / MANIFEST
        if not path.is_file():
            return None
        manifest = json.loads(path.read_text())
        return manifest if manifest.get("config") == self.config else None

    def start(self) -> float:
        for folder in (self.folder, *self.downstream):
            if folder.exists():
                shutil.rmtree(folder)
        self.folder.mkdir(parents=True)
        return time.perf_counter()

    def finish(self, started: float, results: dict) -> dict:
        import transformers

        manifest = {
            "config": self.config,
            "results": results,
            "seconds": round(time.perf_counter() - started, 1),
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        }
        (self.folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        return manifest


def compute_clock() -> float:
    """Seconds of CPU time of this process per torch thread: wall-clock seconds on an idle machine."""
    return time.process_time() / torch.get_num_threads()


def _log(message: str) -> None:
    print(f"[bench_assets] {message}", flush=True)


def _report(name: str, manifest: dict, *, cached: bool) -> None:
    results = ", ".join(f"{key}={_fmt(value)}" for key, value in manifest["results"].items())
    origin = "cached" if cached else "built"
    _log(f"{name}: {origin} ({manifest['seconds']:.0f} s to build){': ' + results if results else ''}")


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def build_tokenizer(corpus: Corpus, config: TokenizerConfig):
    """A byte-level BPE that adds ``<s>`` in front of every encoded text (as the target was trained)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus.train_texts, trainer=trainer)
    bos_id = backend.token_to_id(BOS)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD, bos_token=BOS, eos_token=EOS, clean_up_tokenization_spaces=False
    )


def _token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """All texts as one stream ``<s> file </s> <s> file </s> ...`` (int64)."""
    ids = tokenizer(texts)["input_ids"]
    return torch.tensor([token for row in ids for token in (*row, tokenizer.eos_token_id)], dtype=torch.int64)


def _eval_windows(stream: torch.Tensor, length: int, count: int) -> torch.Tensor:
    """``count`` evenly spaced, non-overlapping windows ``[count, length]`` of ``stream``."""
    count = min(count, len(stream) // length)
    starts = torch.linspace(0, len(stream) - length, count).long()
    return torch.stack([stream[start : start + length] for start in starts])


@torch.no_grad()
def held_out_loss(model, windows: torch.Tensor, batch_size: int) -> float:
    """Mean next-token cross-entropy (nats/token) over ``windows``."""
    was_training = model.training
    model.eval()
    total = 0.0
    for start in range(0, len(windows), batch_size):
        batch = windows[start : start + batch_size]
        total += model(input_ids=batch, labels=batch).loss.item() * len(batch)
    model.train(was_training)
    return total / len(windows)


def build_target(tokenizer, corpus: Corpus, config: TargetConfig, folder: Path) -> dict:
    """Train the target for ``config.minutes`` of compute (`compute_clock`) and save it (float32) with the tokenizer."""
    from transformers import GenerationConfig as HFGenerationConfig
    from transformers import LlamaConfig, LlamaForCausalLM

    train_stream = _token_stream(tokenizer, corpus.train_texts)
    eval_windows = _eval_windows(_token_stream(tokenizer, corpus.eval_texts), config.seq_len, config.num_eval_windows)
    torch.manual_seed(config.seed)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_layers,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=False,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    num_params = sum(p.numel() for p in model.parameters())
    _log(
        f"target: {num_params / 1e6:.1f}M parameters, {len(train_stream) / 1e6:.2f}M training tokens, "
        f"{config.minutes:g} min budget on {torch.get_num_threads()} thread(s)"
    )
    initial_loss = held_out_loss(model, eval_windows, config.batch_size)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.learning_rate,
        betas=(0.9, 0.95),
    )
    generator = torch.Generator().manual_seed(config.seed)
    budget_s = config.minutes * 60
    model.train()
    started, wall_started, last_log = compute_clock(), time.perf_counter(), time.perf_counter()
    step = 0
    while (elapsed := compute_clock() - started) < budget_s:
        # Cosine over the compute budget (the number of steps it buys is not known up front).
        progress = elapsed / budget_s
        cosine = config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        for group in optimizer.param_groups:
            group["lr"] = config.learning_rate * min(1.0, (step + 1) / config.warmup_steps) * cosine
        starts = torch.randint(0, len(train_stream) - config.seq_len, (config.batch_size,), generator=generator)
        batch = torch.stack([train_stream[start : start + config.seq_len] for start in starts])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.autocast_bf16):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if time.perf_counter() - last_log > 60:
            last_log = time.perf_counter()
            _log(f"target: step {step}, {elapsed / 60:.1f} compute min, train loss {loss.item():.3f}")
    wall_seconds = time.perf_counter() - wall_started
    final_loss = held_out_loss(model, eval_windows, config.batch_size)

    model.generation_config = HFGenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return {
        "held_out_loss": final_loss,
        "held_out_loss_untrained": initial_loss,
        "steps": step,
        "train_tokens": step * config.batch_size * config.seq_len,
        "train_wall_seconds": round(wall_seconds, 1),
        "num_parameters": num_params,
    }


@torch.no_grad()
def generate_continuations(target, tokenizer, corpus: Corpus, config: GenerationConfig) -> dict[str, list[list[int]]]:
    """The target's greedy continuations of random ``prefix_len``-token windows (train and held-out files)."""
    generator = torch.Generator().manual_seed(config.seed)
    out = {}
    for split, texts, count in (
        ("train", corpus.train_texts, config.num_train),
        ("eval", corpus.eval_texts, config.num_eval),
    ):
        stream = _token_stream(tokenizer, texts)
        starts = torch.randint(0, len(stream) - config.prefix_len, (count,), generator=generator)
        prefixes = torch.stack([stream[start : start + config.prefix_len] for start in starts])
        sequences = []
        for start in range(0, count, config.batch_size):
            batch = prefixes[start : start + config.batch_size]
            generated = target.generate(
                batch,
                attention_mask=torch.ones_like(batch),
                max_new_tokens=config.new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
            for row in generated.tolist():
                continuation = row[config.prefix_len :]
                if tokenizer.eos_token_id in continuation:  # stop at the target's own end of file
                    continuation = continuation[: continuation.index(tokenizer.eos_token_id)]
                sequences.append(row[: config.prefix_len] + continuation)
        out[split] = sequences
    return out


def _real_windows(tokenizer, texts: list[str], *, length: int, count: int, seed: int) -> list[list[int]]:
    stream = _token_stream(tokenizer, texts)
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(stream) - length, (count,), generator=generator)
    return [stream[start : start + length].tolist() for start in starts]


def _as_texts(tokenizer, sequences: list[list[int]]) -> list[str]:
    return tokenizer.batch_decode(sequences, skip_special_tokens=True)


def draft_step_seconds(target, tokenizer, sequences: list[list[int]], training, *, num_steps: int = 2) -> float:
    """Compute-clock seconds of one draft training step (target forward, the family's objective forward and
    backward) under the `DraftTrainingConfig` ``training``, measured on a throwaway draft after one warm-up step."""
    from hf_spec_cotrain.draft import count_tokens, drafter_family
    from hf_spec_cotrain.warmstart import draft_loss_on_batch, draft_tap_recorder, pad_rows

    family = drafter_family(training.drafter)
    draft = family.from_target(
        target,
        **family.from_target_options(training, tokenizer),
        draft_vocab_size=training.draft_vocab_size,
        token_counts=count_tokens(sequences, target.config.vocab_size),
    )
    input_ids, attention_mask = pad_rows(sequences[: training.batch_size], tokenizer.pad_token_id)
    seconds = []
    with draft_tap_recorder(target, draft) as recorder:
        for _ in range(num_steps + 1):
            started = compute_clock()
            out = draft_loss_on_batch(
                target,
                draft,
                recorder,
                input_ids,
                attention_mask,
                options=draft.training_options(training),
                bf16=training.bf16,
            )
            out.loss.backward()
            seconds.append(compute_clock() - started)
    return sum(seconds[1:]) / num_steps


def build_draft(
    target,
    tokenizer,
    corpus: Corpus,
    generated: dict,
    gen_config: GenerationConfig,
    config: "DraftConfig | DFlashDraftConfig",
    folder: Path,
) -> dict:
    """Warm-start the draft on half real text, half the target's own continuations; evaluate on held-out files.

    The number of steps is the compute budget divided by the cost of a calibration step, so that a loaded machine
    trains the same draft (more slowly) and the schedule can decay over the whole run.
    """
    from datasets import Dataset

    from hf_spec_cotrain.warmstart import DraftTrainingConfig, evaluate_draft, tokenize_for_draft, train_draft

    window = gen_config.prefix_len + gen_config.new_tokens
    real = {
        split: _real_windows(tokenizer, texts, length=window, count=len(generated[split]), seed=config.seed + index)
        for index, (split, texts) in enumerate((("train", corpus.train_texts), ("eval", corpus.eval_texts)))
    }
    train_texts = _as_texts(tokenizer, real["train"]) + _as_texts(tokenizer, generated["train"])
    dataset = Dataset.from_dict({"text": train_texts})
    step_seconds = draft_step_seconds(
        target,
        tokenizer,
        tokenize_for_draft(dataset, tokenizer, max_length=config.max_length),
        DraftTrainingConfig(**config.training_config(folder, 1, tokenizer)),
    )
    max_steps = max(1, round(config.minutes * 60 / step_seconds))
    # evaluated below on held-out files instead
    training = DraftTrainingConfig(**config.training_config(folder, max_steps, tokenizer), eval_fraction=0.0)
    _log(
        f"{training.drafter} draft: {len(train_texts)} training sequences, {config.minutes:g} compute min = "
        f"{max_steps} steps of {step_seconds:.1f} s"
    )
    result = train_draft(target, tokenizer, dataset, training, progress=False)
    results = {"steps": result.steps, "train_wall_seconds": round(result.train_seconds, 1)}
    for split, sequences in (("real", real["eval"]), ("generated", generated["eval"])):
        eval_ids = tokenize_for_draft(
            Dataset.from_dict({"text": _as_texts(tokenizer, sequences)}), tokenizer, max_length=config.max_length
        )
        metrics = evaluate_draft(
            target,
            result.draft,
            eval_ids,
            batch_size=config.batch_size,
            pad_id=tokenizer.pad_token_id,
            options=result.draft.training_options(training),
        )
        results.update({f"held_out_{split}_{key}": value for key, value in metrics.items()})
    return results


# ---------------------------------------------------------------------------------------------- entry point


@contextmanager
def _locked(cache_dir: Path):
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def bf16_matmul_pays(size: int = 256) -> bool:
    """Whether a bfloat16 matmul beats a float32 one on this CPU: with AVX512-BF16 or AMX it does (about 1.7x the
    training steps per minute); without them PyTorch emulates it, tens of times slower."""
    a, b = torch.randn(size, 2 * size), torch.randn(2 * size, size)
    seconds = {}
    for dtype in (torch.float32, torch.bfloat16):
        x, y = a.to(dtype), b.to(dtype)
        x @ y  # warm-up
        started = time.perf_counter()
        for _ in range(3):
            x @ y
        seconds[dtype] = time.perf_counter() - started
    return seconds[torch.bfloat16] < seconds[torch.float32]


def resolve_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir``, else ``$HF_SPEC_COTRAIN_BENCH_DIR``, else ``~/.cache/hf_spec_cotrain/bench``."""
    chosen = cache_dir or os.environ.get(CACHE_ENV) or DEFAULT_CACHE_DIR
    return Path(chosen).expanduser().resolve()


def ensure_bench_assets(
    cache_dir: str | os.PathLike | None = None,
    *,
    target_minutes: float = TargetConfig.minutes,
    draft_minutes: float = DraftConfig.minutes,
) -> BenchAssets:
    """Build (or reuse) the tokenizer, target, continuations and drafts under ``cache_dir``; return their folders.

    Each pair of budgets has its own sub-folder, so asking for other budgets builds beside the cached assets and
    never deletes them (rebuilding one takes up to an hour of CPU)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not target_minutes > 0 or not draft_minutes > 0:
        raise ValueError(
            f"`target_minutes`={target_minutes} and `draft_minutes`={draft_minutes} must both be > 0 (minutes of "
            "compute: CPU time per torch thread)."
        )
    cache_dir = resolve_cache_dir(cache_dir) / f"target-{target_minutes:g}min-draft-{draft_minutes:g}min"
    corpus_config, tokenizer_config = CorpusConfig(), TokenizerConfig()
    bf16 = bf16_matmul_pays()
    target_config = TargetConfig(minutes=target_minutes, autocast_bf16=bf16)
    gen_config = GenerationConfig()
    draft_folders = {"eagle3": cache_dir / "draft", "dflash": cache_dir / "draft-dflash"}
    with _locked(cache_dir):
        corpus = stdlib_corpus(corpus_config)
        _log(f"corpus: {len(corpus.train_texts)} train / {len(corpus.eval_texts)} held-out stdlib files")
        upstream = {"corpus": {**asdict(corpus_config), "fingerprint": corpus.fingerprint}}

        upstream["tokenizer"] = asdict(tokenizer_config)
        upstream["target"] = asdict(target_config)
        target_stage = Stage(
            cache_dir / "target",
            dict(upstream),
            downstream=(cache_dir / "generated", *draft_folders.values()),
        )
        target_manifest = target_stage.manifest
        if target_manifest is None:
            started = target_stage.start()
            tokenizer = build_tokenizer(corpus, tokenizer_config)
            target_manifest = target_stage.finish(
                started, build_target(tokenizer, corpus, target_config, target_stage.folder)
            )
            _report("target", target_manifest, cached=False)
        else:
            _report("target", target_manifest, cached=True)

        upstream["generation"] = asdict(gen_config)
        generated_stage = Stage(cache_dir / "generated", dict(upstream), downstream=tuple(draft_folders.values()))
        # Each draft's stage config is the upstream one plus its own, under the key its stage had from the start.
        draft_stages = {
            drafter: (
                Stage(draft_folders[drafter], {**upstream, key: asdict(config)}),
                config,
            )
            for drafter, key, config in (
                ("eagle3", "draft", DraftConfig(minutes=draft_minutes, bf16=bf16)),
                ("dflash", "dflash_draft", DFlashDraftConfig(minutes=draft_minutes, bf16=bf16)),
            )
        }
        generated_manifest = generated_stage.manifest
        draft_manifests = {drafter: stage.manifest for drafter, (stage, _) in draft_stages.items()}
        if generated_manifest is None or None in draft_manifests.values():
            tokenizer = AutoTokenizer.from_pretrained(target_stage.folder)
            target = AutoModelForCausalLM.from_pretrained(target_stage.folder, dtype=torch.float32).eval()
        if generated_manifest is None:
            started = generated_stage.start()
            generated = generate_continuations(target, tokenizer, corpus, gen_config)
            (generated_stage.folder / "sequences.json").write_text(json.dumps(generated))
            lengths = [len(row) - gen_config.prefix_len for rows in generated.values() for row in rows]
            generated_manifest = generated_stage.finish(
                started, {"sequences": len(lengths), "mean_new_tokens": sum(lengths) / len(lengths)}
            )
            _report("generated", generated_manifest, cached=False)
        else:
            _report("generated", generated_manifest, cached=True)
        for drafter, (stage, config) in draft_stages.items():
            name = f"{drafter} draft"
            if draft_manifests[drafter] is None:
                generated = json.loads((generated_stage.folder / "sequences.json").read_text())
                started = stage.start()
                results = build_draft(target, tokenizer, corpus, generated, gen_config, config, stage.folder)
                draft_manifests[drafter] = stage.finish(started, results)
                _report(name, draft_manifests[drafter], cached=False)
            else:
                _report(name, draft_manifests[drafter], cached=True)
    return BenchAssets(
        cache_dir=cache_dir,
        target_dir=target_stage.folder,
        draft_dirs={drafter: stage.folder for drafter, (stage, _) in draft_stages.items()},
        target_metrics=target_manifest["results"],
        draft_metrics={drafter: manifest["results"] for drafter, manifest in draft_manifests.items()},
    )


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache_dir", default=None, help=f"default: ${CACHE_ENV} or {DEFAULT_CACHE_DIR}")
    parser.add_argument(
        "--target_minutes", type=float, default=TargetConfig.minutes, help="compute budget of the target (CPU min)"
    )
    parser.add_argument(
        "--draft_minutes", type=float, default=DraftConfig.minutes, help="compute budget of each draft (CPU min)"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: OMP_NUM_THREADS)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = make_parser().parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    assets = ensure_bench_assets(args.cache_dir, target_minutes=args.target_minutes, draft_minutes=args.draft_minutes)
    print(f"target: {assets.target_dir}")
    for drafter, folder in assets.draft_dirs.items():
        print(f"{drafter} draft: {folder}")


if __name__ == "__main__":
    sys.exit(main())
