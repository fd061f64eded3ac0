"""The parts of a weight sync that run inside vLLM's worker, called through `LLM.collective_rpc` (worker first).

They describe the policy and draft models as `ModelLayout`s, load checkpoint tensors with vLLM's own loaders (so
vLLM fuses, maps and re-packs them as it does at start-up, MoE experts on CPU included), load past the reload what
it would skip, put a failed layerwise reload back on its previous kernels, and read weights back *through the
kernels vLLM runs* to compare them with what was sent. vLLM is imported
inside each function, when it runs in the worker.
"""

from collections.abc import Callable, Iterable, Iterator

import torch

from .engine import WeightSet
from .vllm_layout import ModelLayout, ParamShape, PolicyNames


__all__ = ["describe_models", "find_mismatches", "load_draft_weights", "load_policy_weights", "read_params"]

# Rows of the identity fed at once to a packed linear layer when reading its weight back.
_PROBE_ROWS = 2048


def _models(worker) -> dict[WeightSet, torch.nn.Module | None]:
    get_draft_model = getattr(worker, "get_draft_model", None)
    return {"policy": worker.get_model(), "draft": get_draft_model() if get_draft_model else None}


def _logical_shape(module: torch.nn.Module, leaf: str, param: torch.Tensor) -> ParamShape:
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    if isinstance(module, LinearBase) and leaf in ("weight", "bias"):
        sizes = list(module.output_partition_sizes)
        input_size = getattr(module, "input_size_per_partition", module.input_size)
        tail = (input_size,) if leaf == "weight" else ()
        parts = [(size, *tail) for size in sizes] if len(sizes) > 1 else None
        return ParamShape(shape=(sum(sizes), *tail), part_shapes=parts)
    if isinstance(module, VocabParallelEmbedding) and leaf == "weight":
        return ParamShape(shape=(module.org_vocab_size, module.embedding_dim))
    return ParamShape(shape=tuple(param.shape))


def _describe(model: torch.nn.Module, *, exclude: set[int]) -> ModelLayout:
    modules = dict(model.named_modules())
    params = {}
    for name, param in model.named_parameters():
        if id(param) in exclude:
            continue
        module_name, _, leaf = name.rpartition(".")
        params[name] = _logical_shape(modules[module_name], leaf, param)
    config = getattr(model, "config", None)
    return ModelLayout(
        params=params,
        packed_modules={key: list(value) for key, value in getattr(model, "packed_modules_mapping", {}).items()},
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        architecture=type(model).__name__,
        vocab_size=getattr(config, "vocab_size", None),
    )


def describe_models(worker) -> dict[WeightSet, ModelLayout | None]:
    """The layout of the policy and of the draft (None without one), which every sync is checked against."""
    models = _models(worker)
    policy_params = {id(param) for param in models["policy"].parameters()}
    return {
        "policy": _describe(models["policy"], exclude=set()),
        # Parameters the drafter shares with the policy (the embedding) are synced with the policy.
        "draft": None if models["draft"] is None else _describe(models["draft"], exclude=policy_params),
    }


def _abort_layerwise_reload(model: torch.nn.Module) -> None:
    """Put every layer that a failed load left mid-reload back on its previous kernel tensors.

    vLLM's `finalize_layerwise_reload` does not cover a layer whose processing raised half-way (its
    parameters stay materialised in checkpoint shape and the next reload cannot copy into them),
    so a failed sync restores the saved kernel tensors of every layer that still holds them. Layers
    that finished keep their new weights: the caller treats the model as unusable until a full sync.
    """
    from vllm.model_executor.model_loader.reload import layerwise

    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
    for layer in model.modules():
        info = layerwise.get_layerwise_info(layer)
        if info.kernel_tensors is not None:
            layerwise._place_kernel_tensors(layer, info)
        info.reset()
    layerwise.LOADING_LAYERS.clear()


def _cpu_moe_experts(module: torch.nn.Module):
    """The CPU grouped-gemm experts kernel of a fused-MoE layer, or None: it keeps its weights prepacked."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    return experts if isinstance(experts, CPUUnquantizedExperts) else None


def _process_moe_updates_as_first_loads(model: torch.nn.Module) -> None:
    """Make the reload of each CPU fused-MoE layer rebuild its kernel, as the first load did.

    On a weight update vLLM's `UnquantizedFusedMoEMethod._setup_kernel` skips the experts kernel's own
    post-load step, which on CPU is the prepacking of w13/w2: the update would copy unpacked weights
    into the packed storage and the kernel would read garbage. Without a kernel the layer is processed
    as at start-up (padding and prepacking included) and the result copied into the same storage.
    """
    for module in model.modules():
        if _cpu_moe_experts(module) is not None:
            module.quant_method.moe_kernel = None


@torch.no_grad()
def load_policy_weights(worker, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Reload every policy weight from HF-named tensors with vLLM's own loader and kernel post-processing, then
    write in place those that the reload would skip (`PolicyNames.for_loader`)."""
    model = worker.get_model()
    # vLLM's loader skips a tied lm_head itself: tying changes nothing here.
    reloaded, copied = PolicyNames(tie_word_embeddings=False, architecture=type(model).__name__).for_loader(weights)
    _process_moe_updates_as_first_loads(model)
    try:
        worker.reload_weights(weights_iterator=iter(reloaded), is_checkpoint_format=True)
    except Exception:
        _abort_layerwise_reload(model)
        raise
    for name, tensor in copied.items():
        model.get_parameter(name).copy_(tensor)


