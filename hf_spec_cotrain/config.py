"""`SpecCoTrainConfig`: TRL's `GRPOConfig` plus the draft, TTT, speculative-rollout and Hub options."""

import copy
import importlib.util
import os
from dataclasses import asdict, dataclass, field

import torch
from accelerate.parallelism_config import ParallelismConfig
from trl import GRPOConfig

from .draft import DEFAULT_DRAFTER, DRAFTER_FAMILIES, drafter_family
from .draft.dflash_configuration import DEFAULT_BLOCK_SIZE
from .draft.dflash_objective import DEFAULT_ANCHORS_PER_ROW, DEFAULT_LOSS_DECAY_GAMMA
from .draft.eagle3_ttt import DEFAULT_STEP_WEIGHT_DECAY
from .generation import DRAFT_SAMPLING_METHODS
from .parallel.compatibility import launcher_fsdp_version
from .parallel.dims import ParallelDims
from .validation import FloatRange, check_float_fields, check_int


VLLM_MODES = ("colocate", "server")
# The range of every float option the package adds, and of TRL's that its rollouts and pipelined step read; any other
# float option must be finite. Checked once, when the config is built (`check_float_fields`). A NaN would pass most
# hand-written checks (`nan > 0` is false, so `draft_max_grad_norm=nan` turned clipping off) and an infinity breaks a
# run long after it starts (`ttt_step_weight_decay=inf` made every draft update skip).
FLOAT_OPTION_RANGES = {
    "ttt_step_weight_decay": FloatRange(0, low_open=True, hint=" (TTT step d's loss weighs ttt_step_weight_decay**d)"),
    "dflash_loss_decay_gamma": FloatRange(0, low_open=True, hint=" (block position i weighs exp(-(i - 1) / gamma))"),
    "draft_learning_rate": FloatRange(0, low_open=True, hint=" (the peak learning rate of the draft's AdamW)"),
    "draft_weight_decay": FloatRange(0),
    "draft_max_grad_norm": FloatRange(0, hint=" (0 turns the draft's gradient clipping off)"),
    "draft_train_fraction": FloatRange(
        0, 1, low_open=True, hint=" (the fraction of each micro-batch's sequences the draft trains on)"
    ),
    "temperature": FloatRange(0, low_open=True, hint=" (rollouts sample at it; TRL divides the logits by it)"),
    "top_p": FloatRange(0, 1, low_open=True, hint=" (1 turns it off)"),
    "min_p": FloatRange(0, 1, hint=" (0 or None turns it off)"),
    "repetition_penalty": FloatRange(0, low_open=True, hint=" (1 turns it off)"),
    "max_grad_norm": FloatRange(0, hint=" (0 turns gradient clipping off)"),
}
# Fields that hold credentials: `repr`/`str`, `to_dict`/`to_json_string` (the arguments logged and written to the
# Hub) and pickles (`training_args.bin` in every checkpoint) show `<FIELD_NAME>` in their place when they are set.
_SECRET_FIELDS = ("hub_token", "vllm_server_api_key")


