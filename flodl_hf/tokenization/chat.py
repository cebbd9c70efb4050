"""Chat templates as transformers 5.24 renders them (``Tokenizer.apply_chat_template``, chats in ``generate``).

A template is jinja2 in a sandboxed environment with transformers' settings (``trim_blocks``,
``lstrip_blocks``, loop controls) and helpers (``raise_exception``, ``tojson``, ``strftime_now``, the
``{% generation %}`` block); ``render_chat`` passes it transformers' variables (``messages``,
``add_generation_prompt``, the special tokens, ``tools``, ``documents``) and handles
``continue_final_message``. Where a tokenizer's templates come from is read in ``flodl_hf.tokenization.loading``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
from collections.abc import Mapping
from contextvars import ContextVar
from datetime import datetime
from pathlib import Path
from typing import Any

from flodl_hf.core.errors import ConfigError, FlodlHFError, InputError


class ChatTemplateError(InputError):
    """The chat template failed while rendering: its raise_exception(...) (transformers raises jinja2's
    TemplateError there), or another error inside the template."""


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_GENERATION_TRACKING: ContextVar = ContextVar("flodl_hf_chat_generation", default=None)


def _named_origin(origin: str | dict[str, str], name: str) -> str:
    return origin.get(name, f"chat template {name!r}") if isinstance(origin, dict) else f"{origin} ({name!r})"


def _chat_template_value(value: Any, where: str, error: type) -> str | dict[str, str] | None:
    """A chat_template setting as transformers takes it: a string, a list of {"name", "template"} (made a dict),
    a {name: template} object, or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):
        templates = {}
        for i, entry in enumerate(value):
            if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)):
                raise error(f"{where}[{i}] is {entry!r}: expected {{\"name\": ..., \"template\": ...}} with strings")
            templates[entry["name"]] = entry["template"]
        return templates
    if isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        return dict(value)
    raise error(f"{where} is a {type(value).__name__}: expected a Jinja template string or a list of "
                "{\"name\": ..., \"template\": ...}")


