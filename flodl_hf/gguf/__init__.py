"""llama.cpp's GGUF files in: config, tensors (dequantised through the `gguf` package) and tokenizer, mapped onto the
families. Sits above the families and below auto, which takes transformers' ``gguf_file=`` argument."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flodl_hf.core import io
from flodl_hf.core.modeling import meta_device
from flodl_hf.gguf.archs import ARCHS, Arch, supported
from flodl_hf.gguf.loading import architecture, config_dict, gguf_path, read_tensors
from flodl_hf.gguf.reader import GGUFFile, open_gguf


@dataclass
class GGUFSource:
    """A GGUF file opened for loading: its path, the read file, its table entry and its config dict."""

    path: Path
    file: GGUFFile
    arch: Arch
    config: dict[str, Any]

    @classmethod
    def open(cls, source: str | os.PathLike | None, gguf_file: str | os.PathLike) -> "GGUFSource":
        path = gguf_path(source, gguf_file)
        file = open_gguf(path)
        return cls(path, file, architecture(file), config_dict(file))

    @property
    def checkpoint(self) -> io.Checkpoint:
        """The file as a resolved checkpoint (its directory is the root), for the loader's messages."""
        return io.Checkpoint(str(self.path), self.path.parent, [self.path], "gguf")

    def hf_keys(self, family: Any, config: Any) -> list[str]:
        """transformers' keys of the family's causal LM for this config (the names gguf's table is asked for)."""
        with meta_device():
            model = family.build(config, "causal_lm")
        key_map = family.key_map()
        return [key_map.to_hf(k) for k in model.state_dict()]

    def tensors(self, family: Any, config: Any, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The file's tensors, dequantised to float32 (then ``dtype``) one at a time, under transformers' keys."""
        self.file.drop_metadata()  # the config is read; the tensors need only the tensor table
        return read_tensors(self.file, self.arch, self.config, self.hf_keys(family, config), dtype)


__all__ = ["ARCHS", "GGUFFile", "GGUFSource", "open_gguf", "supported"]