def load_draft_weights(worker, weights: list[tuple[str, torch.Tensor]]) -> None:
    """The layerwise-reload steps vLLM's weight-transfer engines run for a draft, on its checkpoint tensors."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    model = worker.get_draft_model()
    with set_current_vllm_config(worker.vllm_config):
        initialize_layerwise_reload(model)
        try:
            model.load_weights(iter(weights))
        except Exception:
            _abort_layerwise_reload(model)
            raise
        finalize_layerwise_reload(model, worker.vllm_config.speculative_config.draft_model_config)
    _rebuild_fused_context_kv(model)


@torch.no_grad()
def _rebuild_fused_context_kv(model: torch.nn.Module) -> None:
    """Rebuild the context K/V buffers vLLM's DFlash model concatenates from its layers' weights when it loads them.

    Its `load_weights` builds them last, which at start-up is before the kernels process the weights but on a reload
    is after: on CPU each `qkv_proj.weight` is packed away by then and left empty, so the buffers would be empty and
    the next draft forward fail. They are rebuilt by vLLM's own builder from the weights as the kernels hold them.
    """
    inner = getattr(model, "model", None)
    build = getattr(inner, "_build_fused_kv_buffers", None)
    if build is None:
        return
    packed = []
    for layer in inner.layers:
        proj = layer.self_attn.qkv_proj
        spec = _logical_shape(proj, "weight", proj.weight)
        if tuple(proj.weight.shape) != spec.shape:
            packed.append((proj.weight, proj.weight.data))
            proj.weight.data = _read_weight(proj, "weight", proj.weight, spec)
    try:
        build()
    finally:
        for param, data in packed:
            param.data = data


@torch.no_grad()
def _unpack(packed: torch.Tensor, pack: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Undo `pack`, a reordering of a tensor's elements, by packing the elements' own indices.

    The indices go through `pack` as base-256 digits, which every floating dtype holds exactly.
    """
    numel = packed.numel()
    index = torch.arange(numel, device=packed.device)
    origin = torch.zeros_like(index)
    scale = 1
    while scale < numel:
        digits = torch.div(index, scale, rounding_mode="floor").remainder(256).to(packed.dtype)
        origin += pack(digits.view(packed.shape)).flatten().long() * scale
        scale *= 256
    if not torch.zeros(numel, dtype=torch.bool, device=packed.device).index_fill_(0, origin, True).all():
        raise RuntimeError("The MoE kernel's weight packing is not a reordering: its weights cannot be read back.")
    unpacked = torch.empty_like(packed).flatten()
    unpacked[origin] = packed.flatten()
    return unpacked.view(packed.shape)


@torch.no_grad()
def _read_weight(module: torch.nn.Module, leaf: str, param: torch.Tensor, spec: ParamShape) -> torch.Tensor:
    """The parameter as the kernels use it, in its logical shape.

    A linear weight whose storage the kernel does not read directly (the CPU backend packs it into
    a oneDNN or sgl handle and keeps an empty or stale `weight`) is read by applying the layer to
    the identity: `apply(I) = I @ W.T`. The CPU MoE kernel's prepacked expert weights are unpacked
    (`_unpack`) with that kernel's packing, and its expert biases read from the kernel.
    """
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    is_matmul = isinstance(module, LinearBase | ParallelLMHead) and leaf == "weight"
    if is_matmul and (hasattr(module, "cpu_linear") or tuple(param.shape) != spec.shape):
        rows, columns = spec.shape
        transposed = torch.empty(columns, rows, dtype=param.dtype, device=param.device)
        for start in range(0, columns, _PROBE_ROWS):
            stop = min(start + _PROBE_ROWS, columns)
            probe = torch.zeros(stop - start, columns, dtype=param.dtype, device=param.device)
            probe[:, start:stop].fill_diagonal_(1)
            transposed[start:stop] = module.quant_method.apply(module, probe, bias=None)[:, :rows]
        return transposed.T
    experts = _cpu_moe_experts(module)
    if experts is not None and leaf in ("w13_weight", "w2_weight") and not experts._use_zentorch:
        return _unpack(param, lambda tensor: cpu_prepack_moe_weight(tensor, experts.isa))
    if experts is not None and leaf in ("w13_bias", "w2_bias"):
        # The kernel holds the biases of the layer as it was processed, which a reload does not register.
        return experts.w1_bias if leaf == "w13_bias" else experts.w2_bias
    return param[: spec.shape[0]] if param.shape != spec.shape else param


def _kernel_weights(worker, which: WeightSet, vllm_names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each named parameter of `which` as its kernels use it (see `_read_weight`)."""
    model = _models(worker)[which]
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    for name in vllm_names:
        module_name, _, leaf = name.rpartition(".")
        module, param = modules[module_name], params[name]
        yield name, _read_weight(module, leaf, param, _logical_shape(module, leaf, param))


@torch.no_grad()
def read_params(worker, which: WeightSet, vllm_names: list[str]) -> dict[str, torch.Tensor]:
    """The named parameters as the kernels use them, copied to the CPU."""
    return {
        name: weight.to("cpu", copy=True, memory_format=torch.contiguous_format)
        for name, weight in _kernel_weights(worker, which, vllm_names)
    }


@torch.no_grad()
def find_mismatches(worker, which: WeightSet, expected: dict[str, torch.Tensor]) -> list[tuple[str, str]]:
    """`(vLLM name, what differs)` for every parameter whose kernels do not hold exactly the expected tensor."""
    mismatches = []
    for name, got in _kernel_weights(worker, which, expected):
        want = expected[name].to(device=got.device, dtype=got.dtype)
        if got.shape != want.shape:
            mismatches.append((name, f"shape {list(got.shape)} in vLLM, {list(want.shape)} sent"))
        elif not torch.equal(got, want):
            difference = (got.double() - want.double()).abs()
            mismatches.append(
                (
                    name,
                    f"{int((got != want).sum())} of {want.numel()} values differ, by up to {difference.max():.3g}",
                )
            )
    return mismatches