def _read_template_file(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text, so not a chat template ({exc})") from exc
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it ({exc.strerror or exc})") from exc


@functools.lru_cache(maxsize=1)
def _chat_environment() -> Any:
    """The sandboxed Jinja environment transformers renders chat templates in: trim_blocks, lstrip_blocks, the
    loopcontrols extension and a {% generation %} block (which records the assistant's spans), a tojson filter
    without HTML escaping, raise_exception, strftime_now, and a guarded dict() and namespace()."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_span"), [], [], body).set_lineno(lineno)

        def _span(self, caller: Any) -> str:
            text = caller()
            tracking = _GENERATION_TRACKING.get()
            if tracking is not None:  # the text rendered so far is the blocks already produced
                blocks, spans = tracking
                start = sum(len(b) for b in blocks)
                spans.append((start, start + len(text)))
            return text

    def raise_exception(message: Any) -> None:
        raise _TemplateRaised(message)

    class _TemplateRaised(jinja2.exceptions.TemplateError):
        pass

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:  # noqa: A002 - the name templates use
        return datetime.now().strftime(format)

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

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                       namespace=TemplateNamespace)
    env.raised = _TemplateRaised
    return env


@functools.lru_cache(maxsize=64)
def _compile_chat_template(template: str) -> Any:
    return _chat_environment().from_string(template)


def _plain(value: Any) -> Any:
    """What a template may see: plain JSON-like data (exact str/int/float/bool/None, dicts, lists, tuples), with
    subclasses stripped, numpy scalars unwrapped, dataclasses and pydantic models made dicts, anything else a
    "<TypeName>" placeholder; as transformers' _plain_template_data."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    import numpy
    if isinstance(value, numpy.generic):  # np.bool_(False) would otherwise be a truthy placeholder
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _as_dicts(value: Any) -> Any:
    """Message objects (dataclasses, pydantic models) and those nested in them as dicts; media left as they are."""
    if isinstance(value, Mapping):
        return {k: _as_dicts(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_dicts(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_as_dicts(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _as_dicts(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _as_dicts(value.model_dump())
    return value


def _conversations(conversation: Any) -> tuple[list[list[dict]], bool]:
    """One conversation or a batch of them, each a list of message dicts with None-valued keys dropped."""
    if not isinstance(conversation, (list, tuple)) and not hasattr(conversation, "messages"):
        raise InputError(f"conversation is a {type(conversation).__name__}: expected a list of messages "
                         "({\"role\": ..., \"content\": ...} dicts) or a list of such lists")
    if isinstance(conversation, (list, tuple)) and not conversation:
        raise InputError("conversation is empty: give at least one message")
    batched = isinstance(conversation, (list, tuple)) and (isinstance(conversation[0], (list, tuple))
                                                          or hasattr(conversation[0], "messages"))
    chats = list(conversation) if batched else [conversation]
    out = []
    for c, chat in enumerate(chats):
        name = f"conversation[{c}]" if batched else "conversation"
        messages = _as_dicts(getattr(chat, "messages", chat))
        if not isinstance(messages, (list, tuple)):
            raise InputError(f"{name} is a {type(messages).__name__}: expected a list of message dicts")
        normal = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise InputError(f"{name}[{i}] is {message!r} ({type(message).__name__}): a message is a dict "
                                 "such as {\"role\": \"user\", \"content\": ...}")
            normal.append({k: v for k, v in message.items() if v is not None})
        out.append(normal)
    return out, batched


def _tool_schemas(tools: Any) -> Any:
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)):
        raise InputError(f"tools is a {type(tools).__name__}: expected a list of JSON schemas (dicts) or functions")
    schemas = []
    for i, tool in enumerate(tools):
        if isinstance(tool, dict):
            schemas.append(tool)
        elif inspect.isfunction(tool) or inspect.ismethod(tool):
            from transformers.utils import get_json_schema  # its schema from type hints and a Google docstring
            schemas.append(get_json_schema(tool))
        else:
            raise InputError(f"tools[{i}] is a {type(tool).__name__}: a tool is a JSON schema (dict) or a function "
                             "with type hints and a docstring")
    return schemas


def render_chat(conversations: list[list[dict]], template: str, origin: str = "the chat template",
                error: type = InputError, tools: Any = None, documents: Any = None,
                add_generation_prompt: bool = False, continue_final_message: bool | str = False,
                track: bool = False, variables: dict[str, Any] | None = None) -> tuple[list[str], list[list]]:
    """Render each conversation with ``template`` as transformers' render_jinja_template: the texts, and per
    conversation the (start, end) spans of its {% generation %} blocks when ``track``."""
    import jinja2
    env = _chat_environment()
    try:
        compiled = _compile_chat_template(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise error(f"{origin}: not a valid Jinja template (line {exc.lineno}: {exc.message})") from exc
    tool_schemas = _plain(_tool_schemas(tools))
    if documents is not None:
        if not isinstance(documents, (list, tuple)):
            raise InputError(f"documents is a {type(documents).__name__}: expected a list of dicts")
        for i, document in enumerate(documents):
            if not isinstance(document, dict):
                raise InputError(f"documents[{i}] is a {type(document).__name__}: a document is a dict with "
                                 "'title' and 'text'")
    documents = _plain(documents)
    variables = _plain(dict(variables or {}))
    for name in ("messages", "tools", "documents", "add_generation_prompt"):
        if name in variables:
            raise InputError(f"{name}: a keyword of apply_chat_template, not a template variable to pass in kwargs")
    texts, all_spans = [], []
    for c, chat in enumerate(conversations):
        chat = _plain(chat)
        for i, message in enumerate(chat):
            if not isinstance(message, dict):
                raise InputError(f"conversation[{c}][{i}] is not a dict: a message is a dict")
        # the reasoning under its older names also as reasoning_content, and as thinking (gpt-oss templates)
        aliased = []
        for message in chat:
            reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
            aliased.append(message if reasoning is None
                           else {"thinking": reasoning, **message, "reasoning_content": reasoning})
        chat = aliased
        final = None
        if continue_final_message:
            if not chat:
                raise InputError("continue_final_message is set but the conversation is empty")
            key = continue_final_message if isinstance(continue_final_message, str) else "content"
            final = chat[-1].get(key)
            if final is None:
                raise InputError(f"continue_final_message is set but the final message has no {key!r} to continue")
            keys = [k for k in _REASONING_FIELDS if chat[-1].get(k) == final] if key in _REASONING_FIELDS else [key]
            if not any(k in template for k in keys):
                raise InputError(f"continue_final_message is {key!r}, but the chat template ({origin}) never "
                                 "names that field")
            if isinstance(final, (list, tuple)):
                for block in reversed(final):
                    if "text" in block:
                        final = block["text"]
                        block["text"] = block["text"] + _CONTINUE_TAG
                        break
                else:
                    raise InputError("continue_final_message is set but the final message has no text block to "
                                     "continue")
            else:
                for k in keys:
                    chat[-1][k] = chat[-1][k] + _CONTINUE_TAG
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        arguments = dict(messages=chat, tools=tool_schemas, documents=documents,
                         add_generation_prompt=add_generation_prompt, **variables)
        token = _GENERATION_TRACKING.set((blocks, spans)) if track else None
        try:
            if track:
                for block in compiled.generate(**arguments):
                    blocks.append(block)
                text = "".join(blocks)
            else:
                text = compiled.render(**arguments)
        except env.raised as exc:
            raise ChatTemplateError(f"{origin}: the chat template raised: {exc.message}") from exc
        except FlodlHFError:
            raise
        except Exception as exc:  # noqa: BLE001 - a template fails in many ways; name the template
            raise ChatTemplateError(f"{origin}: rendering the chat template failed "
                                    f"({type(exc).__name__}: {exc})") from exc
        finally:
            if token is not None:
                _GENERATION_TRACKING.reset(token)
        if continue_final_message:
            tag = _CONTINUE_TAG.strip()
            if final.strip() not in text or tag not in text:
                raise InputError("continue_final_message is set but the final message does not appear in the chat "
                                 f"the template ({origin}) rendered: the template drops part of it. Final message: "
                                 f"{final.strip()!r}")
            at = text.rindex(tag)
            text = text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
        texts.append(text)
        all_spans.append(spans)
    return texts, all_spans
