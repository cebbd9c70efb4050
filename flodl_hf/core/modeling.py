"""The model contract, strict loading and saving.

Every model is a plain ``nn.Module`` whose ``state_dict()`` keys are HF's keys:
a backbone (``BertModel``) has no prefix; a task model puts its backbone under the
family's prefix (``bert.``) and mounts its head part's children at the root
(``classifier``, ``cls.predictions``, ``qa_outputs``...), exactly where HF has them.

Loading builds the model on the meta device (no random init that is then thrown
away), checks every key and shape before touching anything, and assigns the
checkpoint tensors straight into the module (memory-mapped for safetensors).
Tied weights are found by identity (``cls.predictions.decoder.weight`` *is*
``bert.embeddings.word_embeddings.weight``), so no table lists them.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Iterator

import torch
from torch import nn

from flodl_hf.core import io, keys, slots
from flodl_hf.core.config import BaseConfig
from flodl_hf.core.errors import CheckpointFormatError, InputError, UnsupportedModelError, WeightsMismatchError
from flodl_hf.core.layers import (PADDING, MaskSpec, build_masks, cast_lazy_buffers, check_attn_implementation,
                                  recording_attentions)
from flodl_hf.core.model_calls import ModelCalls
from flodl_hf.core.outputs import BaseModelOutput
from flodl_hf.core.validate import save_directory

if TYPE_CHECKING:
    from flodl_hf.core.registry import Family
    from flodl_hf.core.registry import Task


# The initialisers modules call in reset_parameters(); on the meta device they compute nothing.
_INITIALISERS = frozenset({
    torch.Tensor.normal_, torch.Tensor.uniform_, nn.init.normal_, nn.init.uniform_, nn.init.trunc_normal_,
    nn.init.kaiming_uniform_, nn.init.kaiming_normal_, nn.init.xavier_uniform_, nn.init.xavier_normal_,
})


class _SkipMetaInit(torch.overrides.TorchFunctionMode):
    """Random initialisers of meta tensors become no-ops. Meta tensors hold no values, so this changes no
    result; but torch runs ``normal_`` on meta through its Python reference, whose first call imports
    torch._dynamo (over a second on a 2-core machine, most of a BERT-base load). A mode is per thread."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _INITIALISERS:
            tensor = args[0] if args else kwargs.get("tensor", kwargs.get("self"))  # nn.init passes tensor=
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


@contextmanager
def meta_device() -> Iterator[None]:
    """Build modules on the meta device without running their (meaningless there) random initialisers."""
    with torch.device("meta"), _SkipMetaInit():
        yield


