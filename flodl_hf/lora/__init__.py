"""LoRA on our native modules, exchanged with PEFT bit for bit.

``add_lora(model, ...)`` puts a low-rank adapter on the named linear layers of a model, with
PEFT's names, PEFT's matching rules and PEFT's arithmetic, so an adapter trained here is a PEFT
adapter and one that PEFT wrote loads here:

- targets are PEFT's module-name suffixes (``query``, ``value``, ``q_lin``, ``query_proj``,
  ``Wqkv``...): a list matches a module whose name is an entry or ends in ``"." + entry``, a string
  is a regex over the whole name (``peft.tuners.tuners_utils.check_target_module_exists``);
  ``None`` takes PEFT's default for the model type (:data:`PEFT_DEFAULT_TARGETS`, the entries of
  ``peft.utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`` for our families;
  tests/test_lora.py compares the two);
- a target is a :class:`LoraLinear`: the linear layer itself, its ``weight`` and ``bias`` kept
  under their keys and frozen, plus ``lora_A`` ``[r, in]``, ``lora_B`` ``[out, r]`` and
  ``lora_dropout``; its forward is PEFT's ``lora.Linear.forward`` op for op:
  ``F.linear(x, W, b) + lora_B(lora_A(dropout(x))) * scaling``, ``scaling = alpha / r`` (rsLoRA:
  ``alpha / sqrt(r)``);
- init is PEFT's, RNG draws included: ``nn.Linear(in, r)`` then ``nn.Linear(r, out)`` are built (each
  draws its default init), then A gets ``kaiming_uniform_(a=sqrt(5))`` and B zeros; targets are
  visited in ``named_modules()`` order, which is transformers' order, so the same seed gives PEFT's A;
- ``modules_to_save`` (PEFT's rule: a module whose name ends with an entry) stay trainable and go
  into the adapter file; PEFT's task classes add their heads (``classifier``/``score`` for SEQ_CLS and
  TOKEN_CLS, ``qa_outputs`` for QUESTION_ANS), and so does :func:`add_lora` for the task type (by default
  the model's task's; ``load_adapter`` takes the adapter's). A module to save that shares a weight with
  another (a tied LM head) trains its own copy, as PEFT's ``ModulesToSaveWrapper`` does;
- on a float16 / bfloat16 base the adapter weights are float32, as PEFT's (``autocast_adapter_dtype``);
- a decoder tied to the input embeddings is never adapted: a target that matches one is refused;
- a ``Conv1D`` target (GPT-2's ``c_attn``..., a module declaring ``fan_in_fan_out = True``) is a
  :class:`LoraConv1D`, as PEFT adapts it with ``fan_in_fan_out`` (which it sets by the layer's type, so the
  field's value in an adapter_config.json changes nothing);
- PEFT's ``exclude_modules``, ``layers_to_transform`` / ``layers_pattern``, ``rank_pattern`` /
  ``alpha_pattern`` (:meth:`LoraConfig.selects`, :meth:`LoraConfig.rank_and_alpha`) and DoRA (``use_dora``:
  a trainable ``lora_magnitude_vector`` per layer, ``DoraLinearVariant``'s forward and merge op for op);
- PEFT's ``trainable_token_indices`` (:class:`TrainableTokensEmbedding`, PEFT's ``TrainableTokensWrapper``):
  the listed embedding rows trained as a delta (``<embedding>.token_adapter.trainable_tokens_delta`` in the
  file), an output layer tied to the input embeddings following them (:class:`TiedTrainableTokensLinear`),
  an untied one named by the object with rows of its own (:class:`TrainableTokensLinear`);
- PEFT's ``target_parameters`` (:class:`LoraParameters`, PEFT's ``ParamWrapper``): LoRA on Parameters by name, an
  MoE's stacked experts (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``) above all, each a low-rank update
  per expert, folded into the Parameter for the module's forward as PEFT folds it (``baddbmm``).

Out: :func:`save_adapter` (a LoRA model) and :func:`export_adapter` (a trainer checkpoint) write
``adapter_config.json`` and ``adapter_model.safetensors`` under PEFT's keys
(``base_model.model.<module>.lora_A.weight``); :func:`merged_checkpoint_state` gives the merged
weights that ``export --checkpoint`` writes as an HF-canonical directory. In: :func:`load_adapter`
(or ``AutoModelFor*.from_pretrained(BASE, adapter=DIR)``) reads what ``PeftModel.save_pretrained``
wrote. :func:`verify_adapter` is ``verify-export`` on an adapter directory.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from flodl_hf.core.errors import (AdapterBaseMismatchError, AdapterError, CheckpointFormatError,
                                  UnsupportedAdapterError, WeightsMismatchError)
from flodl_hf.core.layers import LazyBuffers, cast_lazy_buffers
from flodl_hf.core.fs import ADAPTER_MARK

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
BASE_STAMP = ADAPTER_MARK   # our side file: the task and the base's weight sha256 (PEFT ignores it)
PEFT_PREFIX = "base_model.model."
ALL_LINEAR = "all-linear"   # PEFT's INCLUDE_LINEAR_LAYERS_SHORTHAND
MIN_TARGET_MODULES_FOR_OPTIMIZATION = 20   # peft.utils.constants: longer target lists are condensed
SUPPORTED_PEFT_TYPES = ("LORA",)
BIAS_MODES = ("none", "all", "lora_only")

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
# The adapter dtype rule of PEFT's cast_adapter_dtype (autocast_adapter_dtype=True, its default): adapter weights
# built on a base of one of these dtypes are upcast to float32 (peft.utils.constants.UPCAST_DTYPES adds float8s).
_UPCAST_DTYPES = frozenset(d for d in (torch.float16, torch.bfloat16, *(getattr(torch, n, None) for n in (
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu"))) if d is not None)
_FLOAT8_DTYPES = _UPCAST_DTYPES - {torch.float16, torch.bfloat16}
# init_lora_weights values after which PEFT's reload is plain LoRA: the base is left as it is and the file's A
# and B overwrite the init. pissa*, olora and corda subtract their own init's B @ A from the base weight at every
# load, loftq replaces the base weight by its quantised copy, mica is a LoRA variant (B frozen): refused.
_PLAIN_INITS = ("gaussian", "orthogonal", "eva", "lora_ga")
_TASK_DEFAULT: Any = object()   # add_lora's task_type default: PEFT's task type for the model's task

# adapter_config.json fields whose non-default values change the computation and are not implemented.
_UNSUPPORTED_FIELDS = {"layer_replication": None,
                       "use_qalora": False, "alora_invocation_tokens": None, "arrow_config": None,
                       "use_bdlora": None, "velora_config": None, "monteclora_config": None, "kasa_config": None}


def _is_default(value: Any, default: Any) -> bool:
    """An _UNSUPPORTED_FIELDS value that leaves PEFT's computation plain: null, the default by identity (so
    ``layers_to_transform: 0`` is not taken for ``False``), or an empty list / object / string."""
    if value is None or value is default or value is False:
        return True
    return isinstance(value, (list, dict, str)) and len(value) == 0


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
                if re.match(rf"(.*\.)?({key})$", name):
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
                match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", name)
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


# ---- adding, merging ---------------------------------------------------------------------------------

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


def _matches_target(name: str, targets: list[str] | str | None) -> bool:
    if targets is None:  # target_parameters only (a model type PEFT has no default targets for)
        return False
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return name in targets or any(name.endswith("." + t) for t in targets)


def _in_modules_to_save(name: str, modules_to_save: list[str]) -> bool:
    # PEFT never puts an adapter inside a module to save (check_target_module_exists).
    return any(re.match(rf"(^|.*\.){re.escape(m)}($|\..*)", name) for m in modules_to_save)


def _tied_to_embeddings(model: nn.Module, module: nn.Module) -> bool:
    get = getattr(model, "get_input_embeddings", None)
    embeddings = get() if callable(get) else None
    return embeddings is not None and getattr(module, "weight", None) is embeddings.weight


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
    Returns the model, which carries ``model.lora_config``.
    """
    if is_lora(model):
        raise AdapterError(f"{type(model).__name__} already has LoRA adapters (one adapter per model)")
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
    def listed(value: Any) -> Any:  # a copy; an iterable given for a list field as a list (a string stays one)
        if isinstance(value, dict):
            return dict(value)
        return value if value is None or isinstance(value, (str, int)) else list(value)
    tokens = trainable_token_indices
    if isinstance(tokens, dict):
        tokens = {k: listed(v) for k, v in tokens.items()}
    elif tokens is not None and not isinstance(tokens, (str, int)):
        tokens = list(tokens)
    cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=float(dropout), target_modules=targets,
                     modules_to_save=to_save, use_rslora=use_rslora, bias=bias, task=task, task_type=task_type,
                     rank_pattern={} if rank_pattern is None else listed(rank_pattern),
                     alpha_pattern={} if alpha_pattern is None else listed(alpha_pattern),
                     exclude_modules=listed(exclude_modules), layers_to_transform=listed(layers_to_transform),
                     layers_pattern=listed(layers_pattern), use_dora=use_dora, lora_bias=lora_bias,
                     trainable_token_indices=tokens, target_parameters=listed(target_parameters))

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
        why = (f"{', '.join(tied)}, {'which is' if len(tied) == 1 else 'which are'} tied to the input embeddings (the same "
               "weight), and flodl-hf never puts LoRA on a tied decoder (PEFT would adapt the shared matrix on "
               "the output side only and save it again as <module>.base_layer.weight)")
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


