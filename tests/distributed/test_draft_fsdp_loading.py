"""A draft checkpoint loads whole on every rank of an FSDP launch with CPU-RAM-efficient loading.

`accelerate launch` with `fsdp_cpu_ram_efficient_loading: true` (examples/accelerate_configs/fsdp2.yaml) exports
`ACCELERATE_USE_FSDP` and `FSDP_CPU_RAM_EFFICIENT_LOADING`; transformers' `from_pretrained` then reads the weights on
local rank 0 only and leaves zeros elsewhere for FSDP to broadcast. The draft is replicated, never wrapped by FSDP,
so nothing would fill them in: it must read its checkpoint on every rank.
"""

import tempfile

import pytest
import torch
import torch.distributed as dist
from accelerate.utils import patch_environment

from hf_spec_cotrain import Eagle3DraftModel
from hf_spec_cotrain.testing import build_tiny_target


pytestmark = pytest.mark.distributed


def load_draft_under_fsdp_ram_efficient_loading() -> dict[str, bool]:
    rank = dist.get_rank()
    target = build_tiny_target("llama", num_layers=7, hidden_size=64, num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    saved = Eagle3DraftModel.from_target(target, draft_vocab_size=24, token_counts=torch.arange(target.vocab_size))
    with tempfile.TemporaryDirectory() as folder:
        saved.save_pretrained(folder, on_this_rank=True)  # each rank its own folder
        with patch_environment(ACCELERATE_USE_FSDP="true", FSDP_CPU_RAM_EFFICIENT_LOADING="true", LOCAL_RANK=rank):
            loaded = Eagle3DraftModel.from_pretrained(folder, target=target)
    want = saved.state_dict()
    return {name: torch.equal(tensor, want[name]) for name, tensor in loaded.state_dict().items()}


def test_every_rank_reads_the_whole_draft(cp_pool):
    for rank, equal in enumerate(cp_pool.run(load_draft_under_fsdp_ram_efficient_loading)):
        assert equal and all(equal.values()), f"rank {rank}: tensors that differ from the checkpoint: {equal}"