class PreTrainedModel(ModelCalls, nn.Module):
    """Base of backbones and task models: ``.config``, ``from_pretrained``, ``save_pretrained``; transformers' other
    model calls (``num_parameters``, ``resize_token_embeddings``...) come from ``ModelCalls``."""

    task: ClassVar[str] = "base"
    base_model_prefix: str = ""
    # Keys of a backbone that may be freshly initialised when the head around them is new
    # (HF's MLM checkpoints have no pooler, for example).
    fresh_ok_prefixes: ClassVar[tuple[str, ...]] = ("pooler.",)
    # Backbones check their forward inputs (check_forward_inputs); a task model leaves it to its backbone.
    validates_inputs: ClassVar[bool] = True
    # A task model is built from its family (``TaskModel(config, family=)``); a backbone is not.
    takes_family: ClassVar[bool] = False

    def __init__(self, config: BaseConfig) -> None:
        super().__init__()
        self.config = config
        self._family: type["Family"] | None = None
        if type(self).validates_inputs:
            self.register_forward_pre_hook(_forward_input_hook, with_kwargs=True)

    def __call__(self, *args, **kwargs):
        """transformers' forward keywords (``output_hidden_states``, ``return_dict``, ``output_attentions``,
        ``head_mask``) are handled here, once for every backbone and task model; see ``forward_options``. A
        keyword left out takes the config's value (config.json's, or from_pretrained's keyword), as in
        transformers; one passed as None does too, except ``output_hidden_states`` and ``output_attentions`` in
        the families whose transformers models read None as False (``Family.none_is_config_default``)."""
        if not _FORWARD_OPTIONS.intersection(kwargs) and not config_sets_forward_defaults(self.config):
            return super().__call__(*args, **kwargs)
        defaults = self.config.raw
        options = {k: defaults[k] for k in _CONFIG_DEFAULTS if defaults.get(k) is not None}
        for name in _FORWARD_OPTIONS.intersection(kwargs):
            value = kwargs.pop(name)
            if value is None and name in ("output_hidden_states", "output_attentions"):
                if not self.family.none_is_config_default:
                    options[name] = False
            elif value is not None or name == "head_mask":
                options[name] = value
        hidden, attentions, return_dict = forward_options(**options)
        call = super().__call__
        if attentions:
            if self.config.attn_implementation != "eager":
                raise InputError(
                    f"output_attentions=True: this model runs attn_implementation={self.config.attn_implementation!r}, "
                    "which computes no attention weights (transformers 5's sdpa path returns an empty tuple); "
                    "call model.set_attn_implementation('eager') or load it with attn_implementation='eager'")
            call = _recording_attentions(call)
        if hidden:
            out = _call_recording_hidden_states(self, call, args, kwargs)
        else:
            out = call(*args, **kwargs)
        return out.to_tuple() if return_dict is False else out

    # ---- identity ---------------------------------------------------------------------
    def bind_family(self, family: type["Family"]) -> None:
        """Record the family this model was built for (resolved once, at load or build)."""
        self._family = family

    @property
    def family(self) -> type["Family"]:
        """The family given at build; a model built without one looks its model_type up once."""
        if self._family is None:
            from flodl_hf.core.registry import get_family
            self._family = get_family(self.config.model_type)
        return self._family

    @property
    def architecture(self) -> str:
        return self.family.architecture(self.task)

    @property
    def attn_implementation(self) -> str:
        return self.config.attn_implementation

    def set_attn_implementation(self, name: str) -> None:
        self.config.attn_implementation = check_attn_implementation(name, self.family)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    # ---- loading ----------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, source: str | Path, *model_args, **kwargs) -> "PreTrainedModel":
        """Load ``source`` (a directory, a weights file, or a hub id) into this class; transformers' keywords, as
        ``flodl_hf.auto.load_model`` takes them."""
        return slots.LOAD_MODEL(cls, source, model_args, kwargs)  # flodl_hf.auto.model_from_pretrained

    # ---- saving -----------------------------------------------------------------------
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors under HF's names, each tied tensor once (under its canonical name, ``tied_keys``), as
        save_pretrained writes them."""
        key_map = self.family.key_map()
        _, aliases = tied_keys(self)
        return key_map.to_hf_state({name: tensor.detach() for name, tensor in self.state_dict(keep_vars=True).items()
                                    if name not in aliases})  # to_hf per key, and merged tensors split (keys.Merge)

    def save_pretrained(self, directory: str | Path, max_shard_size: int | str = "5GB", push_to_hub: bool = False,
                        **kwargs: object) -> Path:
        """Write ``config.json`` and ``model.safetensors`` (sharded above ``max_shard_size``). ``push_to_hub=True`` is
        an UnsupportedFeatureError (no network access), before anything is written."""
        directory = save_directory(directory, "model", push_to_hub, kwargs)
        config = self.config.to_dict()
        config["architectures"] = [self.architecture]
        import json
        (directory / io.CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        io.save_safetensors(self.hf_state_dict(), directory, max_shard_size)
        return directory


def tied_keys(model: nn.Module) -> tuple[dict[str, torch.Size], dict[str, str]]:
    """``keys.expected``: canonical key -> shape, and alias -> canonical key for each tied tensor; except that a
    tensor tied across a task model's backbone and head is canonical under the backbone's name (the input
    embeddings, as transformers writes them), whichever of the two is mounted first (a family whose
    ``head_before_backbone`` is true, XLM-RoBERTa's, mounts its head first, so the decoder names the tied weight
    first)."""
    shapes, aliases = keys.expected(model)
    prefix = getattr(model, "base_model_prefix", "") if isinstance(model, TaskModel) else ""
    if not prefix or not aliases:
        return shapes, aliases
    prefix += "."
    groups: dict[str, list[str]] = {}
    for alias, canonical in aliases.items():
        groups.setdefault(canonical, [canonical]).append(alias)
    for canonical, names in groups.items():
        inside = [n for n in names if n.startswith(prefix)]
        if canonical.startswith(prefix) or not inside:
            continue
        chosen = inside[0]
        shapes = {(chosen if k == canonical else k): v for k, v in shapes.items()}
        for name in names:
            if name == chosen:
                del aliases[name]
            else:
                aliases[name] = chosen
    return shapes, aliases


def mount_last(module: nn.Module, *names: str) -> None:
    """Re-register the children ``names`` of ``module`` after its others, in this order. ``named_parameters``
    (hence ``clip_grad_norm_``'s sum, and ``named_modules``, which LoRA follows) lists children in the order they
    were registered: this puts a child that a subclass adds where transformers' class registers it."""
    for name in names:
        child = module._modules.pop(name)
        module._modules[name] = child


def positional_order(*names: str):
    """Class decorator: the class's ``forward`` takes ``names`` positionally, in that order, and its other
    inputs by keyword only. ``names`` is transformers' positional order for the class of the same name (the
    parameters both forwards have), so ``model(a, b, c)`` means what it means to transformers (MPNet's and
    ModernBERT's third input is ``position_ids``, DistilBERT's ``inputs_embeds``, RoBERTa's multiple choice
    takes ``token_type_ids`` second); one positional input past them is a TypeError, not a silent other
    meaning. Keyword calls are unchanged. ``inspect.signature`` shows the order, and the backbones' input
    check (``modeling._forward_input_hook``) reads positional inputs by it."""
    def apply(cls: type) -> type:
        inner = cls.forward
        signature = inspect.signature(inner)
        first, *params = signature.parameters.values()
        by_name = {p.name: p for p in params}
        wrong = [n for n in names if n not in by_name] + [
            p.name for p in params if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if wrong:
            raise TypeError(f"{cls.__name__}.forward: cannot order {', '.join(wrong)}")
        order = signature.replace(parameters=[
            first, *(by_name[n].replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names),
            *(p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in params if p.name not in names)])

        @functools.wraps(inner)
        def forward(self, *args, **kwargs):
            inputs = order.bind(self, *args, **kwargs).arguments
            del inputs[first.name]
            return inner(self, **inputs)

        forward.__signature__ = order
        cls.forward = forward
        return cls
    return apply


# ---- transformers' forward keywords ------------------------------------------------------------------

_FORWARD_OPTIONS = frozenset({"output_hidden_states", "output_attentions", "return_dict", "head_mask"})
# The config's defaults for them, as transformers' PreTrainedConfig has them (a config.json may set another).
_CONFIG_DEFAULTS = {"output_hidden_states": False, "output_attentions": False, "return_dict": True}
# What a caller that reads the record's fields passes when the config sets other defaults (task models to their
# backbone, the task one-liners, generate): the plain record.
PLAIN_RECORD = {"return_dict": True, "output_hidden_states": False, "output_attentions": False}


def config_sets_forward_defaults(config: BaseConfig) -> bool:
    """Whether the config asks every forward for another record than the plain one (hidden states,
    attentions, tuples): three lookups, so a plain model's call stays on the direct path."""
    raw = config.raw
    return any(raw.get(k, default) != default for k, default in _CONFIG_DEFAULTS.items())


def forward_options(output_hidden_states: object = None, output_attentions: object = None,
                    return_dict: object = None, head_mask: object = None) -> tuple[bool, bool, bool | None]:
    """``(output_hidden_states, output_attentions, return_dict)`` after checking transformers' forward keywords.

    ``output_hidden_states=True`` adds ``hidden_states`` (the first layer's input, then each layer's output,
    the last being ``last_hidden_state``, as transformers records them); ``output_attentions=True`` adds
    ``attentions`` (each layer's probabilities, (batch, heads, query, key), on the eager path);
    ``return_dict=False`` returns ``to_tuple()`` (the non-None fields, in transformers' order). A
    ``head_mask`` is a typed error: transformers 5 accepts it and ignores it."""
    for name, value in (("output_hidden_states", output_hidden_states), ("output_attentions", output_attentions),
                        ("return_dict", return_dict)):
        if value is not None and not isinstance(value, bool):
            extra = (f": selecting {name[7:].replace('_', ' ')} by index is not supported; pass True and index "
                     "the tuple" if name != "return_dict" else "")
            raise InputError(f"{name}={value!r}: expected True, False or None{extra}")
    if head_mask is not None:
        raise InputError("head_mask: not supported (transformers 5 accepts it and ignores it, so a model run with "
                         "one computes as without it); pass head_mask=None")
    return bool(output_hidden_states), bool(output_attentions), return_dict


def _recording_attentions(call):
    """``call`` returning its output with ``attentions``: every weight ``layers.record_attention`` received. A
    record with ``cross_attentions`` gets them too, as transformers records both on ``output_attentions``
    (``utils.output_capturing.capture_outputs``): none, since no layer here attends to an encoder's states."""
    def recorded(*args, **kwargs):
        with recording_attentions() as weights:
            out = call(*args, **kwargs)
        out = _with_field(out, "attentions", tuple(weights))
        if "cross_attentions" in {f.name for f in dataclasses.fields(out)}:
            out = dataclasses.replace(out, cross_attentions=())
        return out
    return recorded


# The hidden states being recorded in this context (thread and task safe): None when nothing records.
_RECORDING: ContextVar[dict | None] = ContextVar("flodl_hf_hidden_states", default=None)


def _record_layer_output(module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
    record = _RECORDING.get()
    if record is None or id(module) not in record["modules"]:
        return
    hidden = record["hidden"]
    if not hidden:  # transformers: the first hidden state is the first recorded layer's input
        hidden.append(args[0] if args else kwargs["hidden_states"])
    hidden.append(output[0] if isinstance(output, tuple) else output)


def _record_backbone_output(module: nn.Module, args: tuple, output: object) -> None:
    record = _RECORDING.get()
    if record is not None and record["backbone"] == id(module):
        record["last"] = getattr(output, "last_hidden_state", None)


def record_last_hidden_state(hidden: torch.Tensor) -> None:
    """The last hidden state as a task model reshaped it (GPT-2's double heads: (B, choices, S, H), as transformers'
    GPT2Model views it); a no-op when nothing records, and for every task model that does not call it."""
    record = _RECORDING.get()
    if record is not None:
        record["last"] = hidden


def _call_recording_hidden_states(model: "PreTrainedModel", call, args: tuple, kwargs: dict):
    """``call(*args, **kwargs)``, its output given ``hidden_states``. The recording hooks are installed once,
    on first use, and record only inside this context, so a model never asked for hidden states runs no hook."""
    backbone = model if isinstance(model, Backbone) else model.backbone
    modules = backbone.hidden_state_modules()
    for module in [backbone, *modules]:
        if not getattr(module, "_flodl_hf_records", False):
            if module is backbone:
                module.register_forward_hook(_record_backbone_output)
            else:
                module.register_forward_hook(_record_layer_output, with_kwargs=True)
            object.__setattr__(module, "_flodl_hf_records", True)
    record = {"modules": {id(m) for m in modules}, "backbone": id(backbone), "hidden": [], "last": None}
    token = _RECORDING.set(record)
    try:
        out = call(*args, **kwargs)
    finally:
        _RECORDING.reset(token)
    hidden = record["hidden"]
    # transformers ties the last one to last_hidden_state (not the vision models: ``ties_last_hidden_state``)
    if hidden and record["last"] is not None and getattr(backbone, "ties_last_hidden_state", True):
        hidden[-1] = record["last"]
    return _with_field(out, "hidden_states", tuple(hidden))


_RECORDED_FIELDS = ("hidden_states", "attentions")  # transformers' order, after a record's own fields
_EXTENDED: dict[type, type] = {}


def _with_field(out: object, name: str, value: object) -> object:
    """``out`` with its field ``name`` (one of ``_RECORDED_FIELDS``) set. The records in ``outputs`` carry
    both fields; a task's own record without them is extended once by both, after its own fields."""
    cls = type(out)
    if not dataclasses.is_dataclass(out):
        raise TypeError(f"internal error: {cls.__name__} is not an output record")
    if name in {f.name for f in dataclasses.fields(out)}:
        return dataclasses.replace(out, **{name: value})
    sub = _EXTENDED.get(cls)
    if sub is None:
        title = cls.__name__ + "WithHiddenStatesAndAttentions"
        sub = dataclasses.make_dataclass(title, [(f, object, dataclasses.field(default=None)) for f in _RECORDED_FIELDS],
                                         bases=(cls,), namespace={"__module__": __name__})
        globals()[title] = sub  # so that pickle finds it
        _EXTENDED[cls] = sub
    values = {f.name: getattr(out, f.name) for f in dataclasses.fields(out) if f.init}
    return sub(**values, **{name: value})


_FORWARD_NAMES: dict[type, list[str]] = {}


def _forward_input_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
    names = _FORWARD_NAMES.get(type(module))
    if names is None:
        names = _FORWARD_NAMES[type(module)] = list(inspect.signature(type(module).forward).parameters)[1:]
    inputs = dict(zip(names, args))
    inputs.update(kwargs)
    check_forward_inputs(module, inputs.get("input_ids"), inputs.get("attention_mask"),
                         inputs.get("token_type_ids"), inputs.get("inputs_embeds"),
                         position_ids=inputs.get("position_ids"))


def check_forward_inputs(model: nn.Module, input_ids: object, attention_mask: object = None,
                         token_type_ids: object = None, inputs_embeds: object = None,
                         position_ids: object = None) -> None:
    """InputError, naming the argument and the limit, for inputs torch would fail on deep inside (or,
    for a token id past the table on some devices, not fail on): a non-tensor or float ``input_ids``,
    ids outside ``[0, vocab_size)``, a sequence longer than the position table, an ``attention_mask``
    or ``token_type_ids`` whose shape differs from the input's, a token type past ``type_vocab_size``,
    ``position_ids`` that are not an integer tensor (floats where the family's transformers takes them:
    DeBERTa, RoPE), do not broadcast to (batch, sequence), or fall outside the position table."""
    config = model.config
    if input_ids is not None:
        if not isinstance(input_ids, torch.Tensor):
            raise InputError(f"input_ids is a {type(input_ids).__name__}: expected a tensor of token ids")
        if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
            raise InputError(f"input_ids has dtype {input_ids.dtype}: expected an integer tensor of token ids")
        if input_ids.dim() != 2:
            raise InputError(f"input_ids has shape {tuple(input_ids.shape)}: expected (batch, sequence)")
        shape = tuple(input_ids.shape)
    elif isinstance(inputs_embeds, torch.Tensor):
        if inputs_embeds.dim() != 3:
            raise InputError(f"inputs_embeds has shape {tuple(inputs_embeds.shape)}: expected (batch, sequence, hidden)")
        shape = tuple(inputs_embeds.shape[:2])
    else:
        return
    family = getattr(model, "family", None)
    limit = family.max_sequence_length(config) if family is not None else None
    if getattr(config, "position_biased_input", True) is False:
        limit = None  # DeBERTa-v3: relative positions only, no absolute table to run past
    if limit is not None and shape[1] > limit:
        raise InputError(f"input of {shape[1]} tokens is longer than the model's position table allows "
                         f"({limit}, from max_position_embeddings={getattr(config, 'max_position_embeddings', None)}): "
                         "truncate it (tokenizer truncation=True, max_length=...)")
    vocab = getattr(config, "vocab_size", None)
    if input_ids is not None and input_ids.numel() and vocab is not None and not input_ids.is_meta:
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= vocab:
            raise InputError(f"input_ids holds token id {low if low < 0 else high}, outside the vocabulary "
                             f"[0, vocab_size={vocab}): was it made by another model's tokenizer?")
    for name, value in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids)):
        if value is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise InputError(f"{name} is a {type(value).__name__}: expected a tensor shaped like input_ids {shape}")
        if tuple(value.shape) != shape:
            raise InputError(f"{name} has shape {tuple(value.shape)}, but input_ids has {shape}: they must match")
    types = getattr(config, "type_vocab_size", None)
    if isinstance(token_type_ids, torch.Tensor) and token_type_ids.numel() and types and not token_type_ids.is_meta:
        low, high = int(token_type_ids.min()), int(token_type_ids.max())
        if low < 0 or high >= types:
            raise InputError(f"token_type_ids holds type {low if low < 0 else high}, outside "
                             f"[0, type_vocab_size={types})")
    if position_ids is not None:
        _check_position_ids(model, position_ids, shape)


def _check_position_ids(model: nn.Module, position_ids: object, shape: tuple[int, int]) -> None:
    family = getattr(model, "family", None)
    floats = bool(getattr(family, "float_position_ids", False))
    if not isinstance(position_ids, torch.Tensor):
        raise InputError(f"position_ids is a {type(position_ids).__name__}: expected a tensor of positions "
                         f"broadcastable to {shape}")
    if position_ids.is_complex() or position_ids.dtype == torch.bool or (
            position_ids.is_floating_point() and not floats):
        raise InputError(f"position_ids has dtype {position_ids.dtype}: expected an integer tensor of positions")
    try:
        fits = position_ids.dim() <= 2 and torch.broadcast_shapes(tuple(position_ids.shape), shape) == shape
    except RuntimeError:
        fits = False
    if not fits:
        raise InputError(f"position_ids has shape {tuple(position_ids.shape)}: expected one broadcastable to "
                         f"the input's (batch, sequence) {shape}")
    table = model.position_table_size() if isinstance(model, Backbone) else None
    if table is not None and position_ids.numel() and not position_ids.is_meta:
        ids = position_ids.long() if position_ids.is_floating_point() else position_ids  # DeBERTa: .long()
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= table:
            raise InputError(f"position_ids holds position {low if low < 0 else high}, outside the position "
                             f"table [0, {table})")


class Backbone(PreTrainedModel):
    """A family's bare encoder, in three hooks that a family overrides one at a time.

    ``embed`` turns the inputs into the first hidden states; ``encode`` runs the layers, each
    with the mask its ``MaskSpec`` asks for (``layer_masks``); ``pool`` is the optional pooler.
    A family that changes only its embeddings (ELECTRA's projection) overrides ``embed``; one
    that changes only its layers overrides ``encode`` or the encoder class. ``input_names``
    lists the inputs the backbone takes: task models pass it those and no others.
    """

    input_names: ClassVar[tuple[str, ...]] = ("input_ids", "attention_mask", "token_type_ids", "position_ids",
                                              "inputs_embeds")
    # the record forward returns: the one transformers' model of the same name returns
    output_record: ClassVar[type[BaseModelOutput]] = BaseModelOutput

    def _apply(self, fn, recurse: bool = True):
        # model.to(dtype) / .half() / a device move reach the RoPE frequencies as transformers' buffers
        cast_lazy_buffers(self, fn)
        return super()._apply(fn, recurse)

    def mask_specs(self) -> list[MaskSpec]:
        """One MaskSpec per layer (padding everywhere, unless the family's layers say otherwise)."""
        return [PADDING] * self.num_layers()

    def num_layers(self) -> int:
        return int(getattr(self.config, "num_hidden_layers", 1))

    def hidden_state_modules(self) -> list[nn.Module]:
        """The modules whose outputs are the hidden states ``output_hidden_states=True`` returns (transformers'
        ``_can_record_outputs["hidden_states"]``): each call's output is one, and the first call's input comes
        first. Default: the elements of the innermost ``nn.ModuleList`` s (the layers; ALBERT's shared layers
        are recorded at every call). A family whose recorded states differ overrides this (DeBERTa's conv)."""
        lists = [m for m in self.modules() if isinstance(m, nn.ModuleList)
                 and not any(isinstance(c, nn.ModuleList) for c in m.modules() if c is not m)]
        return [layer for modules in lists for layer in modules]

    def position_table_size(self) -> int | None:
        """Rows in the absolute position table (``embeddings.position_embeddings``); None without one (RoPE,
        relative positions): ``position_ids`` must lie in ``[0, rows)``."""
        table = getattr(getattr(self, "embeddings", None), "position_embeddings", None)
        return table.num_embeddings if isinstance(table, nn.Embedding) else None

    def layer_masks(self, attention_mask: torch.Tensor | None, hidden: torch.Tensor) -> list[torch.Tensor | None]:
        """Each layer's mask in the form the configured attention path takes (None: nothing masked)."""
        impl = self.config.attn_implementation
        if impl not in self.family.attn_implementations:
            impl = self.family.attn_implementations[0]
        return build_masks(attention_mask, self.mask_specs(), impl, hidden.dtype, hidden.shape[1], hidden.device)

    def embed(self, input_ids: torch.Tensor | None = None, token_type_ids: torch.Tensor | None = None,
              position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
              attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def encode(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None,
               position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The layers over ``hidden``; ``position_ids`` for families whose layers read positions (RoPE)."""
        raise NotImplementedError

    def pool(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return None

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None) -> BaseModelOutput:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if token_type_ids is not None and "token_type_ids" not in self.input_names:
            from flodl_hf.core.errors import InputError
            raise InputError(f"{type(self).__name__} has no token types: pass no token_type_ids")
        hidden = self.embed(input_ids=input_ids, token_type_ids=token_type_ids, position_ids=position_ids,
                            inputs_embeds=inputs_embeds, attention_mask=attention_mask)
        hidden = self.encode(hidden, attention_mask, position_ids)
        return self.output_record(last_hidden_state=hidden, pooler_output=self.pool(hidden))


class HeadPart(nn.Module):
    """A head's modules, mounted at the task model's root under HF's names.

    ``forward(hidden_states, pooler_output, attention_mask) -> logits``. A part holds
    no bare parameters of its own (only children), and reads no ``self.training``:
    its dropout is a child module, which follows the model's train/eval switch.
    """

    uses_pooler: ClassVar[bool] = False
    # what the backbone is built with besides the pooler (masked image modeling: {"use_mask_token": True})
    backbone_options: ClassVar[dict[str, object]] = {}

    def output_embeddings(self) -> nn.Module | None:
        """The module whose ``weight`` is tied to the input embeddings (masked-LM decoders)."""
        return None

    def bind(self, backbone: "PreTrainedModel") -> None:
        """Called once the backbone is built. A head that reads backbone modules at forward time without
        tying them (DeBERTa's ``lm_predictions``) keeps an unregistered reference, so no key is added."""


class TaskModel(PreTrainedModel):
    """A backbone plus one head part. Subclasses (in ``flodl_hf.heads``) write each head shape once."""

    validates_inputs: ClassVar[bool] = False
    takes_family: ClassVar[bool] = True
    # Where this task model mounts its backbone when it is not the family's prefix.
    backbone_prefix: ClassVar[str | None] = None

    @classmethod
    def default_head(cls, family: type["Family"], config: BaseConfig) -> "HeadPart":
        """The head part a family gets for this task unless it declares its own (``Family.sequence_head`` and
        friends ask the task's default model for it); the heads in flodl_hf.heads give theirs."""
        raise UnsupportedModelError(f"{family.model_type}: no {cls.task!r} head part is declared for this family")

    def __init__(self, config: BaseConfig, family: type["Family"] | None = None) -> None:
        super().__init__(config)
        if family is None:
            from flodl_hf.core.registry import get_family
            family = get_family(config.model_type)
        self.bind_family(family)
        part: HeadPart = getattr(family, self.spec.head_factory)(config)
        if list(part.parameters(recurse=False)):
            raise TypeError(f"{type(part).__name__}: a HeadPart holds no bare parameters, only children")
        # transformers mounts a few task models' backbones elsewhere (LLaMA's and Qwen2's QA: "transformer")
        self.base_model_prefix = self.backbone_prefix or family.prefix
        backbone = family.backbone_class(config, add_pooling_layer=part.uses_pooler, **part.backbone_options)
        backbone.bind_family(family)
        # transformers' order of registration, which named_parameters follows: most task classes build their
        # backbone first, XLM-RoBERTa's and CamemBERT's their head (the family's head_before_backbone, default False)
        head_first = family.head_before_backbone
        if not head_first:
            self.add_module(self.base_model_prefix, backbone)
        for name, child in part.named_children():
            self.add_module(name, child)
        if head_first:
            self.add_module(self.base_model_prefix, backbone)
        object.__setattr__(self, "head", part)  # not registered: its children already are
        part.bind(self.backbone)
        decoder = part.output_embeddings()
        if decoder is not None and config.tie_word_embeddings:
            decoder.weight = self.backbone.get_input_embeddings().weight

    def get_submodule(self, target: str) -> nn.Module:
        """``nn.Module.get_submodule`` through the registered children only: the unregistered ``self.head`` (the
        head part) would otherwise shadow a child transformers names ``head`` (ModernBERT's prediction head), and
        a checkpoint's key under it (a fresh ``head.dense.weight``) would reach the part. ``get_parameter`` reads
        this too."""
        module: nn.Module = self
        for item in target.split(".") if target else ():
            child = module._modules.get(item)
            if child is None:
                raise AttributeError(f"{type(module).__name__} has no submodule `{item}` (in {target!r})")
            module = child
        return module

    @property
    def spec(self) -> "Task":
        """This task's entry in the task registry."""
        from flodl_hf.core.registry import get_task
        return get_task(self.task)

    @property
    def backbone(self) -> "Backbone":
        return getattr(self, self.base_model_prefix)

    def run_backbone(self, **inputs: torch.Tensor | None):
        """The backbone on the inputs it accepts. An input it has no use for (token types on a family
        without them) is dropped when absent and refused when given."""
        accepted = self.backbone.input_names
        extra = [k for k, v in inputs.items() if v is not None and k not in accepted]
        if extra:
            from flodl_hf.core.errors import InputError
            raise InputError(f"{type(self.backbone).__name__} takes no {', '.join(extra)} "
                             f"(it takes {', '.join(accepted)})")
        # the backbone's record, whatever the config sets as the forward's defaults: they are the task model's
        # (an outer call's recording of hidden states and attentions reaches the backbone's layers still)
        plain = PLAIN_RECORD if config_sets_forward_defaults(self.config) else {}
        return self.backbone(**{k: v for k, v in inputs.items() if k in accepted}, **plain)

    def compute_loss(self, logits, **labels: torch.Tensor) -> torch.Tensor:
        """The task's loss, as the task registry declares it."""
        return self.spec.loss(self, logits, **labels)

    def logits_and_loss(self, labels: torch.Tensor | None = None, num_items_in_batch: torch.Tensor | int | None = None,
                        **inputs: torch.Tensor | None):
        """``(logits, loss)``: the backbone on ``inputs``, the head part on its output, and the task's
        loss where ``labels`` are given (else None), given ``num_items_in_batch`` (transformers' gradient-
        accumulation count: it changes the loss only where ``Family.num_items_tasks`` lists the task). The
        head shapes whose logits are the head part's output as it is (sequence and token classification,
        masked LM) forward through this."""
        out = self.run_backbone(**inputs)
        logits = self.head(out.last_hidden_state, out.pooler_output, inputs.get("attention_mask"))
        if labels is None:
            return logits, None
        return logits, self.compute_loss(logits, labels=labels, num_items_in_batch=num_items_in_batch)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.backbone.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module | None:
        """The head part's vocabulary layer (an LM decoder, tied or not); None for the other heads."""
        return self.head.output_embeddings()


@dataclass
class LoadReport:
    """What a load did: the keys it initialised fresh and the checkpoint keys it did not use."""

    fresh: list[str]
    unused: list[str]


def _check_kinds(model: nn.Module, state: dict[str, torch.Tensor], untied: dict[str, torch.Tensor],
                 source: str) -> None:
    """A floating parameter needs a real floating tensor: an integer, bool or complex tensor in its place
    is refused, naming the key (transformers would cast it silently; a complex one fails in the forward)."""
    expected = dict(model.state_dict(keep_vars=True))
    for key, tensor in [*state.items(), *untied.items()]:
        want = expected.get(key)
        if want is not None and want.is_floating_point() and not tensor.is_floating_point():
            raise CheckpointFormatError(f"{source}: key {key!r} holds a {str(tensor.dtype).removeprefix('torch.')} "
                                        "tensor where the model has a floating-point parameter; nothing was loaded")


def load_weights(model: PreTrainedModel, tensors: dict[str, torch.Tensor], source: str,
                 allow_fresh_head: bool = True) -> LoadReport:
    """Strictly load ``tensors`` into ``model`` (which may live on the meta device).

    Missing keys or shape mismatches raise one WeightsMismatchError listing all of
    them, before any weight is assigned. The only exception: when the checkpoint
    holds none of the head's keys (a base checkpoint, or another head), the head,
    and the pooler it may need, are initialised fresh as transformers does, with a
    warning that lists them.
    """
    shapes, aliases = tied_keys(model)
    untied: dict[str, torch.Tensor] = {}
    state = keys.normalise(model, tensors, shapes, aliases, untied)
    missing = [k for k in shapes if k not in state]
    mismatched = [(k, tuple(shapes[k]), tuple(state[k].shape)) for k in shapes
                  if k in state and state[k].shape != shapes[k]]
    mismatched += [(k, tuple(shapes[aliases[k]]), tuple(t.shape)) for k, t in untied.items()
                   if t.shape != shapes[aliases[k]]]
    _check_kinds(model, state, untied, source)
    unused = sorted(k for k in state if k not in shapes)

    fresh: list[str] = []
    if missing and allow_fresh_head and isinstance(model, TaskModel):
        prefix = model.base_model_prefix + "."
        head_keys = [k for k in shapes if not k.startswith(prefix)]
        fresh_ok = set(head_keys) | {k for k in shapes if k.startswith(prefix)
                                     and k[len(prefix):].startswith(model.fresh_ok_prefixes)}
        if not any(k in state for k in head_keys) and set(missing) <= fresh_ok:
            fresh, missing = missing, []
    if missing or mismatched:
        raise WeightsMismatchError(source, missing, mismatched)

    loadable = {k: state[k] for k in shapes if k in state}
    reference = next(iter(loadable.values()), None)
    dtype = reference.dtype if reference is not None and reference.is_floating_point() else torch.float32
    for key in fresh:
        loadable[key] = torch.empty(shapes[key], dtype=dtype)
    model.load_state_dict(loadable, strict=False, assign=True)
    for alias, canonical in aliases.items():  # assign replaced the tied objects: tie them again
        owner, _, name = alias.rpartition(".")
        if alias in untied:
            tied = model.get_parameter(canonical)
            setattr(model.get_submodule(owner), name, nn.Parameter(untied[alias], requires_grad=tied.requires_grad))
        else:
            setattr(model.get_submodule(owner), name, model.get_parameter(canonical))
    if untied:
        warnings.warn(f"{source}: holds " + ", ".join(f"{a} (different from {aliases[a]})" for a in sorted(untied))
                      + ", which the model ties: the file's tensors are kept and the pair is untied, as transformers "
                      "does (config tie_word_embeddings says otherwise)", stacklevel=3)
    std = getattr(model.config, "initializer_range", 0.02)
    for key in fresh:
        owner, _, name = key.rpartition(".")
        keys.init_fresh(model.get_submodule(owner), name, std)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"internal error: {', '.join(left)} were neither loaded nor initialised")
    if fresh:
        warnings.warn(f"Some weights of {model.architecture} were not in {source} and are newly initialised: "
                      f"{', '.join(fresh)}. Train the model on a downstream task before using it for predictions.",
                      stacklevel=3)
    if unused:
        warnings.warn(f"Some weights of {source} were not used by {model.architecture}: {', '.join(unused)}",
                      stacklevel=3)
    report = LoadReport(fresh, unused)
    model.load_report = report
    return report
