"""The sandboxed Jinja environment chat templates render in, bounded.

The environment is transformers' (``trim_blocks``, ``lstrip_blocks``, loop controls, ``raise_exception``, ``tojson``,
``strftime_now``, the ``{% generation %}`` block, a guarded ``dict()`` and ``namespace()``); unlike transformers', its
renders are bounded by ``LIMITS`` (a ``ChatLimits``). The compiled template counts its steps (each block run, call and
output item) against a step budget and a clock; every operation that can make a large value (``+``, ``*``, ``%``,
``**``, ``~``, method calls, filters, slices, ``lipsum``, printing a list) is checked before it runs and counted after;
``flodl_hf.tokenization.chat`` measures the output as it is produced. Past a bound the render stops with
``ChatTemplateLimitError``, naming the template. What a template is given is copied and measured in ``chat``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import time
from collections.abc import Mapping, MappingView
from contextvars import ContextVar
from datetime import datetime
from typing import Any

from flodl_hf.core.errors import InputError


class ChatTemplateError(InputError):
    """The chat template failed while rendering: its raise_exception(...) (transformers raises jinja2's
    TemplateError there), or another error inside the template."""


class ChatTemplateLimitError(ChatTemplateError):
    """The chat template went past a bound of ``LIMITS`` (time, steps, the size of a value, of all values made, or of
    the output): a template that would run or grow without end; transformers renders on without a bound."""


@dataclasses.dataclass(frozen=True)
class ChatLimits:
    """Bounds on one render of a chat template, each far above what real templates need. The sizes grow with the
    render's inputs (the characters and items of the messages, tools, documents, variables and the template):
    ``steps`` + 256 per input item, ``chars`` + 8 per input character, ``produced`` + 64 per input character.

    seconds: wall time of one conversation's render. steps: block runs, calls and output items. chars: characters
    (or items) of any one value made, and of the output. produced: of all values made, together. int_bits: bits of
    an integer made by ``*`` or ``**``. depth and items: how deep and how large one message (tool, document,
    variable) may be."""
    seconds: float = 10.0
    steps: int = 1 << 22
    chars: int = 1 << 25
    produced: int = 1 << 28
    int_bits: int = 1 << 20
    depth: int = 100
    items: int = 1 << 22


LIMITS = ChatLimits()  # flodl_hf.tokenization.sandbox.LIMITS = dataclasses.replace(LIMITS, seconds=60) moves one


# ---- bounds: a render's budget, and the checks the environment runs ---------------------------------------

GENERATION_TRACKING: ContextVar = ContextVar("flodl_hf_chat_generation", default=None)  # (blocks, spans) when tracked
_BUDGET: ContextVar = ContextVar("flodl_hf_chat_budget", default=None)


class _Budget:
    """One conversation's render: its clock, steps and sizes, scaled by its inputs; the first bound passed is kept
    and raised again at every later check, so a template cannot swallow it."""

    def __init__(self, origin: str, input_chars: int, input_items: int) -> None:
        limits = LIMITS
        self.origin, self.seconds = origin, limits.seconds
        self.deadline = time.monotonic() + limits.seconds
        self.steps = limits.steps + 256 * input_items
        self.chars = limits.chars + 8 * input_chars
        self.produced = limits.produced + 64 * input_chars
        self.int_bits = limits.int_bits
        self.used_steps = self.used = 0
        self.tripped: ChatTemplateLimitError | None = None

    def trip(self, what: str) -> None:
        self.tripped = ChatTemplateLimitError(
            f"{self.origin}: the chat template went past its bound on {what}, so rendering stopped (a loop that does "
            "not end, or a value built to gigabytes; transformers renders on without a bound). Fix the template; if "
            "it is right and the chat that large, raise flodl_hf.tokenization.sandbox.LIMITS")
        raise self.tripped

    def tick(self, n: int) -> None:
        if self.tripped is not None:
            raise self.tripped
        self.used_steps += n
        if self.used_steps > self.steps:
            self.trip(f"steps ({self.steps:,} block runs, calls and output items)")
        if time.monotonic() > self.deadline:
            self.trip(f"time ({self.seconds:g} s)")

    def charge(self, n: int) -> None:
        """A value of ``n`` characters (or items) was made."""
        if n > self.chars:
            self.trip(f"the size of one value ({n:,} characters or items; bound {self.chars:,})")
        self.used += n
        if self.used > self.produced:
            self.trip(f"the values made ({self.produced:,} characters and items in all)")


def _tick(n: int = 1) -> None:
    budget = _BUDGET.get()
    if budget is not None:
        budget.tick(n)


def _limit() -> int:
    """The most characters (or items) one value may have: the render's bound, or LIMITS.chars outside a render."""
    budget = _BUDGET.get()
    return LIMITS.chars if budget is None else budget.chars


