"""Config dataclasses with HF's ``config.json`` field names.

Each family subclasses :class:`BaseConfig` and declares only the fields it reads.
Every field of the source JSON, known or not, is kept and written back, so a
config round-trips losslessly. String options become enums when loaded.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import Any, ClassVar

from flodl_hf.core import slots, validate
from flodl_hf.core.errors import ConfigError, push_to_hub_refused


class Activation(str, Enum):
    """The ``hidden_act`` values we implement, spelled as transformers' ``ACT2FN`` keys."""

    GELU = "gelu"
    GELU_NEW = "gelu_new"
    GELU_PYTORCH_TANH = "gelu_pytorch_tanh"
    GELU_FAST = "gelu_fast"
    GELU_PYTHON = "gelu_python"
    QUICK_GELU = "quick_gelu"
    RELU = "relu"
    SILU = "silu"
    SWISH = "swish"
    TANH = "tanh"
    LINEAR = "linear"

    @classmethod
    def parse(cls, value: Any, where: str = "hidden_act") -> "Activation":
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            known = ", ".join(a.value for a in cls)
            raise ConfigError(f"config field {where}={value!r} is not supported (known: {known})") from None


class ProblemType(str, Enum):
    REGRESSION = "regression"
    SINGLE_LABEL = "single_label_classification"
    MULTI_LABEL = "multi_label_classification"


_RUNTIME_FIELDS = {"raw", "attn_implementation"}

# The value rules (sizes, epsilons, RoPE, scalings, dropouts) and the relations between fields are one table in
# flodl_hf.core.validate (FIELD_RULES, RELATIONS), applied by validate_config to every family's config.


