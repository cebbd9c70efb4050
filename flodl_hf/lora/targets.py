"""Which modules get adapters: PEFT's default targets, ``all-linear``, its MoE conversion of targets, the condensed
target list, the trainable-token targets, the modules to save; the adapted layers of a model."""

from __future__ import annotations

import re
from typing import Any, Iterable

from torch import nn

from flodl_hf.core.errors import AdapterError, UnsupportedAdapterError
from flodl_hf.core.layers import LazyBuffers
from flodl_hf.lora.config import LoraConfig
from flodl_hf.lora.patterns import ALL_LINEAR
from flodl_hf.lora.layers import (LoraLinear, LoraParameters, TrainableTokensEmbedding, TrainableTokensLinear,
                                  _lora_class)

MIN_TARGET_MODULES_FOR_OPTIMIZATION = 20   # peft.utils.constants: longer target lists are condensed

# PEFT's default LoRA targets for the model types registered here, as
# peft.utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING holds them (peft 0.21);
# a model type PEFT has no default for (camembert, distilbert, albert, mpnet, modernbert, phi3, olmo2, granite,
# starcoder2, olmo, cohere)
# needs target_modules, in PEFT as here.
PEFT_DEFAULT_TARGETS: dict[str, tuple[str, ...]] = {
    "bert": ("query", "value"),
    "roberta": ("query", "value"),
    "xlm-roberta": ("query", "value"),
    "electra": ("query", "value"),
    "deberta-v2": ("query_proj", "value_proj"),
    "deberta": ("in_proj",),
    "llama": ("q_proj", "v_proj"),
    "mistral": ("q_proj", "v_proj"),
    "mixtral": ("q_proj", "v_proj"),
    "qwen2": ("q_proj", "v_proj"),
    "qwen3": ("q_proj", "v_proj"),
    "gemma": ("q_proj", "v_proj"),
    "gemma2": ("q_proj", "v_proj"),
    "gemma3_text": ("q_proj", "v_proj"),
    "stablelm": ("q_proj", "v_proj"),
    "gpt2": ("c_attn",),
    "gpt_neox": ("query_key_value",),
    "gptj": ("q_proj", "v_proj"),
    "opt": ("q_proj", "v_proj"),
    "phi": ("q_proj", "v_proj", "fc1", "fc2"),
}


def _module(model: nn.Module, name: str) -> nn.Module:
    """The module registered under ``name`` (a ``state_dict`` prefix), found through ``named_modules()``: an
    attribute that shadows a registered child (TaskModel's unregistered ``head`` part) is not followed."""
    if not name:
        return model
    modules = dict(model.named_modules())
    if name not in modules:
        raise AdapterError(f"{type(model).__name__} has no module {name!r}")
    return modules[name]


