"""The adapter's settings: :class:`LoraConfig` (PEFT's ``LoraConfig`` fields), PEFT's task types, and the checks
of settings read from a file (adapter_config.json, a trainer checkpoint's ``lora`` entry) with PEFT's types."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from flodl_hf.core.errors import AdapterError
from flodl_hf.lora.patterns import compile_problem, layer_regex, rank_regex, regexes

BIAS_MODES = ("none", "all", "lora_only")

# PEFT's task classes (PeftModelForSequenceClassification ...) add these to modules_to_save.
TASK_MODULES_TO_SAVE: dict[str, tuple[str, ...]] = {"seqcls": ("classifier", "score"),
                                                    "tokcls": ("classifier", "score"), "qa": ("qa_outputs",)}
PEFT_TASK_TYPES: dict[str, str] = {"seqcls": "SEQ_CLS", "tokcls": "TOKEN_CLS", "qa": "QUESTION_ANS",
                                   "base": "FEATURE_EXTRACTION"}
# The same, by PEFT task_type: what PeftModelFor<TaskType>.__init__ adds to modules_to_save (at get_peft_model
# and again at from_pretrained); a task_type absent here (None, FEATURE_EXTRACTION, CAUSAL_LM) adds nothing.
TASK_TYPE_MODULES_TO_SAVE: dict[str, tuple[str, ...]] = {PEFT_TASK_TYPES[t]: m for t, m in TASK_MODULES_TO_SAVE.items()}
# PEFT task types that name one of our tasks unambiguously (the head the adapter was trained with).
TASK_OF_PEFT_TASK_TYPE: dict[str, str] = {"SEQ_CLS": "seqcls", "TOKEN_CLS": "tokcls", "QUESTION_ANS": "qa",
                                          "CAUSAL_LM": "causal_lm"}


@dataclass
class LoraConfig:
    """The adapter's settings, with PEFT's ``LoraConfig`` field names."""

    r: int = 8
    lora_alpha: float = 8
    lora_dropout: float = 0.0
    target_modules: list[str] | str | None = None
    modules_to_save: list[str] | None = None
    use_rslora: bool = False
    bias: str = "none"
    task: str = "base"                     # our task name
    targeted: list[str] = field(default_factory=list)   # the module names adapted, in order
    task_type: str | None = None           # PEFT's task_type (SEQ_CLS ...), written to adapter_config.json
    # PEFT's selection and per-module settings (check_target_module_exists, get_pattern_key)
    rank_pattern: dict[str, int] = field(default_factory=dict)      # module-name pattern -> r
    alpha_pattern: dict[str, float] = field(default_factory=dict)   # module-name pattern -> lora_alpha
    exclude_modules: list[str] | str | None = None
    layers_to_transform: list[int] | int | None = None
    layers_pattern: list[str] | str | None = None
    use_dora: bool = False                 # DoRA: a trainable magnitude per output row (PEFT's use_dora)
    lora_bias: bool = False                # a trainable bias on lora_B (PEFT's lora_bias)
    # PEFT's trainable_token_indices: ids of the input embeddings' rows to train, or {module name: ids}
    trainable_token_indices: list[int] | dict[str, list[int]] | None = None
    # PEFT's target_parameters: Parameter-name suffixes (LoraParameters), and the Parameters adapted, in order
    target_parameters: list[str] | None = None
    targeted_parameters: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.r, int) or self.r <= 0:
            raise AdapterError(f"LoRA r must be a positive int, got {self.r!r}")
        if not 0.0 <= float(self.lora_dropout) < 1.0:
            raise AdapterError(f"LoRA dropout must be in [0, 1), got {self.lora_dropout!r}")
        if self.bias not in BIAS_MODES:
            raise AdapterError(f"LoRA bias={self.bias!r}: expected one of {', '.join(BIAS_MODES)}")
        if self.task_type is not None and not isinstance(self.task_type, str):
            raise AdapterError(f"LoRA task_type={self.task_type!r}: expected PEFT's task type (a string) or None")
        problem = _optional_problem({"lora_dropout": self.lora_dropout,
                                     **{name: getattr(self, name) for name, *_ in _OPTIONAL_FIELDS}},
                                    self.target_modules)
        if problem:
            raise AdapterError(f"LoRA {problem}")

    def rank_and_alpha(self, name: str) -> tuple[int, float]:
        """The r and lora_alpha of module ``name``: PEFT's ``_create_and_replace``, the first pattern of
        ``rank_pattern`` / ``alpha_pattern`` that matches the end of the name (``get_pattern_key``), else r / alpha."""
        def pick(patterns: dict, default: Any) -> Any:
            for key in patterns:
                if re.match(rank_regex(key), name):
                    return patterns[key]
            return default
        return pick(self.rank_pattern, self.r), pick(self.alpha_pattern, self.lora_alpha)

    def selects(self, name: str, modules_to_save: list[str]) -> bool:
        """Whether PEFT adapts module ``name`` (``check_target_module_exists``): not excluded, not in one of
        ``modules_to_save`` (those given when the adapters are injected: a task type's head is added after), a
        target, and, with ``layers_to_transform``, in one of those layers (its first numbered segment, or the
        number after one of ``layers_pattern``)."""
        excluded = self.exclude_modules
        if excluded and (re.fullmatch(excluded, name) if isinstance(excluded, str)
                         else name in excluded or any(name.endswith("." + e) for e in excluded)):
            return False
        if _in_modules_to_save(name, modules_to_save) or not _matches_target(name, self.target_modules):
            return False
        layers = self.layers_to_transform
        if layers is None or layers == [] or isinstance(self.target_modules, str):
            return True
        if not self.layers_pattern:
            match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", name)
        else:
            patterns = [self.layers_pattern] if isinstance(self.layers_pattern, str) else self.layers_pattern
            match = None
            for pattern in patterns:
                match = re.match(layer_regex(pattern), name)
                if match is not None:
                    break
        if match is None:
            return False
        index = int(match.group("idx"))
        return index == layers if isinstance(layers, int) else index in layers

    @property
    def scaling(self) -> float:
        """PEFT's ``update_layer``: ``alpha / sqrt(r)`` with rsLoRA, else ``alpha / r``."""
        return self.lora_alpha / math.sqrt(self.r) if self.use_rslora else self.lora_alpha / self.r

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _matches_target(name: str, targets: list[str] | str | None) -> bool:
    if targets is None:  # target_parameters only (a model type PEFT has no default targets for)
        return False
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return name in targets or any(name.endswith("." + t) for t in targets)


def _in_modules_to_save(name: str, modules_to_save: list[str]) -> bool:
    # PEFT never puts an adapter inside a module to save (check_target_module_exists).
    return any(re.match(rf"(^|.*\.){re.escape(m)}($|\..*)", name) for m in modules_to_save)


# ---- checking settings read from a file ---------------------------------------------------------------

_REQUIRED = object()


def _show(value: Any) -> str:
    text = repr(value)
    return (text[:77] + "...") if len(text) > 80 else text


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_names(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


# The LoRA settings, as PEFT's LoraConfig types them: (field, default, check, what is expected).
_LORA_FIELDS: tuple[tuple[str, Any, Any, str], ...] = (
    ("r", _REQUIRED, lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0, "a positive int (the rank)"),
    ("lora_alpha", 8, _is_number, "a number"),
    ("lora_dropout", 0.0, lambda v: _is_number(v) and 0 <= v < 1, "a number in [0, 1)"),
    ("target_modules", None, lambda v: v is None or isinstance(v, str) or _is_names(v),
     "a list of module names, a regular expression string, or null (PEFT's default for the model type)"),
    ("modules_to_save", None, lambda v: v is None or _is_names(v), "a list of module names or null"),
    ("use_rslora", False, lambda v: isinstance(v, bool), "JSON true or false"),
    ("bias", "none", lambda v: v in BIAS_MODES and isinstance(v, str), f"one of {', '.join(BIAS_MODES)}"),
)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_ids(v: Any) -> bool:
    return isinstance(v, list) and all(map(_is_int, v))


def _is_patterns(v: Any, ok: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and ok(x) for k, x in v.items())


# PEFT's selection fields, use_dora and lora_bias, optional everywhere (older trainer checkpoints lack them):
# (field, default, check, what is expected).
_OPTIONAL_FIELDS: tuple[tuple[str, Any, Any, str], ...] = (
    ("rank_pattern", {}, lambda v: _is_patterns(v, lambda x: _is_int(x) and x > 0),
     "an object of module-name pattern -> positive int"),
    ("alpha_pattern", {}, lambda v: _is_patterns(v, _is_number), "an object of module-name pattern -> number"),
    ("exclude_modules", None, lambda v: v is None or isinstance(v, str) or _is_names(v),
     "a list of module names, a regular expression string, or null"),
    ("layers_to_transform", None, lambda v: v is None or _is_int(v) or (isinstance(v, list) and all(map(_is_int, v))),
     "a layer index, a list of them, or null"),
    ("layers_pattern", None, lambda v: v is None or isinstance(v, str) or _is_names(v),
     "a layer-list name (e.g. 'layers'), a list of them, or null"),
    ("use_dora", False, lambda v: isinstance(v, bool), "JSON true or false"),
    ("lora_bias", False, lambda v: isinstance(v, bool), "JSON true or false"),
    ("trainable_token_indices", None, lambda v: v is None or _is_ids(v) or (isinstance(v, dict) and all(
        isinstance(k, str) and _is_ids(x) for k, x in v.items())),
     "a list of token ids (the input embeddings' rows), an object of module name -> list of token ids, or null"),
    ("target_parameters", None, lambda v: v is None or _is_names(v),
     "a list of Parameter names (e.g. mlp.experts.gate_up_proj) or null"),
)


def lora_settings(data: dict[str, Any], where: str, error: type[Exception] = AdapterError,
                  defaults: bool = True) -> dict[str, Any]:
    """The LoRA settings of ``data`` (adapter_config.json, or a trainer checkpoint's ``lora`` config), checked:
    r, lora_alpha, lora_dropout, target_modules, modules_to_save, use_rslora, bias with PEFT's types and
    defaults (``defaults=False``: every one must be there), and PEFT's selection fields (rank_pattern,
    alpha_pattern, exclude_modules, layers_to_transform, layers_pattern; absent: PEFT's defaults). Anything
    else is an ``error`` naming ``where`` and the field, with what was found and what is expected."""
    out: dict[str, Any] = {}
    for name, default, *_ in _OPTIONAL_FIELDS:
        out[name] = data.get(name, default)
    for name, default, ok, expected in _LORA_FIELDS:
        if name not in data:
            if default is _REQUIRED or not defaults:
                raise error(f"{where}: no field {name!r}; expected {expected}")
            out[name] = default
            continue
        value = data[name]
        if not ok(value):
            raise error(f"{where}: field {name!r} is {_show(value)} ({type(value).__name__}); expected {expected}")
        out[name] = value
    targets = out["target_modules"]
    problem = _optional_problem(out, targets)
    if problem:
        raise error(f"{where}: {problem}")
    return out


def _optional_problem(values: dict[str, Any], targets: Any) -> str | None:
    """What is wrong with PEFT's selection fields (``_OPTIONAL_FIELDS``, by name in ``values``), as a phrase
    naming the field; None when nothing is. Types, regular expressions, and PEFT's ``LoraConfig.__post_init__``
    rules (no layer fields with a regex ``target_modules``; ``layers_pattern`` only with ``layers_to_transform``)."""
    for name, _, ok, expected in _OPTIONAL_FIELDS:
        if not ok(values[name]):
            return f"field {name!r} is {_show(values[name])} ({type(values[name]).__name__}); expected {expected}"
    for name, given, regex, _ in regexes({**values, "target_modules": targets}):
        problem = compile_problem(regex)  # as PEFT runs it: a key inside its rank_pattern regex ...
        if problem:
            what = "has a key" if name in ("rank_pattern", "alpha_pattern") else "holds"
            return f"field {name!r} {what} {_show(given)}, {problem}"
    for name in ("layers_to_transform", "layers_pattern"):
        if isinstance(targets, str) and values[name] is not None:
            return (f"field {name!r} is {_show(values[name])}, but target_modules is a string (a regular "
                    f"expression): PEFT refuses {name} with it; expected null")
    if values["target_parameters"]:  # ParamWrapper.__init__'s ValueErrors
        refused = [f"{name}={_show(values[name])}" for name in ("lora_dropout", "use_dora", "lora_bias")
                   if values.get(name)]
        if refused:
            return (f"field 'target_parameters' is {_show(values['target_parameters'])} with {', '.join(refused)}, "
                    "which PEFT refuses (its adapted Parameters take no dropout, DoRA or lora_B bias); expected "
                    "lora_dropout 0, use_dora and lora_bias false")
    if values["lora_bias"] and values["use_dora"]:  # LoraConfig.__post_init__'s ValueError
        return ("fields 'lora_bias' and 'use_dora' are both true, which PEFT refuses (no lora_B bias with DoRA); "
                "expected one of them false")
    tokens = values["trainable_token_indices"]
    for key, ids in (tokens.items() if isinstance(tokens, dict) else [(None, tokens)] if tokens is not None else []):
        where = "field 'trainable_token_indices'" + (f" -> {key!r}" if key is not None else "")
        if not ids:
            return f"{where} is an empty list; expected at least one token id (or null for no trainable tokens)"
        bad = [i for i in ids if i < 0]
        if bad:
            return f"{where} holds negative token ids {bad}; expected ids in [0, vocabulary size)"
        twice = sorted({i for i in ids if ids.count(i) > 1})
        if twice:
            return (f"{where} lists token ids {twice} more than once (the rows would be written twice, in an "
                    "unspecified order); expected each id once")
    if isinstance(tokens, dict) and not tokens:
        return "field 'trainable_token_indices' is an empty object; expected module name -> token ids, or null"
    if values["layers_pattern"] and values["layers_to_transform"] is None:
        return (f"field 'layers_pattern' is {_show(values['layers_pattern'])} without layers_to_transform, which PEFT "
                "refuses; expected layers_to_transform too, or layers_pattern null")
    return None


def _check_base_record(base: Any, where: str, error: type[Exception]) -> None:
    """A recorded base (``{"source", "weights_sha256"}``) or None; anything else is an ``error``."""
    if base is None:
        return
    if not isinstance(base, dict):
        raise error(f"{where}: field 'base' is {_show(base)} ({type(base).__name__}); expected an object with "
                    "'source' and 'weights_sha256', or null")
    source, sha = base.get("source"), base.get("weights_sha256")
    if source is not None and not isinstance(source, str):
        raise error(f"{where}: field 'base' -> 'source' is {_show(source)} ({type(source).__name__}); expected the "
                    "base's path or hub id (a string) or null")
    if sha is not None and not (isinstance(sha, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                              for k, v in sha.items())):
        raise error(f"{where}: field 'base' -> 'weights_sha256' is {_show(sha)} ({type(sha).__name__}); expected "
                    "an object of file name -> sha256 hex string, or null")


def _check_task(task: Any, where: str, error: type[Exception], field_name: str = "task") -> None:
    from flodl_hf.core.registry import task_names
    if not isinstance(task, str) or task not in task_names():
        raise error(f"{where}: field {field_name!r} is {_show(task)} ({type(task).__name__}); expected one of "
                    f"{', '.join(task_names())}")
