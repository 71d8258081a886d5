"""Mixed precision for a model that FSDP does not wrap: low-precision compute copies of float32 master weights.

On one rank the model runs unsharded (`moetrain.parallel.parallelize`), so FSDP's
MixedPrecisionPolicy is not there to cast weights. `ComputeCopy` does the same job
once per step instead of once per unit and microbatch (FSDP casts at every all-gather,
and again in backward when it reshards after forward): on entering `compute()` it
copies every float32 master parameter into a persistent `param_dtype` copy and
swaps the copies into the modules; autograd accumulates their gradients into
persistent zeroed `reduce_dtype` buffers (the copies' `grad_dtype`), so the sum over
microbatches is as exact as FSDP's float32 reduction; on leaving it hands those
gradients to the masters (in the masters' dtype) and swaps the masters back. The optimizer, the
checkpoint, clipping, evaluation outside the context and sampling only ever see the
float32 masters. Buffers (the aux-free expert bias, load counters) stay float32.

This module changes the dtype the forward and backward compute in; it must not
change which parameters exist, their names, or what is saved.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from moetrain.config import ParallelConfig
from moetrain.parallel.shard import DTYPES, fsdp_modules


@dataclass
class _Slot:
    """One registered parameter: where it lives (module, attribute name), its master and its compute copy."""

    module: nn.Module
    name: str
    master: nn.Parameter
    copy: nn.Parameter
    grad: torch.Tensor | None = None  # the persistent reduce-dtype gradient buffer of the copy


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
                    copy = nn.Parameter(torch.empty_like(master, dtype=param_dtype),
                                        requires_grad=master.requires_grad)
                    if master.requires_grad:
                        copy.grad_dtype = reduce_dtype
                    copies[id(master)] = copy
                self.slots.append(_Slot(module, name, master, copies[id(master)]))
        self._masters = list({id(s.master): s for s in self.slots}.values())
        self.active = False

    @torch.no_grad()
    def _refresh(self, with_grads: bool) -> None:
        for slot in self._masters:
            slot.copy.copy_(slot.master)
            if not (with_grads and slot.copy.requires_grad):
                continue
            # Gradients accumulate into a zeroed, persistent buffer: autograd adds each bf16
            # gradient into it in place. Letting autograd create the gradient instead costs an
            # upcast into a fresh tensor per parameter and step, which measured slower than the
            # expert GEMMs themselves (docs/performance.md, "Step time").
            if slot.grad is None or slot.master.grad is slot.grad:
                slot.grad = torch.zeros_like(slot.master, dtype=self.reduce_dtype)
            else:
                slot.grad.zero_()
            slot.copy.grad = slot.grad

    @torch.no_grad()
    def _hand_back_grads(self) -> None:
        for slot in self._masters:
            if slot.copy.grad is None:
                continue
            grad = slot.copy.grad.to(slot.master.dtype)
            slot.copy.grad = None
            if slot.master.grad is None:
                slot.master.grad = grad
            else:
                slot.master.grad += grad

    @contextmanager
    def compute(self) -> Iterator[None]:
        """Run the body (forwards and their backwards) on fresh compute copies; gradients land on the masters."""
        if self.active or not self.slots:
            yield
            return
        self._refresh(with_grads=torch.is_grad_enabled())  # evaluation under no_grad needs no buffers
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


def compute_copy(model: nn.Module, parallel: ParallelConfig) -> ComputeCopy | None:
    """The ComputeCopy an unsharded model needs for `parallel.param_dtype`; None when FSDP casts or all is float32."""
    if any(True for _ in fsdp_modules(model)):
        return None  # FSDP's MixedPrecisionPolicy casts at its all-gathers
    param_dtype = DTYPES[parallel.param_dtype]
    if param_dtype == torch.float32:
        return None
    return ComputeCopy(model, param_dtype, DTYPES[parallel.reduce_dtype])