def _need(size: int, what: str) -> None:
    """Refuse before it is made a value of ``size`` characters (or items) over the bound (outside a render, such as
    folding a constant while compiling: LIMITS.chars)."""
    _within(size, "chars", f"{what} would make {size:,} characters", "the size of one value",
            f"{what} would make {size:,} characters or items")


def _within(amount: int, bound: str, outside: str, kind: str, inside: str) -> None:
    """Refuse ``amount`` over the ``bound`` field of the render's budget (outside a render: of LIMITS), saying
    ``outside`` or, in a render, ``kind`` and ``inside``."""
    budget = _BUDGET.get()
    limit = getattr(LIMITS if budget is None else budget, bound)
    if amount > limit:
        if budget is None:
            raise ChatTemplateLimitError(f"the chat template: {outside} (bound {limit:,})")
        budget.trip(f"{kind} ({inside}; bound {limit:,})")


def _charged(value: Any) -> Any:
    """``value``, its size counted against the render's total of values made."""
    budget = _BUDGET.get()
    if budget is not None and isinstance(value, (str, bytes, list, tuple, dict)):
        budget.charge(len(value))
    return value


def _need_bits(bits: int, what: str) -> None:
    _within(bits, "int_bits", f"{what} would make an integer of {bits:,} bits", "the size of an integer",
            f"{what} would make {bits:,} bits")


def _text_size(value: Any, limit: int) -> int:
    """About how many characters str(value) has: strings and containers walked (through shared references, as
    repr walks them), stopping once past ``limit``."""
    total, stack = 0, [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, (str, bytes)):
            total += len(item) + 2
        elif isinstance(item, (Mapping, list, tuple, set, frozenset, MappingView)):
            total += 2 + 2 * len(item)
            if total <= limit:
                stack.extend(item.keys() if isinstance(item, Mapping) else item)
                if isinstance(item, Mapping):
                    stack.extend(item.values())
        elif isinstance(item, (int, float)) or item is None:
            total += 8
        else:
            from jinja2.utils import Namespace
            if isinstance(item, Namespace):  # printed with all it holds
                stack.append(item._Namespace__attrs)
            else:
                total += 8
    return total


def _depth(value: Any, limit: int) -> int:
    """How deeply lists and dicts nest in ``value`` (walked without recursion); ``limit`` where the walk would visit
    more than ``limit`` items (shared references multiplying the paths)."""
    deepest, stack, visits = 0, [(value, 1)], 0
    while stack:
        item, depth = stack.pop()
        visits += 1
        if visits > limit:
            return limit
        if isinstance(item, (Mapping, list, tuple)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, Mapping) else item))
    return deepest


def _need_text(value: Any, what: str) -> None:
    """Refuse to turn a container into text (print it, join it, format it) where that text would pass the bound."""
    if not isinstance(value, (str, int, float, bool)) and value is not None:
        _need(_text_size(value, _limit()), what)


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


_PRINTF = re.compile(rb"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[a-zA-Z%]")


def _check_printf(fmt: str | bytes, args: Any, what: str) -> None:
    """``fmt % args``: its widths and precisions, and the arguments it prints, within the bound."""
    spec = fmt.encode("utf-8", "surrogatepass") if isinstance(fmt, str) else fmt
    values = args if isinstance(args, tuple) else (args,)
    size = len(fmt) + sum(_text_size(v, _limit()) for v in values)
    for match in _PRINTF.finditer(spec):
        for part in match.groups():
            if part == b"*":
                size += sum(v for v in values if isinstance(v, int))
            elif part:
                size += int(part)
    _need(size, what)


def _check_spec(value: Any, spec: str) -> None:
    """One field of str.format: the value printed and the width or precision of its spec."""
    _need_text(value, "str.format")
    _need(sum(int(d) for d in re.findall(r"\d+", spec)), "a str.format width")


def _check_binop(op: str, left: Any, right: Any) -> None:
    sequences = (str, bytes, list, tuple)
    if op == "*":
        if isinstance(left, int) and isinstance(right, int):
            _need_bits(left.bit_length() + right.bit_length(), "*")
            return
        seq, n = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(seq, sequences) and isinstance(n, int):
            _need(len(seq) * max(n, 0), "repeating a string or list with *")
    elif op == "+" and isinstance(left, sequences) and isinstance(right, sequences):
        _need(len(left) + len(right), "+")
    elif op == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        _need_bits(right * abs(left).bit_length(), "**")
    elif op == "%" and isinstance(left, (str, bytes)):
        _check_printf(left, right, "% formatting")


