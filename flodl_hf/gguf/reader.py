"""Opening a GGUF file through the ``gguf`` package's reader (memory-mapped), with every way a file can be broken
turned into a CheckpointFormatError that names the file and the field or tensor at fault.

``gguf.GGUFReader`` maps the file and reads the header, metadata and tensor table; tensor data stays on disk until
a tensor is dequantised. Before it runs, the fixed header (magic, version, counts) is checked against the file's
size, so an absurd count is refused before anything is allocated for it; after it runs, each tensor's type, size and
extent are checked.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from flodl_hf.core.errors import CheckpointFormatError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
_HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, metadata count
# The least a metadata entry and a tensor-table entry take on disk (empty key / name): an upper bound on the counts.
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_BYTES = 8 + 4 + 8 + 4 + 8


def _gguf() -> Any:
    """The ``gguf`` package (llama.cpp's reader and writer); an ImportError that says how to get it."""
    try:
        import gguf
    except ImportError as exc:  # pragma: no cover - the test extra installs it
        raise ImportError("GGUF files need the gguf package (llama.cpp's reader): pip install 'gguf>=0.10'") from exc
    return gguf


def check_header(path: Path) -> tuple[int, int, int]:
    """The header's (version, tensor count, metadata count), each checked: the magic, a version the reader
    handles, and counts the file could hold."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise CheckpointFormatError(f"{path}: truncated GGUF: {size} bytes, shorter than the "
                                    f"{_HEADER.size}-byte header")
    magic, version, tensors, kvs = _HEADER.unpack(head)
    if magic != MAGIC:
        raise CheckpointFormatError(f"{path}: not a GGUF file: the magic is {magic!r}, expected {MAGIC!r}")
    if version not in VERSIONS:
        raise CheckpointFormatError(f"{path}: GGUF version {version}; the reader handles versions "
                                    f"{', '.join(map(str, VERSIONS))}")
    room = size - _HEADER.size
    if kvs * _MIN_KV_BYTES > room:
        raise CheckpointFormatError(f"{path}: header field kv_count is {kvs}, more metadata entries than "
                                    f"{size} bytes can hold (truncated or corrupt)")
    if tensors * _MIN_TENSOR_BYTES > room:
        raise CheckpointFormatError(f"{path}: header field tensor_count is {tensors}, more tensors than {size} "
                                    "bytes can hold (truncated or corrupt)")
    return version, tensors, kvs


class Metadata(Mapping):
    """The metadata fields as Python values, each converted when first read (a vocabulary of 10**5 strings is
    converted only if asked for); ``count`` is an array's length without converting it."""

    def __init__(self, path: Path, fields: dict[str, Any]) -> None:
        self.path, self.fields, self._values = path, fields, {}

    def __getitem__(self, key: str) -> Any:
        if key not in self._values:
            self._values[key] = _value(self.path, key, self.fields[key])
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.fields)

    def __len__(self) -> int:
        return len(self.fields)

    def count(self, key: str) -> int | None:
        """The number of elements of an array field (None: absent, or not an array)."""
        field = self.fields.get(key)
        if field is None or not field.types or field.types[0].name != "ARRAY":
            return None
        return len(field.data)


@dataclass
class GGUFFile:
    """A read GGUF file: its path, gguf's reader, the metadata (converted on first read), the tensors by name."""

    path: Path
    reader: Any
    metadata: Metadata
    tensors: dict[str, Any]

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def drop_metadata(self) -> None:
        """Free gguf's parsed metadata (its reader keeps an array per vocabulary entry: 160 MiB for a 49k
        vocabulary with its merges) once the config is read, before the tensors take their memory."""
        import gc
        self.reader.fields.clear()
        self.metadata = Metadata(self.path, {})
        gc.collect()

    def release(self) -> None:
        """Drop the map's pages from this process (the file stays in the page cache; a page read again is mapped
        again): after each tensor is dequantised, so the quantised bytes do not add to the resident set."""
        try:
            self.reader.data._mmap.madvise(mmap.MADV_DONTNEED)
        except (AttributeError, OSError, ValueError):  # no madvise here, or not a map: nothing to drop
            pass

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise CheckpointFormatError(f"{self.path}: metadata field {key} is missing")
        return self.metadata[key]


