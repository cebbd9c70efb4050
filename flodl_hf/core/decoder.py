"""Building blocks shared by the decoder families (LLaMA and those derived from it): RMSNorm, RoPE with its
scalings, grouped-query attention on both paths, causal (and sliding causal) masks, the KV cache.

Each mirrors the transformers 5.24 function named in its comment, op for op, so a decoder built from
them is ``torch.equal`` to transformers on CPU float32 (../shared/PARITY_NOTES.md): the cache mirrors
``DynamicCache`` (its ``torch.cat`` makes the keys contiguous, and the attention sees them so), the
masks mirror ``masking_utils`` (when sdpa gets ``None`` and ``is_causal``, when it gets a bool mask),
and the attention mirrors ``sdpa_attention_forward``'s three GQA routes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from flodl_hf.core.errors import ConfigError
from flodl_hf.core.layers import MaskSpec, record_attention, rotate_half
from flodl_hf.core.validate import check_relations, check_value

# the attention kinds of a decoder's layers (transformers' layer_types)
FULL, SLIDING = "full_attention", "sliding_attention"


class RMSNorm(nn.Module):
    """transformers.models.llama.modeling_llama.LlamaRMSNorm: float32 variance, ``x * rsqrt(var + eps)``,
    back to the input dtype, then ``weight *`` (weight on the left)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class SwiGLU(nn.Module):
    """transformers' LlamaMLP: ``down_proj(act(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int, act, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _number(value: Any, field: str, keep_int: bool = False) -> float:
    """A RoPE field as a float (an int kept with ``keep_int``); JSON numbers only (not strings, not booleans), each
    within its rule in the config table (``flodl_hf.core.validate.FIELD_RULES``, by the field's last name: a
    ``rope_parameters.factor`` of 0 or NaN is refused as a top-level one would be)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"config field {field}={value!r}: expected a number")
    check_value(field, value)
    return value if keep_int and isinstance(value, int) else float(value)


def check_layers(config: Any) -> None:
    """A decoder config's layers as they will be built, against the config table: one kind per layer, each full or
    sliding; each kind's window as ``sliding_window``'s rule wants it (a positive size; a sliding kind needs one),
    and each kind's RoPE resolved (``config.rope(config.rope_key(kind))``), so that a bad field of it fails here,
    naming itself, and not at the first forward (a negative window: a tensor-size RuntimeError)."""
    kinds = config.layer_kinds()
    if len(kinds) != config.num_hidden_layers or set(kinds) - {FULL, SLIDING}:
        raise ConfigError(f"config: layer_types={getattr(config, 'layer_types', None)!r} must list "
                          f"{config.num_hidden_layers} entries of {FULL!r} or {SLIDING!r}")
    for kind in dict.fromkeys(kinds):
        window = config.window(kind)
        if window is None and kind == SLIDING:
            raise ConfigError(f"config: field layer_types has {SLIDING} layers but no sliding window is set "
                              f"(sliding_window={getattr(config, 'sliding_window', None)!r}"
                              + (", use_sliding_window=false" if getattr(config, "use_sliding_window", True) is False
                                 else "") + "; transformers cannot run it)")
        if window is not None:
            check_value("sliding_window", window)
        config.rope(config.rope_key(kind))


# ---- RoPE -------------------------------------------------------------------------------------------

# what transformers' ROPE_INIT_FUNCTIONS compute for every LlamaRotaryEmbedding-style module (longrope: Phi3 only)
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


def _factors(value: Any, field: str) -> tuple[float, ...]:
    """A longrope factor list: a JSON array of numbers (Phi3Config.validate_rope refuses anything else; a generic
    config's ``torch.tensor`` fails on it). Kept as given (ints stay ints, as transformers' ``torch.tensor`` reads
    them)."""
    if not isinstance(value, list) or any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in value):
        raise ConfigError(f"config field {field}={value!r}: expected a list of numbers")
    check_value(field, value)  # each finite and > 0: the frequencies divide by them
    return tuple(value)