_WIDTH_METHODS = {"center", "ljust", "rjust", "zfill"}


def _check_call(obj: Any, args: tuple, kwargs: dict) -> tuple:
    """The methods that make a value larger than their inputs (str and bytes padding, tabs, replace, join,
    translate; int.to_bytes): checked before they run. Returns the arguments (a join's parts made a list)."""
    owner, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
    if isinstance(owner, (str, bytes)):
        if name in _WIDTH_METHODS and isinstance(width := _arg(args, kwargs, 0, "width", 0), int):
            _need(width, f"str.{name}")
        elif name == "expandtabs" and isinstance(size := _arg(args, kwargs, 0, "tabsize", 8), int):
            _need(len(owner) + owner.count("\t" if isinstance(owner, str) else b"\t") * size, "str.expandtabs")
        elif name == "replace" and len(args) >= 2 and all(isinstance(a, type(owner)) for a in args[:2]):
            _check_replace(owner, args[0], args[1], _arg(args, kwargs, 2, "count", -1))
        elif name == "join" and args:
            parts = list(args[0])
            _need(sum(len(p) for p in parts if isinstance(p, (str, bytes))) + len(owner) * len(parts), "str.join")
            return (parts, *args[1:])
        elif name == "translate" and isinstance(owner, str) and args and isinstance(args[0], Mapping):
            longest = max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
            _need(len(owner) * longest, "str.translate")
    elif isinstance(owner, int) and name == "to_bytes":
        if isinstance(length := _arg(args, kwargs, 0, "length", 1), int):
            _need(length, "int.to_bytes")
    return args


def _check_replace(text: str | bytes, old: str | bytes, new: str | bytes, count: Any) -> None:
    found = text.count(old) if old else len(text) + 1
    if isinstance(count, int) and count >= 0:
        found = min(found, count)
    _need(len(text) + found * max(len(new) - len(old), 0), "replace")


def _filter_checks() -> dict[str, Any]:
    """Checks run before the filters that can make a value larger than their inputs, by filter name."""
    def center(value: Any, args: tuple, kwargs: dict) -> None:
        if isinstance(width := _arg(args, kwargs, 0, "width", 80), int):
            _need(width, "the center filter")

    def indent(value: Any, args: tuple, kwargs: dict) -> None:
        width = _arg(args, kwargs, 0, "width", 4)
        size = width if isinstance(width, int) else len(width) if isinstance(width, str) else 0
        text = value if isinstance(value, str) else ""
        _need(len(text) + (text.count("\n") + 1) * size, "the indent filter")

    def replace(value: Any, args: tuple, kwargs: dict) -> None:
        old, new = _arg(args, kwargs, 0, "old", None), _arg(args, kwargs, 1, "new", None)
        if isinstance(value, str) and isinstance(old, str) and isinstance(new, str):
            _check_replace(value, old, new, _arg(args, kwargs, 2, "count", None))

    def join(value: Any, args: tuple, kwargs: dict) -> None:
        separator = _arg(args, kwargs, 0, "d", "")
        _need(_text_size(value, _limit()) + len(value) * len(str(separator)), "the join filter")

    def count(name: str, index: int, key: str) -> Any:
        def check(value: Any, args: tuple, kwargs: dict) -> None:
            if isinstance(n := _arg(args, kwargs, index, key, 0), int):
                _need(n, f"the {name} filter")
        return check

    def wordwrap(value: Any, args: tuple, kwargs: dict) -> None:
        wrap = _arg(args, kwargs, 2, "wrapstring", None)
        if isinstance(value, str) and isinstance(wrap, str):
            _need(len(value) * (1 + len(wrap)), "the wordwrap filter")

    def printf(value: Any, args: tuple, kwargs: dict) -> None:
        if isinstance(value, str):
            _check_printf(value, kwargs if kwargs else args, "the format filter")

    return {"center": center, "indent": indent, "replace": replace, "join": join, "wordwrap": wordwrap,
            "format": printf, "batch": count("batch", 0, "linecount"), "slice": count("slice", 0, "slices")}


# Filters that turn their value into text: a container is measured first.
_TEXT_FILTERS = {"string", "pprint", "join", "e", "escape", "forceescape", "urlencode", "xmlattr", "format", "center",
                 "indent", "wordwrap", "truncate", "trim", "upper", "lower", "title", "capitalize", "replace",
                 "striptags", "urlize", "wordcount", "safe"}


