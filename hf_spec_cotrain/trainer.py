"""`SpecCoTrainGRPOTrainer`: TRL's GRPO step with a draft (EAGLE-3 by default: `drafter`) co-trained online on the
policy's own taps.

The trainer holds three components, each built once in ``__init__``, and wires them into TRL's hooks; each hook it
overrides is one call into one of them:

* `DraftCoTrainer` (``draft_cotrainer``): the draft's objective on the taps that ``_compute_loss`` records from the
  policy's *own* training forward (hooks, no extra forward pass), run after the policy's backward; the draft's
  optimizer step right after the policy's (`DraftUpdateCallback`); the ``draft/*`` metrics; its checkpoint state.
* the parallel strategy (``parallel``, `build_parallel_strategy` from the run's `ParallelDims`, after
  `parallelize_policy` applied the parallelisms in order): `DataParallel` (TRL's own step), `ContextParallel` or
  `PipelineParallel`. It owns the training step, scoring log-probs, the gradient norm and clipping, saving and
  loading the policy's checkpoint shards, and the policy that HF-native generation runs on. It gets TRL's behaviour
  and bookkeeping as callables (`TRLHooks`), never the trainer.
* `SpeculativeRollouts` (``rollouts``, `build_rollouts`): ``_generate_single_turn`` sends speculative turns there
  (plain ones to TRL's generation, or, under pipeline parallelism where no rank holds the whole policy, there too).
  They run on the backend of the run's path (HF-native, pipelined HF-native, colocated vLLM, a server, a server the
  stages push into) with the draft of this very step, choose plain decoding where adaptive speculation expects it to
  be faster, fall back to it (logged) when the draft cannot be used, and log the ``spec/*`` metrics.

Checkpoints hold the draft (a vLLM-loadable folder) and its optimizer and scheduler state, written before
transformers marks the checkpoint complete and deletes old ones; resuming from a checkpoint without them is an error
(`hf_spec_cotrain.training.checkpoints`). Under pipeline parallelism each stage saves and restores its own shard of
the policy, optimizer and scheduler, and the last stage the draft.
"""

import os
from contextlib import contextmanager
from functools import cached_property
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate.utils import is_peft_model, patch_environment
from transformers.integrations import is_fsdp_enabled as fsdp_loads_on_rank_zero_only
from transformers.trainer_utils import get_last_checkpoint
from transformers.utils import logging
from trl import GRPOTrainer
from trl.data_utils import apply_chat_template, is_conversational
from trl.trainer.callbacks import SyncRefModelCallback
from trl.trainer.utils import disable_dropout_in_model, get_config_model_id

from .config import SpecCoTrainConfig
from .draft import DraftModel, check_draft_family, count_tokens, drafter_family, load_draft
from .draft.card import CoTrainingRecord, model_license, render_draft_card
from .draft.upload import push_draft_folder
from .parallel.dims import ParallelDims
from .parallel.fsdp import shard_draft
from .taps import TapRecorder
from .training.checkpoints import (
    DRAFT_FOLDER,
    DRAFT_STATE_FILE,
    check_draft_shape,
    check_resumable,
    describe_draft_shape_differences,
    draft_shape_differences,
    write_atomically,
)
from .training.data_parallel import TRLHooks
from .training.draft_cotraining import DraftCoTrainer, DraftUpdateCallback
from .training.pipeline_parallel import load_pipeline_stage
from .training.policy_support import check_trl_can_train
from .training.rewards import checked_reward_function, no_finite_reward_warning, nonfinite_reward_rows
from .training.rollout_backends import RolloutSampling, build_rollout_engine
from .training.rollouts import build_rollouts, conversation_budget, turns_per_rollout
from .training.strategy import GRPOLoss, build_parallel_strategy, unwrapped_hf
from .training.timing import StepTimes, StepTimesCallback


logger = logging.get_logger(__name__)


