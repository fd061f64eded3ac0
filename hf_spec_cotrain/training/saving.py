"""Writing a model's weights as they stream in, in `save_pretrained`'s layout, never holding all of them at once."""

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME


__all__ = ["MAX_SHARD_SIZE", "write_streamed_safetensors"]

MAX_SHARD_SIZE = "50GB"
"""`save_pretrained`'s default shard size."""


def write_streamed_safetensors(
    folder: str | Path,
    listing: list[tuple[str, tuple[int, ...], torch.dtype]],
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    max_shard_size: int | str = MAX_SHARD_SIZE,
) -> None:
    """Write `named_tensors` (every tensor of `listing`: name, shape, dtype) to `folder` as `save_pretrained` shards
    them (``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` with their index), each shard written as soon
    as its last tensor arrived and then dropped: at most the shards still being filled are held."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shapes = {name: torch.empty(shape, dtype=dtype, device="meta") for name, shape, dtype in listing}
    split = split_torch_state_dict_into_shards(shapes, max_shard_size=max_shard_size)  # model{suffix}.safetensors
    missing = {filename: set(names) for filename, names in split.filename_to_tensors.items()}
    filling: dict[str, dict[str, torch.Tensor]] = {filename: {} for filename in missing}
    for name, tensor in named_tensors:
        if name not in split.tensor_to_filename:
            raise ValueError(f"{name} arrived but is not in the listing of the weights to write.")
        filename = split.tensor_to_filename[name]
        filling[filename][name] = tensor.detach().to("cpu").contiguous()
        missing[filename].discard(name)
        if not missing[filename]:
            save_file(filling.pop(filename), folder / filename, metadata={"format": "pt"})
    if filling:
        raise RuntimeError(f"No weights arrived for {sorted(set().union(*missing.values()))}.")
    if split.is_sharded:
        total_parameters = sum(tensor.numel() for tensor in shapes.values())
        index = {
            "metadata": {**split.metadata, "total_parameters": total_parameters},
            "weight_map": split.tensor_to_filename,
        }
        (folder / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
