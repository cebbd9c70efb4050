"""A cut .bin is called corrupt or truncated, never unsafe; a whole .bin holding other objects is refused as unsafe.

The weights-only unpickler reads a legacy torch file cut inside a GLOBAL opcode as an unknown global, so the
reader checks whether the file's pickles parse before it blames their content."""

from __future__ import annotations

import collections

import pytest
import torch

from flodl_hf.core.errors import CheckpointFormatError
from flodl_hf.core.io import _iter_bin


class _Anything:
    """An object the weights-only unpickler refuses."""


def _message(path) -> str:
    with pytest.raises(CheckpointFormatError) as info:
        list(_iter_bin(path))
    return str(info.value)


@pytest.mark.parametrize("zipped", [False, True], ids=["legacy", "zip"])
def test_every_cut_of_a_bin_is_called_truncated_never_unsafe(tmp_path, zipped):
    whole = tmp_path / "whole.bin"
    torch.save({"encoder.weight": torch.randn(8, 8), "encoder.bias": torch.randn(8)}, whole,
               _use_new_zipfile_serialization=zipped)
    data = whole.read_bytes()
    cut = tmp_path / "pytorch_model.bin"
    kinds = collections.Counter()
    for end in range(1, len(data), 3):
        cut.write_bytes(data[:end])
        message = _message(cut)
        assert str(cut) in message
        assert "could run code" not in message, (end, message)
        assert "corrupt or truncated" in message, (end, message)
        kinds[message.split("(")[0]] += 1
    assert sum(kinds.values()) == len(range(1, len(data), 3))


@pytest.mark.parametrize("zipped", [False, True], ids=["legacy", "zip"])
def test_a_whole_bin_with_other_objects_is_refused_as_unsafe(tmp_path, zipped):
    path = tmp_path / "pytorch_model.bin"
    torch.save({"encoder.weight": torch.randn(2, 2), "hook": _Anything()}, path,
               _use_new_zipfile_serialization=zipped)
    message = _message(path)
    assert "could run code" in message and str(path) in message