@dataclass(frozen=True)
class Rope:
    """A resolved RoPE: type, theta, and the scaling fields (linear: factor; llama3: factor, the two frequency
    factors and original_max_position_embeddings; longrope: factor, original_max_position_embeddings, short_factor,
    long_factor, attention_factor; yarn: factor, original_max_position_embeddings, attention_factor, beta_fast,
    beta_slow, truncate; dynamic: factor, and max_position_embeddings as original_max_position_embeddings; None for
    default)."""

    rope_type: str
    theta: float
    factor: float | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: float | None = None
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    truncate: bool = True

    @property
    def attention_scaling(self) -> float:
        """What multiplies cos and sin (the rotary modules' ``attention_scaling``): longrope's and yarn's attention
        factor, 1.0 for the other types."""
        return 1.0 if self.attention_factor is None else self.attention_factor

    @classmethod
    def resolve(cls, rope_parameters: dict | None, rope_scaling: dict | None, rope_theta: float | None,
                default_theta: float, max_position_embeddings: int,
                original_max_position_embeddings: Any = None, supported: Sequence[str] = ROPE_TYPES) -> "Rope":
        """As ``PreTrainedConfig.convert_rope_params_to_dict`` / ``standardize_rope_params`` read them: the older
        ``rope_scaling`` (``type`` or ``rope_type``) when present, over ``rope_parameters`` (``rope_scaling or
        rope_parameters``); a ``rope_theta`` inside it, else the top-level ``rope_theta``, else the default.
        For llama3, a top-level ``original_max_position_embeddings`` (passed here) wins over the nested one,
        which wins over ``max_position_embeddings``. Numbers must be JSON numbers (transformers fails on
        strings at the first forward); anything else is a ConfigError naming config.json and the field, as is a
        type outside ``supported`` (the family's: Phi3 takes ``default`` and ``longrope``).

        longrope (``_compute_longrope_parameters``): ``short_factor`` and ``long_factor`` are required lists of
        numbers; ``factor`` defaults to ``max_position_embeddings / original_max_position_embeddings`` (read as
        for llama3), ``attention_factor`` to ``sqrt(1 + log(factor) / log(original))`` when that factor is above 1,
        else 1.0. Where transformers fails computing them (a division by zero, a log of a non-positive number) it
        is a ConfigError."""
        given = rope_scaling or rope_parameters
        source = "rope_scaling" if rope_scaling else "rope_parameters"
        if given is not None and not isinstance(given, dict):
            raise ConfigError(f"config field {source}={given!r}: expected an object")
        params = dict(given or {})
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in supported:
            raise ConfigError(f"config field {source}.rope_type={rope_type!r} is not supported "
                              f"(supported: {', '.join(supported)})")
        if "rope_theta" in params and params["rope_theta"] is not None:
            theta = _number(params["rope_theta"], f"{source}.rope_theta")
        elif rope_theta is not None:
            theta = _number(rope_theta, "rope_theta")
        else:
            theta = float(default_theta)
        if rope_type == "default":
            return cls("default", theta)
        if rope_type in ("linear", "dynamic"):
            if "factor" not in params:
                raise ConfigError(f"config field {source} ({rope_type}) lacks factor")
            # _compute_dynamic_ntk_parameters scales against max_position_embeddings, the length it starts from
            return cls(rope_type, theta, _number(params["factor"], f"{source}.factor"),
                       original_max_position_embeddings=None if rope_type == "linear" else
                       _number(max_position_embeddings, "max_position_embeddings", True))
        required = {"longrope": ("short_factor", "long_factor"), "yarn": ("factor",)}.get(
            rope_type, ("factor", "low_freq_factor", "high_freq_factor"))
        missing = [k for k in required if k not in params]
        if missing:
            raise ConfigError(f"config field {source} ({rope_type}) lacks {', '.join(missing)}")
        if original_max_position_embeddings is not None:  # standardize_rope_params: the top-level one wins
            old = _number(original_max_position_embeddings, "original_max_position_embeddings", True)
        elif params.get("original_max_position_embeddings") is not None:
            old = _number(params["original_max_position_embeddings"], f"{source}.original_max_position_embeddings",
                          True)
        else:
            old = _number(max_position_embeddings, "max_position_embeddings", True)
        if rope_type == "longrope":
            return cls._longrope(params, source, theta, max_position_embeddings, old)
        if rope_type == "yarn":
            return cls._yarn(params, source, theta, max_position_embeddings, old)
        low = _number(params["low_freq_factor"], f"{source}.low_freq_factor")
        high = _number(params["high_freq_factor"], f"{source}.high_freq_factor")
        check_relations({"low_freq_factor": low, "high_freq_factor": high}, "config", f"{source}.")
        return cls("llama3", theta, _number(params["factor"], f"{source}.factor"), low, high, old)

    @classmethod
    def _longrope(cls, params: dict, source: str, theta: float, max_position_embeddings: int, old: float) -> "Rope":
        """_compute_longrope_parameters' scalars: the factor, then the attention factor, in Python floats."""
        short = _factors(params["short_factor"], f"{source}.short_factor")
        long = _factors(params["long_factor"], f"{source}.long_factor")
        # Phi3: no stored factor, the ratio of the two lengths
        factor = _factor_or_ratio(params.get("factor"), source, max_position_embeddings, old)
        attention = params.get("attention_factor")
        if attention is not None:
            attention = _number(attention, f"{source}.attention_factor")
        elif factor <= 1.0:
            attention = 1.0
        elif old <= 1:
            raise ConfigError(f"config field original_max_position_embeddings={old!r}: longrope's attention factor "
                              "divides by its log, which must be positive (or give attention_factor)")
        else:
            attention = math.sqrt(1 + math.log(factor) / math.log(old))
        return cls("longrope", theta, factor, original_max_position_embeddings=old, short_factor=short,
                   long_factor=long, attention_factor=attention)

    @classmethod
    def _yarn(cls, params: dict, source: str, theta: float, max_position_embeddings: int, old: float) -> "Rope":
        """_compute_yarn_parameters' scalars: the factor (None: the ratio of the two lengths), the attention factor
        (given, else YaRN's mscale ratio when both mscale and mscale_all_dim are set and non-zero, else its mscale of
        the factor), beta_fast / beta_slow (None or 0: 32 / 1) and truncate, in Python floats."""
        factor = _factor_or_ratio(params["factor"], source, max_position_embeddings, old)
        given = {name: params.get(name) for name in ("attention_factor", "mscale", "mscale_all_dim", "beta_fast",
                                                     "beta_slow")}
        given = {name: None if value is None else _number(value, f"{source}.{name}") for name, value in given.items()}
        attention = given["attention_factor"]
        if attention is None:
            if given["mscale"] and given["mscale_all_dim"]:
                below = _yarn_mscale(factor, given["mscale_all_dim"])
                attention = float(_yarn_mscale(factor, given["mscale"]) / below) if below else math.inf
            else:
                attention = _yarn_mscale(factor)
        truncate = params.get("truncate", True)
        if not isinstance(truncate, bool):
            raise ConfigError(f"config field {source}.truncate={truncate!r}: expected true or false")
        if not (math.isfinite(attention) and attention > 0):  # mscale / mscale_all_dim can drive it to 0 or below
            raise ConfigError(f"config field {source}.mscale={given['mscale']!r} with mscale_all_dim="
                              f"{given['mscale_all_dim']!r} gives yarn an attention factor of {attention!r}: it must "
                              "be finite and > 0")
        betas = {"beta_fast": given["beta_fast"] or 32, "beta_slow": given["beta_slow"] or 1}  # 0 or None: default
        check_relations(betas, "config", f"{source}.")
        return cls("yarn", theta, factor, original_max_position_embeddings=old, attention_factor=attention,
                   truncate=truncate, **betas)

    def inverse_frequencies(self, head_dim: int, device: torch.device | None = None, long: bool = False,
                            seq_len: torch.Tensor | None = None) -> torch.Tensor:
        """The inverse frequencies of ``head_dim`` rotated dimensions; longrope's long ones with ``long`` (its short
        ones otherwise, which transformers' rotary module holds in ``inv_freq`` / ``original_inv_freq``); dynamic's
        for a forward ``seq_len`` long (``max(position_ids) + 1``; None: max_position_embeddings, its start)."""
        # modeling_rope_utils: compute_default_rope_parameters / _compute_llama3_parameters /
        # _compute_longrope_parameters / _compute_yarn_parameters / _compute_dynamic_ntk_parameters, in their order
        if self.rope_type == "yarn":
            return self._yarn_inverse_frequencies(head_dim, device)
        if self.rope_type == "dynamic":
            return self._dynamic_inverse_frequencies(head_dim, device, seq_len)
        if self.rope_type == "longrope":
            ext_factors = torch.tensor(self.long_factor if long else self.short_factor, dtype=torch.float32,
                                       device=device)
            inv_freq_shape = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
            return 1.0 / (ext_factors * self.theta ** inv_freq_shape)
        if self.rope_type == "default":
            return 1.0 / (self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim))
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(device=device,
                                                                                             dtype=torch.float) / head_dim))
        if self.rope_type == "linear":  # _compute_linear_scaling_rope_parameters: inv_freq /= factor
            return inv_freq / self.factor
        factor, low, high, old = (self.factor, self.low_freq_factor, self.high_freq_factor,
                                  self.original_max_position_embeddings)
        low_freq_wavelen = old / low
        high_freq_wavelen = old / high
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth_factor = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, inv_freq_llama)

    def _yarn_inverse_frequencies(self, dim: int, device: torch.device | None) -> torch.Tensor:
        """_compute_yarn_parameters: interpolated (/ factor) and extrapolated frequencies blended by a linear ramp
        between the correction dimensions of beta_fast and beta_slow rotations (floored and ceiled with truncate)."""
        base, old = self.theta, self.original_max_position_embeddings

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
        extrapolation = 1.0 / pos_freqs
        interpolation = 1.0 / (self.factor * pos_freqs)
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        extrapolation_factor = 1 - ramp.to(device=device, dtype=torch.float)
        return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor

    def _dynamic_inverse_frequencies(self, dim: int, device: torch.device | None,
                                     seq_len: torch.Tensor | None) -> torch.Tensor:
        """_compute_dynamic_ntk_parameters: theta raised for a sequence past max_position_embeddings, in Python
        floats at the start and in float32 tensors for a forward's length, as transformers computes each."""
        start = self.original_max_position_embeddings
        if seq_len is None:
            seq_len = start
        else:
            seq_len = torch.maximum(seq_len, torch.tensor(start, dtype=seq_len.dtype, device=seq_len.device))
        base = self.theta * ((self.factor * seq_len / start) - (self.factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim))


