"""The adapted layers: :class:`LoraLinear` and :class:`LoraConv1D` (LoRA on a linear / Conv1D layer),
:class:`LoraParameters` (LoRA on Parameters, an MoE's stacked experts) and the trainable-token layers
(:class:`TrainableTokensEmbedding`, :class:`TrainableTokensLinear`, :class:`TiedTrainableTokensLinear`), each PEFT's
arithmetic op for op."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flodl_hf.core.errors import AdapterError, UnsupportedAdapterError
from flodl_hf.core.layers import LazyBuffers, cast_lazy_buffers

# The adapter dtype rule of PEFT's cast_adapter_dtype (autocast_adapter_dtype=True, its default): adapter weights
# built on a base of one of these dtypes are upcast to float32 (peft.utils.constants.UPCAST_DTYPES adds float8s).
_UPCAST_DTYPES = frozenset(d for d in (torch.float16, torch.bfloat16, *(getattr(torch, n, None) for n in (
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu"))) if d is not None)
_FLOAT8_DTYPES = _UPCAST_DTYPES - {torch.float16, torch.bfloat16}


def _lora_factors(in_features: int, out_features: int, rank: int, weight: torch.Tensor,
                  lora_bias: bool = False) -> tuple[nn.Linear, nn.Linear]:
    """PEFT's ``LoraLayer.update_layer`` + ``reset_lora_parameters``, RNG draws included: ``lora_A``
    ``nn.Linear(in, rank)`` then ``lora_B`` ``nn.Linear(rank, out)`` (each draws its own default init), then A
    ``kaiming_uniform_(a=sqrt(5))``, B zeros; then ``_move_adapter_to_device_of_base_layer``: to the device and
    dtype of the adapted ``weight`` (a floating one). The caller upcasts a half / bfloat16 / float8 adapter to
    float32 after that (``cast_adapter_dtype``), so the values are float32(base_dtype(init)), as PEFT's are."""
    lora_a = nn.Linear(in_features, rank, bias=False)
    lora_b = nn.Linear(rank, out_features, bias=lora_bias)
    nn.init.kaiming_uniform_(lora_a.weight, a=math.sqrt(5))
    nn.init.zeros_(lora_b.weight)
    if lora_bias:
        nn.init.zeros_(lora_b.bias)
    if weight.is_floating_point():
        lora_a.to(device=weight.device, dtype=weight.dtype)
        lora_b.to(device=weight.device, dtype=weight.dtype)
    return lora_a, lora_b