def _value(path: Path, key: str, field: Any) -> Any:
    """One metadata field as a Python value (an array as a list; a one-element scalar as itself)."""
    try:
        return field.contents()
    except Exception as exc:  # noqa: BLE001 - gguf raises many kinds on a corrupt field
        raise CheckpointFormatError(f"{path}: metadata field {key} cannot be read ({type(exc).__name__}: {exc})") \
            from None


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Read ``path`` with gguf's reader, memory-mapped: the header, metadata and tensor table are checked; no
    tensor data is read."""
    path = Path(path)
    if not path.is_file():
        from flodl_hf.core.errors import SourceNotFoundError
        raise SourceNotFoundError(f"{path}: no such GGUF file")
    check_header(path)
    gguf = _gguf()
    try:
        reader = _checked_reader(gguf, path)(path)
    except CheckpointFormatError:
        raise
    except Exception as exc:  # noqa: BLE001 - the reader raises ValueError, IndexError, KeyError... on bad bytes
        raise CheckpointFormatError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc}); it is "
                                    "truncated or corrupt") from None
    metadata = Metadata(path, dict(reader.fields))
    size = path.stat().st_size
    tensors: dict[str, Any] = {}
    for tensor in reader.tensors:
        _check_tensor(path, tensor, size, gguf)
        tensors[tensor.name] = tensor
    return GGUFFile(path, reader, metadata, tensors)


def _checked_reader(gguf: Any, path: Path) -> type:
    """gguf's reader with each tensor-table entry checked before the reader maps its data: a known type, and
    bytes inside the file (the reader itself would fail on a reshape that names no tensor)."""

    class Checked(gguf.GGUFReader):
        _key, _inside = "", False

        def _get_str(self, offset: int) -> Any:
            out = super()._get_str(offset)
            if not self._inside:  # a metadata key (the strings inside a value are read below)
                self._key = bytes(out[1]).decode("utf-8", errors="replace")
            return out

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
            if self._inside:
                return super()._get_field_parts(orig_offs, raw_type)
            self._inside = True
            try:
                if raw_type == gguf.GGUFValueType.ARRAY:
                    _check_array(path, self._key, self.data, orig_offs, gguf)
                return super()._get_field_parts(orig_offs, raw_type)
            except CheckpointFormatError:
                raise
            except Exception as exc:  # noqa: BLE001 - the reader's IndexError, ValueError... on bad bytes
                raise CheckpointFormatError(f"{path}: metadata field {self._key} cannot be read "
                                            f"({type(exc).__name__}: {exc}); the file is truncated or corrupt") \
                    from None
            finally:
                self._inside = False

        def _build_tensors(self, start_offs: int, fields: list) -> None:
            for entry in fields:
                _check_entry(path, entry, start_offs, len(self.data), gguf)
            super()._build_tensors(start_offs, fields)

    return Checked


def _check_array(path: Path, key: str, data: np.ndarray, at: int, gguf: Any) -> None:
    """An array's declared length fits in what is left of the file (the reader walks it element by element)."""
    if at + 12 > len(data):
        raise CheckpointFormatError(f"{path}: metadata field {key} is cut off (the file is truncated)")
    item_type, count = struct.unpack_from("<IQ", bytes(data[at:at + 12]))
    sizes = gguf.GGUFReader.gguf_scalar_to_np
    try:
        kind = gguf.GGUFValueType(item_type)
    except ValueError:
        raise CheckpointFormatError(f"{path}: metadata field {key} is an array of unknown type {item_type}") from None
    least = 8 if kind == gguf.GGUFValueType.STRING else 12 if kind == gguf.GGUFValueType.ARRAY \
        else np.dtype(sizes[kind]).itemsize
    if count * least > len(data) - at - 12:
        raise CheckpointFormatError(f"{path}: metadata field {key} declares {count} entries, more than the "
                                    f"{len(data) - at - 12} bytes left in the file can hold (truncated or corrupt)")


def _check_entry(path: Path, entry: Any, start: int, size: int, gguf: Any) -> None:
    _, name_data, _, dims, raw_type, offset = entry.parts
    name = bytes(name_data).decode("utf-8", errors="replace")
    code = int(raw_type[0])
    try:
        qtype = gguf.GGMLQuantizationType(code)
    except ValueError:
        raise CheckpointFormatError(f"{path}: tensor {name} has ggml type {code}, which is not a known "
                                    "quantisation type") from None
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    need = int(np.prod([int(d) for d in dims], dtype=object)) * type_size // block
    end = start + int(offset[0]) + need
    if end > size:
        raise CheckpointFormatError(f"{path}: tensor {name} runs past the end of the file (offset "
                                    f"{int(offset[0])}, {need} bytes, data from byte {start}, file {size} bytes)")


def _check_tensor(path: Path, tensor: Any, size: int, gguf: Any) -> None:
    """A tensor's type is one gguf dequantises, and its bytes lie inside the file, as many as its shape needs."""
    qtype = tensor.tensor_type
    if qtype not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) \
            and qtype not in gguf.quants._type_traits:
        raise CheckpointFormatError(f"{path}: tensor {tensor.name} is of type {qtype.name}, which gguf cannot "
                                    "dequantise")
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    elements = int(np.prod([int(d) for d in tensor.shape]))
    need = elements // block * type_size
    if elements % block or int(tensor.n_bytes) != need:
        raise CheckpointFormatError(f"{path}: tensor {tensor.name} of shape {list(map(int, tensor.shape))} and type "
                                    f"{qtype.name} does not fill whole blocks of {block}")
    if int(tensor.data_offset) + need > size or tensor.data.nbytes != need:
        raise CheckpointFormatError(f"{path}: tensor {tensor.name} runs past the end of the file (offset "
                                    f"{int(tensor.data_offset)}, {need} bytes, file {size} bytes)")
