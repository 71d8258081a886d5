"""Mixed precision for a model that FSDP does not wrap: low-precision compute copies of float32 master weights.

On one rank the model runs unsharded (`moetrain.parallel.parallelize`), so FSDP's
MixedPrecisionPolicy is not there to cast weights. `ComputeCopy` does the same job
once per step instead of once per unit and microbatch (FSDP casts at every all-gather,
and again in backward when it reshards after forward): on entering `compute()` it
copies every float32 master parameter into a persistent `param_dtype` copy and
swaps the copies into the modules; as each microbatch's gradient of a copy arrives
(a post-accumulate-grad hook), it is cast into (first microbatch) or added to (later
ones) a persistent `reduce_dtype` buffer and the copy's `.grad` is cleared, so the sum
over microbatches is as exact as FSDP's float32 reduction; on leaving it hands those
buffers to the masters as gradients and swaps the masters back. A copy and its
gradient buffer are never both alive when each copy takes one gradient (the
one-microbatch step, `compute(backwards=1)`, or evaluation under no_grad): autograd has
run every node that reads a copy before its gradient arrives, so the copy's bytes are
the head of its buffer, overwritten by the gradient, and the step holds the buffers
alone instead of both (docs/results.md, "bf16 memory: the compute copy inside the
gradient buffer"). (Setting the copies'
`grad_dtype` to float32 instead makes the autograd engine upcast every incoming
gradient into a fresh float32 tensor before accumulating it: on qwen3_moe_debug that
was 130 ms per [64, 256, 1536] expert gradient, most of a bf16 backward.) The optimizer, the
checkpoint, clipping, evaluation outside the context and sampling only ever see the
float32 masters. Buffers (the aux-free expert bias, load counters) stay float32.

This module changes the dtype the forward and backward compute in; it must not
change which parameters exist, their names, or what is saved.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from moetrain.config.parallel import ParallelConfig
from moetrain.dtypes import DTYPES
from moetrain.parallel.shard import fsdp_modules

_ADD_SLICE = 1 << 18  # elements per slice when adding a low-precision gradient into its buffer


@dataclass
class _Slot:
    """One registered parameter: where it lives (module, attribute name), its master and its compute copy."""

    module: nn.Module
    name: str
    master: nn.Parameter
    copy: nn.Parameter
    # The copy's shape with no storage: what it holds once its bytes became the gradient (made once, since
    # making one allocates the whole size before dropping it).
    hole: torch.Tensor
    grad: torch.Tensor | None = None  # the persistent reduce-dtype gradient buffer of the copy
    filled: bool = False  # whether `grad` holds this step's gradient (else it holds stale values)
    shared: bool = False  # whether the copy's bytes are the head of `grad` (see the module docstring)


class ComputeCopy:
    """Low-precision compute copies of an unsharded model's float32 master parameters (see the module docstring)."""

    def __init__(self, model: nn.Module, param_dtype: torch.dtype, reduce_dtype: torch.dtype):
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        copies: dict[int, nn.Parameter] = {}  # a tied weight gets one copy, shared like its master
        self.slots: list[_Slot] = []
        for module in model.modules():
            for name, master in module.named_parameters(recurse=False):
                if not master.is_floating_point() or master.dtype == param_dtype:
                    continue
                if id(master) not in copies:
                    # Bytes come at the first entry: of its own, or the head of its gradient buffer.
                    copy = nn.Parameter(_storageless(master, param_dtype),
                                        requires_grad=master.requires_grad)
                    copies[id(master)] = copy
                self.slots.append(_Slot(module, name, master, copies[id(master)], _storageless(master, param_dtype)))
        self._masters = list({id(s.master): s for s in self.slots}.values())
        for slot in self._masters:
            if slot.copy.requires_grad:
                slot.copy.register_post_accumulate_grad_hook(functools.partial(self._take_grad, slot))
        self.active = False

    @torch.no_grad()
    def _take_grad(self, slot: _Slot, copy: torch.Tensor) -> None:
        """Move the gradient autograd just put on a compute copy into the slot's reduce-dtype buffer."""
        grad, copy.grad = copy.grad, None
        if slot.shared:
            if slot.filled:
                raise RuntimeError("a second gradient of a compute copy in a context declared for one backward")
            copy.data = slot.hole  # a forward reading it now fails instead of reading gradient bytes
            slot.grad.copy_(grad)
            slot.filled = True
            return
        if not slot.filled:
            slot.grad.copy_(grad)  # casts while copying
            slot.filled = True
            return
        # On CPU an add of a bf16 tensor into a float32 one first casts the whole bf16 operand
        # into a temporary: for an expert weight that is a fresh 100 MiB tensor per microbatch,
        # which measured 140 ms per add in a step (8 ms warm). Cache-sized slices keep the
        # temporaries small and reused; the sums are the same, element by element.
        for total, part in zip(slot.grad.view(-1).split(_ADD_SLICE), grad.reshape(-1).split(_ADD_SLICE),
                               strict=True):
            total.add_(part)

    @torch.no_grad()
    def _refresh(self, with_grads: bool, share: bool) -> None:
        for slot in self._masters:
            slot.filled, slot.copy.grad = False, None
            if slot.copy.requires_grad and (with_grads or share):
                # A persistent buffer, so no step pays for fresh pages (docs/results.md, "Step
                # time"); a new one only while the master still holds the last one as its gradient.
                if slot.grad is None or slot.master.grad is slot.grad:
                    slot.grad = torch.empty_like(slot.master, dtype=self.reduce_dtype)
            was_shared, slot.shared = slot.shared, share and slot.grad is not None and slot.copy.requires_grad
            if slot.shared:
                slot.copy.data = slot.grad.view(-1).view(torch.uint8)[:slot.hole.nbytes].view(
                    self.param_dtype).view(slot.master.shape)
            elif was_shared or slot.copy.untyped_storage().nbytes() == 0:  # bytes of its own (several backwards)
                slot.copy.data = torch.empty_like(slot.master, dtype=self.param_dtype)
            slot.copy.copy_(slot.master)

    @torch.no_grad()
    def _hand_back_grads(self) -> None:
        for slot in self._masters:
            if not slot.filled:
                continue
            slot.filled = False
            grad = slot.grad.to(slot.master.dtype)
            if slot.master.grad is None:
                slot.master.grad = grad
            else:
                slot.master.grad += grad

    @contextmanager
    def compute(self, backwards: int = 0) -> Iterator[None]:
        """Run the body (forwards and their backwards) on fresh compute copies; gradients land on the masters.

        backwards = 1 declares that the body runs one backward and no forward after it: each copy then lives in
        the head of its gradient buffer (see the module docstring). 0: any number, with copies of their own.
        """
        if self.active or not self.slots:
            yield
            return
        if backwards < 0:
            raise ValueError(f"backwards must be >= 0, got {backwards}")
        grads = torch.is_grad_enabled()  # evaluation under no_grad takes no gradients
        self._refresh(with_grads=grads, share=backwards == 1 or not grads)
        for slot in self.slots:
            slot.module._parameters[slot.name] = slot.copy
        self.active = True
        try:
            yield
        finally:
            for slot in self.slots:
                slot.module._parameters[slot.name] = slot.master
            self.active = False
            self._hand_back_grads()


def _storageless(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of `like`'s shape and device and of `dtype` whose storage holds no bytes: reading it raises."""
    hole = torch.empty_like(like, dtype=dtype)
    hole.untyped_storage().resize_(0)
    return hole


def compute_copy(model: nn.Module, parallel: ParallelConfig) -> ComputeCopy | None:
    """The ComputeCopy an unsharded model needs for `parallel.param_dtype`; None when FSDP casts or all is float32."""
    if any(True for _ in fsdp_modules(model)):
        return None  # FSDP's MixedPrecisionPolicy casts at its all-gathers
    param_dtype = DTYPES[parallel.param_dtype]
    if param_dtype == torch.float32:
        return None
    return ComputeCopy(model, param_dtype, DTYPES[parallel.reduce_dtype])