def _factor_or_ratio(factor: Any, source: str, max_position_embeddings: int, old: float) -> float:
    """longrope's and yarn's factor: the given one, else max_position_embeddings / original_max_position_embeddings
    (_compute_longrope_parameters, _compute_yarn_parameters)."""
    if factor is not None:
        return _number(factor, f"{source}.factor")
    return _number(max_position_embeddings, "max_position_embeddings") / old  # old > 0: _number's rule


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """yarn_get_mscale: ``0.1 * mscale * log(scale) + 1``, 1.0 for a scale up to 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rotary_cos_sin(inv_freq: torch.Tensor, position_ids: torch.Tensor, dtype: torch.dtype,
                   attention_scaling: float = 1.0, interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """LlamaRotaryEmbedding.forward: elementwise ``positions * inv_freq``, cat, cos/sin times the scaling;
    ``interleaved``: each frequency twice in a row, ``repeat_interleave`` where LLaMA has ``cat``
    (CohereRotaryEmbedding.forward, for RoPE on pairs of adjacent dimensions)."""
    freqs = position_ids[..., None].float() * inv_freq.to(device=position_ids.device, dtype=torch.float)
    emb = torch.repeat_interleave(freqs, 2, dim=-1) if interleaved else torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos() * attention_scaling
    sin = emb.sin() * attention_scaling
    return cos.to(dtype=dtype), sin.to(dtype=dtype)


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """modeling_llama.apply_rotary_pos_emb, in q's dtype (no float32 round trip, unlike ModernBERT's). With cos
    narrower than the heads (a partial rotary factor), modeling_phi3's: the first dimensions turn, the rest pass."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotary_dim = cos.shape[-1]
    if rotary_dim < q.shape[-1]:
        q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
        k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
        return (torch.cat([(q_rot * cos) + (rotate_half(q_rot) * sin), q_pass], dim=-1),
                torch.cat([(k_rot * cos) + (rotate_half(k_rot) * sin), k_pass], dim=-1))
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