def save_module_names(model: nn.Module, modules_to_save: list[str]) -> list[str]:
    """The modules PEFT wraps for ``modules_to_save`` (``name.endswith(entry)``; the outermost of nested matches)."""
    out: list[str] = []
    for name, _ in model.named_modules():
        if name and any(name.endswith(m) for m in modules_to_save) and not any(name.startswith(o + ".") for o in out):
            out.append(name)
    return out


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


# ---- the adapter's tensors, under our keys and under PEFT's -------------------------------------------

def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors an adapter holds, under the model's keys: every trainable parameter (LoRA A and B,
    modules to save, biases by ``bias``), in ``state_dict`` order."""
    if not is_lora(model):
        raise AdapterError(f"{type(model).__name__} has no LoRA adapters (call flodl_hf.lora.add_lora first)")
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    return {k: v for k, v in model.state_dict(keep_vars=True).items() if id(v) in trainable}


def _to_hf(model: nn.Module, key: str) -> str:
    """Our key -> PEFT's (without ``base_model.model.``): the module path in transformers' model through the
    family's table (``KeyMap.module_name``); an adapted layer's own bias sits under ``base_layer.`` in PEFT's
    model, and so in its file."""
    key_map = model.family.key_map() if hasattr(model, "family") else None
    hf = key_map.module_name if key_map is not None else (lambda k: k)
    adapted = re.fullmatch(r"(.+)\.(lora_A|lora_B)\.([^.]+)\.weight", key)
    if adapted and isinstance(layer := _module(model, adapted.group(1)), LoraParameters):
        # PEFT's nested ParamWrappers: the first adapted Parameter innermost, one base_layer per wrapper around it
        module, part, name = adapted.groups()
        names = list(layer.lora_A)
        path = hf(f"{module}.{name}")[: -len(name) - 1]
        return path + ".base_layer" * (len(names) - 1 - names.index(name)) + f".{part}.weight"
    if key.endswith(".trainable_tokens_delta"):  # TrainableTokensWrapper.adapter_state_dict's key
        module = key[: -len(".trainable_tokens_delta")]
        return hf(module + ".weight")[: -len(".weight")] + ".token_adapter.trainable_tokens_delta"
    for part in (".lora_A.weight", ".lora_B.weight", ".lora_B.bias", ".lora_magnitude_vector", ".bias"):
        if key.endswith(part):  # the module's own weight key goes through the family's table
            module = key[: -len(part)]
            path = hf(module + ".weight")[: -len(".weight")]
            if part == ".bias":
                if module not in getattr(model.lora_config, "targeted", ()):
                    return hf(key)
                return path + ".base_layer.bias"
            return path + part
    return hf(key)


def peft_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors under the keys ``PeftModel.save_pretrained`` writes."""
    return {PEFT_PREFIX + _to_hf(model, k): v.detach().cpu().contiguous() for k, v in adapter_state(model).items()}


