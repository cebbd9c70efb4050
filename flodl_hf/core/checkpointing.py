"""Gradient (activation) checkpointing, as transformers has it, on every family.

transformers checkpoints each ``GradientCheckpointingLayer`` (a BERT layer, a LLaMA decoder layer...): in training,
with gradients on, the layer's ``forward`` runs inside ``torch.utils.checkpoint.checkpoint``, so its activations are
dropped after the forward and recomputed in the backward, the dropout masks drawn again from the saved RNG state.
Module hooks stay outside the checkpoint (the forward is wrapped, not ``__call__``), so a recorded hidden state is
recorded once.

Here the layers are found, not declared: a backbone's ``checkpoint_layers()`` when it has one (DeBERTa, whose recorded
states put the ConvLayer in layer 0's place), else its ``hidden_state_modules()`` (the elements of the innermost
``nn.ModuleList`` s: the same modules transformers records as hidden states, which are its checkpointed layers). So a
new family gets checkpointing with no line of its own. A backbone whose transformers model has none (ALBERT, MPNet)
sets ``supports_gradient_checkpointing = False`` and is refused, as transformers refuses it.

``GradientCheckpointing`` is mixed into ``flodl_hf.core.model_calls.ModelCalls`` (and so into every model):
``gradient_checkpointing_enable(gradient_checkpointing_kwargs=None)``, ``gradient_checkpointing_disable()``,
``is_gradient_checkpointing`` and their 5.25 names ``activation_checkpointing_*``; ``enable_input_require_grads()``.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any, Callable, ClassVar

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from flodl_hf.core.errors import InputError, UnsupportedFeatureError

# transformers 5.25's default (``_activation_checkpointing_enable``); torch recommends the non-reentrant variant
DEFAULT_KWARGS: dict[str, Any] = {"use_reentrant": False}
# the layer arguments transformers' GradientCheckpointingLayer sets to None under checkpointing (a cache written
# in the forward would be written again by the backward's recompute)
CACHE_ARGUMENTS = ("cache", "layer_past")


def checkpoint_layers(model: nn.Module) -> list[nn.Module]:
    """The layers ``model`` checkpoints: each backbone's (a module with ``hidden_state_modules``) in module order,
    each layer once (ALBERT-style shared layers are one module)."""
    layers: dict[int, nn.Module] = {}
    for module in model.modules():
        find = getattr(module, "checkpoint_layers", None) or getattr(module, "hidden_state_modules", None)
        if callable(find) and isinstance(module, nn.Module):
            layers.update((id(layer), layer) for layer in find())
    return list(layers.values())


@functools.lru_cache(maxsize=None)
def _cache_positions(forward: Callable) -> dict[str, int]:
    """The positions of ``CACHE_ARGUMENTS`` among a layer forward's arguments after ``self``."""
    names = list(inspect.signature(forward).parameters)[1:]
    return {name: names.index(name) for name in CACHE_ARGUMENTS if name in names}