def _replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` in place of the module registered under ``name``; an unregistered holder of the same module
    at the model's root (TaskModel's ``head`` part, whose forward uses its own references) is updated too."""
    owner_name, _, attr = name.rpartition(".")
    owner = _module(model, owner_name)
    old = _module(owner, attr)
    setattr(owner, attr, new)
    if owner is model:
        for holder in list(vars(model).values()):
            if isinstance(holder, nn.Module):
                for child_name, child in list(holder.named_children()):
                    if child is old:
                        setattr(holder, child_name, new)


def _tied_to_embeddings(model: nn.Module, module: nn.Module) -> bool:
    get = getattr(model, "get_input_embeddings", None)
    embeddings = get() if callable(get) else None
    weight = getattr(embeddings, "weight", None)  # an image model's input embeddings (its patches) have none
    return weight is not None and getattr(module, "weight", None) is weight


def all_linear_targets(model: nn.Module, task_type: str | None) -> list[str]:
    """PEFT's ``target_modules="all-linear"`` (``_maybe_include_all_linear_layers``): the full names of every linear
    layer but the output embeddings (the LM decoder), or, without those and for ``SEQ_CLS``, the classification
    head (``score`` or ``classifier``, the first the model has); sorted (a set in PEFT). On a model PEFT's
    transformers-5 MoE conversion rewrites, :func:`add_lora` resolves all-linear as that conversion does
    (:func:`_resolve_moe_string`)."""
    names = {n for n, m in model.named_modules() if _lora_class(m) is not None}  # nn.Linear and Conv1D, as PEFT
    get = getattr(model, "get_output_embeddings", None)
    output = get() if callable(get) else None
    modules = dict(model.named_modules())
    if output is not None:
        names -= {next(n for n, m in modules.items() if m is output)}
    elif task_type == "SEQ_CLS":
        head = next((n for n in ("score", "classifier") if n in modules), None)
        names -= {head}
    return sorted(names)


def _peft_moe_targets(model: nn.Module) -> dict[str, str]:
    """PEFT 0.21's transformers-5 MoE conversion (``_MOE_TARGET_MODULE_MAPPING``): the target_modules names it
    moves to target_parameters, from the blocks' ``peft_moe_targets`` (Mixtral's, Qwen3-MoE's, OLMoE's); empty for
    every other model."""
    return {k: v for m in model.modules() for k, v in getattr(m, "peft_moe_targets", {}).items()}


def _convert_moe_targets(model: nn.Module, targets: list[str], parameters: Iterable[str] | None, r: int,
                         alpha: float, rank_pattern: dict | None, alpha_pattern: dict | None):
    """``_convert_peft_config_moe``: each target whose name (or its end) is one of the model's moved names becomes
    the Parameter it names now (Mixtral's ``w1`` -> ``gate_up_proj``); the names fused into one Parameter must come
    together and give it twice the rank and alpha (``.*\\.gate_up_proj`` added to the patterns, after the user's).
    Returns the targets left, the target_parameters, rank_pattern and alpha_pattern, as PEFT rewrites its config."""
    moved, fused = _peft_moe_targets(model), {}
    for m in model.modules():
        fused.update(getattr(m, "peft_moe_fused", {}))
    left, params, matched = [], list(parameters or []), {}
    for target in targets:
        old = next((o for o in moved if target == o or target.endswith(f".{o}")), None)
        if old is None:
            left.append(target)
            continue
        if moved[old] not in params:
            params.append(moved[old])
        matched.setdefault(moved[old], set()).add(old)
    rank_pattern, alpha_pattern = dict(rank_pattern or {}), dict(alpha_pattern or {})
    for new, required in fused.items():
        present = matched.get(new, set())
        if present and len(present) < len(required):
            raise AdapterError(f"LoRA field 'target_modules': {', '.join(sorted(present))} without "
                               f"{', '.join(sorted(set(required) - present))}: both are fused into {new} "
                               "(PEFT's transformers-5 MoE conversion), name them together")
        if len(present) == len(required) > 1:
            rank_pattern[rf".*\.{re.escape(new)}"] = r * len(required)
            alpha_pattern[rf".*\.{re.escape(new)}"] = alpha * len(required)
    return left, params, rank_pattern, alpha_pattern


def _resolve_moe_string(model: nn.Module, targets: str, task_type: str | None, exclude_modules: Any,
                        modules_to_save: list[str]) -> list[str] | str:
    """PEFT 0.21's ``_resolve_string_target_modules``, the first step of its MoE conversion: a string
    target_modules becomes leaf names. ``"all-linear"``: the last segment of each of :func:`all_linear_targets`,
    and every name the conversion moves (the experts and the router, no longer linear layers in transformers 5).
    A regex: the last segment of every module and Parameter name (transformers' names) it matches in full (as
    ``check_target_module_exists``: not excluded, not in a module to save), and each moved name that it matches
    after the container of the Parameter it moved to (``experts.gate_proj`` for ``experts.gate_up_proj``). A
    regex naming one layer so adapts that name in every layer, as PEFT does. Sorted (a set in PEFT); the string
    itself where nothing matched (PEFT's not-found error follows)."""
    moved = _peft_moe_targets(model)
    if targets.lower() == ALL_LINEAR:
        return sorted({n.rsplit(".", 1)[-1] for n in all_linear_targets(model, task_type)} | moved.keys())
    excluded = (exclude_modules if exclude_modules is None or isinstance(exclude_modules, str)
                else list(exclude_modules))
    probe = LoraConfig(r=1, lora_alpha=1.0, lora_dropout=0.0, target_modules=targets, exclude_modules=excluded)
    key_map = model.family.key_map() if hasattr(model, "family") else None
    modules = [_hf_module_name(model, n) for n, _ in model.named_modules()]
    params = [key_map.module_name(n) if key_map is not None else n for n, _ in model.named_parameters()]
    matched = {key.rsplit(".", 1)[-1] for key in modules + params if probe.selects(key, modules_to_save)}
    containers: dict[str, list[str]] = {}
    for name in params:
        container, _, leaf = name.rpartition(".")
        containers.setdefault(leaf, []).append(container)
    for old, new in moved.items():
        if old not in matched and any(probe.selects(f"{c}.{old}", modules_to_save) for c in containers.get(new, ())):
            matched.add(old)
    return sorted(matched) if matched else targets


def matched_names(model: nn.Module) -> list[str]:
    """Every string :func:`add_lora` may match a pattern of the settings against (for the bound of
    :func:`flodl_hf.lora.patterns.check_patterns`): the module names, ours and transformers', transformers'
    Parameter names (target_parameters' ranks, PEFT's MoE conversion), and the names that conversion forms from
    an expert container and a moved name (``mlp.experts.gate_proj``)."""
    modules = [n for n, _ in model.named_modules()]
    key_map = model.family.key_map() if hasattr(model, "family") else None
    params = [key_map.module_name(n) if key_map is not None else n for n, _ in model.named_parameters()]
    names = modules + [_hf_module_name(model, n) for n in modules if n] + params
    for old, new in _peft_moe_targets(model).items():
        names += [f"{name.rpartition('.')[0]}.{old}" for name in params if name.rpartition(".")[2] == new]
    return names


def _peft_converts(model: nn.Module) -> bool:
    """Whether PEFT 0.21 rewrites this model's LoRA config before matching (its transformers-5 MoE conversion,
    ``convert_peft_config_for_transformers``: the models whose blocks declare ``peft_moe_targets``). It turns
    ``target_modules=None`` into an empty set, so with ``target_parameters`` no module gets PEFT's default targets."""
    return bool(_peft_moe_targets(model))


def minimal_targets(model: nn.Module, targets: list[str] | str) -> list[str] | str:
    """``BaseTuner.inject_adapter``'s condensing of a target list of 20 names or more: the shortest module-name
    suffixes (``_find_minimal_target_modules``, its order) that still match every target and no other module,
    sorted, where that is a shorter list; the targets as given otherwise. They select the same modules; the
    condensed list is what PEFT keeps in its config and writes to adapter_config.json."""
    if isinstance(targets, str) or len(targets) < MIN_TARGET_MODULES_FOR_OPTIMIZATION:
        return targets
    names = [name for name, _ in model.named_modules()]
    wanted = set(targets)
    ends = tuple("." + t for t in wanted)
    others = [n for n in names if n not in wanted and not n.endswith(ends)]

    def suffixes(name: str) -> list[str]:  # the shortest first
        parts = name.split(".")
        return [".".join(parts[i:]) for i in range(len(parts))][::-1]

    taken = {s for n in others for s in suffixes(n)}
    required: set[str] = set()
    for name, options in sorted(((t, suffixes(t)) for t in wanted), key=lambda item: item[1]):
        for suffix in options:
            if suffix in required or suffix in taken:
                continue
            if not any(name.endswith("." + r) for r in required):
                required.add(suffix)
                break
    return sorted(required) if required and len(required) < len(wanted) else targets


def default_targets(model_type: str) -> list[str]:
    """PEFT's default ``target_modules`` for a model type; a typed error where PEFT has none."""
    if model_type not in PEFT_DEFAULT_TARGETS:
        raise AdapterError(f"PEFT has no default LoRA target_modules for model_type {model_type!r}; pass "
                           "target_modules (names of linear layers, e.g. the attention projections)")
    return list(PEFT_DEFAULT_TARGETS[model_type])


def is_lora(model: nn.Module) -> bool:
    return isinstance(getattr(model, "lora_config", None), LoraConfig)


def lora_layers(model: nn.Module) -> dict[str, LoraLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLinear)}


def parameter_layers(model: nn.Module) -> dict[str, LoraParameters]:
    """The modules whose own Parameters carry adapters (``target_parameters``, :class:`LoraParameters`)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoraParameters)}


def _hf_module_name(model: nn.Module, name: str) -> str:
    """A module's name in transformers' model (the family's key table; the same name for most families)."""
    key_map = model.family.key_map() if hasattr(model, "family") else None
    return key_map.module_name(name + ".weight")[: -len(".weight")] if key_map is not None else name


def token_targets(model: nn.Module, value: Any, saved: list[str], where: str = "add_lora",
                  error: type[Exception] = AdapterError) -> tuple[dict[str, list[int]], list[str]]:
    """PEFT's ``trainable_token_indices`` on ``model`` (``set_additional_trainable_modules``): ``(targets, tied)``,
    the embeddings to wrap (our module name -> token ids) and the output layers tied to the input embeddings
    that follow them. A list targets the input embeddings (``get_input_embeddings()``); an object maps a module
    name to ids, matching every module whose transformers name ends with the key (``_set_trainable``'s
    ``endswith``). When the input embeddings are wrapped, every linear layer sharing their weight (a tied
    ``lm_head``, BERT's MLM ``decoder``: PEFT's ``_get_module_names_tied_with_embedding``) is wrapped as tied.
    An untied ``nn.Linear`` output layer named in the object (an untied ``lm_head``) is wrapped with rows of its
    own. Ids out of a module's vocabulary (an output layer's ``out_features``), a module that is neither a plain
    ``nn.Embedding`` (or Gemma's scaled one) nor such a layer (a tied output layer named in the object), or one
    that is (in) a module to save are errors naming the field."""
    if value is None:
        return {}, []
    field_name = "trainable_token_indices"
    modules = dict(model.named_modules())
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    if isinstance(value, dict):
        targets: dict[str, list[int]] = {}
        for key, ids in value.items():
            found = [n for n in modules if n and _hf_module_name(model, n).endswith(key)]
            if not found:
                names = sorted(_hf_module_name(model, n) for n, m in modules.items() if isinstance(m, nn.Embedding))
                raise error(f"{where}: {field_name} -> {key!r} matches no module of {type(model).__name__}; its "
                            f"embeddings are {', '.join(names)}")
            for name in found:
                if name in targets:
                    raise error(f"{where}: {field_name} names module {name} twice (by {key!r} and another key); "
                                "expected one key per module")
                targets[name] = list(ids)
    else:
        if embedding is None:
            raise UnsupportedAdapterError(f"{where}: {field_name} as a list needs the model's input embeddings, and "
                                          f"{type(model).__name__} has no get_input_embeddings()")
        targets = {next(n for n, m in modules.items() if m is embedding): list(value)}
    for name, ids in targets.items():
        module = modules[name]
        scaled = isinstance(module, nn.Embedding) and isinstance(getattr(module, "embed_scale", None), LazyBuffers)
        # an output layer of its own (an untied lm_head) is PEFT's TrainableTokensWrapper around an nn.Linear
        own_linear = type(module) is nn.Linear and (embedding is None or module.weight is not embedding.weight)
        if type(module) is not nn.Embedding and not scaled and not own_linear:
            raise UnsupportedAdapterError(
                f"{where}: {field_name} targets {name} ({type(module).__name__}); flodl-hf trains token rows of "
                "nn.Embedding layers (and Gemma's scaled embeddings) and of untied nn.Linear output layers only (an "
                "output layer tied to the input embeddings follows them: give the input embeddings' ids)")
        rows = module.out_features if own_linear else module.num_embeddings
        out_of_range = [i for i in ids if i >= rows]
        if out_of_range:
            raise error(f"{where}: {field_name} holds token ids {out_of_range} out of the vocabulary of {name} "
                        f"({rows} rows); expected ids in [0, {rows})")
        inside = [s for s in saved if name == s or name.startswith(s + ".")]
        if inside:
            raise error(f"{where}: {field_name} targets {name}, which is a module to save ({inside[0]}): PEFT trains "
                        "it either fully (modules_to_save) or by rows (trainable_token_indices), not both")
    tied: list[str] = []
    if embedding is not None and any(modules[n] is embedding for n in targets):
        tied = [n for n, m in modules.items() if m is not embedding and isinstance(m, nn.Linear)
                and getattr(m, "weight", None) is embedding.weight]
        shared = [n for n, m in modules.items() if n in saved and any(p is embedding.weight for p in m.parameters())]
        if shared:
            raise UnsupportedAdapterError(f"{where}: {field_name} with {shared[0]} in modules_to_save, which shares "
                                          "the input embeddings' weight: not supported (train the tied matrix either "
                                          "by rows or fully)")
        bad = [n for n in tied if type(modules[n]) is not nn.Linear]
        if bad:
            raise UnsupportedAdapterError(f"{where}: {field_name}: {bad[0]} ({type(modules[bad[0]]).__name__}) is tied "
                                          "to the input embeddings, and flodl-hf follows a tied plain nn.Linear only")
    return targets, tied


def token_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The trainable-token layers (:class:`TrainableTokensEmbedding`, :class:`TrainableTokensLinear`,
    :class:`TiedTrainableTokensLinear`)."""
    kinds = (TrainableTokensEmbedding, TrainableTokensLinear)  # TiedTrainableTokensLinear is one of the latter
    return {n: m for n, m in model.named_modules() if isinstance(m, kinds)}


def save_module_names(model: nn.Module, modules_to_save: list[str]) -> list[str]:
    """The modules PEFT wraps for ``modules_to_save`` (``name.endswith(entry)``; the outermost of nested matches)."""
    out: list[str] = []
    for name, _ in model.named_modules():
        if name and any(name.endswith(m) for m in modules_to_save) and not any(name.startswith(o + ".") for o in out):
            out.append(name)
    return out