def _plain_type(annotation: Any) -> tuple[type | None, bool]:
    """('int | None') -> (int, True): the scalar type a field's annotation names, and whether None is allowed."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    parts = [p.strip() for p in text.split("|")]
    optional = "None" in parts
    parts = [p for p in parts if p != "None"]
    scalar = {"int": int, "float": float, "bool": bool, "str": str}
    return (scalar.get(parts[0]) if len(parts) == 1 else None), optional


def validate_config(config: "BaseConfig") -> None:
    """Typed checks of a config's values, each a ConfigError naming the field: integers are ints (not
    floats, strings or lists), then every field the table (``flodl_hf.core.validate.FIELD_RULES``) has a rule
    for (sizes positive and fitting, epsilons and scalings finite and positive, RoPE bases above 1, fractions,
    dropouts in [0, 1]...), except a value the family declares as its spelling of "unset" (``unset_values``),
    then the relations between fields (``RELATIONS``: heads divide the width, KV heads divide the heads, top-k
    at most the experts, one layer type per layer); ``pad_token_id`` is in the vocabulary."""
    where = f"config ({config.model_type or type(config).__name__})"
    values: dict[str, Any] = {}
    for f in fields(config):
        if f.name in _RUNTIME_FIELDS or f.name in config.enum_fields:
            continue
        kind, optional = _plain_type(f.type)
        value = values[f.name] = getattr(config, f.name)
        if kind is None or (value is None and optional):
            continue
        if value is None:
            raise ConfigError(f"{where}: field {f.name} is null, expected {kind.__name__}")
        ok = {int: isinstance(value, int) and not isinstance(value, bool),
              float: isinstance(value, (int, float)) and not isinstance(value, bool),
              bool: isinstance(value, bool), str: isinstance(value, str)}[kind]
        if not ok:
            raise ConfigError(f"{where}: field {f.name}={value!r} is a {type(value).__name__}, expected "
                              f"{'an' if kind is int else 'a'} {kind.__name__}")
    for name, value in values.items():
        if value is not None and value not in config.unset_values.get(name, ()):
            validate.check_value(name, value, where)
    validate.check_relations(values, where)
    vocab = getattr(config, "vocab_size", None)
    pad = config.pad_token_id
    if pad is not None and (not isinstance(pad, int) or isinstance(pad, bool) or pad < 0
                            or (vocab is not None and pad >= vocab)):
        raise ConfigError(f"{where}: field pad_token_id={pad!r} must be an id in [0, vocab_size={vocab})")


@functools.cache
def num_labels_wins() -> bool:
    """Whether the installed transformers reads config.json's ``num_labels`` over an ``id2label`` of another length:
    from 5.4.0 on (measured: 5.3.0 keeps id2label, 5.4.0 and every later release to 5.25 take num_labels)."""
    from importlib.metadata import version

    from packaging.version import Version
    return Version(version("transformers")) >= Version("5.4.0")


def _jsonable(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


@dataclass
class BaseConfig:
    """Fields every family shares. Subclasses add theirs, with HF's names and defaults."""

    model_type: ClassVar[str] = ""
    # Enum-typed fields: name -> enum class; parsed in __post_init__, written back as strings.
    enum_fields: ClassVar[dict[str, type]] = {}
    # Values a family's transformers config writes to mean "unset" where the table's rule would refuse them
    # (Qwen2-MoE's sliding_window 0 without use_sliding_window): field -> values, exempt from the rule only.
    unset_values: ClassVar[dict[str, tuple[Any, ...]]] = {}

    architectures: list[str] | None = None
    id2label: dict[int, str] | None = None
    label2id: dict[str, int] | None = None
    problem_type: ProblemType | None = None
    pad_token_id: int | None = 0
    tie_word_embeddings: bool = True
    classifier_dropout: float | None = None
    initializer_range: float = 0.02
    # Runtime choice, not part of config.json: "sdpa" (default) or "eager".
    attn_implementation: str = field(default="sdpa", compare=False)
    # The whole source JSON, unknown fields included: the base that to_dict writes back.
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.id2label is None:
            self.id2label = {0: "LABEL_0", 1: "LABEL_1"}
        try:
            self.id2label = {int(k): str(v) for k, v in self.id2label.items()}
            if self.label2id is not None and not isinstance(self.label2id, dict):
                raise TypeError
        except (TypeError, ValueError, AttributeError, OverflowError):
            raise ConfigError(f"config field id2label={self.id2label!r} must map integer ids to names") from None
        if self.label2id is None:
            self.label2id = {v: k for k, v in self.id2label.items()}
        if self.problem_type is not None:
            try:
                self.problem_type = ProblemType(self.problem_type)
            except ValueError:
                raise ConfigError(f"config field problem_type={self.problem_type!r} is not one of "
                                  + ", ".join(p.value for p in ProblemType)) from None
        for name, enum_cls in self.enum_fields.items():
            value = getattr(self, name)
            if value is not None:
                try:
                    parsed = enum_cls.parse(value, name) if hasattr(enum_cls, "parse") else enum_cls(value)
                except (ValueError, TypeError):
                    raise ConfigError(f"config field {name}={value!r} is not one of "
                                      + ", ".join(str(getattr(e, "value", e)) for e in enum_cls)) from None
                setattr(self, name, parsed)
        validate_config(self)

    # ---- labels -------------------------------------------------------------------------
    @property
    def num_labels(self) -> int:
        return len(self.id2label or {})

    @num_labels.setter
    def num_labels(self, n: int) -> None:
        if n != self.num_labels:
            self.id2label = {i: f"LABEL_{i}" for i in range(n)}
            self.label2id = {v: k for k, v in self.id2label.items()}

    # ---- (de)serialisation --------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "BaseConfig":
        known = {f.name for f in fields(cls) if f.name not in _RUNTIME_FIELDS}
        kwargs = {k: copy.deepcopy(v) for k, v in data.items() if k in known}
        try:
            config = cls(**kwargs)
        except TypeError as exc:
            raise ConfigError(f"config.json does not fit {cls.__name__}: {exc}") from exc
        # As the installed transformers: without id2label, num_labels sets the labels (LABEL_0...); with an
        # id2label of another length, id2label wins up to transformers 5.3 and num_labels from 5.4 on (its labels
        # then LABEL_0...: the names are dropped, as there)
        n = data.get("num_labels")
        if n is not None and (data.get("id2label") is None or num_labels_wins()):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ConfigError(f"config field num_labels={n!r} must be a positive integer")
            config.num_labels = n
        config.raw = copy.deepcopy(dict(data))
        return config

    def to_dict(self) -> dict[str, Any]:
        """The source JSON with our current values laid over it; unknown fields unchanged."""
        out = copy.deepcopy(self.raw)
        defaults = type(self)()
        for f in fields(self):
            if f.name in _RUNTIME_FIELDS:
                continue
            value = getattr(self, f.name)
            if f.name in out or value != getattr(defaults, f.name):
                out[f.name] = _jsonable(value)
        # The label maps are written where the source had them or they differ from the 2-label
        # default; transformers 5 leaves the default out too.
        default = {0: "LABEL_0", 1: "LABEL_1"}
        if "id2label" in self.raw or self.id2label != default:
            out["id2label"] = _jsonable(self.id2label)
        if "label2id" in self.raw or self.id2label != default:
            out["label2id"] = _jsonable(self.label2id)
        out["model_type"] = self.model_type or out.get("model_type")
        return out

    def to_json_string(self) -> str:
        import json
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def save_pretrained(self, directory: str | Path, push_to_hub: bool = False, **kwargs: Any) -> None:
        """``config.json`` in ``directory`` (made if missing, as transformers makes it); ``push_to_hub=True`` is an
        UnsupportedFeatureError (no network access), before anything is written."""
        directory = validate.save_directory(directory, "config", push_to_hub, kwargs)
        (directory / "config.json").write_text(self.to_json_string())

    def replace(self, **changes: Any) -> "BaseConfig":
        new = dataclasses.replace(self, **changes)
        new.raw = copy.deepcopy(self.raw)
        return new

    @classmethod
    def from_pretrained(cls, source: str | Path, revision: str | None = None,
                        gguf_file: str | Path | None = None) -> "BaseConfig":
        # flodl_hf.auto.AutoConfig.from_pretrained (gguf_file=: the config a GGUF file's metadata describes)
        config = slots.LOAD_CONFIG(source, revision=revision, gguf_file=gguf_file)
        if cls is not BaseConfig and not isinstance(config, cls):
            raise ConfigError(f"{source}: model_type {config.model_type!r} is not a {cls.__name__}")
        return config

    def push_to_hub(self, *args: Any, **kwargs: Any) -> None:
        """Refused: flodl-hf makes no network access (``save_pretrained``, then upload with huggingface_hub)."""
        raise push_to_hub_refused("config")