def peft_config_dict(model: nn.Module, base: str | None = None) -> dict[str, Any]:
    """``adapter_config.json`` as PEFT's ``LoraConfig.save_pretrained`` writes it (the fields that matter)."""
    cfg: LoraConfig = model.lora_config
    task_type = cfg.task_type
    targets = (cfg.target_modules if cfg.target_modules is None or isinstance(cfg.target_modules, str)
               else sorted(cfg.target_modules))
    excluded = cfg.exclude_modules
    out: dict[str, Any] = {
        "peft_type": "LORA", "task_type": task_type, "base_model_name_or_path": base, "revision": None,
        "r": cfg.r, "lora_alpha": cfg.lora_alpha, "lora_dropout": cfg.lora_dropout, "target_modules": targets,
        "modules_to_save": cfg.modules_to_save, "use_rslora": cfg.use_rslora, "bias": cfg.bias,
        # PEFT sets fan_in_fan_out at each target by its type (True on a Conv1D, False on nn.Linear): the last one's
        "fan_in_fan_out": isinstance(next(reversed(lora_layers(model).values()), None), LoraConv1D),
        "init_lora_weights": True, "inference_mode": True,
        "layers_to_transform": cfg.layers_to_transform, "layers_pattern": cfg.layers_pattern,
        "rank_pattern": cfg.rank_pattern, "alpha_pattern": cfg.alpha_pattern,
        "exclude_modules": sorted(excluded) if isinstance(excluded, list) else excluded,  # a set in PEFT
        "use_dora": cfg.use_dora, "lora_bias": cfg.lora_bias,
        "trainable_token_indices": cfg.trainable_token_indices,   # as given: a list, or module name -> list
        # a set in PEFT for the MoE families it converts (written in set order): sorted
        "target_parameters": sorted(cfg.target_parameters) if cfg.target_parameters else cfg.target_parameters,
    }
    if task_type is None and hasattr(model, "architecture"):
        # what PEFT writes for a model without a task type: the class, so our reader knows the head
        out["auto_mapping"] = {"base_model_class": model.architecture, "parent_library": "transformers"}
    return out


def _base_protect(*sources: Any) -> list[tuple[Path, bool]]:
    """The local paths an adapter depends on (its base model directory, a checkpoint), as export's
    ``protect`` entries: --out may neither be, contain, nor lie inside any of them. Hub ids are skipped."""
    out = []
    for source in sources:
        if isinstance(source, (str, os.PathLike)) and str(source):
            path = Path(source).expanduser()
            if path.exists() or path.is_symlink():
                out.append((path.absolute(), True))
    return out


