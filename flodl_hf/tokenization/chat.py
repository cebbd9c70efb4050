"""Chat templates as transformers 5.24 renders them (``Tokenizer.apply_chat_template``, chats in ``generate``).

A template is jinja2 in a sandboxed environment with transformers' settings (``trim_blocks``,
``lstrip_blocks``, loop controls) and helpers (``raise_exception``, ``tojson``, ``strftime_now``, the
``{% generation %}`` block); ``render_chat`` passes it transformers' variables (``messages``,
``add_generation_prompt``, the special tokens, ``tools``, ``documents``) and handles
``continue_final_message``. Where a tokenizer's templates come from is read in ``flodl_hf.tokenization.loading``.

Unlike transformers', a render is bounded: the environment (``flodl_hf.tokenization.sandbox``) checks the template's
work against ``sandbox.LIMITS``, ``render_chat`` measures the output as it comes, and each message, tool, document or
variable is refused with an error naming it where it nests deeper than ``LIMITS.depth``, before anything recurses.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flodl_hf.core.errors import ConfigError, FlodlHFError, InputError
from flodl_hf.tokenization import sandbox
from flodl_hf.tokenization.sandbox import (GENERATION_TRACKING, ChatLimits, ChatTemplateError,  # noqa: F401 - the API
                                           ChatTemplateLimitError, chat_environment, compile_template, render)

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


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


class _Walk:
    """One input (a message, tool, document or variable) as it is copied: its characters and items, and a typed error
    naming it past LIMITS.depth or LIMITS.items, raised before the copy recurses any deeper (transformers raises a
    bare RecursionError, or copies shared lists for as long as they multiply)."""
    __slots__ = ("where", "chars", "items", "depth", "most")

    def __init__(self, where: str) -> None:
        limits = sandbox.LIMITS
        self.where, self.chars, self.items, self.depth, self.most = where, 0, 1, limits.depth, limits.items

    def enter(self, depth: int, size: int) -> None:
        """A list or dict of ``size`` items at ``depth`` (the message itself is 1)."""
        if depth > self.depth:
            raise InputError(f"{self.where}: nested more than {self.depth} lists and dicts deep: refused (a "
                             "message's content is a string or a list of content blocks; "
                             "flodl_hf.tokenization.sandbox.LIMITS.depth)")
        self.items += size
        if self.items > self.most:
            raise InputError(f"{self.where}: holds more than {self.most:,} strings, numbers, lists and dicts: refused "
                             "(flodl_hf.tokenization.sandbox.LIMITS.items)")


def _walked(copy: Any, value: Any, where: str) -> tuple[Any, _Walk]:
    """``copy(value, walk)`` (_plain or _as_dicts) and its walk; a model_dump() deeper than the stack is named too."""
    walk = _Walk(where)
    try:
        return copy(value, walk), walk
    except RecursionError:
        raise InputError(f"{where}: nested too deeply to read (a RecursionError): refused") from None


def _plain(value: Any, walk: _Walk, depth: int = 1) -> Any:
    """What a template may see: plain JSON-like data (exact str/int/float/bool/None, dicts, lists, tuples), with
    subclasses stripped, numpy scalars unwrapped, dataclasses and pydantic models made dicts, anything else a
    "<TypeName>" placeholder; as transformers' _plain_template_data. Measured by ``walk``."""
    if type(value) is str:
        walk.chars += len(value)
        return value
    if value is None or type(value) in (int, float, bool):
        return value
    if isinstance(value, str):
        return _plain(str.__str__(value), walk, depth)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, (Mapping, list, tuple)):
        walk.enter(depth, len(value))
        depth += 1
        if isinstance(value, Mapping):
            return {_plain(k, walk, depth): _plain(v, walk, depth) for k, v in value.items()}
        items = [_plain(v, walk, depth) for v in value]
        return items if isinstance(value, list) else tuple(items)
    import numpy
    if isinstance(value, numpy.generic):  # np.bool_(False) would otherwise be a truthy placeholder
        return _plain(value.item(), walk, depth)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain({f.name: getattr(value, f.name) for f in dataclasses.fields(value)}, walk, depth)
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump(), walk, depth)
    return f"<{type(value).__name__}>"


