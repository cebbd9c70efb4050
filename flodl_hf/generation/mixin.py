"""``GenerationMixin``: what a causal LM task model gains for generation, as transformers' ``*ForCausalLM`` inherit
transformers' ``GenerationMixin``: ``model.generate(...)``, ``model.generation_config``, and the
``generation_config.json`` that ``save_pretrained`` writes beside the weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from flodl_hf.core.errors import ConfigError, InputError
from flodl_hf.generation.generate import generate_ids
from flodl_hf.generation.settings import model_generation_config


class GenerationMixin:
    """Generation for a task model: listed before its ``TaskModel`` base, so that ``save_pretrained`` here runs
    first and hands the weights to the base's (``super().save_pretrained``)."""

    @property
    def generation_config(self) -> Any:
        """transformers' ``model.generation_config``: this checkpoint's ``GenerationConfig`` (its
        generation_config.json, else one made from config.json, ``from_model_config``), read at the first access and
        kept, so that edits to it, or one assigned in its place, are what later ``generate`` calls start from (and
        what an assistant model's settings are read from), as in transformers."""
        config = self.__dict__.get("_generation_config")
        if config is None:
            config = self.__dict__["_generation_config"] = model_generation_config(self)
        return config

    @generation_config.setter
    def generation_config(self, value: Any) -> None:
        if not callable(getattr(value, "to_diff_dict", None)):
            raise InputError(f"generation_config={type(value).__name__}: expected a transformers GenerationConfig")
        self.__dict__["_generation_config"] = value

    def save_pretrained(self, directory: str | Path, max_shard_size: int | str = "5GB", **kwargs: Any) -> Path:
        """``config.json``, the weights and ``generation_config.json``: this model's ``generation_config`` (edits
        included), as transformers' ``save_pretrained`` writes it for a model that can generate. It is validated
        first, strictly when it was edited (``GenerationConfig.save_pretrained``'s rule), and a configuration
        transformers refuses to save is a ConfigError before anything is written."""
        config = self.generation_config
        edited = getattr(config, "_original_object_hash", None) != hash(config)
        try:
            config.validate(strict=edited)
        except ValueError as exc:
            raise ConfigError(f"{Path(directory) / 'generation_config.json'}: model.generation_config does not "
                              f"validate, nothing was written: {exc}") from None
        directory = super().save_pretrained(directory, max_shard_size, **kwargs)  # push_to_hub=True: refused there
        config.save_pretrained(directory)
        return directory

    def generate(self, inputs: torch.Tensor | None = None, generation_config: Any = None, **kwargs: Any) -> Any:
        """transformers' ``model.generate``: the prompts and their new tokens, (B, S + n) ids (a
        ``GenerateDecoderOnlyOutput`` with ``return_dict_in_generate=True``); see
        ``flodl_hf.generation.generate.generate_ids`` for the keywords it takes. ``inputs`` is ``input_ids``, as
        transformers' first argument."""
        input_ids = kwargs.pop("input_ids", None)
        if inputs is not None and input_ids is not None:
            raise InputError("generate: pass the prompts once, as inputs or as input_ids")
        return generate_ids(self, input_ids if inputs is None else inputs, kwargs.pop("attention_mask", None),
                            generation_config=generation_config, **kwargs)
