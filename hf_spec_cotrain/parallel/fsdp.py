"""FSDP2 where the package needs it beyond accelerate.

* `apply_fsdp2`: on CPU, accelerate drops FSDP and runs DDP, so a context-parallel run that asks for FSDP2 shards its
  models here, the way accelerate's FSDP2 preparation does on an accelerator: `fully_shard` on every transformer block
  (the model's `_no_split_modules`), then on the root.
* `gathered_for_generation`: a sharded forward is a collective that every rank must join, but a speculative decoding
  loop runs as many forwards as its own rows need, which differ between ranks. The policy is gathered whole once
  (every rank at once), the loop's forwards then need no communication, and it is sharded again after.
* `shard_draft`: the draft sharded like the policy (`shard_draft=True`), its training objective a forward of the
  root; `full_state_items` gathers a sharded module's tensors one at a time (engine pushes).
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor


def apply_fsdp2(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Shard `model` (a HF model) over `mesh` with `fully_shard`, block by block; returns it (changed in place).

    Its parameters become DTensors sharded over the mesh; each forward gathers a block's parameters, the backward
    reduce-scatters (averages) its gradients over the mesh. `generate` gathers like `forward`.
    """
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} names no transformer blocks (`_no_split_modules`) to shard with FSDP2 one by one."
        )
    for module in model.modules():
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if hasattr(model, "generate"):
        register_fsdp_forward_method(model, "generate")
    return model


def shard_draft(draft: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Shard a draft (a `DraftModel`, replicated alike on every rank) over `mesh` with `fully_shard`, as one unit;
    returns it (changed in place).

    One unit, not block by block: the objectives call pieces of a block outside its forward (DFlash's context keys and
    values), which a per-block unit would leave sharded. A draft has one or a few layers, so its objective
    (`training_loss`, a forward of the root) gathers it whole for the micro-step, what a replica holds all run, and its
    backward reduce-scatters (averages) the gradients over the mesh. FSDP2 takes as its root the first module to run a
    forward, so the root is initialised here, before any proposer runs."""
    fully_shard(draft, mesh=mesh)
    register_fsdp_forward_method(draft, "training_loss")
    draft._get_fsdp_state()._lazy_init()  # torch (2.13) has no public way to fix the root before a forward
    return draft


def full_state_items(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """`module.state_dict().items()` with each FSDP2-sharded tensor gathered whole as it is reached: one whole
    tensor at a time, never the whole module (a collective per sharded tensor: every rank of its mesh iterates
    alike)."""
    for name, tensor in module.state_dict().items():
        yield name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@contextmanager
def gathered_for_generation(model: nn.Module) -> Iterator[nn.Module]:
    """`model` with the parameters of each of its FSDP2 modules gathered whole for the duration (a collective: every
    rank enters together); forwards inside need no communication. A model without FSDP2 modules is left as it is.

    Inside, no module reshards after its forward. On the way out each is sharded again and gets back its setting:
    accelerate and `fully_shard` choose it per module (blocks by the config, output layers not); the root (the first
    FSDP2 module) never reshards after forward, as FSDP2 sets a root whose setting was left to it (its first forward
    may come inside, before FSDP2 has set it)."""
    modules = [module for module in model.modules() if isinstance(module, FSDPModule)]
    settings = [index > 0 and _reshards_after_forward(module) for index, module in enumerate(modules)]
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
        module.unshard()
    try:
        yield model
    finally:
        for module, reshards in zip(modules, settings):
            module.reshard()
            module.set_reshard_after_forward(reshards, recurse=False)


def _reshards_after_forward(module: FSDPModule) -> bool:
    """The module's `reshard_after_forward`. torch (2.13) has a setter for it and no getter: a parameter group that
    reshards after forward is one with a post-forward mesh (what the setter writes). tests/distributed/
    test_fsdp_generation.py checks the round trip by what a forward leaves sharded."""
    groups = module._get_fsdp_state()._fsdp_param_groups
    return any(group.post_forward_mesh_info is not None for group in groups)


__all__ = ["apply_fsdp2", "full_state_items", "gathered_for_generation", "shard_draft"]
