"""The drafter interface (docs/design.md section 3a): what the trainer, the rollouts, the warm start, the checkpoints
and the model card ask of a draft, whatever its family (EAGLE-3, DFlash, ...).

A family is one draft model class implementing `DraftModel`, registered in `DRAFTER_FAMILIES` under the name
`SpecCoTrainConfig.drafter` takes. Nothing outside a family's own modules branches on the family: callers use these
methods only, so a new family is a new module plus one registry entry.
"""

import abc
import dataclasses
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate.utils import patch_environment
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from transformers import DynamicCache, PreTrainedConfig, PreTrainedModel
from transformers import initialization as init
from transformers.utils import CONFIG_NAME, SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, cached_file

from ..attention.decoding import compact_slots
from .checks import VOCAB_MAPS, check_draft_tensors, weight_problems
from .upload import push_draft_folder
from .vocab import vocab_maps


@dataclass
class DraftTrainingBatch:
    """One policy forward's taps and targets, as every family's training objective takes them.

    ``aux_hidden_states``: the tapped layer inputs concatenated, ``[B, L, n * target_hidden]`` (in the order of
    `DraftModel.tap_layer_ids`); ``input_embeds``: the policy's token embeddings ``[B, L, hidden]``;
    ``teacher_logits``: ``[B, L, draft_vocab_size]``, at position ``p`` the policy's prediction of ``x_{p+1}``
    (`DraftModel.teacher_logits`); ``loss_mask``: ``[B, L]``, True where predicting ``x_p`` counts (completion
    tokens); ``attention_mask``: ``[B, L]`` padding of rows whose real tokens are contiguous, or None;
    ``cu_seqlens``: packed document boundaries (B = 1), or None; under context parallelism every ``[B, L]`` tensor is
    this rank's zigzag shard and ``cu_seqlens`` stays global.
    """

    aux_hidden_states: torch.Tensor
    input_embeds: torch.Tensor
    teacher_logits: torch.Tensor
    loss_mask: torch.Tensor
    attention_mask: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None


@dataclass
class DraftLossOutput:
    """A family's training loss and its per-position metrics, detached, each ``[K]``: position ``d`` is the d-th
    drafted token of a round (EAGLE-3: the d-th unrolled step; DFlash: the d-th mask position of a block).
    ``step_losses`` and ``step_accuracies`` are means over the ``step_counts`` counted positions; the whole loss is
    ``(step_weights * step_losses).sum()`` (what decides a skip when ``loss`` is one context-parallel rank's share)."""

    loss: torch.Tensor
    step_losses: torch.Tensor
    step_accuracies: torch.Tensor
    step_counts: torch.Tensor
    step_weights: torch.Tensor


def config_field(args: Any, *names: str) -> Any:
    """The value of the first of ``names`` that ``args`` has: `SpecCoTrainConfig` and `DraftTrainingConfig` name a
    few draft fields apart (``draft_num_layers`` / ``num_layers``), and a family's `training_options` and
    `from_target_options` read either."""
    for name in names:
        if hasattr(args, name):
            return getattr(args, name)
    raise AttributeError(f"{type(args).__name__} has none of the fields {', '.join(names)}.")


# sample(draft_logits [R, draft_vocab]) -> (target ids [R], the distribution q [R, vocab] they were drawn from, or
# None for an argmax): the decoder's, which applies the rollout's warpers and random stream.
SampleFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