def _guarded_filter(name: str, func: Any, check: Any) -> Any:
    """``func`` ticked, checked before and charged after; a context filter, so never folded while compiling."""
    import jinja2
    kind = getattr(getattr(func, "jinja_pass_arg", None), "name", None)
    lead = {"context": lambda c: (c,), "eval_context": lambda c: (c.eval_ctx,),
            "environment": lambda c: (c.environment,)}.get(kind, lambda c: ())
    text = name in _TEXT_FILTERS and name != "join"  # join measures its parts itself

    def guarded(context: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
        budget = _BUDGET.get()
        if budget is not None:
            budget.tick(1)
        if text and type(value) is not str:
            _need_text(value, f"the {name} filter")
        if check is not None:
            if name == "join":
                value = list(value)
            check(value, args, kwargs)
        result = func(*lead(context), value, *args, **kwargs)
        if budget is not None and isinstance(result, (str, bytes, list, tuple, dict)):
            budget.charge(len(result))
        return result
    guarded.__name__ = getattr(func, "__name__", name)
    return jinja2.pass_context(guarded)


def _bounded_join(chunks: Any) -> str:
    """Join text as it comes, stopping once past the bound (tojson's pieces; the filter's guard counts the text)."""
    limit = _limit()
    out, size = [], 0
    for chunk in chunks:
        size += len(chunk)
        if size > limit:
            _need(size, "tojson")
        out.append(chunk)
    return "".join(out)


def _raised_message(message: Any) -> str:
    """raise_exception's message as text, shortened past 2,000 characters."""
    text = message if isinstance(message, str) else str(message) if _text_size(message, 2000) <= 2000 \
        else f"<a {type(message).__name__}>"
    return text if len(text) <= 2000 else f"{text[:2000]}... ({len(text) - 2000:,} more characters)"


def render(compiled: Any, arguments: dict[str, Any], blocks: list[str], origin: str, input_chars: int,
           input_items: int) -> None:
    """Append to ``blocks`` what ``compiled`` yields for ``arguments``, within a budget scaled to the inputs and named
    ``origin``: the output measured as it comes; a bound passed (even one the template caught) raised."""
    budget = _Budget(origin, input_chars, input_items)
    token = _BUDGET.set(budget)
    try:
        size = 0
        for block in compiled.generate(**arguments):
            size += len(block)
            if size > budget.chars:
                budget.trip(f"the output ({budget.chars:,} characters)")
            blocks.append(block)
        if budget.tripped is not None:
            raise budget.tripped
    finally:
        _BUDGET.reset(token)


@functools.lru_cache(maxsize=1)
def chat_environment() -> Any:
    """The sandboxed Jinja environment transformers renders chat templates in: trim_blocks, lstrip_blocks, the
    loopcontrols extension and a {% generation %} block (which records the assistant's spans), a tojson filter
    without HTML escaping, raise_exception, strftime_now, and a guarded dict() and namespace(); bounded, as
    ``_guarded_environment_class`` says, with capped lipsum and strftime_now and a tojson that stops at the bound."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils

    class GenerationBlock(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_span"), [], [], body).set_lineno(lineno)

        def _span(self, caller: Any) -> str:
            text = caller()
            tracking = GENERATION_TRACKING.get()
            if tracking is not None:  # the text rendered so far is the blocks already produced
                blocks, spans = tracking
                start = sum(len(b) for b in blocks)
                spans.append((start, start + len(text)))
            return text

    def raise_exception(message: Any) -> None:
        raise _TemplateRaised(_raised_message(message))

    class _TemplateRaised(jinja2.exceptions.TemplateError):
        pass

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        """json.dumps; where the text could pass the bound (indented, or a large value), made piece by piece and
        stopped there (the same text: json.dumps joins the same encoder's pieces)."""
        limit = _limit()
        size = _text_size(x, limit)  # each character at most 12 (an escaped pair), each item a line of indents
        width = len(indent) if isinstance(indent, str) else indent if isinstance(indent, int) else 0
        if size * (13 + max(width, 0) * size) <= limit:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
        _need(max(width, 0) * (_depth(x, limit) + 1), "tojson's indent")  # its longest piece: a line's indent
        encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                                   sort_keys=sort_keys)
        return _bounded_join(encoder.iterencode(x))

    def strftime_now(format: str) -> str:  # noqa: A002 - the name templates use
        if isinstance(format, str):
            _need(16 * len(format), "strftime_now")
        return datetime.now().strftime(format)

    def lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002 - jinja's names
        if all(isinstance(v, int) for v in (n, min, max)):
            _need(16 * n * (min if min > max else max), "lipsum")
        return jinja2.utils.generate_lorem_ipsum(n=n, html=html, min=min, max=max)

    class TemplateDict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace ({name!r})")

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Namespace's own signature trick
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                _check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            _check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    env = _guarded_environment_class()(trim_blocks=True, lstrip_blocks=True, finalize=_finalize,
                                       extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    checks = _filter_checks()
    env.filters = {name: _guarded_filter(name, func, checks.get(name)) for name, func in env.filters.items()}
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                       namespace=TemplateNamespace, lipsum=lipsum)
    env.raised = _TemplateRaised
    return env


def _finalize(value: Any) -> Any:
    """Every printed value: a container's text is measured (and counted) before str() makes it."""
    if type(value) is not str and not isinstance(value, (str, int, float)) and value is not None:
        budget = _BUDGET.get()
        size = _text_size(value, _limit())
        _need(size, "printing a value")
        if budget is not None:
            budget.charge(size)
    return value


def _guarded_environment_class() -> type:
    """ImmutableSandboxedEnvironment, bounded: its compiled templates tick at every block run (a loop's body, an if's
    branch, a macro's body) and output node; calls tick; the operators that can make large values (+, *, **, %),
    calls, slices, ~ and the joins of a macro's or block's output are checked before and charged after."""
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEscapeFormatter, SandboxedFormatter
    from markupsafe import Markup

    class GuardedCodeGenerator(CodeGenerator):
        def blockvisit(self, nodes: Any, frame: Any) -> None:
            self.writeline("environment.guard_tick(1)")
            super().blockvisit(nodes, frame)

        def visit_Output(self, node: Any, frame: Any) -> None:
            self.writeline(f"environment.guard_tick({len(node.nodes)})")
            super().visit_Output(node, frame)

        def visit_Concat(self, node: Any, frame: Any) -> None:  # as CodeGenerator's, its parts measured first
            if frame.eval_ctx.volatile:
                join = "(markup_join if context.eval_ctx.volatile else str_join)"
            else:
                join = "markup_join" if frame.eval_ctx.autoescape else "str_join"
            self.write(f"environment.guard_join({join}, (")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class GuardedEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"+", "*", "**", "%"})
        code_generator_class = GuardedCodeGenerator

        guard_tick = staticmethod(_tick)

        @staticmethod
        def guard_join(join: Any, parts: tuple) -> str:  # the ~ operator
            limit = _limit()
            _need(sum(_text_size(p, limit) for p in parts), "~")
            return _charged(join(parts))

        @staticmethod
        def concat(parts: Any) -> str:  # a macro's, call block's, set block's or filter block's output
            parts = list(parts)
            _need(sum(len(p) for p in parts), "joining a block's output")
            return _charged("".join(parts))

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "+" and type(left) is str and type(right) is str:  # the commonest: counted, then made
                budget = _BUDGET.get()
                if budget is not None:
                    size = len(left) + len(right)
                    if size > budget.chars:
                        _need(size, "+")
                    budget.charge(size)
                return left + right
            _check_binop(operator, left, right)
            return _charged(self.binop_table[operator](left, right))

        def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
            _tick()
            args = _check_call(obj, args, kwargs)
            return _charged(super().call(context, obj, *args, **kwargs))

        def getitem(self, obj: Any, argument: Any) -> Any:
            value = super().getitem(obj, argument)
            return _charged(value) if isinstance(argument, slice) else value

        def wrap_str_format(self, value: Any) -> Any:  # as the sandbox's, each field checked as it is formatted
            if super().wrap_str_format(value) is None:
                return None
            text, is_map = value.__self__, value.__name__ == "format_map"
            formatter = CheckedEscapeFormatter(self, escape=text.escape) if isinstance(text, Markup) \
                else CheckedFormatter(self)

            def wrapper(*args: Any, **kwargs: Any) -> str:
                if is_map:
                    if kwargs or len(args) != 1:
                        raise TypeError("format_map() takes exactly one argument and no keyword arguments")
                    kwargs, args = args[0], ()
                return type(text)(formatter.vformat(text, args, kwargs))
            return wrapper

    class CheckedFormatter(SandboxedFormatter):
        def format_field(self, value: Any, format_spec: str) -> Any:
            _check_spec(value, format_spec)
            return _charged(super().format_field(value, format_spec))

    class CheckedEscapeFormatter(CheckedFormatter, SandboxedEscapeFormatter):
        pass

    return GuardedEnvironment


@functools.lru_cache(maxsize=64)
def compile_template(template: str) -> Any:
    return chat_environment().from_string(template)
