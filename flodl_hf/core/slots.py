"""Entry points that core offers and a higher layer fills.

A few things users call on a core object need a higher layer: ``PreTrainedModel.from_pretrained`` and
``BaseConfig.from_pretrained`` need the loader (``flodl_hf.auto``), and the family registry needs every family
imported (``flodl_hf.families``). Core never imports those layers; it calls a ``Slot`` here, and the package
facade (``flodl_hf/__init__.py``, which Python runs before any submodule) fills each slot with a thin function
that imports the higher layer on first use. peft's ``mapping.py`` works the same way: empty tables that the
layers above fill.
"""

from __future__ import annotations

from typing import Any, Callable


class Slot:
    """A named entry point: empty until a higher layer fills it, then a call passes through to the filler."""

    def __init__(self, name: str, what: str) -> None:
        self.name, self.what = name, what
        self._fill: Callable[..., Any] | None = None

    def fill(self, function: Callable[..., Any]) -> None:
        self._fill = function

    @property
    def filled(self) -> bool:
        return self._fill is not None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._fill is None:
            raise RuntimeError(f"flodl_hf.core.slots.{self.name} ({self.what}) is empty: the package facade "
                               "flodl_hf/__init__.py fills it when flodl_hf is imported")
        return self._fill(*args, **kwargs)


# (cls, source, model_args, kwargs) -> a model: PreTrainedModel.from_pretrained, filled with flodl_hf.auto's loader.
LOAD_MODEL = Slot("LOAD_MODEL", "PreTrainedModel.from_pretrained's loader")
# (source, revision) -> a config: BaseConfig.from_pretrained, filled with flodl_hf.auto.AutoConfig.from_pretrained.
LOAD_CONFIG = Slot("LOAD_CONFIG", "BaseConfig.from_pretrained's loader")
# () -> None: imports every family (each registers itself), filled with `import flodl_hf.families`.
IMPORT_FAMILIES = Slot("IMPORT_FAMILIES", "the import of every model family")
# (source, gguf_file, options) -> (backend, settings): AutoTokenizer.from_pretrained(gguf_file=), filled with
# flodl_hf.gguf's tokenizer reader (tokenization sits below gguf).
READ_GGUF_TOKENIZER = Slot("READ_GGUF_TOKENIZER", "AutoTokenizer.from_pretrained's GGUF tokenizer reader")