class DraftProposer(abc.ABC):
    """One `speculative_generate` call's drafting state over its live rows (the draft's own caches).

    The decoder verifies and keeps the target's state; it hands the proposer what the target verified
    (`catch_up`), asks for up to K tokens per round (`propose`) and tells it which rows remain (`keep_rows`).
    """

    @abc.abstractmethod
    def catch_up(
        self, next_tokens: torch.Tensor, taps: torch.Tensor, position_ids: torch.Tensor, valid: torch.Tensor
    ) -> None:
        """Positions the target verified since the last round, ``[R, L]``: ``taps[:, j]`` the target's taps at
        ``position_ids[:, j]``, ``next_tokens[:, j]`` the token that follows it, ``valid`` False at holes
        (rejected slots). Called before each `propose`; may defer its work to it."""

    @abc.abstractmethod
    def propose(
        self, last_token: torch.Tensor, next_position: torch.Tensor, k: int, sample: SampleFn
    ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """``k >= 1`` draft tokens per row after ``last_token`` (the last verified token, at ``next_position``):
        target ids ``[R, k]`` and, per drafted position, the distribution each was drawn from (`SampleFn`)."""

    @abc.abstractmethod
    def keep_rows(self, keep: torch.Tensor) -> None:
        """Keep only rows ``keep`` (int64 indices into the current rows), in that order."""

    @abc.abstractmethod
    def compact(self) -> None:
        """Drop cache slots no later round can see (a hint, called after each round)."""


class CachedProposer(DraftProposer):
    """A proposer whose state is the draft's own KV cache with a slot mask (False at holes and padding) and the
    verified positions waiting for the next round that drafts (``pending``: rounds of K = 0 never run the draft).
    Subclasses decide what of `catch_up`'s inputs they keep (`pending_inputs`) and how a round uses them."""

    def __init__(self, draft: "DraftModel", embed: Callable[[torch.Tensor], torch.Tensor]):
        self.draft, self.embed = draft, embed
        self.cache = DynamicCache()
        self.slot_mask: torch.Tensor | None = None  # [R, slots]
        self.pending: list[tuple[torch.Tensor, ...]] = []

    def pending_inputs(
        self, next_tokens: torch.Tensor, taps: torch.Tensor, position_ids: torch.Tensor, valid: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """What of one `catch_up` the family keeps for its next round (all of it by default)."""
        return next_tokens, taps, position_ids, valid

    def catch_up(
        self, next_tokens: torch.Tensor, taps: torch.Tensor, position_ids: torch.Tensor, valid: torch.Tensor
    ) -> None:
        if self.slot_mask is None:
            self.slot_mask = valid[:, :0]
        self.pending.append(self.pending_inputs(next_tokens, taps, position_ids, valid))

    def keep_rows(self, keep: torch.Tensor) -> None:
        self.cache.batch_select_indices(keep)
        self.slot_mask = self.slot_mask[keep]
        self.pending = [tuple(t[keep] for t in chunk) for chunk in self.pending]

    def compact(self) -> None:
        self.slot_mask = compact_slots(self.cache, self.slot_mask)


class DraftModel(PreTrainedModel):
    """A drafter family's model: a small network on the target's taps that proposes tokens for the target to
    verify, reading the target's token embedding (bound by `bind_target`, never saved, never trained).

    Subclasses set `drafter_name` (the `SpecCoTrainConfig.drafter` value), `vllm_method` (vLLM's
    `speculative_config["method"]`) and `checkpoint_architecture` (the ``architectures`` entry vLLM dispatches on),
    register their vocabulary maps (`_register_vocab_maps`) and implement the abstract methods below. Their config
    carries ``vocab_size`` (the target's) and ``draft_vocab_size``.

    What every family shares lives here: strict safetensors loading, saving from a chosen rank, the Hub upload, the
    weight checks, the draft-to-target vocabulary (``d2t`` offsets, vLLM's convention, and optionally the ``t2d``
    mask), the bound target's embedding and the teacher's logits over the draft vocabulary.
    """

    drafter_name: ClassVar[str]
    vllm_method: ClassVar[str]
    checkpoint_architecture: ClassVar[str]
    display_name: ClassVar[str]  # the family in messages ("EAGLE-3")
    card_template: ClassVar[str]  # its model card's template in the repository's model_cards/ (`draft.card`)
    # The draft's names in vLLM for the per-step weight sync (`to_vllm`, `to_checkpoint`, `relayout`,
    # `unknown_problems`: `hf_spec_cotrain.generation.vllm_layout.WeightNames`).
    vllm_weight_names: ClassVar[Any]
    base_model_prefix = "draft"
    main_input_name = "input_ids"
    # Checkpoints from other tools may carry the target's embedding; the draft reads the bound target's instead.
    _keys_to_ignore_on_load_unexpected = [r"^embed_tokens\.weight$"]
    _save_on_this_rank = False  # set by `save_pretrained(on_this_rank=True)` while it runs

    def __init__(self, config):
        super().__init__(config)
        self.__dict__["_target_embedding"] = None  # a reference, not a submodule: never saved, never trained
        self.__dict__["_token_rows"] = None  # the rows of `embedded_token_ids` while `token_rows` binds them

    def _register_vocab_maps(self, *, with_t2d: bool = True) -> None:
        """``d2t`` (int64 ``[draft_vocab_size]``, target id = draft id + offset) and, with ``with_t2d``, ``t2d`` (bool
        ``[vocab_size]``, the target ids in the draft vocabulary). vLLM 0.31 refuses a ``d2t`` when the two
        vocabularies are equal: it stays out of the checkpoint then."""
        reduced = self.config.draft_vocab_size < self.config.vocab_size
        self.register_buffer("d2t", torch.zeros(self.config.draft_vocab_size, dtype=torch.int64), persistent=reduced)
        if with_t2d:
            self.register_buffer("t2d", torch.ones(self.config.vocab_size, dtype=torch.bool))

    @property
    def vocab_map_buffers(self) -> dict[str, torch.Tensor]:
        """The vocabulary maps this family keeps (``d2t``, and ``t2d`` where it has one), by checkpoint name."""
        buffers = dict(self.named_buffers())
        return {name: buffers[name] for name in VOCAB_MAPS if name in buffers}

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if module is self:
            for name, tensor in self.vocab_map_buffers.items():
                (init.zeros_ if name == "d2t" else init.ones_)(tensor)

    @torch.no_grad()
    def _set_draft_vocab(self, draft_ids: torch.Tensor) -> None:
        """Keep the target ids ``draft_ids`` (ascending) as the draft vocabulary (`vocab_map_buffers`)."""
        buffers = self.vocab_map_buffers
        for name, tensor in zip(("d2t", "t2d"), vocab_maps(draft_ids, self.config.vocab_size)):
            if name in buffers:
                buffers[name].copy_(tensor)

    # ------------------------------------------------------------------ building and binding

    @classmethod
    @abc.abstractmethod
    def from_target(cls, target: PreTrainedModel, **options: Any) -> "DraftModel":
        """A fresh draft sized for ``target``, bound to it (`bind_target`)."""

    @classmethod
    @abc.abstractmethod
    def from_target_options(cls, args: Any, tokenizer: Any = None) -> dict[str, Any]:
        """The family's own `from_target` options from a `SpecCoTrainConfig` or `DraftTrainingConfig` and the
        policy's tokenizer, for what a family derives from it (DFlash's mask token); ``draft_vocab_size`` and
        ``token_counts``, which every family takes, come from the caller."""

    @classmethod
    @abc.abstractmethod
    def shape_options(cls, config: PreTrainedConfig) -> dict[str, Any]:
        """The `SpecCoTrainConfig` options that shape a draft of this family (depth, vocabulary, taps, ...), by their
        names, with the values ``config`` holds: a checkpoint's draft resumes only into a run whose draft has the same
        (`hf_spec_cotrain.training.checkpoints.check_draft_shape`)."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, target=None, **kwargs):
        """Load a draft checkpoint (safetensors only) of this family.

        ``t2d``/``d2t`` absent means the full vocabulary. Loading is strict: a checkpoint without a ``config.json`` of
        this family's model type, or without every other tensor, is refused before the draft is built; so is a draft
        that fails `validate_weights` or whose stored weights are not floating in the config's dtype.
        Pass ``target=`` to validate and bind in one go.
        """
        if kwargs.get("use_safetensors") is False:
            raise ValueError("`use_safetensors=False` is not allowed: drafts load from safetensors only.")
        kwargs["use_safetensors"] = True
        key_mapping = cls._checkpoint_key_mapping()
        if key_mapping is not None:
            kwargs.setdefault("key_mapping", key_mapping)
        _check_folder_or_repo_id(pretrained_model_name_or_path)
        what, hub_kwargs = f"The draft checkpoint {pretrained_model_name_or_path}", _hub_kwargs(kwargs)
        config = kwargs.get("config")
        if not isinstance(config, PreTrainedConfig):
            config = cls._checkpoint_config(pretrained_model_name_or_path, hub_kwargs, what)
        files = _checkpoint_files(pretrained_model_name_or_path, hub_kwargs)
        cls._check_stored_weights(files, config, what)
        want_info = kwargs.pop("output_loading_info", False)
        # Under FSDP's CPU-RAM-efficient loading transformers reads the weights on local rank 0 only and leaves zeros
        # elsewhere for FSDP to broadcast; the draft is replicated, never FSDP-wrapped, so every rank reads it.
        with patch_environment(FSDP_CPU_RAM_EFFICIENT_LOADING="false"):
            draft, info = super().from_pretrained(
                pretrained_model_name_or_path, *model_args, output_loading_info=True, **kwargs
            )
        missing = set(info["missing_keys"])
        draft._check_stored_dtypes(files, what=what)
        draft._complete_vocab_maps(missing)
        draft.validate_weights(what=what)
        if target is not None:
            draft.bind_target(target)
        return (draft, info) if want_info else draft

    @classmethod
    def _checkpoint_config(cls, name_or_path, hub_kwargs: dict, what: str) -> PreTrainedConfig:
        """The checkpoint's config, from its ``config.json`` (downloaded first, for a Hub id); refused when there is
        none, or one of another model type or that this family cannot read: transformers would otherwise build a
        draft from the config class's defaults or from another model's sizes (32 layers of 4096 for EAGLE-3: minutes
        and ~17 GB) before finding none of its weights."""
        instead = (
            f"Pass a {cls.display_name} draft checkpoint (the folder `save_pretrained` writes: config.json and "
            "safetensors weights), or leave `draft_model_name_or_path` unset to build a draft from the policy."
        )
        config_file = cached_file(name_or_path, CONFIG_NAME, _raise_exceptions_for_missing_entries=False, **hub_kwargs)
        if config_file is None:
            where = _where_config_is_missing(Path(name_or_path, hub_kwargs.get("subfolder") or ""))
            raise FileNotFoundError(f"{what} has no config.json: {where}. {instead}")
        try:
            config_dict = json.loads(Path(config_file).read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{what} has a config.json that is not JSON ({error}). {instead}") from None
        expected = cls.config_class.model_type
        try:
            model_type = cls._checkpoint_model_type(config_dict)
            config = cls.config_class.from_dict(config_dict) if model_type == expected else None
        except ValueError as error:
            raise ValueError(f"{what} is no usable {cls.display_name} draft: {error}") from None
        if config is None:
            raise ValueError(
                f"{what} is no {cls.display_name} draft: its config.json has model_type={model_type!r}, where "
                f"{cls.display_name} drafts have {expected!r} (a policy's folder, or another kind of model). {instead}"
            )
        return config

    @classmethod
    def _check_stored_weights(cls, files: list[str], config: PreTrainedConfig, what: str) -> None:
        """Every weight of the draft ``config`` describes must be stored in ``files`` (the vocabulary maps may be
        absent: the full vocabulary): a draft is loaded whole, never with weights initialised at random. Compared
        with a draft built on the meta device (no memory), before the real one is built: a policy's folder can hold
        a valid config of the family's model type (a Llama policy's, for EAGLE-3), from which a draft of the policy's
        size would be built and filled before the same refusal. No files: the loader says what it looked for."""
        if not files:
            return
        with torch.device("meta"):
            expected = set(cls(config).state_dict()) - set(VOCAB_MAPS)
        stored = set()
        for file in files:
            with safe_open(file, framework="pt") as tensors:
                stored.update(cls._checkpoint_tensor_name(name) for name in tensors.keys())
        missing = sorted(expected - stored)
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise ValueError(
                f"{what} has no {shown} ({len(missing)} of the {len(expected)} weights of the draft its config.json "
                "describes; a policy's checkpoint holds next to none): a draft is loaded whole, never with weights "
                f"initialised at random. Load a complete {cls.display_name} checkpoint (`save_pretrained` writes one)."
            )

    @classmethod
    def _checkpoint_model_type(cls, config_dict: dict) -> str | None:
        """The ``model_type`` of the draft a checkpoint's ``config.json`` describes, in this family's layouts."""
        return config_dict.get("model_type")

    @classmethod
    def checkpoint_architectures(cls) -> tuple[str, ...]:
        """The ``architectures`` names in a ``config.json`` that mark a checkpoint of this family."""
        return (cls.checkpoint_architecture,)

    @classmethod
    def _checkpoint_key_mapping(cls) -> dict[str, str] | None:
        """transformers' ``key_mapping`` from another layout of this family's checkpoints to its own, if any."""
        return None

    @classmethod
    def _checkpoint_tensor_name(cls, stored_name: str) -> str:
        """A stored tensor's parameter name (the inverse of `_checkpoint_key_mapping`)."""
        return stored_name

    def should_save_on_this_rank(self, is_main_process: bool) -> bool:
        if self._save_on_this_rank:
            return is_main_process
        return super().should_save_on_this_rank(is_main_process)

    def save_pretrained(self, save_directory, *args, push_to_hub: bool = False, on_this_rank: bool = False, **kwargs):
        """Write the checkpoint (safetensors) as vLLM loads this family's drafts; ``config.json`` names
        `checkpoint_architecture`, which vLLM dispatches on.

        ``on_this_rank``: write the weights from this process whatever its rank, the caller having chosen it (under
        pipeline parallelism the last stage, which trains the draft); transformers writes them from global rank 0 only.
        """
        if push_to_hub:
            return self.push_to_hub(kwargs.pop("repo_id", os.path.basename(os.fspath(save_directory))), **kwargs)
        self._save_on_this_rank = on_this_rank
        try:
            # The names are this method's choice: never the reverse of a `key_mapping` the draft was loaded with.
            result = super().save_pretrained(save_directory, *args, save_original_format=False, **kwargs)
        finally:
            self._save_on_this_rank = False
        # PreTrainedModel records the Python class name; vLLM dispatches on the family's architecture name.
        self.config.architectures = [self.checkpoint_architecture]
        self.config.save_pretrained(save_directory)
        return result

    def push_to_hub(
        self,
        repo_id: str,
        *,
        model_card: str | None = None,
        commit_message: str | None = None,
        private: bool | None = None,
        token: str | bool | None = None,
        revision: str | None = None,
        create_pr: bool = False,
    ):
        """Upload the checkpoint (plus ``model_card`` as README.md) to ``repo_id``; returns the commit info."""
        with tempfile.TemporaryDirectory() as folder:
            self.save_pretrained(folder)
            if model_card is not None:
                Path(folder, "README.md").write_text(model_card, encoding="utf-8")
            return push_draft_folder(
                folder,
                repo_id,
                token=token,
                private=private,
                revision=revision,
                create_pr=create_pr,
                commit_message=commit_message or f"Upload {self.display_name} draft",
            )

    def _check_stored_dtypes(self, files: list[str], *, what: str) -> None:
        """The loader casts every tensor to the parameter's dtype without a word (an int32 weight arrives truncated):
        check the weights as stored, each floating and in the config's declared dtype."""
        declared = self.config.dtype if isinstance(self.config.dtype, torch.dtype) else None
        weights = dict(self.named_parameters())
        problems = []
        for file in files:
            with safe_open(file, framework="pt") as stored:
                for stored_name in stored.keys():
                    name = self._checkpoint_tensor_name(stored_name)
                    if name in weights:
                        empty = stored.get_slice(stored_name)[:0]  # the stored dtype, no data read
                        problems.extend(weight_problems(name, empty, dtype=declared))
        if problems:
            raise ValueError(
                f"{what} is not usable: {'; '.join(problems)}. Save the draft with floating weights in one dtype "
                "(`save_pretrained` does)."
            )

    def _complete_vocab_maps(self, missing_keys: set[str]) -> None:
        reduced = self.config.draft_vocab_size < self.config.vocab_size
        if "d2t" in missing_keys and reduced:
            raise ValueError(
                f"The checkpoint has draft_vocab_size={self.config.draft_vocab_size} < vocab_size="
                f"{self.config.vocab_size} but no `d2t` tensor, so its draft ids cannot be mapped to target ids."
            )
        if "t2d" in missing_keys and "t2d" in self.vocab_map_buffers:
            t2d = torch.zeros_like(self.t2d)
            t2d[self.draft_to_target_ids] = True
            self.t2d.copy_(t2d)

    def validate_weights(self, *, what: str = "The draft") -> None:
        """Raise a ValueError if a weight is non-finite or not in the draft's dtype, or if the vocabulary maps do not
        map into the target vocabulary: such a draft would fail or draft garbage at the first rollout. A draft
        sharded with FSDP2 checks this rank's shards (no collective: every rank checks its own)."""
        weights = {name: p.to_local() if isinstance(p, DTensor) else p for name, p in self.named_parameters()}
        tensors = {**weights, **self.vocab_map_buffers}
        check_draft_tensors(tensors, vocab_size=self.config.vocab_size, dtype=self.dtype, what=what)

    def bind_target(self, target: PreTrainedModel) -> "DraftModel":
        """Check that this draft fits ``target`` (`validate_target`) and read token embeddings from it from now on."""
        self.validate_target(target.config)
        self.__dict__["_target_embedding"] = target.get_input_embeddings()
        return self

    @abc.abstractmethod
    def validate_target(self, target_config) -> tuple[int, ...]:
        """Raise a ValueError naming the field if the draft cannot serve a target with this config; return its tap
        ids (`tap_layer_ids`)."""

    @abc.abstractmethod
    def tap_layer_ids(self, num_target_layers: int) -> tuple[int, ...]:
        """The target layers whose *inputs* the draft reads (`hf_spec_cotrain.taps.TapRecorder` ids), in the order
        its input projection concatenates them."""

    @property
    def target_embedding(self) -> nn.Module:
        if self._target_embedding is None:
            raise RuntimeError(
                "This draft is not bound to a target: call `draft.bind_target(target)` (or pass `target=` to "
                "`from_pretrained`); the draft reads token embeddings from the target."
            )
        return self._target_embedding

    @property
    def draft_to_target_ids(self) -> torch.Tensor:
        """Target id of every draft id, ``[draft_vocab_size]``."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Target token embeddings, detached, in the draft's dtype: the draft never trains the policy's embedding.

        While `token_rows` binds rows, only the ids of `embedded_token_ids` are embedded, from those rows. Under FSDP2
        the policy's embedding is sharded by rows: each rank looks up the ids it holds and one all-reduce of the
        ``[..., H]`` result completes them (every rank of its mesh calls alike), never the whole table."""
        rows = self._token_rows
        if rows is None:
            weight = self.target_embedding.weight.detach()
            input_ids = input_ids.to(weight.device)
            if isinstance(weight, DTensor):
                mesh = weight.device_mesh
                input_ids = DTensor.from_local(input_ids, mesh, [Replicate()] * mesh.ndim, run_check=False)
                return F.embedding(input_ids, weight).full_tensor().to(self.dtype)
            return F.embedding(input_ids, weight).to(self.dtype)
        known = self.embedded_token_ids()
        matches = input_ids.to(rows.device)[..., None] == torch.tensor(known, device=rows.device)
        if not matches.any(-1).all():
            unknown = sorted(set(input_ids.flatten().tolist()) - set(known))
            raise ValueError(
                f"This draft holds the embeddings of tokens {list(known)} only (`token_rows`: its stage has no "
                f"embedding), not of {unknown}: embed other tokens where the embedding is (the rollouts' `embed`)."
            )
        return rows.detach()[matches.long().argmax(-1)].to(self.dtype)

    def embedded_token_ids(self) -> tuple[int, ...]:
        """The token ids whose target embeddings the draft's training forward looks up itself (DFlash: its mask
        token); the other embeddings it reads come with the taps. Under pipeline parallelism the draft's stage holds
        no embedding, so the first stage sends these rows every step (`token_rows`)."""
        return ()

    @contextmanager
    def token_rows(self, rows: torch.Tensor) -> Iterator[None]:
        """Inside the block, `embed_input_ids` reads the embeddings of `embedded_token_ids` from ``rows``
        ``[n, hidden]`` (in that order) instead of the bound target's embedding, which the draft's pipeline stage
        does not hold."""
        known = self.embedded_token_ids()
        if rows.dim() != 2 or rows.shape[0] != len(known):
            raise ValueError(
                f"`rows` has shape {tuple(rows.shape)}; expected one embedding row per token of `embedded_token_ids` "
                f"{list(known)}: ({len(known)}, hidden)."
            )
        self.__dict__["_token_rows"] = rows
        try:
            yield
        finally:
            self.__dict__["_token_rows"] = None

    # ------------------------------------------------------------------ training

    @classmethod
    @abc.abstractmethod
    def training_options(cls, args: Any | None) -> Any:
        """The family's objective settings (a frozen dataclass) from a `SpecCoTrainConfig` or `DraftTrainingConfig`;
        its defaults for None."""

    @abc.abstractmethod
    def training_loss(
        self,
        batch: DraftTrainingBatch,
        options: Any,
        *,
        cp_group: dist.ProcessGroup | None = None,
        generator: torch.Generator | None = None,
        gradient_checkpointing: bool = False,
    ) -> DraftLossOutput:
        """The family's objective on one forward's taps (``options`` from `training_options`), with the policy's
        distribution as teacher. Under context parallelism (``cp_group`` of W > 1) ``loss`` is this rank's share of
        the single-device loss and the metrics are global. ``generator``: the family's own randomness (DFlash's
        anchors), reproducible from the trainer's seed."""

    @classmethod
    @abc.abstractmethod
    def trained_tokens_per_round(cls, args: Any) -> int:
        """The most tokens one round may propose that a draft built from ``args`` is trained for: the default of
        `SpecCoTrainConfig.max_speculative_tokens`."""

    @classmethod
    @abc.abstractmethod
    def check_tokens_per_round(cls, args: Any) -> None:
        """Judge ``args.max_draft_tokens`` against what the objective trains, when the config is built: refuse a K
        the draft cannot propose, warn about one it proposes untrained."""

    def max_tokens_per_round(self) -> int | None:
        """The most tokens this draft can propose in one round (None: no limit of its own); the trainer refuses a
        larger K when it is built, instead of every round failing."""
        return None

    @abc.abstractmethod
    def loss_positions(self, options: Any) -> int:
        """K, the length of `training_loss`'s per-position metrics under ``options`` (the ``draft/*_step_{d}``
        metrics, and the held-out agreement of a warm start)."""

    @classmethod
    def describe_options(cls, options: Any) -> dict[str, str]:
        """The objective's settings as the model card's training table shows them (label: value)."""
        return {field.name: str(getattr(options, field.name)) for field in dataclasses.fields(options)}

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    # ------------------------------------------------------------------ generation and serving

    @staticmethod
    @abc.abstractmethod
    def draft_forwards(k: int) -> int:
        """Forwards of the draft in a round that proposes ``k`` tokens (a chain runs one per token, a block drafter
        one in all): what the adaptive cost model multiplies the draft's measured cost per forward by."""

    @abc.abstractmethod
    def new_proposer(self, embed: Callable[[torch.Tensor], torch.Tensor]) -> DraftProposer:
        """HF-native drafting state for one generate call; ``embed`` maps token ids to the target's embeddings
        (through the pipeline's first stage under pipeline parallelism)."""

    def vllm_bootstrap_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights a vLLM engine starts from, which its first sync then replaces: this draft's own, unless the
        family must start the engine differently for every weight to be syncable."""
        return self.state_dict()

    @classmethod
    @abc.abstractmethod
    def vllm_speculative_config(cls, model: str, num_speculative_tokens: int) -> dict[str, Any]:
        """vLLM's ``speculative_config`` for a draft of this family saved at ``model`` (a class method: the engine
        and the server know the draft by its folder)."""


def _check_folder_or_repo_id(name) -> None:
    """A name that is no local folder goes to the Hub; when it cannot be a repo id either, say so in words (rather than
    huggingface_hub's "Repo id must be in the form ...")."""
    if os.path.isdir(name):
        return
    try:
        validate_repo_id(os.fspath(name))
    except HFValidationError:
        path = Path(name).resolve()
        problem = f"{path} is a file, not a folder" if path.exists() else f"no such folder: {path}"
        raise FileNotFoundError(
            f"The draft checkpoint {os.fspath(name)!r} is neither a local folder ({problem}) nor a Hub repo id "
            "('name' or 'namespace/name'). Pass the folder `save_pretrained` wrote (config.json and safetensors "
            "weights), or a Hub repo id."
        ) from None


def _hub_kwargs(loading_kwargs: dict) -> dict:
    """The options of `from_pretrained` that say where a checkpoint's files are (`cached_file`'s)."""
    return {
        key: loading_kwargs[key]
        for key in ("cache_dir", "revision", "token", "subfolder", "local_files_only")
        if key in loading_kwargs
    }


def _where_config_is_missing(name_or_path, shown: int = 8) -> str:
    """Where a checkpoint has no config.json, for an error: a local folder's first `shown` entries and its subfolders
    that hold one (a training checkpoint keeps its draft in ``draft/``); a Hub repository by name."""
    folder = Path(name_or_path)
    if not folder.is_dir():
        return "the Hub repository holds none"
    names = sorted(entry.name for entry in folder.iterdir())
    listed = ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")
    drafts = [str(folder / name) for name in names if (folder / name / CONFIG_NAME).is_file()]
    inside = f"; {' and '.join(drafts)} {'has' if len(drafts) == 1 else 'have'} one" if drafts else ""
    return f"the folder {folder.resolve()} holds {listed or 'nothing'}{inside}"


def _checkpoint_files(pretrained_model_name_or_path, kwargs: dict) -> list[str]:
    """The safetensors files of a checkpoint (fetched, for a Hub id), one or the shards of its index; none when it has
    neither. ``kwargs``: where they are (`_hub_kwargs`)."""
    single, index = (
        cached_file(pretrained_model_name_or_path, name, _raise_exceptions_for_missing_entries=False, **kwargs)
        for name in (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME)
    )
    if single is not None:
        return [single]
    if index is None:
        return []
    shards = sorted(set(json.loads(Path(index).read_text())["weight_map"].values()))
    return [cached_file(pretrained_model_name_or_path, shard, **kwargs) for shard in shards]