@dataclass
class SpecCoTrainConfig(GRPOConfig):
    r"""
    Configuration of [`SpecCoTrainGRPOTrainer`]: every [`~trl.GRPOConfig`] field plus the ones below.

    Parameters:
        > Parameters that control how the draft starts

        drafter (`str`, *optional*, defaults to `"eagle3"`):
            The drafter family (`hf_spec_cotrain.draft.DRAFTER_FAMILIES`): `"eagle3"`, the EAGLE-3 head trained by
            training-time test.
        draft_model_name_or_path (`str`, *optional*):
            A draft checkpoint of the `drafter` family (folder or Hub id, safetensors) to start from. When unset a
            draft is built from the policy with the three options below.
        draft_num_layers (`int`, *optional*, defaults to `1`):
            Decoder layers of a draft built from the policy.
        draft_vocab_size (`int`, *optional*):
            Draft vocabulary size of a draft built from the policy: the most frequent tokens of the training
            prompts. Defaults to the policy's whole vocabulary.
        aux_layer_ids (`list[int]`, *optional*):
            Tapped policy layers (the inputs of these decoder layers). Defaults to `(2, L//2, L-3)`.

        > Parameters that control the draft's training (training-time test)

        ttt_steps (`int`, *optional*, defaults to `3`):
            Unrolled steps K of the training-time-test loss.
        ttt_step_weight_decay (`float`, *optional*, defaults to `0.8`):
            The loss of step d is weighted by `ttt_step_weight_decay ** d`.
        ttt_gradient_checkpointing (`bool`, *optional*, defaults to `False`):
            Recompute each unrolled step's draft layers in the backward instead of keeping their activations:
            for long completions, where the draft's MLP activations dominate its memory, at the cost of about
            one more draft forward.
        draft_learning_rate (`float`, *optional*, defaults to `2e-4`):
            Peak learning rate of the draft's own AdamW optimizer.
        draft_weight_decay (`float`, *optional*, defaults to `0.0`):
            Weight decay of the draft's optimizer.
        draft_max_grad_norm (`float`, *optional*, defaults to `1.0`):
            Gradient clipping of the draft (0 disables).
        draft_warmup_steps (`int`, *optional*, defaults to `20`):
            Linear warm-up of the draft's learning rate, in draft updates. A cold start at full rate can wreck a
            warm-started draft in one step.
        draft_lr_scheduler_type (`str`, *optional*, defaults to `"constant_with_warmup"`):
            A transformers scheduler name for the draft.
        draft_update_interval (`int`, *optional*, defaults to `1`):
            Update the draft every this many policy optimizer steps (gradients accumulate in between).
        draft_train_fraction (`float`, *optional*, defaults to `1.0`):
            Fraction of each micro-batch's sequences the draft's TTT trains on, drawn at random per micro-batch
            from (seed, step, rank, micro-batch). The draft's cost falls in proportion (it is linear in the rows
            it trains on) while it still updates every step; the GRPO group's samples of one prompt are alike,
            so a fraction of them teaches it nearly as much.
        draft_bf16 (`bool` or `None`, *optional*, defaults to `None`):
            Run the draft's TTT under bf16 autocast, on float32 weights. `None` follows the policy's `bf16`;
            `True` also under a float32 policy, whose training is untouched (on GPUs and AVX512-BF16 CPUs the draft
            then trains about 1.6x faster); `False` keeps the draft in float32 under a bf16 policy.
        shard_draft (`bool`, *optional*, defaults to `False`):
            Shard the draft with FSDP2 over the ranks the policy is sharded over, instead of a replica on every rank:
            each rank holds 1/N of the draft's weights, gradients, optimizer state and last good copy. It is gathered
            whole only for rollouts (as the policy is), one tensor at a time for engine pushes, and on rank 0 for
            checkpoints. Needs FSDP2 (`fsdp_version=2`, or a `parallelism_config` with `dp_shard_size` > 1); not with
            pipeline parallelism, whose last stage alone holds the draft.

        > Parameters that control speculative rollouts

        speculative_decoding (`bool`, *optional*, defaults to `True`):
            Generate rollouts with the co-trained draft. When False the draft still trains (for a later push) but
            rollouts use plain generation.
        num_speculative_tokens (`int` or `"auto"`, *optional*, defaults to `3`):
            Tokens the draft proposes per verification step (K). `"auto"` chooses K in
            `0 .. max_speculative_tokens` before every decoding round, K = 0 being plain decoding, from an online
            cost model of this machine and policy (`AdaptiveSpeculation`: the policy's forward time at the live
            batch size, the draft's step time, the live acceptance per draft position). Rollouts follow the same law
            whatever K runs, but with `"auto"` they are not reproducible bit for bit, since K depends on measured
            time. HF-native rollouts adapt per round; vLLM ones run K = `max_speculative_tokens`. A K above
            `ttt_steps` warns: the draft never trained on proposals past step `ttt_steps`.
        max_speculative_tokens (`int`, *optional*):
            Largest K with `num_speculative_tokens="auto"`. Defaults to `ttt_steps`: the positions the draft was
            trained to propose.
        draft_sampling (`str`, *optional*):
            How the draft proposes when rollouts sample: `"probabilistic"` (sample from the draft's distribution,
            standard speculative sampling; the default) or `"greedy"` (propose the draft's argmax).
        vllm_draft_sample_method (`str`, *optional*):
            vLLM's `speculative_config.draft_sample_method`. Defaults to what `draft_sampling` asks for when vLLM
            accepts it for the draft at hand (vLLM 0.31 refuses probabilistic drafting with a reduced draft
            vocabulary; the trainer then falls back to greedy drafting and says so in the log).
        vllm_rejection_sample_method (`str`, *optional*):
            vLLM's `speculative_config.rejection_sample_method`; paired with `vllm_draft_sample_method`.

        > Parameters that control saving the draft

        save_draft (`bool`, *optional*, defaults to `True`):
            Save the draft (vLLM-loadable folder `draft/`, plus its optimizer) in every checkpoint and at the end.
        push_draft_to_hub (`bool`, *optional*, defaults to `False`):
            Push the co-trained draft, with its model card, to the Hub at the end of training.
        draft_hub_model_id (`str`, *optional*):
            Hub repository of the draft. Defaults to `<hub_model_id or output_dir name>-eagle3`.

        > Parameters that control the rollout server (`vllm_mode="server"`)

        vllm_server_api_key (`str`, *optional*):
            API key of the ``hf-spec-cotrain vllm-serve`` server. Defaults to the ``HF_SPEC_COTRAIN_API_KEY``
            environment variable. Like `hub_token`, it never appears in `repr`, saved arguments or checkpoints. A
            server that restarts mid-run gets the policy and the draft pushed again; one that cannot be reached for
            `vllm_server_timeout` seconds stops the run with an error (resume from the last checkpoint).

        > Parameters that control context parallelism

        context_parallel_size (`int`, *optional*, defaults to `1`):
            Ranks per context-parallel group (consecutive ranks). Each rank still generates its own rollouts; in
            the training step the group runs the policy's GRPO forward and backward, and the draft's TTT, on each
            member's micro-batch in turn, packed as documents and zigzag-sharded across the group (ring attention),
            so that a rank holds `1 / context_parallel_size` of each sequence's activations; the old policy's and
            the reference model's log-prob passes run sharded the same way. Gradients equal those of plain data
            parallelism over the same ranks. The world size must be a multiple of it. The ranks form a 2-D mesh,
            data parallel x context parallel: DDP replicas, or with FSDP2 the policy sharded over every rank. An
            accelerate `ParallelismConfig` (given as `parallelism_config`, or in the accelerate config file) with
            `cp_size` > 1 sets it instead; its `dp_shard_size` > 1 turns FSDP2 on.
        data_parallel_shard_size (`int`, *optional*, not an argument):
            That `ParallelismConfig`'s `dp_shard_size`, kept when it sets `context_parallel_size` (the config then
            hands accelerate another parallelism config, or none on CPU): the world size must be it times
            `cp_size`. None otherwise.

        > Parameters that control pipeline parallelism

        pipeline_parallel_size (`int`, *optional*, defaults to `1`):
            Pipeline stages, one process each (the world size must equal it). The policy is cut into this many
            stages (`hf_spec_cotrain.PipelineCoTrainStep`); the last holds the final norm, the lm_head,
            the GRPO loss and the whole draft, and the other stages send it their taps. Each rank draws
            `per_device_train_batch_size` rows as under data parallelism; the training step runs all ranks' rows
            as one batch through the pipeline. The last stage generates every rollout through the stages, with the
            draft, or with `use_vllm=True` and `vllm_mode="server"` requests them from the server, into which every
            stage pushes its own weights; no rank holds the whole policy.
        pipeline_schedule (`str`, *optional*, defaults to `"1F1B"`):
            `torch.distributed.pipelining` schedule: `"1F1B"` or `"GPipe"`.
        pipeline_num_microbatches (`int`, *optional*, defaults to `4`):
            Micro-batches per pipelined step (>= 4, and >= `pipeline_parallel_size` for 1F1B); must divide the
            step's batch, `per_device_train_batch_size * pipeline_parallel_size`.
        pipeline_tap_transport (`str`, *optional*, defaults to `"channel"`):
            How taps reach the draft's stage: `"channel"` (`TapChannel`) or `"relay"` (taps ride the stage
            outputs; the benchmark's baseline).

        The values of these three are checked whether pipeline parallelism is on or not.
    """

    _VALID_DICT_FIELDS = GRPOConfig._VALID_DICT_FIELDS

    drafter: str = field(
        default=DEFAULT_DRAFTER,
        metadata={"help": "The drafter family.", "choices": list(DRAFTER_FAMILIES)},
    )
    draft_model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Draft checkpoint (folder or Hub id) of the `drafter` family to start from; unset: build from the "
            "policy."
        },
    )
    draft_num_layers: int = field(default=1, metadata={"help": "Decoder layers of a draft built from the policy."})
    draft_vocab_size: int | None = field(
        default=None,
        metadata={"help": "Draft vocabulary size (most frequent prompt tokens); unset: the whole vocabulary."},
    )
    aux_layer_ids: list[int] | None = field(
        default=None, metadata={"help": "Tapped policy layers (inputs of these layers); unset: (2, L//2, L-3)."}
    )
    ttt_steps: int = field(default=3, metadata={"help": "EAGLE-3: unrolled steps K of the training-time-test loss."})
    ttt_step_weight_decay: float = field(
        default=DEFAULT_STEP_WEIGHT_DECAY,
        metadata={"help": "EAGLE-3: loss weight of TTT step d, ttt_step_weight_decay**d."},
    )
    dflash_block_size: int = field(
        default=DEFAULT_BLOCK_SIZE,
        metadata={"help": "DFlash: the trained block (anchor + mask tokens); a round proposes at most block - 1."},
    )
    dflash_anchors_per_row: int = field(
        default=DEFAULT_ANCHORS_PER_ROW, metadata={"help": "DFlash: blocks trained per sequence and step."}
    )
    dflash_loss_decay_gamma: float = field(
        default=DEFAULT_LOSS_DECAY_GAMMA,
        metadata={"help": "DFlash: block position i weighs exp(-(i-1)/gamma) in the loss."},
    )
    dflash_target_layer_ids: list[int] | None = field(
        default=None,
        metadata={"help": "DFlash: policy layers whose outputs form the context (vLLM's numbering); unset: spread."},
    )
    dflash_mask_token_id: int | None = field(
        default=None,
        metadata={"help": "DFlash: the token filling the block; unset: the tokenizer's mask token or an unused id."},
    )
    ttt_gradient_checkpointing: bool = field(
        default=False,
        metadata={"help": "Recompute each TTT step's draft layers in the backward (less memory, ~1 more forward)."},
    )
    draft_learning_rate: float = field(default=2e-4, metadata={"help": "Peak learning rate of the draft."})
    draft_weight_decay: float = field(default=0.0, metadata={"help": "Weight decay of the draft's optimizer."})
    draft_max_grad_norm: float = field(default=1.0, metadata={"help": "Draft gradient clipping (0 disables)."})
    draft_warmup_steps: int = field(default=20, metadata={"help": "Warm-up of the draft's learning rate."})
    draft_lr_scheduler_type: str = field(
        default="constant_with_warmup", metadata={"help": "transformers scheduler name for the draft."}
    )
    draft_update_interval: int = field(
        default=1, metadata={"help": "Update the draft every this many policy optimizer steps."}
    )
    draft_train_fraction: float = field(
        default=1.0,
        metadata={
            "help": "Fraction of each micro-batch's sequences the draft trains on (random per micro-batch); lower "
            "values cut the co-training cost in proportion."
        },
    )
    draft_bf16: bool | None = field(
        default=None,
        metadata={
            "help": "Train the draft under bf16 autocast (float32 weights). None: as the policy's `bf16`; True: also "
            "under a float32 policy."
        },
    )
    shard_draft: bool = field(
        default=False,
        metadata={
            "help": "Shard the draft with FSDP2 over the policy's ranks (each rank holds 1/N of its weights, "
            "gradients and optimizer state) instead of replicating it. Needs FSDP2; not with pipeline parallelism."
        },
    )
    speculative_decoding: bool = field(
        default=True, metadata={"help": "Generate rollouts with the co-trained draft (speculative decoding)."}
    )
    # `| None` makes the command line pass a string, so that `--num_speculative_tokens auto` parses.
    num_speculative_tokens: int | str | None = field(
        default=3,
        metadata={
            "help": "Draft tokens proposed per verification, or 'auto': chosen per decoding round in "
            "0..max_speculative_tokens by an online cost model."
        },
    )
    max_speculative_tokens: int | None = field(
        default=None,
        metadata={"help": "Largest K with num_speculative_tokens='auto' (default: ttt_steps, the positions trained)."},
    )
    draft_sampling: str | None = field(
        default=None,
        metadata={"help": "How the draft proposes when sampling: 'probabilistic' (default) or 'greedy'."},
    )
    vllm_draft_sample_method: str | None = field(
        default=None, metadata={"help": "vLLM speculative_config.draft_sample_method (default: from draft_sampling)."}
    )
    vllm_rejection_sample_method: str | None = field(
        default=None, metadata={"help": "vLLM speculative_config.rejection_sample_method."}
    )
    save_draft: bool = field(default=True, metadata={"help": "Save the draft in checkpoints and at the end."})
    push_draft_to_hub: bool = field(default=False, metadata={"help": "Push the co-trained draft to the Hub."})
    draft_hub_model_id: str | None = field(
        default=None, metadata={"help": "Hub repository of the draft (default: <hub_model_id>-eagle3)."}
    )
    vllm_server_api_key: str | None = field(
        default=None,
        metadata={
            "help": "API key of the rollout server (default: the HF_SPEC_COTRAIN_API_KEY environment variable)."
        },
    )
    context_parallel_size: int = field(
        default=1,
        metadata={
            "help": "Ranks per context-parallel group: every policy forward of the step (training, old policy, "
            "reference) and the draft's TTT run on sequences zigzag-sharded across the group (ring attention). Must "
            "divide the world size. A `parallelism_config` with `cp_size` > 1 sets it (and FSDP2 for `dp_shard_size` "
            "> 1)."
        },
    )
    data_parallel_shard_size: int | None = field(
        default=None,
        init=False,
        metadata={
            "help": "Not an argument: the `dp_shard_size` of the `parallelism_config` that set "
            "`context_parallel_size`, which the trainer checks the world size against (`dp_shard_size` x `cp_size`). "
            "Kept here because the config then hands accelerate another parallelism config (or none, on CPU)."
        },
    )
    pipeline_parallel_size: int = field(
        default=1,
        metadata={
            "help": "Pipeline stages, one process each: the policy is cut into stages, the last holding the lm_head, "
            "the GRPO loss and the draft, which receives its taps over a TapChannel. Must equal the world size."
        },
    )
    pipeline_schedule: str = field(default="1F1B", metadata={"help": "Pipeline schedule: '1F1B' or 'GPipe'."})
    pipeline_num_microbatches: int = field(
        default=4,
        metadata={
            "help": "Micro-batches per pipelined step (>= 4); must divide per_device_train_batch_size * stages."
        },
    )
    pipeline_tap_transport: str = field(
        default="channel", metadata={"help": "How taps reach the draft's stage: 'channel' (TapChannel) or 'relay'."}
    )

    def __post_init__(self):
        check_float_fields(self, FLOAT_OPTION_RANGES)  # first: transformers' own checks take an infinity for an int
        self._take_context_parallel_size()
        super().__post_init__()
        if isinstance(self.num_speculative_tokens, str) and self.num_speculative_tokens.strip().isdigit():
            self.num_speculative_tokens = int(self.num_speculative_tokens)  # from the command line
        if self.num_speculative_tokens != "auto":
            check_int(self.num_speculative_tokens, "num_speculative_tokens", hint=" or 'auto'")
        family = drafter_family(self.drafter)
        check_int(self.ttt_steps, "ttt_steps")
        if self.max_speculative_tokens is None:
            self.max_speculative_tokens = family.trained_tokens_per_round(self)
        for name in ("draft_num_layers", "max_speculative_tokens", "draft_update_interval"):
            check_int(getattr(self, name), name)
        if self.draft_vocab_size is not None:
            check_int(self.draft_vocab_size, "draft_vocab_size", hint=" (or unset: the whole vocabulary)")
        if self.draft_model_name_or_path is not None:
            conflicting = {"draft_vocab_size": self.draft_vocab_size, "aux_layer_ids": self.aux_layer_ids}
            set_fields = [name for name, value in conflicting.items() if value is not None]
            if set_fields or self.draft_num_layers != 1:
                raise ValueError(
                    f"`draft_model_name_or_path` loads a draft whose shape is fixed; do not also set "
                    f"{set_fields or ['draft_num_layers']} (they only apply to a draft built from the policy)."
                )
        if not (self.draft_bf16 is None or isinstance(self.draft_bf16, bool)):
            raise ValueError(
                f"`draft_bf16`={self.draft_bf16!r} is not allowed: use None (as the policy), True or False."
            )
        check_int(self.draft_warmup_steps, "draft_warmup_steps", minimum=0)
        if self.vllm_mode not in VLLM_MODES:
            raise ValueError(
                f"`vllm_mode`={self.vllm_mode!r} is not allowed: TRL would take it for 'colocate'. Choose 'colocate' "
                "(vLLM in the training process) or 'server' (a separate `hf-spec-cotrain vllm-serve`)."
            )
        if self.use_vllm and self.vllm_mode == "server" and importlib.util.find_spec("requests") is None:
            raise ValueError(
                "`vllm_mode='server'` talks to the rollout server over HTTP with `requests`, which is not installed: "
                'pip install "hf-spec-cotrain[client]" (or use `vllm_mode="colocate"`, or HF-native rollouts).'
            )
        family.check_tokens_per_round(self)
        if self.draft_sampling is not None and self.draft_sampling not in DRAFT_SAMPLING_METHODS:
            raise ValueError(
                f"`draft_sampling`={self.draft_sampling!r} is not allowed: choose one of {DRAFT_SAMPLING_METHODS}."
            )
        if self.push_draft_to_hub and not self.save_draft:
            raise ValueError("`push_draft_to_hub=True` needs `save_draft=True`: the pushed folder is the saved draft.")
        if (
            self.speculative_decoding
            and ((self.repetition_penalty not in (None, 1.0)) or (self.min_p not in (None, 0.0)))
            and not self.use_vllm
        ):
            raise ValueError(
                f"Speculative rollouts without vLLM support temperature, top_p and top_k, not "
                f"repetition_penalty={self.repetition_penalty} or min_p={self.min_p}: unset those or set "
                "`speculative_decoding=False`."
            )
        ParallelDims.from_config(self)

    def _take_context_parallel_size(self) -> None:
        """Read the context-parallel size from accelerate's `ParallelismConfig`: the one given, or the accelerate
        config file's (`accelerate launch` passes it in the environment).

        The package's zigzag ring is the context parallelism (accelerate's own is CUDA-only SDPA, with no mask for the
        draft's branches, and TRL refuses it), so `cp_size` becomes `context_parallel_size`; `dp_shard_size` > 1 asks
        for FSDP2 (`fsdp`), which shards the policy over all `dp_shard_size * cp_size` ranks as accelerate's
        `dp_shard_cp` axis would. accelerate gets that mesh without its context parallelism, or on CPU, where it
        accepts no parallelism config (and drops FSDP: the trainer then shards the policy itself), none.
        """
        parallelism = self.parallelism_config
        if parallelism is None and os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "").lower() == "true":
            parallelism = ParallelismConfig()  # the launcher's sizes, from the environment
        if parallelism is None or not parallelism.cp_enabled:
            return
        if self.context_parallel_size not in (1, parallelism.cp_size):
            raise ValueError(
                f"`context_parallel_size`={self.context_parallel_size} contradicts the parallelism config's "
                f"`cp_size`={parallelism.cp_size}: set one of them (or both to the same value)."
            )
        if parallelism.dp_replicate_size > 1 or parallelism.tp_size > 1:
            raise ValueError(
                f"The parallelism config's `cp_size`={parallelism.cp_size} cannot be combined with `dp_replicate_size`"
                f"={parallelism.dp_replicate_size} or `tp_size`={parallelism.tp_size}: context parallelism runs on a "
                "2-D mesh, data parallel (DDP, or FSDP2 with `dp_shard_size` = world size / `cp_size`) x context "
                "parallel. Set both to 1."
            )
        self.context_parallel_size = parallelism.cp_size
        self.data_parallel_shard_size = parallelism.dp_shard_size
        # An FSDP launch config is accelerate's to apply as written (`fsdp` here would have transformers rebuild FSDP
        # from `fsdp_config`'s defaults, dropping the launch config's own settings, CPU-RAM-efficient loading first).
        if parallelism.dp_shard_enabled and not self.fsdp and launcher_fsdp_version() is None:
            self.fsdp = True
            self.fsdp_config = {"fsdp_version": 2, **(self.fsdp_config or {})}
        on_cpu = self.use_cpu or not torch.accelerator.is_available()
        shard_size = parallelism.dp_shard_size * parallelism.cp_size
        self.parallelism_config = None if on_cpu else ParallelismConfig(dp_shard_size=shard_size)

    def _masked_secrets(self) -> dict[str, str]:
        return {name: f"<{name.upper()}>" for name in _SECRET_FIELDS if getattr(self, name, None) is not None}

    def __str__(self) -> str:
        shown = asdict(self) | self._masked_secrets()
        lines = "".join(f"{name}={value},\n" for name, value in sorted(shown.items()))
        return f"{type(self).__name__}(\n{lines})"

    __repr__ = __str__

    def to_dict(self) -> dict:
        return super().to_dict() | self._masked_secrets()

    def __getstate__(self) -> dict:
        """Pickles (``training_args.bin``) hold placeholders for the secrets; copies keep them (`__deepcopy__`)."""
        return self.__dict__ | self._masked_secrets()

    def __copy__(self):
        copied = object.__new__(type(self))
        copied.__dict__.update(self.__dict__)
        return copied

    def __deepcopy__(self, memo):
        copied = object.__new__(type(self))
        memo[id(self)] = copied
        copied.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return copied

    @property
    def max_draft_tokens(self) -> int:
        """The most tokens the draft may propose in one round: K, or `max_speculative_tokens` under `"auto"`."""
        return self.max_speculative_tokens if self.num_speculative_tokens == "auto" else self.num_speculative_tokens
