"""Numerical building blocks shared by every family.

Exactness against transformers (CPU, float32, ``torch.equal``) needs the same
ops in the same order; ../shared/PARITY_NOTES.md has the measurements. In short:
``F.linear`` (never ``x @ W.T + b``), ``F.gelu``, ``F.layer_norm``, and
``F.scaled_dot_product_attention`` with HF's scale for sdpa, HF's literal order
for eager.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from flodl_hf.core.config import Activation

if TYPE_CHECKING:
    from flodl_hf.core.registry import Family

# The attention paths attend() computes. Which of them a family has is declared once, in
# Family.attn_implementations; a model asked for a path its family lacks runs the family's first.
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    # transformers.activations.NewGELUActivation, literally: F.gelu(approximate="tanh") is ~5e-7 away.
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def _gelu_fast(x: torch.Tensor) -> torch.Tensor:
    # transformers.activations.FastGELUActivation
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def _gelu_python(x: torch.Tensor) -> torch.Tensor:
    # transformers.activations.GELUActivation(use_gelu_python=True)
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


# named functions, not lambdas: a module holding one (an MLP's act_fn) must pickle and deepcopy
def _gelu_pytorch_tanh(x: torch.Tensor) -> torch.Tensor:
    # transformers.activations.PytorchGELUTanh
    return F.gelu(x, approximate="tanh")


def _linear(x: torch.Tensor) -> torch.Tensor:
    return x


ACTIVATIONS: dict[Activation, Callable[[torch.Tensor], torch.Tensor]] = {
    Activation.GELU: F.gelu,
    Activation.GELU_NEW: _gelu_new,
    Activation.GELU_PYTORCH_TANH: _gelu_pytorch_tanh,
    Activation.GELU_FAST: _gelu_fast,
    Activation.GELU_PYTHON: _gelu_python,
    Activation.QUICK_GELU: _quick_gelu,
    Activation.RELU: F.relu,
    Activation.SILU: F.silu,
    Activation.SWISH: F.silu,
    Activation.TANH: torch.tanh,
    Activation.LINEAR: _linear,
}


def activation(act: Activation | str) -> Callable[[torch.Tensor], torch.Tensor]:
    return ACTIVATIONS[Activation.parse(act)]


def check_attn_implementation(name: str, family: "type[Family] | None" = None) -> str:
    """``name`` if attend() has that path (and, given a family, the family declares it); else ValueError."""
    known = ATTN_IMPLEMENTATIONS if family is None else tuple(family.attn_implementations)
    if name not in ATTN_IMPLEMENTATIONS or (family is not None and name not in known and len(known) > 1):
        from flodl_hf.core.errors import InputError
        raise InputError(f"attn_implementation={name!r}: expected one of {', '.join(known)}")
    return name


# ---- masks ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MaskSpec:
    """What one layer may attend to: ``padding`` (every real token), ``sliding`` (real tokens within
    ``window`` positions either side, ``|q - k| <= window``, as transformers'
    ``sliding_window_bidirectional_overlay``), or ``causal`` (real tokens at or before the query; with a
    ``window``, only the ``window - 1`` before it, as ``sliding_window_causal_mask_function``). Causal masks
    depend on the KV cache, so decoders build them with ``flodl_hf.core.decoder.causal_mask``."""

    kind: str = "padding"
    window: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("padding", "sliding", "causal"):
            raise ValueError(f"mask kind {self.kind!r}: expected padding, sliding or causal")
        if self.kind == "causal":
            return
        if (self.kind == "sliding") != (self.window is not None):
            raise ValueError("a sliding mask needs a window; a padding mask takes none")


PADDING = MaskSpec()


def _as_impl(keep: torch.Tensor, impl: str, dtype: torch.dtype) -> torch.Tensor:
    if impl == "sdpa":
        return keep
    return torch.where(keep, torch.tensor(0.0, dtype=dtype, device=keep.device),
                       torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=keep.device))


def build_mask(attention_mask: torch.Tensor | None, spec: MaskSpec, impl: str, dtype: torch.dtype,
               length: int, device: torch.device | None = None) -> torch.Tensor | None:
    """One layer's mask in the form its attention path takes, or None when it masks nothing.

    sdpa: bool, True = attend. eager: additive float with ``finfo.min`` where masked, as
    ``transformers.masking_utils`` builds it. Padding alone is (B, 1, 1, S); a window makes it (B, 1, S, S).
    """
    if attention_mask is not None and attention_mask.dim() == 4:  # already prepared by the caller
        return attention_mask
    if spec.kind == "causal":
        raise ValueError("a causal mask depends on the KV cache: build it with flodl_hf.core.decoder.causal_mask")
    keep = None
    if attention_mask is not None:
        keep = attention_mask.bool()
        if bool(keep.all()):
            keep = None
        else:
            keep = keep[:, None, None, :]
    if spec.kind == "sliding" and length > spec.window:
        device = device if attention_mask is None else attention_mask.device
        pos = torch.arange(length, device=device)
        band = ((pos[:, None] - pos[None, :]).abs() <= spec.window)[None, None]
        keep = band if keep is None else keep & band
    if keep is None:
        return None
    return _as_impl(keep, impl, dtype)


def build_masks(attention_mask: torch.Tensor | None, specs: Sequence[MaskSpec], impl: str, dtype: torch.dtype,
                length: int, device: torch.device | None = None) -> list[torch.Tensor | None]:
    """Every layer's mask, each distinct spec built once (layers with the same spec share one tensor)."""
    built: dict[MaskSpec, torch.Tensor | None] = {}
    for spec in specs:
        if spec not in built:
            built[spec] = build_mask(attention_mask, spec, impl, dtype, length, device)
    return [built[spec] for spec in specs]