def _as_dicts(value: Any, walk: _Walk, depth: int = 1) -> Any:
    """Message objects (dataclasses, pydantic models) and those nested in them as dicts; media left as they are."""
    if isinstance(value, (Mapping, list, tuple)):
        walk.enter(depth, len(value))
        depth += 1
        if isinstance(value, Mapping):
            return {k: _as_dicts(v, walk, depth) for k, v in value.items()}
        items = [_as_dicts(v, walk, depth) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _as_dicts({f.name: getattr(value, f.name) for f in dataclasses.fields(value)}, walk, depth)
    if callable(getattr(value, "model_dump", None)):
        return _as_dicts(value.model_dump(), walk, depth)
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
        messages = getattr(chat, "messages", chat)
        if not isinstance(messages, (list, tuple)):
            messages = _walked(_as_dicts, messages, name)[0]
        if not isinstance(messages, (list, tuple)):
            raise InputError(f"{name} is a {type(messages).__name__}: expected a list of message dicts")
        normal = []
        for i, message in enumerate(messages):
            message = _walked(_as_dicts, message, f"{name}[{i}]")[0]
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
    env = chat_environment()
    try:
        compiled = compile_template(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise error(f"{origin}: not a valid Jinja template (line {exc.lineno}: {exc.message})") from exc
    except RecursionError:
        raise error(f"{origin}: not a Jinja template that can be compiled: its expressions or blocks nest too "
                    "deeply (a RecursionError)") from None
    schemas = _tool_schemas(tools)
    shared = [len(template), 0]  # the characters and items of what every conversation's render is given

    def plain(value: Any, where: str) -> Any:
        value, walk = _walked(_plain, value, where)
        shared[0] += walk.chars
        shared[1] += walk.items
        return value
    tool_schemas = None if schemas is None else [plain(t, f"tools[{i}]") for i, t in enumerate(schemas)]
    if documents is not None:
        if not isinstance(documents, (list, tuple)):
            raise InputError(f"documents is a {type(documents).__name__}: expected a list of dicts")
        for i, document in enumerate(documents):
            if not isinstance(document, dict):
                raise InputError(f"documents[{i}] is a {type(document).__name__}: a document is a dict with "
                                 "'title' and 'text'")
        documents = type(documents)(plain(d, f"documents[{i}]") for i, d in enumerate(documents))
    variables = {plain(k, "a template variable's name"): plain(v, f"{k} (a template variable)")
                 for k, v in dict(variables or {}).items()}
    for name in ("messages", "tools", "documents", "add_generation_prompt"):
        if name in variables:
            raise InputError(f"{name}: a keyword of apply_chat_template, not a template variable to pass in kwargs")
    texts, all_spans = [], []
    for c, chat in enumerate(conversations):
        if not isinstance(chat, (list, tuple)):
            raise InputError(f"conversation[{c}] is a {type(chat).__name__}: expected a list of message dicts")
        sized = [_walked(_plain, message, f"conversation[{c}][{i}]") for i, message in enumerate(chat)]
        chat = [message for message, _ in sized]
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
        token = GENERATION_TRACKING.set((blocks, spans)) if track else None
        try:
            render(compiled, arguments, blocks, origin, shared[0] + sum(w.chars for _, w in sized),
                   shared[1] + sum(w.items for _, w in sized))
            text = "".join(blocks)
        except env.raised as exc:
            raise ChatTemplateError(f"{origin}: the chat template raised: {exc.message}") from exc
        except FlodlHFError:
            raise
        except RecursionError:
            raise ChatTemplateLimitError(f"{origin}: the chat template recursed too deeply (a macro or a recursive "
                                         "loop that calls itself without end): refused") from None
        except Exception as exc:  # noqa: BLE001 - a template fails in many ways; name the template
            raise ChatTemplateError(f"{origin}: rendering the chat template failed "
                                    f"({type(exc).__name__}: {exc})") from exc
        finally:
            if token is not None:
                GENERATION_TRACKING.reset(token)
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
