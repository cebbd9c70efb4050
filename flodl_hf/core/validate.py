"""Small checks shared by the readers and writers: paths that must stay inside a directory,
paths that must not overlap, a content hash of a directory tree, and the one table of rules that every
family's config values are checked against (``FIELD_RULES``, ``RELATIONS``).

Paths are compared after ``os.path.realpath``, so ``..`` segments and symbolic links are seen
through: ``SRC/../SRC`` is ``SRC``, and a link pointing out of a checkpoint points out of it.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


def real(path: str | os.PathLike) -> Path:
    """The absolute path with every symlink and ``..`` resolved (the path need not exist)."""
    return Path(os.path.realpath(os.path.expanduser(os.fspath(path))))


def is_within(path: str | os.PathLike, root: str | os.PathLike) -> bool:
    """``path`` is ``root`` or lies below it, once both are resolved."""
    p, r = real(path), real(root)
    return p == r or p.is_relative_to(r)


def overlap(a: str | os.PathLike, b: str | os.PathLike) -> str | None:
    """How two paths overlap once resolved: 'is', 'contains' (a holds b), 'is inside' (b holds a), or None."""
    ra, rb = real(a), real(b)
    if ra == rb:
        return "is"
    if rb.is_relative_to(ra):
        return "contains"
    if ra.is_relative_to(rb):
        return "is inside"
    return None


def file_above(path: str | os.PathLike) -> Path | None:
    """The nearest existing ancestor of ``path`` where it is not a directory (nothing can be made
    below it), else None."""
    above = next((p for p in Path(path).expanduser().absolute().parents if p.exists() or p.is_symlink()), None)
    return above if above is not None and not above.is_dir() else None


def safe_member(root: Path, name: object, allowed: Path | None = None) -> Path | None:
    """``root / name`` when ``name`` is a relative path that stays inside ``root`` (or ``allowed``, the
    directory its symlinks may point into, e.g. a hub cache's blobs), else None."""
    if not isinstance(name, str) or not name or "\x00" in name:
        return None
    rel = Path(name)
    if rel.is_absolute() or ".." in rel.parts or name.startswith(("/", "\\")):
        return None
    path = root / rel
    if not is_within(path, allowed or root):
        return None
    return path


def tree_hash(path: str | os.PathLike) -> str:
    """sha256 over a directory tree: every entry's relative path, kind and content (links by target).

    A missing path hashes to ``"missing"``; a file hashes as a one-entry tree.
    """
    root = Path(path)
    if not root.exists() and not root.is_symlink():
        return "missing"
    digest = hashlib.sha256()

    def add(entry: Path, rel: str) -> None:
        if entry.is_symlink():
            digest.update(f"L {rel} -> {os.readlink(entry)}\n".encode("utf-8", "surrogateescape"))
        elif entry.is_dir():
            digest.update(f"D {rel}\n".encode("utf-8", "surrogateescape"))
            for child in sorted(entry.iterdir(), key=lambda p: p.name):
                add(child, f"{rel}/{child.name}" if rel else child.name)
        else:
            digest.update(f"F {rel}\n".encode("utf-8", "surrogateescape"))
            with open(entry, "rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
    add(root, "")
    return digest.hexdigest()


# ---- configs against what they describe --------------------------------------------------------------

def check_config_dict(data: object, where: str) -> None:
    """The shape of a config dict before any family reads it: an object whose ``model_type`` (when
    present) is a string and whose ``architectures`` is a list of strings."""
    from flodl_hf.core.errors import ConfigError
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a JSON object, found a {type(data).__name__}")
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise ConfigError(f"{where}: field names must be strings, found {bad[0]!r}")
    model_type = data.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise ConfigError(f"{where}: field model_type={model_type!r} is a {type(model_type).__name__}, expected a string")
    architectures = data.get("architectures")
    if architectures is not None and (not isinstance(architectures, list)
                                      or not all(isinstance(a, str) for a in architectures)):
        raise ConfigError(f"{where}: field architectures={architectures!r} must be a list of class names (strings)")


# Config fields that count stacked layers, and the key pattern that holds one per layer.
_LAYER_FIELDS = (("num_hidden_layers", re.compile(r"(?:^|\.)encoder\.layer\.(\d+)\.")),
                 ("n_layers", re.compile(r"(?:^|\.)transformer\.layer\.(\d+)\.")),
                 ("num_hidden_groups", re.compile(r"(?:^|\.)albert_layer_groups\.(\d+)\.")),
                 ("num_hidden_layers", re.compile(r"(?:^|\.)model\.layers\.(\d+)\.|^layers\.(\d+)\.")))  # ModernBERT


def check_config_fits(config: object, tensors: dict, where: str) -> None:
    """Bound what a config asks to build by the checkpoint's own keys, before anything is built: a
    config asking for more stacked layers than the checkpoint holds keys for fails at once (it would
    otherwise spend minutes building 10**6 layers only to report them missing)."""
    from flodl_hf.core.errors import ConfigError
    keys = [k for k in tensors if isinstance(k, str)]
    for name, pattern in _LAYER_FIELDS:
        asked = getattr(config, name, None)
        if not isinstance(asked, int):
            continue
        held = {int(m.group(m.lastindex)) for k in keys for m in [pattern.search(k)] if m}
        if held and asked > len(held):
            raise ConfigError(f"{where}: field {name}={asked}, but the checkpoint holds keys for {len(held)} "
                              f"layer(s) (indices {min(held)}..{max(held)}): fix {name} in config.json")


# ---- the value rules of config fields: one table for every family ------------------------------------

# No real checkpoint has a dimension near 2**31; a larger one would overflow size computations.
MAX_SIZE = 2**31 - 1
_NAN, _INF = float("nan"), float("inf")


@dataclass(frozen=True)
class Rule:
    """What a config field's value must be once its type is right, and values that break it (the registry-wide
    test sets each one in every family whose config has the field)."""

    text: str
    holds: Callable[[Any], bool]
    bad: tuple[Any, ...]


SIZE = Rule(f"> 0 and at most {MAX_SIZE}", lambda v: 1 <= v <= MAX_SIZE, (0, -1, 2**40))
COUNT = Rule(f">= 0 and at most {MAX_SIZE}", lambda v: 0 <= v <= MAX_SIZE, (-1,))
POSITIVE = Rule("finite and > 0", lambda v: math.isfinite(v) and v > 0, (0, -1.0, _NAN, _INF))
NON_NEGATIVE = Rule("finite and >= 0", lambda v: math.isfinite(v) and v >= 0, (-0.5, _NAN, _INF))
FINITE = Rule("finite", math.isfinite, (_NAN, _INF))
FRACTION = Rule("in (0, 1]", lambda v: 0 < v <= 1, (0.0, -0.5, 1.5, _NAN))
PROBABILITY = Rule("a probability: it must lie in [0, 1]", lambda v: 0 <= v <= 1, (-0.1, 1.5, _NAN))
# RoPE turns dimension pair i by position * theta ** (-2i / d): a base of 1 or less is no trained model's
THETA = Rule("finite and > 1 (RoPE's base)", lambda v: math.isfinite(v) and v > 1, (0, 1.0, -1.0, _NAN, _INF))

# field name -> rule, for every family whose config has the field (HF's names). A name inside a RoPE dict
# (rope_parameters.factor) is checked by its last part where the decoder reads it (flodl_hf.core.decoder._number).
FIELD_RULES: dict[str, Rule] = {
    **dict.fromkeys((  # sizes and counts of things built
        "hidden_size", "num_attention_heads", "vocab_size", "intermediate_size", "max_position_embeddings",
        "embedding_size", "num_hidden_groups", "inner_group_num", "n_heads", "dim", "hidden_dim", "pooler_hidden_size",
        "num_key_value_heads", "head_dim", "n_positions", "n_embd", "n_head", "n_inner", "ffn_dim",
        "word_embed_proj_dim", "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts",
        "num_local_experts", "num_experts_per_tok", "decoder_sparse_step", "original_max_position_embeddings",
        "sliding_window", "sliding_window_pattern"), SIZE),
    **dict.fromkeys(("num_hidden_layers", "n_layers", "n_layer", "type_vocab_size", "conv_kernel_size",
                     "max_window_layers"), COUNT),
    **dict.fromkeys(("layer_norm_eps", "layer_norm_epsilon", "rms_norm_eps", "norm_epsilon", "norm_eps"), POSITIVE),
    **dict.fromkeys(("rope_theta", "rotary_emb_base", "rope_local_base_freq", "global_rope_theta",
                     "local_rope_theta"), THETA),
    # inside a RoPE dict (transformers' _validate_*_rope_parameters warn on most and run on): beta 0 is its default
    **dict.fromkeys(("factor", "low_freq_factor", "high_freq_factor", "attention_factor", "short_factor",
                     "long_factor"), POSITIVE),
    **dict.fromkeys(("beta_fast", "beta_slow"), NON_NEGATIVE),
    **dict.fromkeys(("mscale", "mscale_all_dim"), FINITE),
    **dict.fromkeys(("partial_rotary_factor", "rotary_pct"), FRACTION),
    # what scales or caps activations, scores and logits (Cohere, Granite, Gemma 2, OLMo)
    **dict.fromkeys(("logit_scale", "logits_scaling", "embedding_multiplier", "residual_multiplier",
                     "attention_multiplier", "query_pre_attn_scalar", "final_logit_softcapping",
                     "attn_logit_softcapping", "clip_qkv"), POSITIVE),
    **dict.fromkeys(("router_jitter_noise", "router_aux_loss_coef"), NON_NEGATIVE),
    **dict.fromkeys(("initializer_range", "init_std"), FINITE),
}


def rule_for(name: str) -> Rule | None:
    """The rule of a field (a dotted name by its last part); a dropout (``*dropout*``, ``*_pdrop``, ``layerdrop``)
    is a probability."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf in FIELD_RULES:
        return FIELD_RULES[leaf]
    return PROBABILITY if "dropout" in leaf or leaf.endswith("pdrop") or leaf == "layerdrop" else None


def check_value(name: str, value: Any, where: str = "config") -> None:
    """A ConfigError naming ``name`` (and ``where``) when a number (or each number of a list) breaks its rule;
    other values, and names without a rule, pass (their types are checked where they are read)."""
    from flodl_hf.core.errors import ConfigError
    rule = rule_for(name)
    if rule is None:
        return
    values = value if isinstance(value, (list, tuple)) else [value]
    for v in values:
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not rule.holds(v):
            raise ConfigError(f"{where}: field {name}={value!r} must be {rule.text}")


@dataclass(frozen=True)
class Relation:
    """A rule between two fields: ``field`` against the first of ``others`` present. ``kind``: "multiple" (field is
    a multiple of the other), "at_most", "above", "at_least", "length" (a list with one entry per the other)."""

    field: str
    others: tuple[str, ...]
    kind: str

    def holds(self, value: Any, other: Any) -> bool:
        if self.kind == "multiple":
            return value % other == 0
        if self.kind == "length":
            return not isinstance(value, list) or len(value) == other
        return {"at_most": value <= other, "above": value > other, "at_least": value >= other}[self.kind]


_RELATION_TEXT = {"multiple": "is not a multiple of", "at_most": "must be at most", "above": "must be above",
                  "at_least": "must be at least", "length": "must list one entry per layer of"}

RELATIONS: tuple[Relation, ...] = (
    Relation("hidden_size", ("num_attention_heads",), "multiple"),
    Relation("dim", ("n_heads",), "multiple"),
    Relation("n_embd", ("n_head",), "multiple"),
    Relation("num_attention_heads", ("num_key_value_heads",), "multiple"),  # each KV head serves a group of heads
    Relation("num_experts_per_tok", ("num_experts", "num_local_experts"), "at_most"),  # top-k of the experts
    Relation("layer_types", ("num_hidden_layers",), "length"),
    # inside a RoPE dict: llama3 smooths over high - low; YaRN ramps from beta_fast's dimension to beta_slow's
    Relation("high_freq_factor", ("low_freq_factor",), "above"),
    Relation("beta_fast", ("beta_slow",), "at_least"),
)


def check_relations(values: dict[str, Any], where: str = "config", prefix: str = "") -> None:
    """Every relation whose fields ``values`` holds (not None, numbers where compared): a ConfigError naming both."""
    from flodl_hf.core.errors import ConfigError
    for relation in RELATIONS:
        value = values.get(relation.field)
        other_name = next((o for o in relation.others if values.get(o) is not None), None)
        if value is None or other_name is None:
            continue
        other = values[other_name]
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (other, *(
            () if relation.kind == "length" else (value,))))
        if numbers and (relation.kind != "multiple" or other) and not relation.holds(value, other):
            raise ConfigError(f"{where}: field {prefix}{relation.field}={value!r} {_RELATION_TEXT[relation.kind]} "
                              f"{prefix}{other_name}={other!r}")


def save_directory(directory: str | os.PathLike, what: str, push_to_hub: bool, kwargs: dict) -> Path:
    """Where ``<what>.save_pretrained`` writes, made if missing as transformers makes it. Refused before anything is
    written: ``push_to_hub=True`` (flodl-hf makes no network access), unknown keywords, a file in its place."""
    from flodl_hf.core.errors import OutputExistsError, push_to_hub_refused
    if push_to_hub:
        raise push_to_hub_refused(what)
    if kwargs:
        raise TypeError(f"save_pretrained() got unexpected keyword arguments: {', '.join(sorted(kwargs))}")
    directory = Path(directory)
    if directory.is_file():
        raise OutputExistsError(f"{what}.save_pretrained: {directory} is a file; pass a directory")
    directory.mkdir(parents=True, exist_ok=True)
    return directory