@contextmanager
def _hidden_from(args, values: dict):
    """`args` with `values` in place of its own fields for the duration (TRL's __init__, its tool loop), restored
    after."""
    saved = {name: getattr(args, name) for name in values}
    for name, value in values.items():
        setattr(args, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(args, name, value)


def _broadcast_module(module: torch.nn.Module, *, src: int) -> None:
    """Every parameter and buffer of `module` from rank `src` (in place), on every rank of the world."""
    for tensor in [*module.parameters(), *module.buffers()]:
        dist.broadcast(tensor.data, src=src)


class SpecCoTrainGRPOTrainer(GRPOTrainer):
    r"""
    [`~trl.GRPOTrainer`] that co-trains a draft (of the ``args.drafter`` family) every step and rolls out with it.

    Args:
        model, reward_funcs, args, ...: as for [`~trl.GRPOTrainer`]; ``args`` is a [`SpecCoTrainConfig`].
        draft_model ([`DraftModel`], *optional*):
            The draft to co-train, of the ``args.drafter`` family. Default: loaded from
            ``args.draft_model_name_or_path``, or built from the policy by the family's `from_target`
            (``draft_vocab_size`` from the training prompts' token counts, the family's own options from ``args``:
            `from_target_options`).
    """

    _tag_names = ["trl", "grpo", "hf_spec_cotrain"]  # and the draft's family (`drafter_name`), added once built
    _saving_checkpoint = False  # True inside `_save_checkpoint`: `save_model` then writes the draft too
    _tool_loop_prompts = None  # inside TRL's tool loop: the batch's prompt ids, whose conversations its turns extend
    _warned_no_finite_reward = False  # a step without any finite reward is warned about once per run

    def __init__(self, model, reward_funcs=None, args: SpecCoTrainConfig | None = None, *, draft_model=None, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = SpecCoTrainConfig(f"{name.split('/')[-1]}-SpecCoTrain")
        if not isinstance(args, SpecCoTrainConfig):
            raise ValueError(
                f"`args` is a {type(args).__name__}; SpecCoTrainGRPOTrainer needs a SpecCoTrainConfig (it adds the "
                "draft and speculative-rollout options to GRPOConfig)."
            )
        # Options TRL's __init__ must not see as they are (restored after it).
        hidden_from_trl = {}
        # With speculative vLLM rollouts the package owns the engine (it also holds the draft): keep TRL from
        # building a plain one first, since two engines must never coexist.
        speculative_vllm = args.use_vllm and args.speculative_decoding
        if speculative_vllm:
            hidden_from_trl["use_vllm"] = False
        # Under pipeline parallelism each rank loads only its stage of the policy and of the reference model: TRL
        # would load both whole on every rank.
        pipeline = args.pipeline_parallel_size > 1
        reference_stage = pipeline and args.beta != 0.0
        if pipeline:
            if isinstance(model, str):
                model = load_pipeline_stage(model, args)
                # The stage's load used them: keep TRL from warning that they are ignored, unless it loads a reward
                # model by name with them.
                rewards = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
                if not any(isinstance(reward, str) for reward in rewards):
                    hidden_from_trl["model_init_kwargs"] = None
            else:
                logger.warning(
                    "pipeline_parallel_size > 1 with a policy passed already built: every rank holds the whole "
                    "policy until its stage is cut out. Pass its name or path to load only each rank's stage."
                )
        if reference_stage:
            hidden_from_trl.update(beta=0.0, sync_ref_model=False)
        with _hidden_from(args, hidden_from_trl):
            super().__init__(model, reward_funcs, args, **kwargs)
        if reference_stage:
            self.beta = args.beta
            self.ref_model = self._load_reference_stage()
        self.parallel_dims = ParallelDims.from_config(
            args,
            world_size=self.accelerator.num_processes,
            deepspeed=self.is_deepspeed_enabled,
            fsdp=self.is_fsdp_enabled,
            fsdp_version=(2 if self.accelerator.is_fsdp2 else 1) if self.is_fsdp_enabled else None,
            peft=is_peft_model(self.accelerator.unwrap_model(self.model)),
            tools=bool(self.tools),
        )
        self.parallel_dims.check_policy(self._policy(), aux_loss=self.aux_loss_enabled)
        check_trl_can_train(
            self._policy(), gradient_checkpointing=args.gradient_checkpointing, aux_loss=self.aux_loss_enabled
        )
        # Where accelerate dropped FSDP (on CPU), a context-parallel run shards the policy itself.
        shards_policy_itself = self.parallel_dims.cp_enabled and self.parallel_dims.fsdp and not self.is_fsdp_enabled
        if shards_policy_itself and args.save_strategy != "no":
            strategy = getattr(args.save_strategy, "value", args.save_strategy)
            raise ValueError(
                f"`save_strategy`={strategy!r} with FSDP2 that the trainer applies itself (on CPU, where accelerate "
                "drops FSDP) is not supported: each rank would checkpoint its own shard of the optimizer state, which "
                "no resume reads back. Set `save_strategy='no'` (the final `save_model` gathers the whole policy), or "
                "run FSDP2 on accelerators, where accelerate shards and checkpoints it."
            )
        self._share_weights_read_on_rank_zero()
        self._check_reward_returns()
        self.draft = self._build_draft(draft_model)
        self._tag_names = [*self._tag_names, self.draft.drafter_name]
        self._policy().add_model_tags([self.draft.drafter_name])
        self.aux_layer_ids = self.draft.tap_layer_ids(self._policy().config.get_text_config().num_hidden_layers)
        self.step_times = StepTimes(self._metrics)
        engine = None
        if speculative_vllm:  # before the draft is sharded: the engine starts from a folder of the whole draft
            engine = build_rollout_engine(
                self.draft,
                args,
                policy=self._policy(),
                tokenizer=self._tokenizer,
                max_num_seqs=args.per_device_train_batch_size * args.steps_per_generation,
            )
        if args.shard_draft:  # before its optimizer is built over its (then sharded) parameters
            shard_draft(self.draft, self.parallel_dims.build_shard_mesh(self.accelerator.device.type))
        self.draft_cotrainer = DraftCoTrainer(
            self.draft,
            args,
            self.accelerator,
            policy=self._policy,
            metrics=self._metrics,
            owner_rank=self.accelerator.num_processes - 1 if self.parallel_dims.pp_enabled else None,
            step_times=self.step_times,
        )
        self.add_callback(DraftUpdateCallback(self.draft_cotrainer))
        self.add_callback(StepTimesCallback(self.step_times))
        self.parallel = build_parallel_strategy(
            self.parallel_dims,
            self._trl_hooks(),
            model=self.model,
            policy=self._policy(),
            reference_model=self.ref_model,
            draft=self.draft,
            aux_layer_ids=self.aux_layer_ids,
            draft_cotrainer=self.draft_cotrainer,
            accelerator=self.accelerator,
            args=args,
            distributed=self._dist,
            processing_class=self.processing_class,
            pad_token_id=self._tokenizer.pad_token_id,
            loss=GRPOLoss(
                temperature=self.temperature,
                epsilon_low=self.epsilon_low,
                epsilon_high=self.epsilon_high,
                loss_type=self.loss_type,
                beta=self.beta,
                max_completion_length=self.max_completion_length,
            ),
            shards_policy_itself=shards_policy_itself,
        )
        self.rollouts = build_rollouts(
            self.draft,
            args,
            self.accelerator,
            sampling=RolloutSampling(
                max_tokens=self.max_completion_length,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k or 0,
                eos_token_ids=self.eos_token_ids,
                pad_token_id=self._tokenizer.pad_token_id,
                pad_to_multiple_of=self.pad_to_multiple_of,
            ),
            metrics=self._metrics,
            policy=lambda: self.accelerator.unwrap_model(self.model),
            policy_for_generation=self.parallel.policy_for_generation,
            trl_generation=self._trl_generation,
            engine=engine,
            pipeline=self.parallel.generation_pipeline(),
            step_times=self.step_times,
        )
        if args.speculative_decoding:
            try:
                self.rollouts.check_can_serve(self._policy())
            except ValueError:
                if engine is not None:
                    engine.close()
                raise

    def _trl_hooks(self) -> TRLHooks:
        """TRL's behaviour and bookkeeping that the parallel strategy runs or wraps (`super()`'s, bound here)."""

        def compute_loss(model, inputs, num_items_in_batch):
            with self.compute_loss_context_manager():
                return self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)

        trl = super()
        return TRLHooks(
            training_step=trl.training_step,
            log_probs=trl._get_per_token_logps_and_entropies,
            clip_grad_norm=trl._clip_grad_norm,
            grad_norm=trl._get_grad_norm,
            save_model=trl.save_model,
            save_state_dict=self._save,
            save_optimizer_and_scheduler=trl._save_optimizer_and_scheduler,
            load_from_checkpoint=trl._load_from_checkpoint,
            load_optimizer_and_scheduler=trl._load_optimizer_and_scheduler,
            prepare_inputs=self._prepare_inputs,
            compute_loss=compute_loss,
            loss_is_unscaled=self._loss_is_unscaled,
            gradient_accumulation_steps=lambda: self.current_gradient_accumulation_steps,
            draft_loss_divisor=self._draft_loss_divisor,
            count_micro_step=self._count_micro_step,
            model_wrapped=lambda: self.model_wrapped,
            global_step=lambda: self.state.global_step,
            optimizer=lambda: self.optimizer,
            lr_scheduler=lambda: self.lr_scheduler,
        )

    def create_accelerator_and_postprocess(self):
        """Without a parallelism config in the arguments accelerate builds one from `accelerate launch`'s environment,
        and refuses any on CPU. Under context parallelism the config has already taken those sizes (and dropped them
        on CPU, where the trainer builds the mesh itself): accelerate must not read them again."""
        if self.args.context_parallel_size > 1 and self.args.parallelism_config is None:
            with patch_environment(ACCELERATE_USE_PARALLELISM_CONFIG="false"):
                return super().create_accelerator_and_postprocess()
        return super().create_accelerator_and_postprocess()

    def _load_reference_stage(self):
        """This rank's stage of the reference model, prepared as TRL prepares its whole one."""
        policy = self._policy()
        reference = load_pipeline_stage(
            get_config_model_id(policy.config),
            self.args,
            dtype=policy.dtype,
            attn_implementation=policy.config._attn_implementation,
        )
        if self.args.disable_dropout:
            disable_dropout_in_model(reference)
        reference = self.accelerator.prepare_model(reference, evaluation_mode=True)
        if self.args.sync_ref_model:
            self.add_callback(SyncRefModelCallback(ref_model=reference, accelerator=self.accelerator))
        return reference

    def _share_weights_read_on_rank_zero(self) -> None:
        """Under FSDP's CPU-RAM-efficient loading (`fsdp_cpu_ram_efficient_loading`) transformers reads a model's
        weights on local rank 0 only, leaving zeros elsewhere for FSDP to broadcast when it wraps the model. Where
        accelerate dropped FSDP (on CPU) nothing would: DDP does not wrap the reference model, and the trainer's own
        FSDP2 shards what each rank holds. So the policy and the reference model get rank 0's weights here. Pipeline
        stages differ per rank: `load_pipeline_stage` reads each on its own rank."""
        if not fsdp_loads_on_rank_zero_only() or self.is_fsdp_enabled or self.parallel_dims.pp_enabled:
            return
        for model in (self.model, self.ref_model):
            if model is not None:
                _broadcast_module(model, src=0)

    @property
    def draft_optimizer(self) -> torch.optim.Optimizer:
        return self.draft_cotrainer.optimizer

    @property
    def draft_skipped_steps(self) -> int:
        return self.draft_cotrainer.skipped_steps

    @property
    def rollout_engine(self):
        """The vLLM engine of speculative vLLM rollouts (None for HF-native ones)."""
        return self.rollouts.engine

    # ------------------------------------------------------------------ the draft

    def _policy(self):
        """The policy as a HF causal LM (PEFT and DDP wrappers removed)."""
        return self.unwrapped(self.model)

    def unwrapped(self, model):
        """`model` (the policy or the reference model) as a HF causal LM, PEFT and DDP wrappers removed."""
        return unwrapped_hf(self.accelerator, model)

    def _build_draft(self, draft_model: DraftModel | None) -> DraftModel:
        args = self.args
        policy = self._policy()
        family = drafter_family(args.drafter)
        # Every rank starts from the source's draft. A fresh draft's lm_head starts from the policy's, which under
        # pipeline parallelism only the last stage holds: that stage builds it and sends its config to the others.
        source = self.accelerator.num_processes - 1 if self.parallel_dims.pp_enabled else 0
        sent_config = draft_model is None and args.draft_model_name_or_path is None and self.parallel_dims.pp_enabled
        # A private RNG stream: building the draft must not change the policy run's sampling.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(args.seed)
            if draft_model is not None:
                check_draft_family(draft_model, args.drafter)
                draft = draft_model
            elif args.draft_model_name_or_path is not None:
                draft = load_draft(args.draft_model_name_or_path, args.drafter)
            elif not sent_config or self.accelerator.process_index == source:
                counts = self._prompt_token_counts() if args.draft_vocab_size is not None else None
                draft = family.from_target(
                    policy,
                    **family.from_target_options(
                        args, getattr(self.processing_class, "tokenizer", self.processing_class)
                    ),
                    draft_vocab_size=args.draft_vocab_size,
                    token_counts=counts,
                )
            if sent_config:
                config = [draft.config if self.accelerator.process_index == source else None]
                dist.broadcast_object_list(config, src=source)
                if self.accelerator.process_index != source:
                    draft = family(config[0])
        draft.bind_target(policy)
        limit = draft.max_tokens_per_round()
        if limit is not None and args.max_draft_tokens > limit:
            raise ValueError(
                f"This draft proposes at most {limit} tokens per round, but up to {args.max_draft_tokens} were asked "
                "(`num_speculative_tokens`, or `max_speculative_tokens` under 'auto'): ask for at most "
                f"{limit}, or use a draft that proposes more."
            )
        draft.to(device=self.accelerator.device, dtype=torch.float32)  # fp32 master weights for a small head
        draft.train()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            _broadcast_module(draft, src=source)
        return draft

    def _prompt_token_counts(self) -> torch.Tensor:
        """Token frequencies of the training prompts, which choose a reduced draft vocabulary."""
        if self.train_dataset is None:
            raise ValueError("`draft_vocab_size` chooses tokens by frequency in the training prompts: pass a dataset.")
        texts = []
        for example in self.train_dataset:
            if is_conversational(example):
                example = apply_chat_template(example, self.processing_class)
            texts.append(example["prompt"])
        vocab_size = self._policy().config.get_text_config().vocab_size
        return count_tokens(self._tokenizer(texts, add_special_tokens=False)["input_ids"], vocab_size)

    def _draft_loss_divisor(self) -> int:
        """The micro-steps the draft's gradients accumulate over before its update."""
        return self.current_gradient_accumulation_steps * self.args.draft_update_interval

    # ------------------------------------------------------------------ the training step

    def _compute_loss(self, model, inputs):
        if not self.model.training:
            return super()._compute_loss(model, inputs)
        with (
            TapRecorder(model, self.aux_layer_ids, record_embeddings=True, record_final_hidden=True) as recorder,
            recorder.capture(),
        ):
            loss = super()._compute_loss(model, inputs)
        taps = recorder.pop_all()
        if len(taps) != 1:
            raise RuntimeError(f"Expected one recorded policy forward per micro-batch, got {len(taps)}.")
        self.parallel.record_taps(taps[0], inputs)
        return loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        with self.step_times.measure("step"):
            return self.parallel.training_step(model, inputs, num_items_in_batch)

    def _count_micro_step(self, seconds: float) -> None:
        """What GRPOTrainer.training_step records around the base step, for a strategy that replaces it: the
        micro-step counter and the step time."""
        self._step += 1
        self._current_train_step_time += seconds
        if self._step % self.current_gradient_accumulation_steps == 0:
            self._metrics["train"]["step_time"].append(self._current_train_step_time)
            self._current_train_step_time = 0.0

    def _loss_is_unscaled(self, num_items_in_batch) -> bool:
        """Whether a step divides the loss by the accumulation steps itself, as `Trainer.training_step` does (TRL's
        loss is scaled already when the model takes loss kwargs)."""
        return (not self.model_accepts_loss_kwargs or num_items_in_batch is None) and self.compute_loss_func is None

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **kwargs,
    ):
        return self.parallel.log_probs(
            model,
            input_ids,
            attention_mask,
            logits_to_keep,
            batch_size,
            compute_entropy,
            compute_aux_loss=compute_aux_loss,
            **kwargs,
        )

    def _clip_grad_norm(self, model):
        return self.parallel.clip_grad_norm(model)

    def _get_grad_norm(self, model, grad_norm=None):
        return self.parallel.grad_norm(model, grad_norm)

    # ------------------------------------------------------------------ rewards that cannot train

    def _check_reward_returns(self) -> None:
        """Have every reward function (a callable, not a reward model) refused, by its name, when it does not return
        one value per completion (`checked_reward_function`)."""
        self.reward_funcs = [
            func if isinstance(func, torch.nn.Module) else checked_reward_function(func, name)
            for func, name in zip(self.reward_funcs, self.reward_func_names, strict=True)
        ]

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's rewards (of every process), with the rows that cannot train counted in ``rewards/nonfinite_rows``
        and one warning, the first time all of a step's rows are such."""
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        num_nonfinite = nonfinite_reward_rows(rewards_per_func)
        self._metrics["train" if self.model.training else "eval"]["rewards/nonfinite_rows"].append(num_nonfinite)
        if num_nonfinite == len(rewards_per_func) and not self._warned_no_finite_reward:
            self._warned_no_finite_reward = True
            logger.warning(
                no_finite_reward_warning(self.reward_func_names, num_nonfinite, step=self.state.global_step + 1)
            )
        return rewards_per_func

    # ------------------------------------------------------------------ rollouts

    def _generate(self, prompts):
        """A batch of rollouts, every turn of it: the turns' ``spec/*`` metrics are logged once for the batch,
        weighted by what each measured; with tools, ``tools/turns_per_rollout`` too (assistant turns per rollout)."""
        with self.rollouts.generation_batch(step=self.state.global_step, training=self.model.training):
            generated = super()._generate(prompts)
        if self.tools:  # TRL's completions: each rollout's messages
            mode = "train" if self.model.training else "eval"
            self._metrics[mode]["tools/turns_per_rollout"].append(turns_per_rollout(generated[3], self.accelerator))
        return generated

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """Speculative turns from the rollouts; plain ones from TRL's generation, or from the rollouts where no rank
        holds the whole policy (pipeline parallelism)."""
        with self.step_times.measure("generation"):
            speculative = self._speculates(images, multimodal_fields)
            if not (speculative or self.rollouts.generates_plain_turns):
                return super()._generate_single_turn(
                    prompt_ids, images, multimodal_fields, num_generations, has_tool_images
                )
            if images is not None or multimodal_fields:
                raise ValueError("Pipeline parallelism supports text-only rollouts.")
            max_tokens = None
            if self._tool_loop_prompts is not None:  # a later turn: no more than the conversation's budget leaves
                max_tokens = conversation_budget(prompt_ids, self._tool_loop_prompts, self.max_completion_length)
            return self.rollouts.generate(
                prompt_ids,
                step=self.state.global_step,
                training=self.model.training,
                speculative=speculative,
                max_tokens=max_tokens,
            )

    def _tool_call_loop(self, prompts, prompt_ids, *args):
        """TRL's tool loop, timed less its turns' generation (``time/tool_calls``); its turns ask for no more tokens
        than their conversation's budget leaves (TRL cuts the rest after a turn, `conversation_budget`). It drops a
        tool result that would take a conversation past the rollout backend's context, which it reads from the
        policy's ``max_position_embeddings`` unless TRL owns the vLLM engine: it sees the package's colocated
        engine's (``vllm_max_model_length``) where that is smaller, as TRL's own engine's."""
        ceiling = self.rollouts.context_ceiling
        config = self.model.config.get_text_config()
        engine_context = {}
        if ceiling is not None and ceiling < config.max_position_embeddings:
            engine_context = {"max_position_embeddings": ceiling}
        self._tool_loop_prompts = prompt_ids
        try:
            with self.step_times.measure("tool_calls", excluding="generation"), _hidden_from(config, engine_context):
                return super()._tool_call_loop(prompts, prompt_ids, *args)
        finally:
            self._tool_loop_prompts = None

    def _trl_generation(self, prompt_ids):
        """TRL's plain generation of a text-only turn: the speculative rollouts' plain backend."""
        return super()._generate_single_turn(prompt_ids, None, {}, self.num_generations)

    def _speculates(self, images, multimodal_fields) -> bool:
        """Whether this turn's rollouts are speculative (else plain generation serves them)."""
        return (
            self.args.speculative_decoding
            and self.draft_cotrainer.speculating
            and not self.use_vllm  # TRL's own engine
            and not self.use_transformers_continuous_batching
            and images is None
            and not multimodal_fields
        )

    # ------------------------------------------------------------------ checkpoints, saving, the Hub

    def _save_checkpoint(self, model, trial):
        # The draft is written inside `save_model`, the first write of transformers' checkpoint (see
        # training/checkpoints.py): before the trainer state marks the checkpoint complete and old ones are deleted.
        self._saving_checkpoint = True
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._saving_checkpoint = False

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The policy as the strategy saves it; in a checkpoint the draft and its training state too, from the
        process that `writes_draft`."""
        folder = Path(output_dir or self.args.output_dir)
        self.parallel.save_policy(folder, _internal_call)
        if self._saving_checkpoint and self.args.save_draft and self.joins_draft_save():
            self._save_draft_checkpoint(folder)

    def writes_draft(self) -> bool:
        """Whether this process writes the draft: the last stage under pipeline parallelism (it trains the draft,
        and generated the rollouts whose acceptance history goes with it), else the main process."""
        return self.parallel.writes_draft()

    def joins_draft_save(self) -> bool:
        """Whether this process takes part in saving the draft: the one that `writes_draft`, and every process when
        the draft is sharded (`shard_draft`: it is gathered whole for the writer, a collective)."""
        return self.args.shard_draft or self.writes_draft()

    def _save_optimizer_and_scheduler(self, output_dir):
        self.parallel.save_optimizer_and_scheduler(output_dir)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        return self.parallel.load_from_checkpoint(resume_from_checkpoint, model)

    def _save_draft_checkpoint(self, folder: Path) -> None:
        """The draft and its training state, each renamed into place once written whole (by the process that
        `writes_draft`; every process that `joins_draft_save` gathers them)."""
        self.save_draft(folder / DRAFT_FOLDER)
        state = {**self.draft_cotrainer.state_dict(), "acceptance_history": self.rollouts.acceptance_history}
        if self.writes_draft():
            write_atomically(folder / DRAFT_STATE_FILE, lambda path: torch.save(state, path))

    def _load_optimizer_and_scheduler(self, checkpoint):
        self.parallel.load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        if not (Path(checkpoint) / DRAFT_FOLDER).is_dir():  # `train` refused this unless `save_draft=False`
            logger.warning(
                f"{checkpoint} holds no draft (it was written with `save_draft=False`): the resumed run starts from a "
                "fresh draft, with a fresh optimizer."
            )
            return
        differences = draft_shape_differences(checkpoint, self.draft)
        if differences:  # `train` refused this unless `save_draft=False`
            logger.warning(
                f"The draft in {checkpoint} has another shape than this run's "
                f"({describe_draft_shape_differences(differences)}): with `save_draft=False` the resumed run starts "
                "from a fresh draft, with a fresh optimizer."
            )
            return
        loaded = load_draft(Path(checkpoint) / DRAFT_FOLDER, self.args.drafter)
        self.draft_cotrainer.load_draft_weights(loaded.state_dict())
        state = torch.load(Path(checkpoint) / DRAFT_STATE_FILE, map_location="cpu", weights_only=True)
        self.draft_cotrainer.load_state_dict(state)
        self.rollouts.acceptance_history = [tuple(item) for item in state["acceptance_history"]]

    def save_draft(
        self, folder: str | os.PathLike, *, repo_id: str | None = None, final_policy: str | None = None
    ) -> Path:
        """Write the draft as a vLLM-loadable folder, with its model card (README.md). ``final_policy``: the Hub id or
        folder of the policy the draft pairs with, the run's final one, for the card (default: ``hub_model_id``);
        call it from every process that `joins_draft_save`: the process that `writes_draft` writes it."""
        folder = Path(folder)
        self.draft.validate_weights(what=f"The draft to save in {folder}")  # healed every step: a bug if it fails
        weights = self.draft_cotrainer.whole_draft_weights()
        if not self.writes_draft():
            return folder
        card = render_draft_card(
            self.draft,
            target_model=self._starting_policy,
            repo_id=repo_id or self._draft_repo_id(),
            training=CoTrainingRecord(
                acceptance_history=self.rollouts.acceptance_history,
                final_policy=final_policy or self.args.hub_model_id,
                skipped_steps=self.draft_cotrainer.skipped_steps,
                restored_steps=self.draft_cotrainer.restored_steps,
            ),
            hyperparameters=self._card_hyperparameters(),
            num_speculative_tokens=self.args.max_draft_tokens,
            license_fields=self._starting_policy_license,
            num_target_layers=self._policy().config.get_text_config().num_hidden_layers,
        )

        def write(temporary: Path) -> None:
            # the caller is the process that writes it
            self.draft.save_pretrained(temporary, on_this_rank=True, state_dict=weights)
            (temporary / "README.md").write_text(card, encoding="utf-8")

        write_atomically(folder, write)
        return folder

    def push_draft_to_hub(self, repo_id: str | None = None, *, private: bool | None = None):
        """Save the draft with its card and upload that folder to the Hub; returns the commit info."""
        repo_id = repo_id or self._draft_repo_id()
        folder = self.save_draft(Path(self.args.output_dir) / DRAFT_FOLDER, repo_id=repo_id)
        return push_draft_folder(
            folder,
            repo_id,
            token=self.args.hub_token,
            private=private,
            commit_message=f"Co-trained {self.draft.display_name} draft, step {self.state.global_step}",
        )

    @property
    def _starting_policy(self) -> str:
        """The policy the run started from (Hub id or folder; "" when built in memory): the draft's card names it as
        its `base_model`. The policy the draft pairs with is the run's final one, published as ``hub_model_id`` when
        set."""
        return self._policy().config._name_or_path

    @cached_property
    def _starting_policy_license(self) -> dict[str, str]:
        """The starting policy's license, read once (it may take a Hub request)."""
        return model_license(self._starting_policy)

    def _card_hyperparameters(self) -> dict[str, object]:
        """The training settings that shape the draft, as the card's table shows them."""
        args = self.args
        drafted = args.num_speculative_tokens
        if drafted == "auto":
            drafted = f"auto: 0..{args.max_speculative_tokens}, chosen per round"
        return {
            "RL steps with co-training (GRPO)": self.state.global_step,
            "Policy learning rate": f"{args.learning_rate:g}",
            "Generations per prompt x max completion length": (
                f"{args.num_generations} x {args.max_completion_length} tokens"
            ),
            "Rollout temperature, engine": f"{args.temperature:g}, {'vLLM' if args.use_vllm else 'HF-native'}",
            "Draft learning rate (warm-up steps)": f"{args.draft_learning_rate:g} ({args.draft_warmup_steps})",
            **self.draft.describe_options(self.draft_cotrainer.settings.options),
            "Drafted tokens per round (K)": drafted,
            "Share of rollouts the draft trains on (`draft_train_fraction`)": f"{args.draft_train_fraction:g}",
        }

    def _draft_repo_id(self) -> str:
        base = self.args.hub_model_id or Path(self.args.output_dir).name
        return self.args.draft_hub_model_id or f"{base}-{self.draft.drafter_name}"

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        checkpoint = resume_from_checkpoint
        if checkpoint is True and Path(self.args.output_dir).is_dir():
            checkpoint = get_last_checkpoint(self.args.output_dir)  # as transformers resolves it
        if isinstance(checkpoint, str | os.PathLike):
            stages = self.parallel_dims.pipeline_parallel_size
            check_resumable(checkpoint, draft=self.args.save_draft, pipeline_stages=stages)
            if self.args.save_draft:
                check_draft_shape(checkpoint, self.draft)
        output = super().train(resume_from_checkpoint, *args, **kwargs)
        if self.args.save_draft and self.joins_draft_save():
            self.save_draft(Path(self.args.output_dir) / DRAFT_FOLDER)
            if self.args.push_draft_to_hub and self.writes_draft():
                self.push_draft_to_hub()
        return output


__all__ = ["SpecCoTrainGRPOTrainer"]