def save_adapter(model: nn.Module, out: str | os.PathLike, force: bool = False,
                 base: str | os.PathLike | None = None,
                 protect: list[tuple[Path, bool]] | None = None) -> Path:
    """Write ``model``'s adapter as a PEFT adapter directory (atomically). ``out`` may not be, contain or lie
    inside the base model the adapter depends on, nor any path in ``protect``."""
    from flodl_hf.core.fs import atomic_directory, check_out, written_files_list
    ref = getattr(model, "lora_base", None) or {}
    base = str(base) if base is not None else ref.get("source")
    protect = list(protect or []) + _base_protect(ref.get("source"), base, getattr(model, "source_root", None))
    out_path = check_out(out, force, protect)
    with atomic_directory(out_path, force, protect) as tmp:
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(peft_config_dict(model, base), indent=2, sort_keys=True) + "\n")
        _save_file(peft_state(model), tmp)
        # with the list of files written (itself included): all that a later --force may replace
        (tmp / BASE_STAMP).write_text(json.dumps({"task": model.lora_config.task, "base": ref or None,
                                                  "files": written_files_list(tmp) + [BASE_STAMP]},
                                                 indent=2, sort_keys=True) + "\n")
    return out_path


def _save_file(tensors: dict[str, torch.Tensor], directory: Path) -> None:
    from safetensors.torch import save_file
    save_file(tensors, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})


# ---- reading PEFT's adapters --------------------------------------------------------------------------

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


def _add_lora_from(model: nn.Module, settings: dict[str, Any], task_type: str | None) -> nn.Module:
    """``add_lora`` with checked settings (:func:`lora_settings`), for weights loaded next: the RNG draws of the
    init, overwritten, leave the caller's RNG as it was."""
    with torch.random.fork_rng(devices=[]):
        return add_lora(model, r=settings["r"], alpha=settings["lora_alpha"], dropout=settings["lora_dropout"],
                        target_modules=settings["target_modules"], modules_to_save=settings["modules_to_save"],
                        use_rslora=settings["use_rslora"], bias=settings["bias"], task_type=task_type,
                        **{name: settings[name] for name, *_ in _OPTIONAL_FIELDS})


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
    if isinstance(targets, str) and targets.lower() != ALL_LINEAR:  # a regex over the whole module name
        try:
            re.compile(targets)
        except re.error as exc:
            raise error(f"{where}: field 'target_modules' is {_show(targets)}, not a valid regular expression "
                        f"({exc}); expected a list of module names or a regular expression string") from None
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
    patterns = [("rank_pattern", k) for k in values["rank_pattern"]]
    patterns += [("alpha_pattern", k) for k in values["alpha_pattern"]]
    for name in ("exclude_modules", "layers_pattern"):
        value = values[name]
        patterns += [(name, v) for v in ([value] if isinstance(value, str) else value or [])]
    for name, pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as exc:
            return f"field {name!r} holds {_show(pattern)}, not a valid regular expression ({exc})"
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


# adapter_config.json's other fields that we read: (field, check, what is expected).
_OTHER_FIELDS: tuple[tuple[str, Any, str], ...] = (
    ("task_type", lambda v: v is None or isinstance(v, str), "a string or null"),
    ("base_model_name_or_path", lambda v: v is None or isinstance(v, str), "a string or null"),
    ("auto_mapping", lambda v: v is None or (isinstance(v, dict) and isinstance(v.get("base_model_class"),
                                                                                 (str, type(None)))),
     "an object or null, its 'base_model_class' a string"),
)