def extended_attention_mask(attention_mask: torch.Tensor | None, impl: str, dtype: torch.dtype) -> torch.Tensor | None:
    """The 2-D padding mask in the form each attention path takes, or None when nothing is padded."""
    length = attention_mask.shape[-1] if attention_mask is not None else 0
    return build_mask(attention_mask, PADDING, impl, dtype, length)


# The attention weights an ``output_attentions=True`` call is collecting (thread and task safe); None otherwise.
_ATTENTIONS: ContextVar[list | None] = ContextVar("flodl_hf_attentions", default=None)


def record_attention(weights: torch.Tensor) -> None:
    """Hand one layer's attention probabilities, (B, heads, q, k) after dropout as transformers returns them,
    to the ``output_attentions=True`` call in progress; nothing otherwise. The contract for a family that
    computes its own eager attention (not through ``attend``): call this once per layer application."""
    sink = _ATTENTIONS.get()
    if sink is not None:
        sink.append(weights)


@contextmanager
def recording_attentions() -> Iterator[list[torch.Tensor]]:
    """The list every ``record_attention`` inside this context appends to, in call order."""
    sink: list[torch.Tensor] = []
    token = _ATTENTIONS.set(sink)
    try:
        yield sink
    finally:
        _ATTENTIONS.reset(token)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, impl: str,
           dropout_p: float = 0.0, scaling: float | None = None) -> torch.Tensor:
    """Scaled dot-product attention over (B, heads, S, head_dim) in HF's op order; returns (B, S, heads*head_dim)."""
    if scaling is None:
        scaling = q.size(-1) ** -0.5
    if impl == "sdpa":
        # transformers.integrations.sdpa_attention.sdpa_attention_forward
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scaling)
    else:
        # transformers.models.bert.modeling_bert.eager_attention_forward: (qk^T * s) + mask, softmax, @ v
        weights = torch.matmul(q, k.transpose(2, 3)) * scaling
        if mask is not None:
            weights = weights + mask
        weights = F.softmax(weights, dim=-1)
        if dropout_p:
            weights = F.dropout(weights, p=dropout_p, training=True)
        record_attention(weights)
        out = torch.matmul(weights, v)
    out = out.transpose(1, 2).contiguous()
    return out.reshape(*out.shape[:2], -1)


def split_heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(B, S, H) -> (B, heads, S, head_dim) as a view, exactly as HF's ``view(...).transpose(1, 2)``."""
    return x.view(*x.shape[:-1], -1, head_dim).transpose(1, 2)


