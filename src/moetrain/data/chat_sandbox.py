"""The jinja2 sandbox chat templates render in, with a time, recursion and size budget per render.

A chat template is untrusted code: jinja2's `ImmutableSandboxedEnvironment` keeps it away from
Python's internals, but not from running for hours (nested `range` loops), recursing until Python's
own limit, or asking for gigabytes (`'x' * 10**10`, a string doubled with `~` in a loop). This
environment checks a `RenderBudget` at the points every such template passes through: each
iteration of `range`, each call (macros, methods, globals), each attribute or item lookup, the
operators `*`, `**` and `~`, the size-growing filters (checked before they allocate), and the
rendered text as it is produced. A template over budget raises `TemplateBudgetError`, which the
caller turns into a one-line refusal of that record. The budget is per render, set with
`budget(...)`; outside one, nothing is limited (a template compiled but not rendered costs nothing).
This module knows nothing of conversations or tokenizers.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import jinja2
import jinja2.compiler
import jinja2.filters
import jinja2.nodes
import jinja2.runtime
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Per-record defaults: generous for any real conversation (a long one renders in milliseconds, to
# kilobytes), small enough that a hostile template is stopped in seconds and megabytes.
TIME_LIMIT_S = 10.0
MAX_CHARS = 1 << 25  # 32 Mi characters of rendered text, or of any one string or list built on the way
MAX_DEPTH = 100  # nested calls (a macro calling itself counts each level)
MAX_RANGE = 100_000  # items of one range(), as jinja2's sandbox allows


class TemplateBudgetError(jinja2.exceptions.TemplateError):
    """A render went over its time, depth or size budget (the message says which, in one line)."""


@dataclass
class RenderBudget:
    time_limit_s: float = TIME_LIMIT_S
    max_chars: int = MAX_CHARS
    max_depth: int = MAX_DEPTH
    deadline: float = field(default=0.0, init=False)
    depth: int = field(default=0, init=False)

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateBudgetError(f"the chat template ran longer than its {self.time_limit_s:g} s limit per "
                                      "record (a loop that does not end soon)")

    def size(self, n: int, what: str) -> None:
        if n > self.max_chars:
            raise TemplateBudgetError(f"the chat template builds {what} of {n:,} items, over its limit of "
                                      f"{self.max_chars:,} per record")


_BUDGET: ContextVar[RenderBudget | None] = ContextVar("moetrain_chat_budget", default=None)


@contextmanager
def budget(limits: RenderBudget | None, fresh: bool = True) -> Iterator[RenderBudget | None]:
    """Renders inside the block run under `limits` (None: unlimited), counted from the block's start.
    With `fresh` False, a budget already running (a whole record's) is kept instead."""
    if not fresh and _BUDGET.get() is not None:
        yield _BUDGET.get()
        return
    if limits is not None:
        limits.deadline, limits.depth = time.monotonic() + limits.time_limit_s, 0
    token = _BUDGET.set(limits)
    try:
        yield limits
    finally:
        _BUDGET.reset(token)


def _length(value: Any) -> int:
    return len(value) if isinstance(value, (str, list, tuple, bytes)) else 0


def check_size(value: Any, what: str = "a value") -> Any:
    limits = _BUDGET.get()
    if limits is not None:
        limits.size(_length(value), what)
    return value


class _BoundedRange(Sequence):
    """range(...) for templates: at most MAX_RANGE items, each iteration checking the time budget."""

    def __init__(self, *args: int):
        self._range = range(*args)
        if len(self._range) > MAX_RANGE:
            raise TemplateBudgetError(f"the chat template asks for range{args}, over {MAX_RANGE:,} items")

    def __len__(self) -> int:
        return len(self._range)

    def __getitem__(self, index: Any) -> Any:
        return self._range[index]

    def __iter__(self) -> Iterator[int]:
        limits = _BUDGET.get()
        for value in self._range:
            if limits is not None:
                limits.tick()
            yield value


@jinja2.pass_eval_context
def _join(eval_ctx: Any, value: Any, d: str = "", attribute: Any = None) -> str:
    items = list(value)
    limits = _BUDGET.get()
    if limits is not None:
        limits.size(sum(len(str(i)) for i in items) + len(str(d)) * max(len(items) - 1, 0), "a joined string")
    return jinja2.filters.sync_do_join(eval_ctx, items, d, attribute)


@jinja2.pass_eval_context
def _replace(eval_ctx: Any, s: Any, old: str, new: str, count: int | None = None) -> str:
    text, old, new = str(s), str(old), str(new)
    occurrences = text.count(old) if old else len(text) + 1
    if count is not None and count >= 0:
        occurrences = min(occurrences, count)
    limits = _BUDGET.get()
    if limits is not None:
        limits.size(len(text) + occurrences * max(len(new) - len(old), 0), "a replaced string")
    return jinja2.filters.do_replace(eval_ctx, s, old, new, count)


def _width_checked(name: str) -> Any:
    """A filter whose width argument (center, indent) sizes its result: refused before it allocates."""
    original = jinja2.filters.FILTERS[name]

    def bounded(value: Any, width: Any = 80, *args: Any, **kwargs: Any) -> Any:
        limits = _BUDGET.get()
        if limits is not None and isinstance(width, int):
            limits.size(_length(str(value)) * (1 + (name == "indent")) + abs(width), f"a {name}ed string")
        return original(value, width, *args, **kwargs)

    return bounded


class _BoundedCodeGenerator(jinja2.compiler.CodeGenerator):
    """`a ~ b` through the environment's size check (jinja compiles it to a bare string join)."""

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: jinja2.compiler.Frame) -> None:
        self.write("environment.bounded_concat(")
        super().visit_Concat(node, frame)
        self.write(")")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandboxed environment, checking the current render's budget (see the module doc)."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "**"})

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.globals["range"] = _BoundedRange
        self.filters["join"] = _join
        self.filters["replace"] = _replace
        for name in ("center", "indent"):
            self.filters[name] = _width_checked(name)

    def bounded_concat(self, value: str) -> str:
        return check_size(value, "a string")

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        limits = _BUDGET.get()
        if limits is not None:
            if operator == "*":
                for seq, times in ((left, right), (right, left)):
                    if _length(seq) and isinstance(times, int):
                        limits.size(_length(seq) * times, "a repeated string or list")
            elif isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
                limits.size(int(right * abs(left).bit_length() / 3.3), "a power's digits")
        return super().call_binop(context, operator, left, right)

    def getattr(self, obj: Any, attribute: str) -> Any:
        limits = _BUDGET.get()
        if limits is not None:
            limits.tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        limits = _BUDGET.get()
        if limits is not None:
            limits.tick()
        return super().getitem(obj, argument)

    def call(__self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        limits = _BUDGET.get()
        if limits is None:
            return super().call(__context, __obj, *args, **kwargs)
        limits.tick()
        limits.depth += 1
        try:
            if limits.depth > limits.max_depth:
                raise TemplateBudgetError(f"the chat template nests calls deeper than {limits.max_depth} "
                                          "(a macro that recurses without end)")
            return check_size(super().call(__context, __obj, *args, **kwargs), "a string")
        finally:
            limits.depth -= 1


def render_bounded(template: jinja2.Template, variables: dict[str, Any], blocks: list[str]) -> str:
    """The template's text, produced chunk by chunk into `blocks` (the generation tracker reads them),
    the total checked against the current budget as it grows."""
    limits = _BUDGET.get()
    total = 0
    for block in template.generate(**variables):
        blocks.append(block)
        total += len(block)
        if limits is not None:
            limits.size(total, "rendered text")
            limits.tick()
    return "".join(blocks)