def _without_cache(layer: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with a given cache set to None, warned once per layer class, as transformers'
    GradientCheckpointingLayer does."""
    dropped = []
    for name, position in _cache_positions(type(layer).forward).items():
        if kwargs.get(name) is not None:
            kwargs = {**kwargs, name: None}
            dropped.append(name)
        elif len(args) > position and args[position] is not None:
            args = (*args[:position], None, *args[position + 1:])
            dropped.append(name)
    if dropped and not getattr(type(layer), "_cache_warned", False):
        type(layer)._cache_warned = True
        warnings.warn(f"Caching is incompatible with gradient checkpointing in {type(layer).__name__}. Setting "
                      + ", ".join(f"`{name}=None`" for name in dropped) + ".", stacklevel=3)
    return args, kwargs


def checkpointed_forward(layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A layer's forward, run inside its checkpoint function when checkpointing is on, the layer trains and
    gradients are on (GradientCheckpointingLayer's ``forward_with_checkpointing``); its class's forward otherwise."""
    forward = type(layer).forward
    if layer.gradient_checkpointing and layer.training and torch.is_grad_enabled():
        args, kwargs = _without_cache(layer, args, kwargs)
        return layer._gradient_checkpointing_func(functools.partial(forward, layer, **kwargs), *args)
    return forward(layer, *args, **kwargs)


def _set_layers(model: nn.Module, enable: bool, func: Callable | None = None, every_n_layers: int = 1) -> None:
    """transformers' ``_set_gradient_checkpointing``: the flag (every ``every_n_layers``-th layer on) and the
    checkpoint function on each layer; the layer's forward goes through ``checkpointed_forward`` from then on."""
    layers = checkpoint_layers(model)
    if not layers:
        raise UnsupportedFeatureError(f"{type(model).__name__} is not compatible with gradient checkpointing: it has "
                                      "no layers (no backbone with hidden_state_modules)")
    for index, layer in enumerate(layers):
        if "forward" not in layer.__dict__:
            layer.forward = functools.partial(checkpointed_forward, layer)
        layer.gradient_checkpointing = enable and index % every_n_layers == 0
        layer._gradient_checkpointing_func = func or functools.partial(checkpoint, **DEFAULT_KWARGS)


class GradientCheckpointing:
    """transformers' checkpointing calls; ``self`` is an ``nn.Module`` with ``get_input_embeddings``."""

    # a backbone whose transformers model has no checkpointing (ALBERT, MPNet) sets False
    supports_gradient_checkpointing: ClassVar[bool] = True
    main_input_name: ClassVar[str] = "input_ids"

    def _refused_by(self) -> nn.Module | None:
        return next((m for m in self.modules() if getattr(m, "supports_gradient_checkpointing", True) is False), None)

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: dict | None = None,
                                        every_n_layers: int = 1) -> None:
        """Checkpoint every ``every_n_layers``-th layer in training, with ``torch.utils.checkpoint.checkpoint`` and
        ``activation_checkpointing_kwargs`` (default ``{"use_reentrant": False}``, transformers 5.25's). A model
        fed ``input_ids`` also gets ``enable_input_require_grads()``, as in transformers (the reentrant variant
        needs an input that requires grad: a frozen embedding's output does not)."""
        refused = self._refused_by()
        if refused is not None:
            raise UnsupportedFeatureError(
                f"{type(refused).__name__} does not support gradient checkpointing (transformers' "
                f"{type(refused).__name__} has none either); lower the batch size or the sequence length instead")
        if not isinstance(every_n_layers, int) or isinstance(every_n_layers, bool) or every_n_layers < 1:
            raise InputError(f"every_n_layers={every_n_layers!r}: a whole number of layers, 1 or more")
        kwargs = DEFAULT_KWARGS if activation_checkpointing_kwargs is None else activation_checkpointing_kwargs
        if not isinstance(kwargs, dict):
            raise InputError(f"gradient_checkpointing_kwargs={kwargs!r}: a dict of keywords for "
                             "torch.utils.checkpoint.checkpoint (e.g. {'use_reentrant': False})")
        _set_layers(self, True, functools.partial(checkpoint, **kwargs), every_n_layers)
        if self.main_input_name == "input_ids":
            self.enable_input_require_grads()

    def activation_checkpointing_disable(self) -> None:
        """Every layer runs its forward again (the input hook stays, as transformers leaves it outside PEFT)."""
        if self._refused_by() is None:
            _set_layers(self, False)

    @property
    def is_activation_checkpointing(self) -> bool:
        """Whether any layer is checkpointed."""
        return any(getattr(m, "gradient_checkpointing", False) for m in self.modules())

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None,
                                      **kwargs: Any) -> None:
        """transformers' older name of ``activation_checkpointing_enable`` (``every_n_layers`` by keyword)."""
        self.activation_checkpointing_enable(gradient_checkpointing_kwargs, **kwargs)

    def gradient_checkpointing_disable(self) -> None:
        """transformers' older name of ``activation_checkpointing_disable``."""
        self.activation_checkpointing_disable()

    @property
    def is_gradient_checkpointing(self) -> bool:
        """transformers' older name of ``is_activation_checkpointing``."""
        return self.is_activation_checkpointing

    def enable_input_require_grads(self) -> None:
        """A forward hook on the input embeddings that makes their output require grad (transformers': so the
        gradient reaches a checkpointed layer, or an adapter, behind a frozen embedding)."""
        self.disable_input_require_grads()
        embeddings = self.get_input_embeddings()
        self._require_grads_hooks = [embeddings.register_forward_hook(_require_grads)]

    def disable_input_require_grads(self) -> None:
        """Removes ``enable_input_require_grads``' hook."""
        for hook in self.__dict__.pop("_require_grads_hooks", ()):
            hook.remove()


def _require_grads(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
    output.requires_grad_(True)


def drops_cache(model: nn.Module, use_cache: bool) -> bool:
    """``use_cache`` for a decoder's forward: False, warned once, when ``model`` checkpoints its layers in training
    with gradients on (transformers' ``merge_with_config_defaults``); as given otherwise."""
    if use_cache and model.training and torch.is_grad_enabled() and model.is_gradient_checkpointing:
        if not getattr(model, "_use_cache_warned", False):
            model._use_cache_warned = True
            warnings.warn("`use_cache=True` is incompatible with gradient checkpointing. Setting `use_cache=False`.",
                          stacklevel=3)
        return False
    return use_cache