class Conv1D(nn.Module):
    """transformers.pytorch_utils.Conv1D: a linear layer whose weight is stored (in, out), run as
    ``addmm(bias, x.view(-1, in), weight)`` (``F.linear`` on the transposed weight may round differently).
    ``fan_in_fan_out``: LoRA adapts it as PEFT adapts a Conv1D (flodl_hf.lora.LoraConv1D)."""

    fan_in_fan_out: ClassVar[bool] = True

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


@dataclass(frozen=True)
class Draw:
    """A ``fresh_init`` rule for a weight its family's ``_init_weights`` draws with a spread of its own: normal(0,
    ``std``), truncated at ``cutoff`` x ``std`` either side where ``cutoff`` is given (``trunc_normal_``). GPT-2's
    residual projections (``initializer_range / sqrt(2 n_layer)``), ModernBERT's truncated normals per layer kind.
    A drawn embedding table keeps no zero padding row (the family's draw comes after the default's)."""

    std: float
    cutoff: float | None = None


def fresh_rule(module: nn.Module, name: str) -> "str | Draw":
    """How transformers' ``_init_weights`` starts a module's parameter ``name``: "normal" (at
    ``initializer_range``), "ones", "zeros", or a ``Draw``. A module's ``fresh_init`` ({name: rule}) says where its
    family's ``_init_weights`` differs from the default (Mixtral's router and stacked experts: normal; Gemma's
    (1 + w) RMSNorm: zeros; GPT-2's ``c_proj`` and ModernBERT's layers: a ``Draw``); otherwise nn.Linear's,
    nn.Conv1d's, Conv1D's and nn.Embedding's weights are drawn and their biases zero, nn.LayerNorm's weight is one
    and bias zero, and, as ``PreTrainedModel._init_weights``, any other module whose class name holds "LayerNorm"
    or "RMSNorm" starts its weight at one and its bias at zero, and any other bare parameter (an LM head's output
    bias) at zero."""
    rule = getattr(module, "fresh_init", {}).get(name)
    if rule is not None:
        return rule
    if isinstance(module, (nn.Linear, nn.Conv1d, Conv1D, nn.Embedding)):
        return "normal" if name == "weight" else "zeros"
    norm = isinstance(module, nn.LayerNorm) or "LayerNorm" in type(module).__name__ or "RMSNorm" in type(module).__name__
    return "ones" if norm and name == "weight" else "zeros"


def init_fresh_parameter(tensor: torch.Tensor, rule: "str | Draw", std: float) -> None:
    if isinstance(rule, Draw):
        if rule.cutoff is None:
            tensor.normal_(mean=0.0, std=rule.std)
        else:
            nn.init.trunc_normal_(tensor, mean=0.0, std=rule.std, a=-rule.cutoff * rule.std,
                                  b=rule.cutoff * rule.std)
    elif rule == "normal":
        tensor.normal_(mean=0.0, std=std)
    else:
        tensor.fill_(1.0 if rule == "ones" else 0.0)


def init_fresh_module_parameter(module: nn.Module, name: str, std: float) -> None:
    """One parameter of ``module`` as transformers' ``_init_weights`` starts it (``fresh_rule``); an embedding's
    padding row at zero after the default draw, as ``nn.Embedding``'s."""
    tensor = getattr(module, name)
    rule = fresh_rule(module, name)
    init_fresh_parameter(tensor, rule, std)
    if rule == "normal" and isinstance(module, nn.Embedding) and module.padding_idx is not None:
        tensor[module.padding_idx].zero_()


@torch.no_grad()
def init_weights(module: nn.Module, std: float) -> None:
    """transformers' ``_init_weights`` for fresh (not loaded) modules. A parameter shared by two modules (an LM
    head's decoder tied to the input embeddings) is started once, by the embedding holding it (transformers marks
    a parameter initialised and skips it after), so a tied table keeps its padding row at zero and ModernBERT's
    its embedding draw, whichever module a task model registers first."""
    done: set[int] = set()
    for sub in sorted(module.modules(), key=lambda m: not isinstance(m, nn.Embedding)):  # stable: embeddings first
        for name, param in sub.named_parameters(recurse=False):
            if id(param) not in done:
                done.add(id(param))
                init_fresh_module_parameter(sub, name, std)
    for sub in module.modules():  # a family's own _init_weights step, after the defaults (DistilBERT's sinusoids)
        if hasattr(sub, "init_fresh_weights"):
            sub.init_fresh_weights(std)


