"""Reading a sharded trainer checkpoint (``sync="fsdp"``) on one process, without a process group or a GPU.

The trainer's sharded checkpoint is a ``torch.distributed.checkpoint`` directory beside its main file
(``step-XXXXXXXX.dcp/``): ``.metadata`` (a pickle: which file holds which slice of which tensor) and one
``__R_0.distcp`` file per worker. DCP reads its tensors with ``torch.load(weights_only=True)``, but its metadata
with a plain ``pickle.load``; :class:`SafeReader` reads the metadata with an unpickler that builds only DCP's own
metadata records and torch's sizes and dtypes (anything else is refused, never run), and refuses a file name
that leaves the directory. :func:`read_model` puts the model's shards together into whole tensors.
"""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch

from flodl_hf.core.errors import CheckpointFormatError

__all__ = ["MODEL", "OPTIMIZER", "SafeReader", "read_model"]

MODEL, OPTIMIZER = "model", "optimizer"  # the entries of the trainer's DCP state

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_DCP_METADATA, name) for name in ("Metadata", "ChunkStorageMetadata", "TensorStorageMetadata",
                                       "BytesStorageMetadata", "TensorProperties", "MetadataIndex", "StorageMeta",
                                       "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
     ("pathlib", "PurePosixPath"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's metadata records, torch's sizes, dtypes and layouts; nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name} is not a DCP metadata record")


def _reader_base() -> type:
    from torch.distributed.checkpoint import FileSystemReader
    return FileSystemReader


class SafeReader(_reader_base()):  # type: ignore[misc]
    """``FileSystemReader`` whose metadata is unpickled by an allow-list, and whose data files lie in the
    checkpoint's own directory."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(str(path))
        self.directory = Path(path)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
        where = self.directory / ".metadata"
        if kwargs.get("rank") is not None:
            where = self.directory / f"__{kwargs['rank']}.metadata"
        try:
            with open(where, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except FileNotFoundError as exc:
            raise CheckpointFormatError(f"{where}: missing; {self.directory} is not a complete sharded checkpoint "
                                        "(torch.distributed.checkpoint writes .metadata last)") from exc
        except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as exc:
            raise CheckpointFormatError(f"{where}: refused, not a torch.distributed.checkpoint metadata file "
                                        f"({type(exc).__name__}: {exc}); it was never run") from exc
        if not isinstance(metadata, Metadata):
            raise CheckpointFormatError(f"{where}: holds a {type(metadata).__name__}, not DCP's Metadata")
        for index, info in (metadata.storage_data or {}).items():
            name = str(getattr(info, "relative_path", ""))
            if not name or Path(name).name != name or name in (".", ".."):
                raise CheckpointFormatError(f"{where}: the data of {getattr(index, 'fqn', index)!r} is in "
                                            f"{name!r}, a file outside {self.directory}")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def read_model(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The whole tensors of the ``"model"`` entry of a trainer's DCP directory, on the CPU, in one process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointFormatError(f"{directory}: the sharded checkpoint's directory is missing (its main file "
                                    "names it; copy it with the main file)")
    reader = SafeReader(directory)
    metadata = reader.read_metadata()
    prefix = MODEL + "."
    state: dict[str, Any] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata):
            state[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
    if not state:
        raise CheckpointFormatError(f"{directory}: the sharded checkpoint holds no {MODEL!r} tensors")
    nested: dict[str, Any] = {MODEL: {k[len(prefix):]: v for k, v in state.items()}}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(nested, storage_reader=SafeReader(directory), no_dist=True)
    except CheckpointFormatError:
        raise
    except (Exception, CheckpointException) as exc:  # DCP wraps a reader's failure in its (BaseException) own
        raise CheckpointFormatError(f"{directory}: its shards cannot be read ({type(exc).__name__}: "
                                    f"{str(exc).splitlines()[0] if str(exc) else ''})") from exc
    return nested[MODEL]
