"""transformers' ``PreTrainedModel`` calls that users make on a model besides forward, load and save.

``ModelCalls`` is mixed into ``flodl_hf.core.modeling.PreTrainedModel``: each call works as in transformers
(``num_parameters``, ``get_output_embeddings``, ``resize_token_embeddings``), or is an ``UnsupportedFeatureError``
that says what to call instead (``push_to_hub``, ``add_adapter``, ``load_adapter``); gradient checkpointing comes from
``flodl_hf.core.checkpointing``. docs/habits.md lists them with the test of each.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from flodl_hf.core.checkpointing import GradientCheckpointing
from flodl_hf.core.errors import UnsupportedFeatureError, push_to_hub_refused
from flodl_hf.core.resize import resize_token_embeddings


class ModelCalls(GradientCheckpointing):
    """The calls; ``self`` is an ``nn.Module`` with a ``config`` and ``get_input_embeddings``."""

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """transformers' count: each parameter once (a tied one once, under the name ``named_parameters`` lists it
        by), only those that require grad with ``only_trainable``, without the ``weight`` of each ``nn.Embedding``
        module with ``exclude_embeddings``."""
        skip = {f"{name}.weight" for name, module in self.named_modules()
                if isinstance(module, nn.Embedding)} if exclude_embeddings else set()
        return sum(p.numel() for name, p in self.named_parameters()
                   if name not in skip and (p.requires_grad or not only_trainable))

    def get_output_embeddings(self) -> nn.Module | None:
        """The LM head's vocabulary layer; None for a model without one (a backbone), as transformers."""
        return None

    def resize_token_embeddings(self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                                mean_resizing: bool = True) -> nn.Embedding:
        """transformers' ``resize_token_embeddings`` (``flodl_hf.core.resize``): after ``tok.add_tokens(...)``,
        ``model.resize_token_embeddings(len(tok))``."""
        return resize_token_embeddings(self, new_num_tokens, pad_to_multiple_of, mean_resizing)

    def push_to_hub(self, *args: Any, **kwargs: Any) -> None:
        """Refused: flodl-hf makes no network access (``save_pretrained``, then upload with huggingface_hub)."""
        raise push_to_hub_refused("model")

    def add_adapter(self, *args: Any, **kwargs: Any) -> None:
        """transformers' PEFT integration; flodl-hf's LoRA is ``flodl_hf.lora.add_lora``."""
        raise UnsupportedFeatureError(
            "model.add_adapter(LoraConfig): not supported (transformers' PEFT integration); flodl-hf's LoRA is "
            "flodl_hf.lora.add_lora(model, r=..., alpha=..., target_modules=[...]), the LoraConfig's fields as "
            "keywords (docs/lora.md)")

    def load_adapter(self, *args: Any, **kwargs: Any) -> None:
        """transformers' PEFT integration; flodl-hf reads a PEFT adapter with ``flodl_hf.lora.load_adapter``."""
        raise UnsupportedFeatureError(
            "model.load_adapter(directory): not supported as a model method; read a PEFT adapter with "
            "flodl_hf.lora.load_adapter(model, directory), or load_model(base, adapter=directory) (docs/lora.md)")
