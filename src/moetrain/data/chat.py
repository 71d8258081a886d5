"""Conversations: a tokenizer directory's chat template rendered as `transformers` renders it, and the loss mask.

A conversation is an OpenAI-style list of messages ({"role": ..., "content": ...}). It is
rendered with the chat template of the tokenizer directory (`chat_template.jinja`, else the
`chat_template` of `tokenizer_config.json`; a `--chat-template FILE` overrides both) in a
jinja2 `ImmutableSandboxedEnvironment` set up exactly as `transformers`' chat template code sets
it up (`transformers.utils.chat_template_utils._cached_compile_jinja_template`: trim_blocks,
lstrip_blocks, loop controls, the `{% generation %}` tracker, the `tojson` filter without HTML
escaping, the globals `raise_exception`, `strftime_now`, `dict`, `namespace` refusing underscore
attributes) and with the same template variables (`messages`, `tools`, `documents`,
`add_generation_prompt`, and the tokenizer's named special tokens `bos_token`, `eos_token`, ...).
Messages have their None-valued keys dropped first, as `apply_chat_template` does. Templates
are untrusted code; the sandbox is why transformers uses it, and why we do.

The loss mask is 1 on the tokens the assistant writes: where the template has
`{% generation %}` ... `{% endgeneration %}` blocks, exactly the tokens overlapping those
blocks (the rule of transformers' `return_assistant_tokens_mask`); otherwise, for every
assistant turn i, the text between the rendering of messages[:i] with the generation prompt
and the rendering of messages[:i+1], trailing whitespace left out: the assistant's content and
its end-of-turn token, not the template's newline after it. Both renderings must be prefixes of
the whole conversation's; a template for which they are not (one that rewrites earlier turns,
as reasoning templates that drop old thoughts do) is refused for that conversation.

This module renders and masks; it reads no data files and writes nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
import numpy as np

from moetrain.args import read_input_text
from moetrain.data.chat_sandbox import BoundedSandbox, RenderBudget, TemplateBudgetError, budget, render_bounded
from moetrain.errors import ConfigError

# The roles a conversation may hold (OpenAI's, plus 'developer' and 'tool' as current templates read them).
ROLES = ("system", "developer", "user", "assistant", "tool")
# transformers' SPECIAL_TOKENS_ATTRIBUTES: the names under which a tokenizer's special tokens reach the template.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Names a message's reasoning is passed under; transformers fills 'thinking' and 'reasoning_content' from any.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_GENERATION_TAG = re.compile(r"\{\%-?\s*generation\s*-?\%\}")


class ConversationError(ValueError):
    """One conversation cannot be rendered or masked (the message says why, in one line)."""


class _GenerationTracker(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: records the character span each block renders to."""

    tags = {"generation"}

    def __init__(self, environment: jinja2.Environment):
        super().__init__(environment)
        environment.extend(activate_tracker=self.activate_tracker)
        self._tracking: ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = ContextVar(
            "moetrain_generation_tracker", default=None)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_generation_support"), [], [], body).set_lineno(lineno)

    @jinja2.pass_eval_context
    def _generation_support(self, context: jinja2.nodes.EvalContext, caller: Callable[[], str]) -> str:
        rendered = caller()
        tracking = self._tracking.get()
        if tracking is not None:
            blocks, spans = tracking
            start = len("".join(blocks))
            spans.append((start, start + len(rendered)))
        return rendered

    @contextmanager
    def activate_tracker(self, blocks: list[str], spans: list[tuple[int, int]]):  # type: ignore[no-untyped-def]
        token = self._tracking.set((blocks, spans))
        try:
            yield
        finally:
            self._tracking.reset(token)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # As transformers: jinja's own tojson escapes HTML characters, which templates do not expect.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # noqa: A002 - the name templates call it with
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` in a template, without the class itself (no attribute access to break out through)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's namespace refusing underscore-prefixed names (no route to CPython internals)."""

    def __init__(*args: Any, **kwargs: Any):  # noqa: N805 - jinja's own signature trick, so namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot store underscore-prefixed attributes "
                                                  f"on a namespace, but got {name!r}")


def compile_template(template: str) -> jinja2.Template:
    """The template compiled in transformers' sandboxed environment (ConfigError when it does not parse)."""
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTracker, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as err:
        raise ConfigError(f"the chat template does not parse: {err.message} (template line {err.lineno})") from None


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json stores it: a string, or an AddedToken dict with 'content'."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _no_constant(name: str) -> None:
    raise ValueError(f"it holds {name}, which JSON does not allow (a number must be finite)")


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file holding an object (a model's or tokenizer's config), else one ConfigError line naming it:
    unreadable, not UTF-8, not JSON, Infinity or NaN anywhere, nested too deeply to parse, not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"), parse_constant=_no_constant)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path} is not valid JSON: {err}") from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ConfigError(f"{path} is not valid JSON: {err}") from None
    except RecursionError:
        raise ConfigError(f"{path} is not valid JSON: nested too deeply to read") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not a JSON object")
    return data


def tokenizer_config(directory: Path) -> dict[str, Any]:
    """A tokenizer directory's tokenizer_config.json ({} when there is none)."""
    path = directory / "tokenizer_config.json"
    return read_json_object(path) if path.is_file() else {}


def special_tokens(directory: Path) -> dict[str, str]:
    """The named special tokens a template sees (bos_token, eos_token, ...), from tokenizer_config.json,
    else special_tokens_map.json, as transformers' `special_tokens_map` holds them."""
    found: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the config wins, read last
        path = directory / name
        if path.is_file():
            for key, value in read_json_object(path).items():
                if key in SPECIAL_TOKEN_NAMES and _token_text(value) is not None:
                    found[key] = _token_text(value)  # type: ignore[assignment]
    return found


def find_chat_template(tokenizer_spec: str, override: str | None = None) -> tuple[str, str]:
    """(template text, where it came from) for a tokenizer directory, or the file `override` names."""
    if override:
        path = Path(override)
        if not path.is_file():
            raise ConfigError(f"--chat-template {override!r} is not a file")
        return read_input_text(path, "chat template"), str(path)
    directory = Path(tokenizer_spec)
    if tokenizer_spec == "byte" or not directory.is_dir():
        raise ConfigError(f"--format chat needs a tokenizer directory with a chat template, not --tokenizer "
                          f"{tokenizer_spec!r} (or give --chat-template FILE)")
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return read_input_text(jinja_file, "chat template"), str(jinja_file)
    template = tokenizer_config(directory).get("chat_template")
    if isinstance(template, list):  # named templates: transformers uses 'default'
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str) or not template:
        raise ConfigError(f"{directory} has no chat template (no chat_template.jinja, no 'chat_template' string "
                          "in tokenizer_config.json); give one with --chat-template FILE")
    return template, str(directory / "tokenizer_config.json")


def template_sha256(template: str) -> str:
    return hashlib.sha256(template.encode("utf-8")).hexdigest()


def validate_messages(messages: Any, field: str) -> list[dict[str, Any]]:
    """The messages with None-valued keys dropped (as apply_chat_template does); ConversationError when invalid."""
    if not isinstance(messages, list) or not messages:
        raise ConversationError(f"{field!r} is not a non-empty list of messages")
    clean = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ConversationError(f"message {i} is a {type(message).__name__}, not an object")
        role = message.get("role")
        if role not in ROLES:
            raise ConversationError(f"message {i} has role {role!r}; valid roles: {', '.join(ROLES)}")
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:  # transformers' aliasing of the names reasoning is passed under
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        clean.append(message)
    if not any(m["role"] == "assistant" for m in clean):
        raise ConversationError("it has no assistant turn (nothing to learn from)")
    return clean


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template and the special tokens it is rendered with."""

    text: str
    special: dict[str, str]
    limits: RenderBudget = dataclasses.field(default_factory=RenderBudget)  # per record (encode_conversation) or render
    source: str = ""  # the file it was read from, named when it goes over its budget

    def __post_init__(self) -> None:
        object.__setattr__(self, "_compiled", compile_template(self.text))

    @property
    def has_generation_markers(self) -> bool:
        return bool(_GENERATION_TAG.search(self.text))

    @property
    def sha256(self) -> str:
        return template_sha256(self.text)

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = False,
               track: bool = False, blocks: list[str] | None = None) -> tuple[str, list[tuple[int, int]]]:
        """(text, character spans of the {% generation %} blocks when `track`); ConversationError on failure.
        `blocks` receives the text chunk by chunk as it is rendered."""
        compiled: jinja2.Template = self._compiled  # type: ignore[attr-defined]
        variables = {**self.special, "messages": messages, "tools": None, "documents": None,
                     "add_generation_prompt": add_generation_prompt}
        blocks = [] if blocks is None else blocks
        spans: list[tuple[int, int]] = []
        try:
            with budget(self.limits, fresh=False):
                if not track:
                    return render_bounded(compiled, variables, blocks), spans
                with compiled.environment.activate_tracker(blocks, spans):  # type: ignore[attr-defined]
                    return render_bounded(compiled, variables, blocks), spans
        except TemplateBudgetError as err:
            raise ConversationError(f"{err.message} ({self.source or 'chat template'})") from None
        except RecursionError:
            raise ConversationError("the chat template recursed deeper than Python allows") from None
        except MemoryError:
            raise ConversationError("the chat template ran out of memory") from None
        except jinja2.exceptions.TemplateError as err:
            raise ConversationError(f"the chat template raised: {err.message or type(err).__name__}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as err:
            raise ConversationError(f"the chat template failed on it: {type(err).__name__}: {err}") from None

    def assistant_spans(self, messages: list[dict[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
        """(the conversation's text, the character spans the assistant writes).

        Without generation markers the rule is the prefix rule of the module doc. Rendering every
        prefix costs time quadratic in the conversation's length, so the whole conversation is rendered
        once, noting where the output stood as the template's loop reached each message; the spans
        follow from those positions and the generation prompt, and the prefix rule is checked exactly on
        the first and the last assistant turn. A template for which that does not hold (one that
        reads the messages other than in one loop) is answered by rendering every prefix.
        """
        if self.has_generation_markers:
            text, spans = self.render(messages, track=True)
            return text, [(a, b) for a, b in spans if b > a]
        turns = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
        text, _ = self.render(messages)
        starts: dict[int, int] = {}
        blocks: list[str] = []
        try:  # a template may use the messages as a list (`messages + [...]`): then the prefix renders answer
            tracked, _ = self.render(_TrackedMessages(messages, list(range(len(messages))), starts, blocks),
                                     blocks=blocks)
        except ConversationError:
            tracked = None
        spans = self._spans_from_positions(messages, text, starts, turns) if tracked == text else None
        if spans is None:
            spans = [self._prefix_span(messages, i, text) for i in turns]
        return text, [span for span in spans if span[1] > span[0]]

    def _prefix_span(self, messages: list[dict[str, Any]], i: int, text: str) -> tuple[int, int]:
        """Turn i's span by the prefix rule: after messages[:i] with the generation prompt, to the end of
        messages[:i+1]."""
        prompt, _ = self.render(messages[:i], add_generation_prompt=True)
        turn, _ = self.render(messages[: i + 1])
        turn = turn.rstrip()
        if not (text.startswith(prompt) and text.startswith(turn) and len(turn) >= len(prompt)):
            raise ConversationError(f"the chat template does not render turn {i} as a prefix of the whole "
                                    "conversation, so the assistant's tokens cannot be found by rendering "
                                    "prefixes (a template with {% generation %} markers can)")
        return len(prompt), max(len(turn), len(prompt))

    def _spans_from_positions(self, messages: list[dict[str, Any]], text: str, starts: dict[int, int],
                              turns: list[int]) -> list[tuple[int, int]] | None:
        """The prefix rule's spans from where each message's output starts (None when they cannot be trusted)."""
        n = len(messages)
        positions = [starts.get(i, -1) for i in range(n)] + [len(text)]
        if not turns or min(positions) < 0 or positions != sorted(positions):
            return None
        exact = {turns[0]: self._prefix_span(messages, turns[0], text)}
        prompt = text[positions[turns[0]]:exact[turns[0]][0]]  # the generation prompt, as the first turn has it
        spans = []
        for i in turns:
            start = positions[i] + len(prompt)
            if text[positions[i]:start] != prompt:
                return None
            spans.append((start, max(len(text[:positions[i + 1]].rstrip()), start)))
        exact[turns[-1]] = exact.get(turns[-1]) or self._prefix_span(messages, turns[-1], text)
        return spans if all(exact[i] == spans[turns.index(i)] for i in exact) else None


class _TrackedMessages(Sequence):
    """The messages as a template sees them, noting in `starts` how much text was out when its loop reached each.

    Slices stay tracked (templates often loop over `messages[1:]`); an item is the message itself.
    """

    def __init__(self, items: list[dict[str, Any]], indices: list[int], starts: dict[int, int], blocks: list[str]):
        self._items, self._indices, self._starts, self._blocks = items, indices, starts, blocks
        self._counted = [0, 0]  # blocks counted, their characters: the output's length in amortised O(1)

    def _output_length(self) -> int:
        counted = self._counted
        while counted[0] < len(self._blocks):
            counted[1] += len(self._blocks[counted[0]])
            counted[0] += 1
        return counted[1]

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            view = _TrackedMessages(self._items[key], self._indices[key], self._starts, self._blocks)
            view._counted = self._counted
            return view
        return self._items[key]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for index, message in zip(self._indices, self._items):
            self._starts[index] = self._output_length()
            yield message


def load_chat_template(tokenizer_spec: str, override: str | None = None) -> ChatTemplate:
    text, source = find_chat_template(tokenizer_spec, override)
    directory = Path(tokenizer_spec)
    return ChatTemplate(text, special_tokens(directory) if directory.is_dir() else {}, source=source)


def mask_from_spans(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """uint8 per token: 1 where the token's characters overlap a span (transformers' assistant-mask rule)."""
    mask = np.zeros(len(offsets), dtype=np.uint8)
    span = 0
    for index, (start, end) in enumerate(offsets):
        while span < len(spans) and start >= spans[span][1]:
            span += 1
        if span == len(spans):
            break
        if end > spans[span][0]:
            mask[index] = 1
    return mask


def encode_conversation(template: ChatTemplate, encode_with_offsets: Callable[[str], tuple[list[int], list]],
                        messages: Any, field: str = "messages") -> tuple[np.ndarray, np.ndarray, str]:
    """(token ids, loss mask, the assistant's text) of one conversation; ConversationError when it is bad."""
    clean = validate_messages(messages, field)
    with budget(template.limits):  # the whole record's renders share one budget
        text, spans = template.assistant_spans(clean)
    ids, offsets = encode_with_offsets(text)
    mask = mask_from_spans(offsets, spans)
    if not mask.any():
        raise ConversationError("its assistant turns render to no tokens")
    return np.asarray(ids, dtype=np.int64), mask, "".join(text[a:b] for a, b in spans)


def end_of_turn_ids(template: ChatTemplate, encode_with_offsets: Callable[[str], tuple[list[int], list]],
                    special_ids: set[int]) -> list[int]:
    """The token(s) that end an assistant turn under `template`: the special tokens at the end of the
    assistant's masked span in a one-exchange conversation (e.g. <|im_end|>, <|eot_id|>); generation
    must stop at them, so export writes them into generation_config.json."""
    messages = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"}]
    text, spans = template.assistant_spans(messages)
    ids, offsets = encode_with_offsets(text)
    mask = mask_from_spans(offsets, spans)
    found: list[int] = []
    for token, keep in zip(reversed(ids), reversed(mask.tolist())):
        if not keep or token not in special_ids:
            break
        found.insert(0, int(token))
    return found