# ---- the KV cache ------------------------------------------------------------------------------------

class KVCache:
    """Per-layer keys and values, (B, kv_heads, S, head_dim), as transformers' ``DynamicCache`` keeps them:
    a full layer keeps everything (``DynamicLayer``); a sliding layer keeps the last ``window - 1`` tokens and
    returns the full states of the step (``DynamicSlidingWindowLayer``)."""

    def __init__(self, windows: Sequence[int | None]) -> None:
        self.windows = list(windows)
        self.keys: list[torch.Tensor | None] = [None] * len(self.windows)
        self.values: list[torch.Tensor | None] = [None] * len(self.windows)
        self.seen = [0] * len(self.windows)  # tokens each layer has seen (cumulative_length)

    def __len__(self) -> int:
        return len(self.windows)

    def update(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # DynamicLayer.update: cat onto an empty tensor first (the result is contiguous, as transformers')
        if self.keys[layer] is None:
            self.keys[layer] = torch.tensor([], dtype=key.dtype, device=key.device)
            self.values[layer] = torch.tensor([], dtype=value.dtype, device=value.device)
        self.seen[layer] += key.shape[-2]
        full_k = torch.cat([self.keys[layer], key], dim=-2)
        full_v = torch.cat([self.values[layer], value], dim=-2)
        window = self.windows[layer]
        if window is None:
            self.keys[layer], self.values[layer] = full_k, full_v
        else:  # DynamicSlidingWindowLayer.update: keep the last window - 1, return the full states
            self.keys[layer], self.values[layer] = full_k[:, :, -window + 1:, :], full_v[:, :, -window + 1:, :]
        return full_k, full_v

    def get_seq_length(self, layer: int = 0) -> int:
        """Tokens seen so far by ``layer`` (the query offset of the next step)."""
        return self.seen[layer]

    def mask_sizes(self, query_length: int, layer: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of the next step, as ``DynamicLayer`` / ``DynamicSlidingWindowLayer.get_mask_sizes``."""
        window, seen = self.windows[layer], self.seen[layer]
        if window is None:
            return seen + query_length, 0
        kv_offset = max(seen - window + 1, 0)
        kv_length = window - 1 + query_length if seen >= window else seen + query_length
        return kv_length, kv_offset

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """``Cache.reorder_cache`` (``DynamicLayer.reorder_cache``): every layer's keys and values take the rows
        ``beam_idx`` names, in its order (beam search)."""
        for layer, keys in enumerate(self.keys):
            if keys is not None and keys.numel() > 0:
                self.keys[layer] = keys.index_select(0, beam_idx.to(keys.device))
                self.values[layer] = self.values[layer].index_select(0, beam_idx.to(keys.device))

    def nbytes(self) -> int:
        """Bytes held by the cached keys and values."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values) if t is not None)

    def to_legacy(self) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """``(keys, values)`` per layer. A sliding layer keeps only its window, so a cache with one cannot be
        rebuilt from these (``from_legacy`` refuses it, as transformers 5 refuses tuples altogether)."""
        return tuple((k, v) for k, v in zip(self.keys, self.values))

    @classmethod
    def from_legacy(cls, layers: Iterable[tuple[torch.Tensor, torch.Tensor]], windows: Sequence[int | None]) -> "KVCache":
        """A cache filled with ``(keys, values)`` per layer (a full layer's whole history). Not for a model with
        a sliding layer: its tuples hold the last ``window - 1`` tokens only, not how many were seen, so the
        positions and masks of the next step would be wrong; pass the ``KVCache`` itself."""
        if any(w is not None for w in windows):
            from flodl_hf.core.errors import InputError
            raise InputError("cache: per-layer (keys, values) tuples cannot carry a sliding-window cache "
                             "(they lose how many tokens each layer has seen); pass the KVCache the model "
                             "returned (out.cache) instead")
        cache = cls(windows)
        for i, (k, v) in enumerate(layers):
            cache.update(i, k, v)
        return cache


class StaticKVCache(KVCache):
    """transformers' ``StaticCache``, what ``generate`` makes for ``cache_implementation="static"``; ``is_compileable``:
    a one-token step always builds its mask (``create_causal_mask`` skips it only for a prefill).

    A full layer (``StaticLayer``): zeros of (B, kv_heads, ``max_cache_len``, head_dim) from its first update,
    written in place at the positions seen so far (``index_copy_``) and returned whole, so that every forward
    attends over ``max_cache_len`` keys, the unwritten ones masked (``get_mask_sizes``: (``max_cache_len``, 0)).
    A sliding layer (``StaticSlidingWindowLayer``) holds min(window, ``max_cache_len``) positions: written in place
    until they are full, then a one-token step rolls them by one and writes the last, and a longer step attends
    over the held ones and its own and keeps the last of them."""

    is_compileable = True

    def __init__(self, windows: Sequence[int | None], max_cache_len: int) -> None:
        super().__init__(windows)
        self.max_cache_len = max_cache_len
        self.sizes = [max_cache_len if w is None else min(w, max_cache_len) for w in self.windows]

    def update(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        size, current, n = self.sizes[layer], self.seen[layer], key.shape[-2]
        if self.keys[layer] is None:  # lazy_initialization
            self.keys[layer] = key.new_zeros((*key.shape[:2], size, key.shape[-1]))
            self.values[layer] = value.new_zeros((*value.shape[:2], size, value.shape[-1]))
        keys, values = self.keys[layer], self.values[layer]
        self.seen[layer] += n
        if self.windows[layer] is not None and current >= size:  # a full sliding layer
            if n == 1:
                new_k, new_v = keys.roll(-1, dims=-2), values.roll(-1, dims=-2)
                last = torch.tensor([-1], dtype=torch.long, device=key.device)
                new_k[:, :, last], new_v[:, :, last] = key, value
                keys.copy_(new_k)
                values.copy_(new_v)
                return keys, values
            full_k = torch.cat((keys[:, :, 1:, :], key), dim=-2)
            full_v = torch.cat((values[:, :, 1:, :], value), dim=-2)
        elif self.windows[layer] is not None and current + n > size:  # a sliding layer filling past its size
            full_k = key if current == 0 else torch.cat((keys[:, :, :current, :], key), dim=-2)
            full_v = value if current == 0 else torch.cat((values[:, :, :current, :], value), dim=-2)
        else:
            if current + n > size:  # transformers' index_copy_ raises an IndexError here
                from flodl_hf.core.errors import InputError
                raise InputError(f"cache_implementation='static': a forward writes positions {current} to "
                                 f"{current + n - 1} of a static cache of {size} (assisted decoding's last drafts can "
                                 "pass max_length - 1); pass a larger max_cache_len, or use the dynamic cache")
            positions = torch.arange(n, device=key.device) + current
            keys.index_copy_(2, positions, key)
            values.index_copy_(2, positions, value)
            return keys, values
        keys.copy_(full_k[:, :, -size:, :])
        values.copy_(full_v[:, :, -size:, :])
        return full_k, full_v

    def crop(self, tokens: int) -> None:
        """``StaticLayer.crop(-tokens)`` (assisted decoding's rejected candidates): each layer's count of positions
        goes back by ``tokens``, the stale states stay where the next update overwrites them (masked till then).
        Full layers only: a sliding one is refused where the cache is made."""
        self.seen = [seen - tokens for seen in self.seen]

    def mask_sizes(self, query_length: int, layer: int) -> tuple[int, int]:
        size, seen = self.sizes[layer], self.seen[layer]
        if self.windows[layer] is None:
            return size, 0
        kv_offset = max(seen - size + 1, 0)
        if seen >= size:
            return size + query_length - 1, kv_offset
        return (seen + query_length if seen + query_length > size else size), kv_offset


def as_cache(past: Any, windows: Sequence[int | None], past_key_values: Any = None) -> KVCache | None:
    """The ``cache`` keyword as given (our KVCache, None, or a sequence of per-layer (keys, values)), or
    ``past_key_values``, transformers' name for it before 5.24, which still takes it; not both."""
    from flodl_hf.core.errors import InputError
    if past_key_values is not None:
        if past is not None:
            raise InputError("cache and past_key_values are one argument under two names (past_key_values is "
                             "transformers' older one): pass cache only")
        past = past_key_values
    if past is None or isinstance(past, KVCache):
        return past
    try:
        return KVCache.from_legacy([(layer[0], layer[1]) for layer in past], windows)
    except (TypeError, IndexError):
        raise InputError("cache: expected a KVCache or a sequence of (keys, values) per layer") from None


# ---- causal masks --------------------------------------------------------------------------------------

def _ignore_causal_mask_sdpa(padding: torch.Tensor | None, q_length: int, kv_length: int, q_offset: int,
                             kv_offset: int, local_size: int | None) -> bool:
    # masking_utils._ignore_causal_mask_sdpa: sdpa gets None and is_causal instead of a mask
    if padding is not None and padding.shape[-1] > kv_length:
        padding = padding[:, torch.arange(kv_length, device=padding.device) + kv_offset]
    if local_size is not None and kv_length >= local_size:
        return False
    if (q_length == 1 or kv_length == q_length) and (padding is None or bool(padding.all())):
        return True
    if q_offset == 0 and (padding is None or (bool(padding[:, :q_length].all()) and bool((~padding[:, q_length:]).all()))):
        return True
    return False


def causal_mask(spec: MaskSpec, attention_mask: torch.Tensor | None, batch: int, q_length: int, impl: str,
                dtype: torch.dtype, device: torch.device, cache: KVCache | None = None,
                cache_layer: int = 0) -> torch.Tensor | None:
    """One causal spec's mask, as ``masking_utils.create_causal_mask`` / ``create_sliding_window_causal_mask``
    build it: sdpa a bool (B, 1, q, kv) or None (then the attention runs ``is_causal``); eager always an
    additive float mask with ``finfo.min``. ``spec.window``: keys within ``window - 1`` positions behind."""
    if attention_mask is not None and attention_mask.dim() == 4:
        return attention_mask
    if attention_mask is not None:
        attention_mask = attention_mask.to(device=device, dtype=torch.bool)
    if cache is not None:
        q_offset = cache.get_seq_length(cache_layer)
        kv_length, kv_offset = cache.mask_sizes(q_length, cache_layer)
    else:
        q_offset, kv_offset = 0, 0
        kv_length = attention_mask.shape[-1] if attention_mask is not None else q_length
    padding = attention_mask  # masking_utils.prepare_padding_mask
    if padding is not None and (extra := kv_length + kv_offset - padding.shape[-1]) > 0:
        padding = F.pad(padding, (0, extra))
    # create_causal_mask: no skip for a one-token step over a static cache (is_compileable)
    skip = not (getattr(cache, "is_compileable", False) and q_length == 1)
    if impl == "sdpa" and skip and _ignore_causal_mask_sdpa(padding, q_length, kv_length, q_offset, kv_offset,
                                                            spec.window):
        return None
    # masking_utils.sdpa_mask (non-vmap): and_masks over broadcast indices, then expand
    b = torch.arange(batch, device=device)[:, None, None, None]
    q = (torch.arange(q_length, device=device) + q_offset)[None, None, :, None]
    kv = (torch.arange(kv_length, device=device) + kv_offset)[None, None, None, :]
    keep = q.new_ones((), dtype=torch.bool)
    if spec.window is not None:
        keep = keep & (kv > q - spec.window)
    keep = keep & (kv <= q)
    if padding is not None:
        keep = keep & padding[b, kv]
    keep = keep.expand(batch, -1, q_length, kv_length)
    if impl == "sdpa":
        return keep
    # masking_utils.eager_mask
    return torch.where(keep, torch.zeros((), device=device, dtype=dtype), torch.finfo(dtype).min)


# ---- attention -----------------------------------------------------------------------------------------

def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """modeling_llama.repeat_kv: (B, kv_heads, S, d) -> (B, kv_heads * n_rep, S, d) by expand + reshape."""
    batch, kv_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, kv_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, kv_heads * n_rep, slen, head_dim)


def grouped_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, impl: str,
                   groups: int, scaling: float, dropout_p: float = 0.0, softcap: float | None = None) -> torch.Tensor:
    """Causal grouped-query attention over q (B, heads, q, d) and k, v (B, kv_heads, kv, d); returns
    (B, q, heads, d), contiguous, as the attention interface returns it. ``softcap``: the scores become
    ``tanh(s / cap) * cap`` before the mask (Gemma2's ``attn_logit_softcapping``), eager only, as transformers."""
    q_length = q.shape[2]
    if impl == "sdpa":
        if softcap is not None:  # a family with a softcap declares eager only (transformers has no sdpa for it)
            raise ValueError("attention logit softcapping runs on the eager path only")
        # integrations.sdpa_attention.sdpa_attention_forward: enable_gqa, pack_gqa (one query) or repeat_kv
        extra = {}
        if groups > 1:
            if mask is None and k.shape[-1] == v.shape[-1] <= 256:
                extra["enable_gqa"] = True
            elif q_length == 1:
                q = q.reshape(q.shape[0], q.shape[1] // groups, groups, q.shape[-1])
            else:
                k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        is_causal = q_length > 1 and mask is None
        if is_causal and k.shape[2] > q_length:
            k, v = k[:, :, :q_length, :], v[:, :, :q_length, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scaling,
                                             is_causal=is_causal, **extra)
        out = out.reshape(out.shape[0], -1, q_length, v.shape[-1])
        return out.transpose(1, 2).contiguous()
    # modeling_llama.eager_attention_forward: repeat_kv, (q k^T) * s, + mask, float32 softmax, @ v
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    weights = torch.matmul(q, k.transpose(2, 3)) * scaling
    if softcap is not None:  # modeling_gemma2.eager_attention_forward: / cap, tanh, * cap, then the mask
        weights = weights / softcap
        weights = torch.tanh(weights)
        weights = weights * softcap
    if mask is not None:
        weights = weights + mask
    weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(q.dtype)
    if dropout_p:
        weights = F.dropout(weights, p=dropout_p, training=True)
    record_attention(weights)
    return torch.matmul(weights, v).transpose(1, 2).contiguous()
