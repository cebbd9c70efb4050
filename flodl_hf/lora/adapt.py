"""Adding adapters to a model (:func:`add_lora`, PEFT's ``get_peft_model``), merging them into the base weights and
taking them out again; a refused adapter undone (:func:`undo_on_error`, :func:`atomic`)."""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, TypeVar

from torch import nn

from flodl_hf.core.errors import AdapterError, UnsupportedAdapterError
from flodl_hf.lora.base import base_reference
from flodl_hf.lora.config import PEFT_TASK_TYPES, TASK_TYPE_MODULES_TO_SAVE, LoraConfig, _show
from flodl_hf.lora.layers import (LoraConv1D, LoraLinear, LoraParameters, TiedTrainableTokensLinear,
                                  TrainableTokensEmbedding, TrainableTokensLinear, _lora_class)
from flodl_hf.lora.patterns import ALL_LINEAR, check_patterns
from flodl_hf.lora.targets import (PEFT_DEFAULT_TARGETS, _convert_moe_targets, _module, _peft_converts,
                                   _peft_moe_targets, _replace_module, _resolve_moe_string, _tied_to_embeddings,
                                   all_linear_targets, default_targets, is_lora, lora_layers, matched_names,
                                   minimal_targets, parameter_layers, save_module_names, token_layers, token_targets)

_TASK_DEFAULT: Any = object()   # add_lora's task_type default: PEFT's task type for the model's task
_LORA_ATTRIBUTES = ("lora_config", "lora_base")   # what adding an adapter sets on the model
_F = TypeVar("_F", bound=Callable[..., Any])


@contextmanager
def undo_on_error(model: nn.Module) -> Iterator[None]:
    """On an exception in the block, put ``model`` back as it was before it, then let the exception go on: every
    module's children, Parameters and buffers (the same objects: a tied weight stays tied), each Parameter's
    requires_grad, and the attributes an adapter sets (``lora_config``, ``lora_base``). Adding an adapter only
    replaces modules and Parameters and sets flags and attributes, so a refused adapter leaves nothing behind."""
    modules = {id(m): m for m in model.modules()}
    for holder in vars(model).values():  # an unregistered part (TaskModel's head), updated by _replace_module too
        if isinstance(holder, nn.Module):
            modules.update((id(m), m) for m in holder.modules())
    saved = [(m, dict(m._modules), dict(m._parameters), dict(m._buffers)) for m in modules.values()]
    flags = [(p, p.requires_grad) for m in modules.values() for p in m._parameters.values() if p is not None]
    attributes = {k: vars(model)[k] for k in _LORA_ATTRIBUTES if k in vars(model)}
    try:
        yield
    except BaseException:
        for module, children, params, buffers in saved:
            for table, before in ((module._modules, children), (module._parameters, params),
                                  (module._buffers, buffers)):
                table.clear()
                table.update(before)
        for param, flag in flags:
            param.requires_grad_(flag)
        for key in _LORA_ATTRIBUTES:
            vars(model).pop(key, None)
        vars(model).update(attributes)
        raise


def atomic(fn: _F) -> _F:
    """``fn(model, ...)``, which adds an adapter to ``model``, leaving the model as it was when it raises
    (:func:`undo_on_error`)."""
    @functools.wraps(fn)
    def wrapper(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with undo_on_error(model):
            return fn(model, *args, **kwargs)
    return wrapper  # type: ignore[return-value]


def _listed(value: Any) -> Any:
    """A copy; an iterable given for a list field as a list (a string, an int or None stays as it is)."""
    if isinstance(value, dict):
        return dict(value)
    return value if value is None or isinstance(value, (str, int)) else list(value)


def _untie(model: nn.Module, names: list[str]) -> None:
    """PEFT's ``ModulesToSaveWrapper`` trains a deep copy of each module to save: a Parameter that a module to
    save shares with a module outside it (an LM head tied to the input embeddings) becomes the module's own
    copy, so that the two are trained and saved apart, as in PEFT (the other module keeps the original)."""
    for name in names:
        module = _module(model, name)
        outside = {id(p) for k, p in model.named_parameters(remove_duplicate=False) if not k.startswith(name + ".")}
        for pname, param in list(module.named_parameters()):
            if id(param) in outside:
                owner_name, _, attr = pname.rpartition(".")
                owner = _module(module, owner_name)
                setattr(owner, attr, nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad))