# ---- computing a per-token head on some rows only -----------------------------------------------------
#
# A per-token head (an LM head: dense, activation, LayerNorm, a vocabulary-wide decoder) run on the few rows
# a task reads gives the same bits as on every row only if the BLAS computes each row the same way in the
# small product as in the full one. It does not always: the kernel is picked by shape, and which shapes
# agree depends on the CPU. Measured with F.linear, K 768, N 30522, 2 threads: on an AMD EPYC, gathered row
# counts 1-3, 5-7 and 9-11 differed from the full product; on an Intel Xeon (AVX-512), 1-9 and 12 did
# (8 included). So no row-count rule is written here. Instead each shape class (the full product's rows,
# the gathered rows, the head, its widths, dtype, device and thread count) is proven on the machine at
# hand, once per process, on real data, before the shortcut is taken for it:
#
# - the first two times a class is seen, the full head runs (it is the answer);
# - the third time, the full head runs again and the gathered path is checked against it on every row,
#   at two alignments (see ``_prove``: about two more full heads); the verdict is cached;
# - from then on the class takes the shortcut only if it was proven equal, else the full head runs.
#
# A proof pays for itself after two or three more batches of its class, so only a class that has
# recurred is proven: a workload whose shapes never repeat runs the full head at no extra cost.
#
# Opt-in fast precisions claim no exactness and take the shortcut unconditionally.

ROW_MULTIPLE = 8        # gathered rows are padded to a multiple of this (fewer distinct shape classes)
PROVE_AT_SIGHTING = 3   # a class is proven the third time it is seen (see above)


class RowProofs:
    """Per-process verdicts: is the head on gathered rows bit-equal to the full head, for this shape class?"""

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self.verdicts: dict[tuple, bool] = {}
        self.sightings: dict[tuple, int] = {}

    def clear(self) -> None:
        self.verdicts.clear()
        self.sightings.clear()

    def summary(self) -> dict[str, int]:
        proven = sum(self.verdicts.values())
        return {"classes_seen": len(self.sightings) + len(self.verdicts), "proven_equal": proven,
                "proven_different": len(self.verdicts) - proven}


ROW_PROOFS = RowProofs()


def shape_class(head: nn.Module, hidden: torch.Tensor, gathered_rows: int) -> tuple:
    """What decides the kernels of a head on ``hidden`` (.., H): the full and gathered row counts, the
    head's parameter shapes, dtype, device and thread count."""
    widths = tuple(tuple(p.shape) for p in head.parameters())
    full_rows = hidden.numel() // hidden.shape[-1]
    return (type(head).__qualname__, widths, full_rows, gathered_rows, hidden.dtype, hidden.device.type,
            torch.get_num_threads())


