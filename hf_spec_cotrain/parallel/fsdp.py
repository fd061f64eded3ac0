"""FSDP2 of the policy where accelerate does not apply it: on CPU, accelerate drops FSDP and runs DDP, so a
context-parallel run that asks for FSDP2 shards its models here, the way accelerate's FSDP2 preparation does on an
accelerator: `fully_shard` on every transformer block (the model's `_no_split_modules`), then on the root.
"""

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method


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


__all__ = ["apply_fsdp2"]