def read_adapter_config(directory: str | os.PathLike) -> dict[str, Any]:
    """``adapter_config.json``, checked: a PEFT type and options we implement, each field of PEFT's type, or a
    typed error naming the file and the field."""
    path = Path(directory).expanduser() / ADAPTER_CONFIG
    if not path.is_file():
        raise AdapterError(f"{Path(directory)}: no {ADAPTER_CONFIG}, so this is not a PEFT adapter directory")
    from flodl_hf.core.errors import ConfigError
    from flodl_hf.core.io import read_json
    try:
        data = read_json(path, ADAPTER_CONFIG)
    except ConfigError as exc:
        raise AdapterError(str(exc)) from exc
    kind = data.get("peft_type")
    if kind not in SUPPORTED_PEFT_TYPES:
        raise UnsupportedAdapterError(f"{path}: peft_type {_show(kind)} is not supported; flodl-hf reads "
                                      f"{', '.join(SUPPORTED_PEFT_TYPES)} adapters")
    if data.get("fan_in_fan_out") is True and data.get("target_parameters"):  # ParamWrapper's ValueError
        raise AdapterError(f"{path}: fan_in_fan_out=true with target_parameters, which PEFT refuses; expected "
                           "fan_in_fan_out false")
    if data.get("fan_in_fan_out") is not None and not isinstance(data["fan_in_fan_out"], bool):
        # any true or false: PEFT decides it per layer type (LoraConv1D)
        raise AdapterError(f"{path}: field 'fan_in_fan_out' is {_show(data['fan_in_fan_out'])} "
                           f"({type(data['fan_in_fan_out']).__name__}); expected JSON true or false")
    for name, default in _UNSUPPORTED_FIELDS.items():
        value = data.get(name, default)
        if default is False and value is not None and not isinstance(value, bool):
            raise AdapterError(f"{path}: field {name!r} is {_show(value)} ({type(value).__name__}); expected JSON "
                               "true or false")
        if not _is_default(value, default):
            raise UnsupportedAdapterError(f"{path}: {name}={_show(value)} is not supported (flodl-hf implements "
                                          f"plain LoRA on linear layers; {name} must be {default!r})")
    init = data.get("init_lora_weights", True)
    if not isinstance(init, (bool, str)):
        raise AdapterError(f"{path}: field 'init_lora_weights' is {_show(init)} ({type(init).__name__}); expected "
                           "JSON true or false, or the name of one of PEFT's initialisations")
    if isinstance(init, str) and init not in _PLAIN_INITS:
        if init.startswith(("pissa", "corda")) or init == "olora":
            why = ("PEFT reruns this initialisation when it loads the adapter and subtracts its B @ A from the "
                   "base weights, so the base under the adapter is not the base checkpoint")
        elif init == "loftq":
            why = "PEFT replaces the base weights by their LoftQ-quantised copy when it loads the adapter"
        elif init == "mica":
            why = "MiCA is a LoRA variant (lora_B frozen)"
        else:
            why = "it is not one of PEFT's initialisations that reload as plain LoRA"
        raise UnsupportedAdapterError(f"{path}: init_lora_weights={_show(init)} is not supported: {why}; flodl-hf "
                                      "reads adapters whose init_lora_weights is true, false or one of "
                                      f"{', '.join(map(repr, _PLAIN_INITS))} (PEFT's path_initial_model_for_weight_"
                                      "conversion saves a PiSSA/OLoRA/CorDA adapter as plain LoRA)")
    settings = lora_settings(data, str(path))
    if settings["lora_bias"] and not isinstance(init, bool):  # LoraConfig.__post_init__'s ValueError
        raise AdapterError(f"{path}: lora_bias=true with init_lora_weights={_show(init)}, which PEFT refuses (a lora_B "
                           "bias only with init_lora_weights true or false); expected init_lora_weights true")
    odd = [f"{k} -> {r}" for k, r in settings["rank_pattern"].items() if r % 2]
    if init == "orthogonal" and (settings["r"] % 2 or odd):
        # peft.tuners.lora.layer.LoraLayer.orthogonal_init reruns at every load and splits a QR basis in halves
        given = f"field 'r' is {settings['r']}" if settings["r"] % 2 else f"field 'rank_pattern' gives {', '.join(odd)}"
        raise AdapterError(f"{path}: init_lora_weights='orthogonal' needs an even r, and {given}; PEFT refuses this adapter too (its orthogonal initialisation, rerun "
                           "when it loads the adapter, requires the LoRA rank to be even). The saved A and B replace "
                           "the initialisation at load, so setting init_lora_weights to true in this file loads the "
                           "same adapter, in PEFT as here")
    for name, ok, expected in _OTHER_FIELDS:
        if not ok(data.get(name)):
            value = data[name]
            raise AdapterError(f"{path}: field {name!r} is {_show(value)} ({type(value).__name__}); expected {expected}")
    return data


def read_base_stamp(directory: str | os.PathLike) -> dict[str, Any] | None:
    """Our side file (``flodl_hf_base.json``: the task and the base reference), checked; None where absent."""
    path = Path(directory) / BASE_STAMP
    if not path.is_file():
        return None
    from flodl_hf.core.errors import ConfigError
    from flodl_hf.core.io import read_json
    try:
        data = read_json(path, BASE_STAMP)
    except ConfigError as exc:
        raise AdapterError(str(exc)) from exc
    if data.get("task") is not None:
        _check_task(data["task"], str(path), AdapterError)
    _check_base_record(data.get("base"), str(path), AdapterError)
    return data


def adapter_task(data: dict[str, Any], directory: Path) -> str | None:
    """The head an adapter was trained with, from task_type, our side file, or auto_mapping."""
    reverse = {v: k for k, v in PEFT_TASK_TYPES.items()}
    if data.get("task_type") in reverse:
        return reverse[data["task_type"]]
    stamp = read_base_stamp(directory)
    if stamp and stamp.get("task"):
        return stamp["task"]
    arch = (data.get("auto_mapping") or {}).get("base_model_class")
    if arch:
        from flodl_hf.core.registry import parse_architecture
        return parse_architecture(arch)[1]
    return None


def _check_base(model: nn.Module, recorded: dict | None, where: str) -> None:
    """A recorded base sha256 that differs from the model's base is a typed error."""
    if not recorded or not recorded.get("weights_sha256"):
        return
    if getattr(model, "lora_base", None) is None:
        model.lora_base = base_reference(model)  # hashed once per model
    mine = (model.lora_base or {}).get("weights_sha256")
    if mine and mine != recorded["weights_sha256"]:
        raise AdapterBaseMismatchError(f"{where}: the adapter was trained on base {recorded.get('source')} with "
                                       f"weights sha256 {recorded['weights_sha256']}, but this model's base has "
                                       f"{mine}; load the adapter onto the base it was trained on")