def padded_count(n: int) -> int:
    """``n`` gathered rows rounded up to a multiple of ``ROW_MULTIPLE`` (at least one block)."""
    return -(-max(n, 1) // ROW_MULTIPLE) * ROW_MULTIPLE


def _prove(run: Callable[[torch.Tensor], torch.Tensor], flat: torch.Tensor, full: torch.Tensor, m: int) -> bool:
    """Whether ``run`` on blocks of ``m`` rows of ``flat`` gives ``full`` (the head on every row), row for row.

    Every row is checked twice: in blocks aligned at row 0 (row r at block position r mod m) and shifted
    by one (position (r+1) mod m). If a row's bits depend only on its position in its product, the two
    together mean every full-product row equals every block position: the first pass ties each full row to
    one block position, the second ties neighbouring block positions to each other.
    """
    rows = flat.shape[0]
    for shift in (0, 1):
        order = torch.cat([torch.zeros(shift, dtype=torch.long), torch.arange(rows)])
        for start in range(0, order.numel(), m):
            index = order[start:start + m].to(flat.device)
            if index.numel() < m:
                index = torch.cat([index, index.new_zeros(m - index.numel())])
            if not torch.equal(run(flat.index_select(0, index)), full.index_select(0, index)):
                return False
    return True


def gather_rows(head: Callable[..., torch.Tensor], module: nn.Module, hidden: torch.Tensor,
                 flat_index: torch.Tensor, full: Callable[[], torch.Tensor], exact: bool = True,
                 proofs: RowProofs | None = None) -> torch.Tensor:
    """``full().reshape(-1, V)[flat_index]`` — the head's outputs at some rows of ``hidden`` (.., H) — computed
    on those rows only where that was proven bit-equal on this machine for this shape class.

    ``head(rows_2d)`` runs the head on (N, H) rows; ``full()`` runs it on the whole of ``hidden``.
    With ``exact=False`` (fast precisions) the rows are gathered unconditionally.
    """
    proofs = ROW_PROOFS if proofs is None else proofs
    flat = hidden.reshape(-1, hidden.shape[-1])
    n = flat_index.numel()
    if not exact:
        return head(flat.index_select(0, flat_index))
    m = padded_count(n)
    if m >= flat.shape[0]:  # nothing to save
        return _rows_of(full(), flat_index)
    key = shape_class(module, hidden, m)
    verdict = proofs.verdicts.get(key)
    if verdict:
        index = torch.cat([flat_index, flat_index.new_zeros(m - n)]) if m > n else flat_index
        return head(flat.index_select(0, index))[:n]
    out = full()
    if verdict is None:
        seen = proofs.sightings.get(key, 0) + 1
        if seen >= PROVE_AT_SIGHTING:
            proofs.sightings.pop(key, None)
            if len(proofs.verdicts) < proofs.limit:
                proofs.verdicts[key] = _prove(head, flat, out.reshape(flat.shape[0], -1), m)
        elif len(proofs.sightings) < proofs.limit:
            proofs.sightings[key] = seen
    return _rows_of(out, flat_index)


def _rows_of(out: torch.Tensor, flat_index: torch.Tensor) -> torch.Tensor:
    return out.reshape(-1, out.shape[-1]).index_select(0, flat_index)


# ---- rotary position embeddings -----------------------------------------------------------------------

class LazyBuffers:
    """Tensors that transformers keeps in non-persistent float32 buffers (RoPE's inverse frequencies per key, a
    layer kind, or one key; Gemma's embedding scale), made by ``make(key, device)`` at first use, so a meta build
    holds none. Those buffers follow ``model.to(dtype)``, ``.half()`` and ``.bfloat16()``, which round them, and a
    later ``.float()`` keeps the rounding: the module holding a LazyBuffers hands it every cast
    (:func:`cast_lazy_buffers` in its ``_apply``; ``Backbone`` does), which does as those buffers do."""

    def __init__(self, make: Callable[[object, torch.device | None], torch.Tensor], keys: Sequence = (None,)) -> None:
        self._make, self._keys, self._made = make, tuple(dict.fromkeys(keys)), {}

    def __call__(self, key: object = None, device: torch.device | None = None) -> torch.Tensor:
        if key not in self._made:
            self._made[key] = self._make(key, device)
        return self._made[key]

    def apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for key in self._keys:
            self._made[key] = fn(self(key))


def cast_lazy_buffers(module: torch.nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """``module._apply``'s cast (dtype or device) on each LazyBuffers among the module's own attributes."""
    for value in list(vars(module).values()):
        if isinstance(value, LazyBuffers):
            value.apply(fn)


def rope_inverse_frequencies(theta: float, head_dim: int, device: torch.device | None = None) -> torch.Tensor:
    """Default RoPE inverse frequencies, as transformers' ``compute_default_rope_parameters``:
    ``1 / theta ** (arange(0, d, 2) / d)`` in float32."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim))


def rope_cos_sin(inv_freq: torch.Tensor, position_ids: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (B, S, head_dim), as the rotary modules' forward computes them (default RoPE,
    whose attention scaling is 1.0 and multiplies nothing)."""
    freqs = position_ids[..., None].float() * inv_freq.to(device=position_ids.device, dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb`` on (B, heads, S, head_dim), computed in float32."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q_embed = (q.float() * cos) + (rotate_half(q.float()) * sin)
    k_embed = (k.float() * cos) + (rotate_half(k.float()) * sin)
    return q_embed.to(q.dtype), k_embed.to(k.dtype)