def _lowrank_delta(a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """PEFT's ``lora.Linear.get_delta_weight``: ``(B @ A) * scaling`` (a half / bfloat16 adapter on the CPU in
    float32, cast back)."""
    cast = b.device.type == "cpu" and b.dtype in (torch.float16, torch.bfloat16)
    delta = (b.float() @ a.float() if cast else b @ a) * scaling
    return delta.to(b.dtype) if cast else delta


class LoraLinear(nn.Linear):
    """A linear layer with a LoRA adapter; ``weight`` and ``bias`` stay the same Parameters, under the same keys."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float, use_rslora: bool,
                 use_dora: bool = False, lora_bias: bool = False) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = self.features(base)
        self.weight = base.weight
        self.bias = base.bias
        self.r, self.lora_alpha = r, alpha
        self.scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
        self.lora_dropout = nn.Dropout(p=dropout) if dropout > 0.0 else nn.Identity()
        dtype = base.weight.dtype
        self.lora_A, self.lora_B = _lora_factors(self.in_features, self.out_features, r, base.weight, lora_bias)
        self.use_dora = use_dora
        if use_dora:
            # DoraLinearVariant.init -> DoraLinearLayer.update_layer, after the move to the base's dtype: the
            # magnitude is the row norm of W + scaling * (B @ A) (B is zero here), in the weight's dtype
            a, b = self.lora_A.weight.detach(), self.lora_B.weight.detach()
            half = a.dtype == torch.float16
            lora_weight = b.float() @ a.float() if half else b @ a
            lora_weight = lora_weight.half() if half else lora_weight
            self.lora_magnitude_vector = nn.Parameter(self._weight_norm(self.weight.detach(), lora_weight,
                                                                        self.scaling))
        if base.weight.is_floating_point() and dtype in _UPCAST_DTYPES:
            self.lora_A.to(dtype=torch.float32)
            self.lora_B.to(dtype=torch.float32)
            if use_dora:
                self.lora_magnitude_vector.data = self.lora_magnitude_vector.data.float()
        self.merged = False
        self._merged_norm: torch.Tensor | None = None  # DoRA: the weight norm of the merge, for unmerge

    def _weight_norm(self, weight: torch.Tensor, lora_weight: torch.Tensor, scaling: float) -> torch.Tensor:
        """DoraLinearLayer.get_weight_norm: the L2 norm of each output row of ``weight + scaling * lora_weight``,
        ``weight`` in the layer's layout (:meth:`_oriented` to (out, in)), ``lora_weight`` in (out, in)."""
        weight = self._oriented(weight) + scaling * lora_weight
        return torch.linalg.norm(weight, dim=1).to(weight.dtype)

    def _oriented(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor in the layer's weight layout seen in nn.Linear's (out, in) one, and back: PEFT's
        ``transpose(tensor, fan_in_fan_out)``, the identity here (:class:`LoraConv1D` transposes)."""
        return tensor

    @staticmethod
    def features(base: nn.Module) -> tuple[int, int]:
        return base.in_features, base.out_features

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def unloaded(self) -> nn.Module:
        """The plain layer again, holding this one's (merged) weight and bias."""
        plain = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        plain.weight, plain.bias = self.weight, self.bias
        return plain

    def delta_weight(self) -> torch.Tensor:
        """PEFT's ``get_delta_weight``: ``(B @ A) * scaling`` (a half / bfloat16 adapter on the CPU in float32,
        cast back)."""
        return _lowrank_delta(self.lora_A.weight, self.lora_B.weight, self.scaling)

    @torch.no_grad()
    def merge(self) -> None:
        """W += delta, in place (PEFT's unsafe merge, the default of ``merge_and_unload``); DoRA's
        (``DoraLinearVariant.merge_unsafe``): W = magnitude / ||W + delta||_row * (W + delta); with ``lora_bias``,
        b += lora_B.bias * scaling."""
        if self.merged:
            return
        if self.lora_B.bias is not None:
            if self.bias is None:  # PEFT: "Impossible to merge LoRA with `lora_bias=True` ..." (a RuntimeError)
                raise AdapterError(f"{type(self).__name__} with lora_bias=True on a layer without a bias: its lora_B "
                                   "bias has nowhere to merge into; keep the adapter unmerged")
            self.bias.data += self.lora_B.bias * self.scaling
        if self.use_dora:
            delta = self.delta_weight()
            self._merged_norm = self._weight_norm(self.weight, self._oriented(delta), scaling=1).detach()
            factor = self._oriented((self.lora_magnitude_vector / self._merged_norm).view(-1, 1))
            self.weight.data = (factor * (self.weight.data + delta)).to(self.weight.dtype)
        else:
            self.weight.data += self.delta_weight()
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        if not self.merged:
            return
        if self.use_dora:  # DoraLinearVariant.unmerge: W / factor - delta, with the norm of the merge
            factor = self._oriented((self.lora_magnitude_vector / self._merged_norm).view(-1, 1))
            self.weight.data = (self.weight.data / factor - self.delta_weight()).to(self.weight.dtype)
            self._merged_norm = None
        else:
            self.weight.data -= self.delta_weight().to(self.weight.dtype)
        if self.lora_B.bias is not None:
            self.bias.data -= self.lora_B.bias * self.scaling
        self.merged = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # peft.tuners.lora.layer.Linear.forward: result = base_layer(x); x cast to lora_A's dtype; result +
        # lora_B(lora_A(dropout(x))) * scaling (a float32 adapter promotes the sum), cast back to result's dtype.
        result = self.base_forward(x)
        if self.merged:
            return result
        result_dtype = result.dtype
        lora_dtype = self.lora_A.weight.dtype
        if x.dtype != lora_dtype:
            x = x.to(lora_dtype)
        if self.use_dora:
            result = result + self._dora(x, result)
        else:
            result = result + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling
        return result.to(result_dtype)

    def _dora(self, x: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
        # DoraLinearVariant.forward then DoraLinearLayer.forward, op for op: the base result is reused unless
        # dropout is live (then x is dropped out and the base product recomputed without bias); the norm is detached
        if isinstance(self.lora_dropout, nn.Identity) or not self.training:
            base_result = result
        else:
            x = self.lora_dropout(x)
            base_result = None
        a = self.lora_A.weight
        x_eye = torch.eye(a.shape[1], device=a.device, dtype=a.dtype)
        lora_weight = self.lora_B(self.lora_A(x_eye)).T.to(x.dtype)
        weight = self.weight.to(x.dtype)
        weight_norm = self._weight_norm(weight, lora_weight.detach(), self.scaling).detach()
        mag_norm_scale = (self.lora_magnitude_vector / weight_norm).view(1, -1)
        lora_result = self.lora_B(self.lora_A(x))
        if base_result is not None:
            if self.bias is not None:
                base_result = base_result - self.bias
        else:
            base_result = F.linear(x, self._oriented(weight))
        return (mag_norm_scale - 1) * base_result + mag_norm_scale * lora_result * self.scaling

    def extra_repr(self) -> str:
        dora = ", use_dora=True" if self.use_dora else ""
        dora += ", lora_bias=True" if self.lora_B.bias is not None else ""
        return f"{super().extra_repr()}, r={self.r}, scaling={self.scaling}{dora}, merged={self.merged}"


class LoraConv1D(LoraLinear):
    """LoRA on a ``Conv1D`` layer (a module declaring ``fan_in_fan_out = True``, as GPT-2's: weight stored (in, out),
    run as ``addmm(bias, x, weight)``): PEFT's ``lora.Linear`` with ``fan_in_fan_out``, which PEFT sets for every
    Conv1D target whatever the config says: the base layer's own forward, A ``[r, in]`` and B ``[out, r]`` as on a
    linear layer, the delta ``transpose(B @ A) * scaling`` to merge into the (in, out) weight. DoRA is
    :class:`LoraLinear`'s with the weight read through its transpose (:meth:`_oriented`), as PEFT's
    ``DoraLinearLayer`` and ``DoraLinearVariant`` read it with ``fan_in_fan_out``: the magnitude and the weight norm
    per output column of the (in, out) weight, the dropped-out base product ``x @ W``, the merge factor ``[1, out]``."""

    def __init__(self, base: nn.Module, r: int, alpha: float, dropout: float, use_rslora: bool,
                 use_dora: bool = False, lora_bias: bool = False) -> None:
        super().__init__(base, r, alpha, dropout, use_rslora, use_dora, lora_bias)
        object.__setattr__(self, "_base", base)  # not registered: unloading puts it back

    @staticmethod
    def features(base: nn.Module) -> tuple[int, int]:
        return tuple(base.weight.shape)  # (in, out), as PEFT reads a Conv1D's

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        # transformers.pytorch_utils.Conv1D.forward
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(x.size()[:-1] + (self.out_features,))

    def unloaded(self) -> nn.Module:
        self._base.weight, self._base.bias = self.weight, self.bias
        return self._base

    def delta_weight(self) -> torch.Tensor:
        return super().delta_weight().T  # transpose(B @ A, fan_in_fan_out) * scaling: the same bits

    def _oriented(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.T


class LoraParameters(nn.Module):
    """LoRA on some of a module's own Parameters (PEFT's ``target_parameters``, its ``lora.ParamWrapper``): the
    main use is an MoE's stacked experts, ``gate_up_proj`` (experts, 2 x intermediate, hidden) and ``down_proj``.

    It takes the module's place and registers the module's own Parameters, buffers and children under their names,
    so every base key stays where it was; the module itself is kept unregistered and runs the forward, with each
    adapted Parameter read as its adapted value. Per adapted Parameter ``name``: ``lora_A[name]``
    ``nn.Linear(in, r x experts)`` and ``lora_B[name]`` ``nn.Linear(r x experts, out)``, PEFT's init and RNG draws
    (:func:`_lora_factors`). A 3-D Parameter is (experts, out, in), or (experts, in, out) on a module declaring
    ``is_transposed = True``; a 2-D one is (out, in), one expert. Expert ``e`` uses rows ``e*r .. e*r + r - 1`` of A
    and columns ``e, e + experts, ...`` of B (PEFT's reshapes). The adapted value, PEFT's ``_activate_lora`` op for
    op: with several experts, ``baddbmm(W, lhs, rhs, alpha=scaling)`` of the per-expert factors
    (``_LoraFactorsProxy``, autocast off); with one, ``W + delta`` (``_LoraParameterProxy``; a float8 W added in the
    delta's dtype, clamped, cast back). PEFT substitutes the value with ``torch.nn.utils.parametrize`` for the
    base layer's forward; here the Parameter is set aside and the value put in its place for the module's forward:
    the same tensor, the same graph. The merge adds ``delta_weight`` (PEFT's ``get_delta_weight``: an einsum of the
    factors times scaling) in place. PEFT nests one wrapper per Parameter, the first in ``named_parameters`` order
    innermost, so its file names them ``<module>.base_layer.lora_A.weight`` ... by that depth (:func:`_to_hf`)."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        for name, param in base._parameters.items():
            self.register_parameter(name, param)
        for name, buffer in base._buffers.items():
            self.register_buffer(name, buffer, persistent=name not in base._non_persistent_buffers_set)
        for name, child in base._modules.items():
            self.add_module(name, child)
        self.lora_A = nn.ModuleDict()
        self.lora_B = nn.ModuleDict()
        self.scaling: dict[str, float] = {}
        self.experts: dict[str, int] = {}
        self.swapped: dict[str, bool] = {}   # PEFT's _did_swap_in_out_features: a 3-D (experts, out, in) Parameter
        self.merged = False
        object.__setattr__(self, "_base", base)  # not registered: its Parameters, buffers and children are ours

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if "_base" not in self.__dict__:
                raise
            return getattr(self.__dict__["_base"], name)  # the module's other attributes (num_experts, act ...)

    def adapt(self, name: str, r: int, alpha: float, use_rslora: bool) -> None:
        """Put an adapter on Parameter ``name`` (PEFT's ``ParamWrapper.__init__`` and ``update_layer``)."""
        param = self._parameters[name]
        if param.dim() == 3:
            experts, in_features, out_features = param.shape
            self.swapped[name] = not getattr(self._base, "is_transposed", False)
            if self.swapped[name]:
                in_features, out_features = out_features, in_features
        elif param.dim() == 2:
            experts, in_features, out_features = 1, param.shape[1], param.shape[0]
            self.swapped[name] = False
        else:
            raise UnsupportedAdapterError(f"target_parameters: {name} is a {param.dim()}-D Parameter; LoRA adapts "
                                          "2-D and 3-D Parameters only (as PEFT)")
        self.experts[name] = experts
        self.scaling[name] = alpha / math.sqrt(r) if use_rslora else alpha / r
        self.lora_A[name], self.lora_B[name] = _lora_factors(in_features, out_features, r * experts, param)
        if param.is_floating_point() and param.dtype in _UPCAST_DTYPES:
            self.lora_A[name].to(dtype=torch.float32)
            self.lora_B[name].to(dtype=torch.float32)

    def unloaded(self) -> nn.Module:
        return self._base

    def delta_weight(self, name: str) -> torch.Tensor:
        """PEFT's ``ParamWrapper.get_delta_weight``: one expert, ``(B @ A) * scaling``; several, the einsum of
        A (experts, r, in) and B (out, r, experts) into the Parameter's layout, times scaling; in the
        Parameter's dtype (float32 for a float8 one)."""
        a, b = self.lora_A[name].weight, self.lora_B[name].weight
        experts = self.experts[name]
        if experts == 1:
            delta = _lowrank_delta(a, b, self.scaling[name])
        else:
            a = a.reshape(experts, -1, a.shape[-1])
            b = b.reshape(b.shape[0], -1, experts)
            pattern = "o r e, e r i -> e o i" if self.swapped[name] else "o r e, e r i -> e i o"
            delta = torch.einsum(pattern, b, a) * self.scaling[name]
        param = self._parameters[name]
        if param.dtype in (torch.float16, torch.bfloat16, torch.float32):  # PEFT's ALLOWED_COMPUTE_DTYPES
            return delta.to(param.device, param.dtype)
        return delta.to(param.device)

    def adapted(self, name: str) -> torch.Tensor:
        """The Parameter as the module's forward reads it: W plus the adapter (PEFT's ``_activate_lora``)."""
        weight = self._parameters[name]
        float8 = weight.dtype in _FLOAT8_DTYPES   # PEFT's UPCAST_DTYPES: the float8s
        experts = self.experts[name]
        if experts > 1 and not float8:
            # ParamWrapper.get_delta_factors: A as (experts, r, in), B as (experts, out, r)
            a, b = self.lora_A[name].weight, self.lora_B[name].weight
            a = a.reshape(experts, -1, a.shape[-1])
            b = b.reshape(b.shape[0], -1, experts).permute(2, 0, 1)
            lhs, rhs = (b, a) if self.swapped[name] else (a.transpose(-2, -1), b.transpose(-2, -1))
            with torch.autocast(device_type=weight.device.type, enabled=False):
                return torch.baddbmm(weight, lhs.to(weight.dtype), rhs.to(weight.dtype), alpha=self.scaling[name])
        delta = self.delta_weight(name)
        if float8:  # _LoraParameterProxy._low_prec_add
            info = torch.finfo(weight.dtype)
            return (weight.to(delta.dtype) + delta).clamp(min=info.min, max=info.max).to(weight.dtype)
        return weight + delta

    @torch.no_grad()
    def merge(self) -> None:
        """W += delta, in place, for each adapted Parameter (PEFT's unsafe merge)."""
        if self.merged:
            return
        for name in self.lora_A:
            self._parameters[name].data += self.delta_weight(name)
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        if not self.merged:
            return
        for name in self.lora_A:
            param = self._parameters[name]
            param.data -= self.delta_weight(name).to(param.dtype)
        self.merged = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        base = self._base
        if self.merged:
            return base(*args, **kwargs)
        values = {name: self.adapted(name) for name in self.lora_A}
        originals = {name: base._parameters.pop(name) for name in values}
        try:
            base.__dict__.update(values)  # a plain attribute: the module reads the adapted value
            return base(*args, **kwargs)
        finally:
            for name, param in originals.items():
                del base.__dict__[name]
                base._parameters[name] = param

    def extra_repr(self) -> str:
        adapters = ", ".join(f"{n}: r={self.lora_A[n].out_features // self.experts[n]}, experts={self.experts[n]}, "
                             f"scaling={self.scaling[n]}" for n in self.lora_A)
        return f"{type(self._base).__name__}, {adapters}, merged={self.merged}"


class _TokenRows:
    """The rows of ``self.weight`` that PEFT's ``TrainableTokensLayer`` trains: a trainable
    ``trainable_tokens_delta`` ``[n, dim]``, initialised to those rows (``init_weights=True``), the originals kept
    (not saved) for ``unmerge``. On a half / bfloat16 / float8 base the delta is float32, as PEFT's
    ``cast_adapter_dtype`` leaves it, and cast to the weight's dtype where it is used."""

    def _init_rows(self, token_indices: list[int]) -> None:
        self.token_indices = list(token_indices)
        rows = self.weight.detach()[self.token_indices].clone()   # TrainableTokensLayer.update_layer
        if rows.is_floating_point() and rows.dtype in _UPCAST_DTYPES:
            rows = rows.float()
        self.trainable_tokens_delta = nn.Parameter(rows.clone())
        self.register_buffer("trainable_tokens_original", rows, persistent=False)
        self.merged = False

    def _rows(self) -> "_TokenRows":
        """The layer holding the rows: this one (a tied layer reads its embedding's)."""
        return self

    def _index(self, device: torch.device) -> torch.Tensor:
        return torch.tensor(self._rows().token_indices, device=device)

    def merged_weight(self) -> torch.Tensor:
        """``TrainableTokensLayer.get_merged_weights``: the base weight with the listed rows replaced by the delta."""
        w = self.weight
        return w.index_copy(0, self._index(w.device), self._rows().trainable_tokens_delta.to(w))

    @torch.no_grad()
    def merge(self) -> None:
        """``TrainableTokensLayer.merge``: the listed rows of the base weight become the delta's values."""
        if not self.merged:
            self.weight.data = self.weight.data.index_copy(0, self._index(self.weight.device),
                                                           self._rows().trainable_tokens_delta.to(self.weight))
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """``TrainableTokensLayer.unmerge``: the original rows written back."""
        if self.merged:
            self.weight.data.index_copy_(0, self._index(self.weight.device),
                                         self._rows().trainable_tokens_original.to(self.weight))
            self.merged = False


class TrainableTokensEmbedding(_TokenRows, nn.Embedding):
    """PEFT's ``trainable_token_indices`` on an embedding (``TrainableTokensWrapper`` around a
    ``TrainableTokensLayer``): the base ``weight`` stays the same frozen Parameter under its key; the listed rows
    are the trainable delta (:class:`_TokenRows`), and the forward looks tokens up in the base weight with those
    rows replaced (``W.index_copy(0, ids, delta)``, ``get_merged_weights``), so only the listed rows get
    gradients. A scaled embedding (Gemma's, whose ``embed_scale`` multiplies the lookup) keeps its scale: PEFT's
    ``_get_embed_scale``, the lookup times the scale cast to the result's dtype, as transformers'
    ``*ScaledWordEmbedding.forward``."""

    def __init__(self, base: nn.Embedding, token_indices: list[int]) -> None:
        nn.Module.__init__(self)
        object.__setattr__(self, "_base", base)  # not registered: unloading puts it back
        scale = getattr(base, "embed_scale", None)
        object.__setattr__(self, "_scale", scale if isinstance(scale, LazyBuffers) else None)
        self.num_embeddings, self.embedding_dim = base.num_embeddings, base.embedding_dim
        self.padding_idx, self.max_norm, self.norm_type = base.padding_idx, base.max_norm, base.norm_type
        self.scale_grad_by_freq, self.sparse = base.scale_grad_by_freq, base.sparse
        self.weight = base.weight
        self._init_rows(token_indices)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # TrainableTokensLayer.forward_adapters: merged, the base layer as it is; else F.embedding on the merged weight
        weight = self.weight if self.merged else self.merged_weight()
        result = F.embedding(x, weight, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq,
                             self.sparse)
        if self._scale is not None:
            result = result * self._scale(None, weight.device).to(result.dtype)
        return result

    def _apply(self, fn, recurse: bool = True):
        if self._scale is not None:  # the scale follows casts, as the scaled embedding's own _apply has it do
            cast_lazy_buffers(self._base, fn)
        return super()._apply(fn, recurse)

    def unloaded(self) -> nn.Module:
        """The embedding it wraps again, holding this one's (merged) weight."""
        self._base.weight = self.weight
        return self._base

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, trainable_token_indices={self.token_indices}, merged={self.merged}"


class TrainableTokensLinear(_TokenRows, nn.Linear):
    """PEFT's ``trainable_token_indices`` naming an output layer that is not tied to the input embeddings (an
    untied ``lm_head``: ``{"lm_head": ids}``): its own delta of the listed rows (:class:`_TokenRows`), saved as
    ``<layer>.token_adapter.trainable_tokens_delta``. The forward is PEFT's for a wrapped ``nn.Linear``:
    ``F.linear(x, merged weight)`` with no bias while unmerged (a biased layer, GPT-J's ``lm_head``, loses it, as in
    PEFT); merged, the base layer runs as it is."""

    def __init__(self, base: nn.Linear, token_indices: list[int]) -> None:
        nn.Module.__init__(self)
        object.__setattr__(self, "_base", base)  # not registered: unloading puts it back
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self._init_rows(token_indices)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merged:
            return F.linear(x, self.weight, self.bias)
        return F.linear(x, self.merged_weight())  # TrainableTokensLayer.forward_adapters, nn.Linear branch

    def unloaded(self) -> nn.Module:
        """The layer it wraps again, holding this one's (merged) weight and its bias."""
        self._base.weight, self._base.bias = self.weight, self.bias
        return self._base

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, trainable_token_indices={self.token_indices}, merged={self.merged}"


class TiedTrainableTokensLinear(TrainableTokensLinear):
    """An output layer tied to a :class:`TrainableTokensEmbedding` (the same weight: a tied ``lm_head``, BERT's MLM
    ``decoder``): PEFT wraps it too, in a ``TrainableTokensWrapper`` whose layer follows the embedding's
    (``tied_adapter``: the same delta, nothing of its own saved). Forward, merge and unmerge are
    :class:`TrainableTokensLinear`'s on the embedding's rows: a tied decoder with a bias (BERT's MLM ``decoder``)
    loses it while unmerged, as in PEFT, and PEFT merges the tied layer too (the same rows into the same weight)."""

    def __init__(self, base: nn.Linear, source: TrainableTokensEmbedding) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        object.__setattr__(self, "_source", source)  # not registered: its delta is saved once, by the embedding
        object.__setattr__(self, "_base", base)  # not registered: unloading puts it back
        self.merged = False

    def _rows(self) -> TrainableTokensEmbedding:
        return self._source

    def extra_repr(self) -> str:
        return f"{nn.Linear.extra_repr(self)}, tied to the rows {self._source.token_indices}, merged={self.merged}"


def _lora_class(module: nn.Module) -> type[LoraLinear] | None:
    """The LoRA layer for a module: a linear layer, a ``fan_in_fan_out`` (Conv1D) layer, or None."""
    if getattr(module, "fan_in_fan_out", False) is True:
        return LoraConv1D
    return LoraLinear if isinstance(module, nn.Linear) else None