def _load_into(model: nn.Module, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Strictly put an adapter's tensors (under the model's keys) into a LoRA model."""
    want = adapter_state(model)
    missing = [k for k in want if k not in tensors]
    unexpected = sorted(k for k in tensors if k not in want)
    if missing or unexpected:
        raise WeightsMismatchError(where, missing, [], unexpected)
    mismatched = [(k, tuple(want[k].shape), tuple(tensors[k].shape)) for k in want if tensors[k].shape != want[k].shape]
    if mismatched:
        lines = ", ".join(f"{k}: model {a}, adapter {b}" for k, a, b in mismatched)
        raise AdapterBaseMismatchError(f"{where}: the adapter does not fit this base (shapes differ): {lines}")
    with torch.no_grad():
        for k, v in want.items():
            v.copy_(tensors[k])


def load_adapter(model: nn.Module, directory: str | os.PathLike) -> nn.Module:
    """Add the PEFT LoRA adapter in ``directory`` to ``model`` (in place) and load its weights strictly."""
    directory = Path(directory).expanduser()
    data = read_adapter_config(directory)
    weights = directory / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise AdapterError(f"{directory}: no {ADAPTER_WEIGHTS} (adapters saved as .bin are not read; save with "
                           "safe_serialization=True)")
    stamp = read_base_stamp(directory)
    if stamp:
        _check_base(model, stamp.get("base"), str(directory))
    settings = lora_settings(data, str(directory / ADAPTER_CONFIG))
    task = getattr(model, "task", "base")
    task_type = data.get("task_type")
    if task_type in TASK_OF_PEFT_TASK_TYPE and TASK_OF_PEFT_TASK_TYPE[task_type] != task:
        raise AdapterBaseMismatchError(
            f"{directory / ADAPTER_CONFIG}: task_type {task_type!r} is an adapter for the "
            f"{TASK_OF_PEFT_TASK_TYPE[task_type]} task (its head), but this model "
            f"({type(model).__name__}) is {task}; load it onto a {TASK_OF_PEFT_TASK_TYPE[task_type]} model")
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    try:  # read before the model is touched: a bad file leaves it as it was
        raw = load_file(str(weights))
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterError(f"{weights}: not a readable safetensors file ({exc}); {ADAPTER_WEIGHTS} must be what "
                           "PeftModel.save_pretrained writes") from exc
    # token ids checked against this model's embeddings first, so the error names the file
    token_targets(model, settings["trainable_token_indices"], [], str(directory / ADAPTER_CONFIG))
    # PeftModel.from_pretrained: the config's modules_to_save, plus the head its task_type's class adds
    _add_lora_from(model, settings, task_type)
    ours = {}
    hf_of = {_to_hf(model, k): k for k in adapter_state(model)}
    for key, tensor in raw.items():
        bare = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
        if data.get("bias") == "all" and re.search(r"\.(original_module|modules_to_save)\.(.+\.)?bias$", bare):
            continue  # bias="all": PEFT also saves its wrapper's copies of a saved module's biases (nested too)
        ours[hf_of.get(bare, bare)] = tensor
    _load_into(model, ours, str(weights))
    return model


# ---- the base reference and trainer checkpoints --------------------------------------------------------

def base_reference(model: nn.Module) -> dict[str, Any] | None:
    """Where the base was loaded from and its weight files' sha256 (None for a model not loaded from disk)."""
    root = getattr(model, "source_root", None)
    if not root:
        return None
    from flodl_hf.core.fs import sha256_file
    from flodl_hf.core.io import resolve
    ckpt = resolve(root)
    return {"source": str(root), "weights_sha256": {f.name: sha256_file(f) for f in ckpt.weight_files}}