@atomic
def add_lora(model: nn.Module, r: int = 8, alpha: float = 8, dropout: float = 0.0,
             target_modules: Iterable[str] | str | None = None, modules_to_save: Iterable[str] | None = None,
             use_rslora: bool = False, bias: str = "none", task_type: str | None = _TASK_DEFAULT,
             rank_pattern: dict[str, int] | None = None, alpha_pattern: dict[str, float] | None = None,
             exclude_modules: Iterable[str] | str | None = None, layers_to_transform: Iterable[int] | int | None = None,
             layers_pattern: Iterable[str] | str | None = None, use_dora: bool = False,
             lora_bias: bool = False,
             trainable_token_indices: Iterable[int] | dict[str, Iterable[int]] | None = None,
             target_parameters: Iterable[str] | None = None) -> nn.Module:
    """Put LoRA adapters on ``model``'s linear layers named by ``target_modules`` (PEFT's rules), in place.

    Every base parameter is frozen; the adapters, ``modules_to_save`` (plus PEFT's head for the task type:
    ``classifier``/``score`` for ``SEQ_CLS`` and ``TOKEN_CLS``, ``qa_outputs`` for ``QUESTION_ANS``) and, with
    ``bias="all"`` / ``"lora_only"``, the biases stay trainable. ``task_type`` is PEFT's ``LoraConfig.task_type``:
    by default the one of the model's task (:data:`PEFT_TASK_TYPES`); ``None`` is a plain ``PeftModel``, which
    adds no head. A module to save that shares a weight with another module (a tied LM head) gets its own copy,
    as PEFT's wrapper does. ``exclude_modules``, ``layers_to_transform`` / ``layers_pattern``, ``rank_pattern`` and
    ``alpha_pattern`` are PEFT's ``LoraConfig`` fields, with PEFT's matching rules; ``use_dora`` is PEFT's DoRA (a
    trainable magnitude per output row of each adapted layer), ``lora_bias`` PEFT's trainable bias on each
    ``lora_B`` (merged into the base layer's bias). ``trainable_token_indices`` is PEFT's: a list of token ids
    trains those rows of the input embeddings (:class:`TrainableTokensEmbedding`; a tied output layer follows
    them, :class:`TiedTrainableTokensLinear`), an object ``{module name: ids}`` those of the named embeddings
    (or untied output layers, :class:`TrainableTokensLinear`; :func:`token_targets`). ``target_parameters`` is
    PEFT's: Parameters named by the end of their full name (``mlp.experts.gate_up_proj``) get an adapter of their
    own (:class:`LoraParameters`, the stacked experts of an MoE), with or without ``target_modules`` (``[]``: none;
    ``None``: PEFT's default for the model type, where it has one and PEFT's MoE conversion does not empty it,
    :func:`_peft_converts`; where it does, None without ``target_parameters`` is refused, as PEFT refuses it).
    Every regular expression among the settings is checked first, against the names it will be matched with
    (:func:`flodl_hf.lora.patterns.check_patterns`: one that could backtrack without bound is refused). A refusal
    at any point leaves the model as it was (:func:`atomic`). Returns the model, which carries ``model.lora_config``.
    """
    if is_lora(model):
        raise AdapterError(f"{type(model).__name__} already has LoRA adapters (one adapter per model)")
    exclude_modules, layers_pattern = _listed(exclude_modules), _listed(layers_pattern)
    rank_pattern, alpha_pattern = _listed(rank_pattern), _listed(alpha_pattern)
    check_patterns({"target_modules": target_modules, "exclude_modules": exclude_modules,
                    "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern, "layers_pattern": layers_pattern},
                   matched_names(model), "add_lora")
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if target_modules is None and target_parameters is not None and _peft_converts(model):
        targets: list[str] | str | None = []  # PEFT's MoE conversion turns None into an empty set: no default
    elif target_modules is None and target_parameters is None and _peft_converts(model):
        raise AdapterError(f"target_modules=None on model_type {model_type!r}: PEFT 0.21's MoE conversion of this "
                           "model's LoRA config empties PEFT's default target_modules, so PEFT adapts nothing and "
                           "raises (NoMatchingPeftModuleError); pass target_modules (e.g. ['q_proj', 'v_proj']) or "
                           "target_parameters")
    elif target_modules is None and target_parameters is not None and str(model_type) not in PEFT_DEFAULT_TARGETS:
        targets = None  # PEFT targets no module then (check_target_module_exists)
    elif target_modules is None:
        targets = default_targets(str(model_type))
    else:
        targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    task = getattr(model, "task", "base")
    if task_type is _TASK_DEFAULT:
        task_type = PEFT_TASK_TYPES.get(task)
    to_save = None
    if modules_to_save is not None:
        to_save = []
        for m in modules_to_save:
            if m not in to_save:
                to_save.append(m)
    heads = TASK_TYPE_MODULES_TO_SAVE.get(task_type, ()) if isinstance(task_type, str) else ()
    if heads:  # PeftModelFor<TaskType>.__init__ extends modules_to_save with its head
        to_save = (to_save or []) + [m for m in heads if m not in (to_save or [])]
    # The modules to save that the adapters are injected with (never adapted): SEQ_CLS adds its head before the
    # injection, TOKEN_CLS and QUESTION_ANS after it (a head they then adapt is PEFT's TypeError, refused below)
    given = list(to_save or []) if task_type == "SEQ_CLS" else list(dict.fromkeys(modules_to_save or []))
    if isinstance(targets, str) and _peft_moe_targets(model):  # PEFT's MoE conversion resolves a string first
        targets = _resolve_moe_string(model, targets, task_type, exclude_modules, given)
    if isinstance(targets, str) and targets.lower() == ALL_LINEAR:
        targets = all_linear_targets(model, task_type)
    if isinstance(targets, list) and _peft_moe_targets(model):  # names PEFT moves to the stacked experts
        targets, target_parameters, rank_pattern, alpha_pattern = _convert_moe_targets(
            model, targets, target_parameters, r, alpha, rank_pattern, alpha_pattern)
    targets = minimal_targets(model, targets) if targets is not None else None
    tokens = trainable_token_indices
    if isinstance(tokens, dict):
        tokens = {k: _listed(v) for k, v in tokens.items()}
    elif tokens is not None and not isinstance(tokens, (str, int)):
        tokens = list(tokens)
    cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=float(dropout), target_modules=targets,
                     modules_to_save=to_save, use_rslora=use_rslora, bias=bias, task=task, task_type=task_type,
                     rank_pattern={} if rank_pattern is None else rank_pattern,
                     alpha_pattern={} if alpha_pattern is None else alpha_pattern,
                     exclude_modules=exclude_modules, layers_to_transform=_listed(layers_to_transform),
                     layers_pattern=layers_pattern, use_dora=use_dora, lora_bias=lora_bias,
                     trainable_token_indices=tokens, target_parameters=_listed(target_parameters))

    chosen: list[str] = []
    tied: list[str] = []
    for name, module in list(model.named_modules()):
        if not name or not cfg.selects(name, given):
            continue
        if _lora_class(module) is None:
            raise AdapterError(f"target_modules {targets!r} matches {name} ({type(module).__name__}); LoRA "
                               "here adapts nn.Linear (and Conv1D) layers only")
        if _tied_to_embeddings(model, module):
            tied.append(name)  # the tied decoder is the embedding matrix: never adapted
            continue
        chosen.append(name)
    if tied:
        why = (f"{', '.join(tied)}, {'which is' if len(tied) == 1 else 'which are'} tied to the input embeddings "
               "(the same weight), and flodl-hf never puts LoRA on a tied decoder (PEFT would adapt the shared matrix "
               "on the output side only and save it again as <module>.base_layer.weight)")
        lead = (f"target_modules {targets!r} matches no linear layer that can be adapted, only " if not chosen else
                f"target_modules {targets!r} matches ")
        raise UnsupportedAdapterError(f"{lead}{why}; leave {', '.join(n.rsplit('.', 1)[-1] for n in tied)} out of "
                                      "target_modules")
    if not chosen and not cfg.target_parameters:
        linears = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                          if _lora_class(m) is not None and not _tied_to_embeddings(model, m)})
        raise AdapterError(f"target_modules {targets!r} matches no linear layer of {type(model).__name__}; "
                           f"its linear layers are named {', '.join(linears)}")

    saved = save_module_names(model, to_save or [])
    clash = [n for n in chosen if n in saved]
    if clash:  # PEFT: "modules_to_save cannot be applied to modules of type lora.Linear" (a TypeError)
        raise AdapterError(f"target_modules {_show(targets)} matches {', '.join(clash)}, which is also a module to "
                           f"save ({', '.join(to_save or [])}, by its name's end), and PEFT cannot both adapt and save "
                           "one module; leave it out of target_modules (exclude_modules=) or of modules_to_save")
    token_modules, tied_to_tokens = token_targets(model, tokens, saved)
    for p in model.parameters():
        p.requires_grad_(False)
    _untie(model, saved)
    for name in chosen:  # named_modules() order: transformers' order, so PEFT's RNG draws
        base = _module(model, name)
        _replace_module(model, name, _lora_class(base)(base, *cfg.rank_and_alpha(name), float(dropout), use_rslora,
                                                       use_dora, lora_bias))
    cfg.targeted = chosen
    cfg.targeted_parameters = _adapt_parameters(model, cfg, chosen, saved)
    for name, module in model.named_modules():
        if isinstance(module, LoraLinear):
            module.lora_A.weight.requires_grad_(True)
            module.lora_B.weight.requires_grad_(True)
            if module.lora_B.bias is not None:
                module.lora_B.bias.requires_grad_(True)
            if module.use_dora:
                module.lora_magnitude_vector.requires_grad_(True)
            if bias == "lora_only" and module.bias is not None:
                module.bias.requires_grad_(True)
    for name in saved:
        for p in _module(model, name).parameters():
            p.requires_grad_(True)
    if bias == "all":
        for name, p in model.named_parameters():
            if "bias" in name:
                p.requires_grad_(True)
    # set_additional_trainable_modules, after the adapters and the modules to save: the embeddings' rows, then the
    # output layers tied to them (TrainableTokensWrapper with tied_adapter)
    for name, ids in token_modules.items():
        base = _module(model, name)
        kind = TrainableTokensLinear if type(base) is nn.Linear else TrainableTokensEmbedding
        _replace_module(model, name, kind(base, ids))
    if tied_to_tokens:
        source = model.get_input_embeddings()
        for name in tied_to_tokens:
            _replace_module(model, name, TiedTrainableTokensLinear(_module(model, name), source))
    model.lora_config = cfg
    if not hasattr(model, "lora_base"):
        model.lora_base = base_reference(model)
    return model


