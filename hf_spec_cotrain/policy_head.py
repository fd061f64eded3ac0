"""The policy's output distribution from its decoder's output, through the policy's own forward.

Families post-process the lm_head's product in their ``*ForCausalLM.forward``: Granite divides it by
``logits_scaling``, Cohere multiplies it by ``logit_scale``, Gemma 2 and 3 soft-cap it, MiniCPM scales the hidden
state first. A teacher or a log-prob computed as ``hidden @ lm_head.T`` trains towards a distribution such a policy
does not have. `PolicyHead` runs the policy's own forward with its decoder replaced by the recorded output, so
whatever the family (or a later one) applies is applied, with no per-family table.
"""

import inspect
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel


__all__ = ["PolicyHead", "unwrapped_policy"]


def unwrapped_policy(model: nn.Module) -> PreTrainedModel:
    """The transformers model inside DDP-style (``.module``) and PEFT wrappers."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model


class _RecordedOutput:
    """A decoder's output holding only its last hidden state: the heads read ``last_hidden_state`` or ``[0]``, and
    whatever else a family's head asks for (caches, attentions, router logits) is None."""

    def __init__(self, hidden: torch.Tensor):
        self.last_hidden_state = hidden

    def __getitem__(self, index):
        return (self.last_hidden_state,)[index]

    def __getattr__(self, name):  # only for names not set above
        if name.startswith("__"):
            raise AttributeError(name)
        return None


class _RecordedDecoder(nn.Module):
    """Stands in for the decoder: returns the recorded output whatever it is called with."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden

    def forward(self, *args, **kwargs) -> _RecordedOutput:
        return _RecordedOutput(self.hidden)


class _HeadRows(nn.Module):
    """The lm_head restricted to some vocabulary rows, in a chosen dtype, outside autocast."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.weight, self.dtype = weight, dtype

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            return F.linear(hidden.to(self.dtype), self.weight.to(self.dtype))


class PolicyHead:
    """Logits of ``policy`` (a transformers causal LM, possibly wrapped) from its decoder's output.

    `logits` keeps the real lm_head (differentiable: the pipeline's last stage scores the GRPO loss with it);
    `teacher_logits` takes only some vocabulary rows, detached, in a chosen dtype (the draft's teacher, docs/design.md
    section 2). Restricting the rows first is exact when the forward's post-processing is elementwise; `__init__`
    compares both on a random input and, where a family's is not, computes the full vocabulary and then selects.
    """

    def __init__(self, policy: nn.Module):
        self.policy, self.model = policy, unwrapped_policy(policy)
        # The module the forward calls for the decoder's output (`get_decoder()`: OPT's sits inside its base model).
        decoder = self.model.get_decoder()
        path = next((name for name, module in self.model.named_modules() if module is decoder and name), None)
        if path is None:
            raise ValueError(
                f"{type(self.model).__name__} has no decoder submodule (`get_decoder()`), so its output head cannot "
                "be run on recorded hidden states."
            )
        parent_path, _, self.decoder_name = path.rpartition(".")
        self.decoder_parent = self.model.get_submodule(parent_path)
        head = self.model.get_output_embeddings()
        self.head_name = next((name for name, child in self.model.named_children() if child is head), None)
        if self.head_name is None:
            raise ValueError(
                f"{type(self.model).__name__}'s output embeddings are not one of its direct submodules, so the "
                "teacher cannot take its vocabulary rows."
            )
        accepted = inspect.signature(self.model.forward).parameters
        self.forward_kwargs = {
            name: value
            for name, value in {"use_cache": False, "logits_to_keep": 0, "output_router_logits": False}.items()
            if name in accepted
        }
        self.rows_first = self._rows_first_is_exact()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The policy's logits over its whole vocabulary from its decoder's output ``hidden`` ``[B, L, hidden]``."""
        with self._decoder_replaced(hidden):
            return self._forward(hidden)

    @torch.no_grad()
    def teacher_logits(self, hidden: torch.Tensor, rows: torch.Tensor, *, dtype: torch.dtype | None = None):
        """The policy's logits at vocabulary ids ``rows`` only, ``[B, L, len(rows)]``, computed in ``dtype``
        (default: the lm_head's) outside any autocast. FSDP2's sharded lm_head is gathered first."""
        weight = self._output_weight()
        dtype = weight.dtype if dtype is None else dtype
        rows = rows.to(weight.device)
        with self._decoder_replaced(hidden), self._head_replaced(weight[rows] if self.rows_first else weight, dtype):
            logits = self._forward(hidden).to(dtype)
        return logits if self.rows_first else logits[..., rows]

    def _forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # `forward`, not `__call__`: the module's hooks (FSDP2's gathers, TRL's, the tap recorder's) stay out of it.
        placeholder_ids = torch.zeros(hidden.shape[:2], dtype=torch.long, device=hidden.device)
        return self.model.forward(input_ids=placeholder_ids, **self.forward_kwargs).logits

    @contextmanager
    def _decoder_replaced(self, hidden: torch.Tensor) -> Iterator[None]:
        decoder = getattr(self.decoder_parent, self.decoder_name)
        setattr(self.decoder_parent, self.decoder_name, _RecordedDecoder(hidden))
        try:
            yield
        finally:
            setattr(self.decoder_parent, self.decoder_name, decoder)

    @contextmanager
    def _head_replaced(self, weight: torch.Tensor, dtype: torch.dtype) -> Iterator[None]:
        head = getattr(self.model, self.head_name)
        setattr(self.model, self.head_name, _HeadRows(weight, dtype))
        try:
            yield
        finally:
            setattr(self.model, self.head_name, head)

    def _rows_first_is_exact(self) -> bool:
        """Whether selecting vocabulary rows before the forward's post-processing equals selecting after it, on one
        random position in the lm_head's dtype (up to the matmul's rounding: a non-elementwise step differs by far
        more)."""
        weight = self._output_weight()
        generator = torch.Generator(device=weight.device).manual_seed(0)
        hidden = torch.randn(1, 1, weight.shape[1], generator=generator, device=weight.device).to(weight.dtype)
        rows = torch.randperm(weight.shape[0], generator=generator, device=weight.device)[
            : max(weight.shape[0] // 2, 1)
        ]
        with torch.no_grad(), self._decoder_replaced(hidden):
            with self._head_replaced(weight, weight.dtype):
                after = self._forward(hidden)[..., rows].float()
            with self._head_replaced(weight[rows], weight.dtype):
                before = self._forward(hidden).float()
        if before.shape != after.shape:
            return False
        tolerance = 8 * torch.finfo(weight.dtype).eps * after.abs().nan_to_num(posinf=0, neginf=0).max().clamp(min=1)
        return torch.allclose(before, after, rtol=0, atol=float(tolerance), equal_nan=True)

    def _output_weight(self) -> torch.Tensor:
        """The lm_head's weight, detached, gathered first where FSDP2 shards it."""
        weight = self.model.get_output_embeddings().weight
        if hasattr(weight, "full_tensor"):
            weight = weight.full_tensor()
        return weight.detach()