def trainer_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a trainer checkpoint's ``"model"`` holds: the whole state_dict, or, for a LoRA model whose base
    is on disk, only the adapter (the base is referenced by ``trainer_entry``)."""
    if is_lora(model) and (getattr(model, "lora_base", None) or {}).get("source"):
        return {k: v.detach().cpu() for k, v in adapter_state(model).items()}
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def trainer_entry(model: nn.Module) -> dict[str, Any] | None:
    """The checkpoint's ``"lora"`` entry: the adapter's config, the base reference, whether only the adapter is saved."""
    if not is_lora(model):
        return None
    base = getattr(model, "lora_base", None)
    return {"config": model.lora_config.to_dict(), "base": base, "adapter_only": bool((base or {}).get("source"))}


def checkpoint_entry(data: dict[str, Any], path: str | os.PathLike | None) -> dict[str, Any] | None:
    """A trainer checkpoint's ``"lora"`` entry, checked (what :func:`trainer_entry` writes): None for a model
    without LoRA, else a dict with ``config`` (the LoRA settings and ``task``), ``base`` and ``adapter_only``.
    Anything else is a CheckpointFormatError naming the file and the entry."""
    entry = data.get("lora")
    if entry is None:
        return None
    where = f"{path}: entry 'lora'"
    if not isinstance(entry, dict):
        raise CheckpointFormatError(f"{where} is {_show(entry)} ({type(entry).__name__}); expected None or a dict "
                                    "with 'config', 'base' and 'adapter_only' (flodl_hf.lora.trainer_entry)")
    for key in ("config", "adapter_only"):
        if key not in entry:
            raise CheckpointFormatError(f"{where} has no field {key!r}; expected a dict with 'config', 'base' and "
                                        "'adapter_only' (flodl_hf.lora.trainer_entry)")
    if not isinstance(entry["adapter_only"], bool):
        raise CheckpointFormatError(f"{where}: field 'adapter_only' is {_show(entry['adapter_only'])} "
                                    f"({type(entry['adapter_only']).__name__}); expected True or False")
    cfg = entry["config"]
    if not isinstance(cfg, dict):
        raise CheckpointFormatError(f"{where}: field 'config' is {_show(cfg)} ({type(cfg).__name__}); expected the "
                                    "adapter's settings (a dict: r, lora_alpha, lora_dropout, target_modules ...)")
    lora_settings(cfg, f"{where}, 'config'", CheckpointFormatError, defaults=False)
    _check_task(cfg.get("task"), f"{where}, 'config'", CheckpointFormatError)
    if cfg.get("task_type") is not None and not isinstance(cfg["task_type"], str):
        raise CheckpointFormatError(f"{where}, 'config': field 'task_type' is {_show(cfg['task_type'])} "
                                    f"({type(cfg['task_type']).__name__}); expected PEFT's task type (a string) or "
                                    "null")
    _check_base_record(entry.get("base"), where, CheckpointFormatError)
    return entry


def load_trainer_state(model: nn.Module, state: dict[str, Any], where: str) -> None:
    """Resume: put a checkpoint's ``"model"`` back, strictly (adapter-only checkpoints into a LoRA model)."""
    entry = checkpoint_entry(state, where)
    if not entry or not entry["adapter_only"]:
        model.load_state_dict(state["model"])
        return
    if not is_lora(model):
        raise AdapterError(f"{where}: the checkpoint holds only a LoRA adapter; call flodl_hf.lora.add_lora with "
                           f"the same settings ({_settings(entry['config'])}) before resuming")
    _check_base(model, entry.get("base"), where)
    _load_into(model, state["model"], where)


def _settings(cfg: dict[str, Any]) -> str:
    return ", ".join(f"{k}={cfg[k]!r}" for k in ("r", "lora_alpha", "lora_dropout", "target_modules",
                                                  "modules_to_save", "use_rslora", "bias", "use_dora", "lora_bias",
                                                  "target_parameters") if k in cfg)


def model_from_checkpoint(data: dict[str, Any], path: str | os.PathLike) -> nn.Module:
    """The LoRA model a trainer checkpoint describes: the referenced base (sha256 checked), the adapter on it."""
    from flodl_hf.core import checkpoint_schema
    from flodl_hf.auto import config_from_dict, load_model
    entry = checkpoint_entry(data, path)
    if not entry:
        raise CheckpointFormatError(f"{path}: not a LoRA checkpoint (no 'lora' entry); export it without --adapter")
    cfg = entry["config"]
    settings = lora_settings(cfg, f"{path}: entry 'lora', 'config'", CheckpointFormatError, defaults=False)
    base = entry.get("base") or {}
    if not base.get("source"):
        raise CheckpointFormatError(f"{path}: the LoRA checkpoint records no base source")
    config_dict, saved = checkpoint_schema.model_part(data, path)
    config = config_from_dict(config_dict, f"{path} (config)")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a head fresh on the base is a module to save, loaded below
        model = load_model(base["source"], cfg["task"], config=config)
    model.lora_base = base_reference(model)
    _check_base(model, base, str(path))
    model.lora_base = base
    # a checkpoint written before task_type was recorded: PEFT's task type for the task, as add_lora then took
    task_type = cfg["task_type"] if "task_type" in cfg else PEFT_TASK_TYPES.get(cfg["task"])
    _add_lora_from(model, settings, task_type)
    state = saved if entry["adapter_only"] else {k: v for k, v in saved.items() if k in adapter_state(model)}
    _load_into(model, state, str(path))
    return model.eval()