def _adapt_parameters(model: nn.Module, cfg: LoraConfig, chosen: list[str], saved: list[str]) -> list[str]:
    """PEFT's ``_inject_parameters``, after the linear layers (so its RNG draws): a Parameter whose full name (in
    transformers' model) is an entry of ``target_parameters`` or ends in ``"." + entry`` gets an adapter, module by
    module in ``named_modules()`` order, each module's in ``named_parameters(recurse=False)`` order, its r and
    lora_alpha by its full name (rank_pattern / alpha_pattern); the full names adapted. What PEFT refuses is an
    AdapterError: a Parameter of the model's root, of a layer ``target_modules`` adapts too, with a Conv1D target
    (PEFT's ``fan_in_fan_out``), and entries matching no Parameter at all."""
    wanted = cfg.target_parameters
    if not wanted:
        return []
    key_map = model.family.key_map() if hasattr(model, "family") else None
    found: dict[str, list[str]] = {}
    full: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(c + ".") for c in chosen):
            continue  # a LoRA layer's own lora_A / lora_B
        for pname, _ in module.named_parameters(recurse=False):
            key = f"{name}.{pname}" if name else pname
            hf = key_map.module_name(key) if key_map is not None else key
            if hf not in wanted and not any(hf.endswith("." + t) for t in wanted):
                continue
            if not name:
                raise AdapterError(f"target_parameters {wanted!r} matches {key}, a Parameter of the model's root "
                                   "module, which PEFT cannot adapt; name a Parameter of a submodule")
            if name in chosen:
                raise AdapterError(f"target_parameters {wanted!r} matches {key}, a Parameter of {name}, which "
                                   f"target_modules {_show(cfg.target_modules)} adapts too; PEFT refuses a layer "
                                   "targeted both ways: leave it out of one of them")
            if any(name == m or name.startswith(m + ".") for m in saved):
                raise AdapterError(f"target_parameters {wanted!r} matches {key}, inside a module to save "
                                   f"({', '.join(cfg.modules_to_save or [])}); leave it out of one of them")
            found.setdefault(name, []).append(pname)
            full.append(hf)
    if not found:
        stacked = sorted({n.rsplit(".", 1)[-1] for n, p in model.named_parameters() if p.dim() == 3})
        hint = f"; its 3-D Parameters are named {', '.join(stacked)}" if stacked else ""
        raise AdapterError(f"target_parameters {wanted!r} matches no Parameter of {type(model).__name__} (an entry "
                           f"is a Parameter's full name or its end, e.g. mlp.experts.gate_up_proj){hint}")
    conv1d = [n for n in chosen if isinstance(_module(model, n), LoraConv1D)]
    if conv1d:  # PEFT sets fan_in_fan_out for a Conv1D target, then ParamWrapper refuses it
        raise AdapterError(f"target_parameters with Conv1D targets ({', '.join(conv1d)}): PEFT adapts those with "
                           "fan_in_fan_out, which it refuses with target_parameters; use one or the other")
    position = iter(full)
    for name, names in found.items():
        layer = LoraParameters(_module(model, name))
        _replace_module(model, name, layer)
        for pname in names:
            layer.adapt(pname, *cfg.rank_and_alpha(next(position)), cfg.use_rslora)
    return full


def _adapted_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Every layer that carries an adapter: LoRA layers, adapted Parameters, trainable tokens."""
    return {**lora_layers(model), **parameter_layers(model), **token_layers(model)}


def merge(model: nn.Module) -> nn.Module:
    """Add every adapter's delta into its base weight (outputs then come from the base path alone)."""
    for layer in _adapted_layers(model).values():
        layer.merge()
    return model


def unmerge(model: nn.Module) -> nn.Module:
    """Subtract the deltas again (PEFT's ``unmerge_adapter``; float rounding may leave ulps)."""
    for layer in _adapted_layers(model).values():
        layer.unmerge()
    return model


def merge_and_unload(model: nn.Module) -> nn.Module:
    """Merge, then put the plain layers back: the model is an ordinary one again, keys unchanged."""
    merge(model)
    for name, layer in _adapted_layers(model).items():
        _replace_module(model, name, layer.unloaded())
    for p in model.parameters():
        p.requires_grad_(True)
    del model.lora_config
    return model