def merged_checkpoint_state(data: dict[str, Any], path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A LoRA trainer checkpoint's full, merged state_dict (what ``export --checkpoint`` writes)."""
    model = merge_and_unload(model_from_checkpoint(data, path))
    return {k: v.detach() for k, v in model.state_dict().items()}


def export_adapter(checkpoint: str | os.PathLike, out: str | os.PathLike, force: bool = False) -> Path:
    """``flodl-hf export --checkpoint CKPT --adapter``: a trainer checkpoint's adapter as a PEFT directory."""
    from flodl_hf.core import checkpoint_schema
    path = Path(checkpoint).expanduser().absolute()
    from flodl_hf.core.fs import check_out
    protect = [(path, True)]
    check_out(out, force, protect)
    data = checkpoint_schema.read(path)
    entry = checkpoint_entry(data, path) or {}
    protect += _base_protect((entry.get("base") or {}).get("source"))  # the base the adapter depends on
    check_out(out, force, protect)  # before the base is loaded
    model = model_from_checkpoint(data, path)
    return save_adapter(model, out, force, protect=protect)


def require_lora_checkpoint(checkpoint: str | os.PathLike) -> None:
    """``--merge``: a typed error unless the checkpoint holds a LoRA adapter."""
    from flodl_hf.core import checkpoint_schema
    if not checkpoint_entry(checkpoint_schema.read(checkpoint), checkpoint):
        raise CheckpointFormatError(f"{checkpoint}: not a LoRA checkpoint (no 'lora' entry); export it without --merge")


# ---- verify-export on an adapter directory --------------------------------------------------------------

def verify_adapter(directory: str | os.PathLike, base: str | None = None):
    """Two checks: PEFT loads the adapter onto transformers' base with no missing or unexpected keys, and our
    LoRA model's eval outputs are ``torch.equal`` to PeftModel's. Returns a ``flodl_hf.roundtrip.verify.VerifyReport``."""
    from flodl_hf.auto import load_model
    from flodl_hf.roundtrip.parity import compare_outputs, make_batch, quiet_transformers
    from flodl_hf.core.registry import get_task
    from flodl_hf.roundtrip.verify import FAIL, PASS, SKIP, Check
    directory = Path(directory).expanduser().absolute()
    data = read_adapter_config(directory)
    base = base or data.get("base_model_name_or_path")
    if not base:
        raise AdapterError(f"{directory / ADAPTER_CONFIG}: no base_model_name_or_path; pass --source BASE")
    task = adapter_task(data, directory)
    if task is None:
        from flodl_hf.auto import AutoConfig, task_of
        task = task_of(AutoConfig.from_pretrained(base))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a head fresh on the base comes from the adapter (modules to save)
        ours = load_model(base, task)
        load_adapter(ours, directory)
    batch = make_batch(ours.config, task)
    report = _adapter_report_class()(str(directory), f"LoRA adapter on {ours.architecture}", task, str(base),
                          "random token ids (parity.make_batch)")
    state: dict[str, Any] = {}

    def peft_loads() -> Check:
        try:
            import peft
        except ImportError:
            return Check(1, ADAPTER_CHECKS[1], SKIP, "peft is not installed (pip install peft)")
        transformers = quiet_transformers()
        reference = getattr(transformers, get_task(task).auto_class).from_pretrained(str(base), dtype=torch.float32)
        model = peft.PeftModel.from_pretrained(reference, str(directory)).eval()
        saved = set(peft.utils.load_peft_weights(str(directory)))
        wanted = {k.replace(".default", "") for k in peft.utils.get_peft_model_state_dict(model)}
        missing, extra = sorted(wanted - saved), sorted(saved - wanted)
        state["peft"] = model
        if missing or extra:
            return Check(1, ADAPTER_CHECKS[1], FAIL, f"missing: {missing[:6]}; unexpected: {extra[:6]}")
        return Check(1, ADAPTER_CHECKS[1], PASS, f"{type(model).__name__}: {len(saved)} tensors, 0 missing, 0 unexpected")

    def equal_outputs() -> Check:
        if "peft" not in state:
            return Check(2, ADAPTER_CHECKS[2], SKIP, "peft did not load the adapter (check 1)")
        with torch.inference_mode():
            mine, theirs = ours(**batch), state["peft"](**batch)
        fields = [k for k, v in theirs.items() if isinstance(v, torch.Tensor)]
        diffs, equal = compare_outputs(mine, theirs, fields)
        detail = ", ".join(f"{k} {'equal' if equal[k] else f'max abs diff {diffs[k]:.3g}'}" for k in fields)
        return Check(2, ADAPTER_CHECKS[2], PASS if all(equal.values()) else FAIL, detail, max(diffs.values()))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for number, check in ((1, peft_loads), (2, equal_outputs)):
            try:
                report.checks.append(check())
            except Exception as exc:  # a crash inside a check is a failed check, named in the table
                first = (str(exc).strip().splitlines() or [""])[0]
                report.checks.append(Check(number, ADAPTER_CHECKS[number], FAIL, f"{type(exc).__name__}: {first}"))
    return report


ADAPTER_CHECKS = {1: "loadable by peft", 2: "native vs peft (eval)"}


@functools.cache
def _adapter_report_class():
    from flodl_hf.roundtrip.verify import FAIL, PASS, VerifyReport

    class AdapterVerifyReport(VerifyReport):
        """verify-export's report for an adapter directory: checks 1 (peft loads it) and 2 (outputs equal)."""

        @property
        def ok(self) -> bool:
            ran = {c.number for c in self.checks if c.status == PASS}
            return not any(c.status == FAIL for c in self.checks) and {1, 2} <= ran

    return AdapterVerifyReport


def __getattr__(name: str):
    if name == "AdapterVerifyReport":
        return _adapter_report_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
