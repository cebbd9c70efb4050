"""Checkpoint keys: how a file's tensor names map onto a model's ``state_dict()`` keys, and back.

Our modules are named as transformers names them, so most keys map to themselves. What
does not is declared once per family, in its :class:`KeyMap`:

- the prefix (``bert.``) a task model puts its backbone under: a backbone saved without it
  loads into a task model, and a task model's file loads into a bare backbone;
- renames: invertible ``(hf, native)`` patterns, ``{}`` standing for one key segment; load
  maps hf -> native, export native -> hf, from the same table;
- legacy spellings: old names a checkpoint may still use (TF-era ``LayerNorm.gamma`` /
  ``beta``), mapped one way on load; an export writes today's names, as transformers does;
- merges (:class:`Merge`): several file tensors held as one module tensor (Mixtral's experts,
  stacked and concatenated as transformers' conversion mapping does); load merges, export splits,
  from the same declaration. Empty for every family without one, where nothing changes;
- a file layout (:class:`FileLayout`): files whose keys follow another tree than the modules'
  (Nomic BERT's and GTE's, as transformers' conversion mapping renames and splits them on load):
  load turns a file into the module layout before anything else, export turns it back last.
  None for every family whose files are in the module layout.

Loading (``flodl_hf.core.modeling.load_weights``), export and verify-export all go through this
module; nothing else maps a key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from flodl_hf.core.errors import CheckpointFormatError
from flodl_hf.core.layers import init_fresh_module_parameter

# Keys HF checkpoints carry that are not weights (buffers HF recomputes).
IGNORED_KEY = re.compile(r"(^|\.)(position_ids|token_type_ids)$")
# A backbone's pooler, wherever it is mounted.
POOLER_KEY = re.compile(r"(^|\.)pooler\.")
# transformers reads these TF-era spellings of LayerNorm parameters in any model, so every family's
# table starts with them (tests/test_keys.py loads and exports a checkpoint written with them).
LEGACY_LAYERNORM = ((".gamma", ".weight"), (".beta", ".bias"))


def has_pooler(keys: Iterable[str]) -> bool:
    """Whether a checkpoint's keys hold a pooler (so a bare backbone is built with one)."""
    return any(POOLER_KEY.search(k) for k in keys)


@dataclass(frozen=True)
class Merge:
    """One module tensor made of several file tensors, as transformers' ``WeightConverter`` with
    ``MergeModulelist(dim=0)`` then ``Concatenate(dim)`` (conversion_mapping.py), and its reverse on save.

    ``native`` is the module key's suffix; ``parts`` are the file keys' suffixes, in concatenation order, the same
    key stem before each (``model.layers.3.``: any prefix, so a task model's and a bare backbone's files both
    match). In a part, ``{}`` stands for an index (an expert): each part's tensors are stacked along dim 0 in index
    order (every index from 0, the same for every part), then the parts concatenated along ``dim`` (equal sizes, so
    export splits them evenly). A part without ``{}`` is one tensor; a single one is a suffix rename."""

    native: str
    parts: tuple[str, ...]
    dim: int = 0

    def __post_init__(self) -> None:
        if len({"{}" in part for part in self.parts}) != 1:
            raise ValueError(f"Merge {self.native!r}: every part has the index '{{}}', or none has")

    @property
    def indexed(self) -> bool:
        return "{}" in self.parts[0]

    def match_part(self, key: str) -> tuple[int, str, int | None] | None:
        """(part number, key stem, index) of a file key that is one of the parts, else None."""
        for number, part in enumerate(self.parts):
            found = re.match(r"^(.*\.)?" + re.escape(part).replace(r"\{\}", r"(\d+)") + "$", key)
            if found:
                return number, found.group(1) or "", int(found.group(2)) if self.indexed else None
        return None

    def stem(self, key: str) -> str | None:
        """The key stem of a module key ending in ``native``, else None."""
        found = re.match(r"^(.*\.)?" + re.escape(self.native) + "$", key)
        return (found.group(1) or "") if found else None

    def join(self, stem: str, parts: list[dict[int | None, torch.Tensor]]) -> torch.Tensor:
        """The module tensor from each part's tensors by index; a missing one is a CheckpointFormatError naming it."""
        indices = sorted(set().union(*parts)) if self.indexed else [None]
        expected = list(range(len(indices))) if self.indexed else [None]
        missing = [stem + part.replace("{}", str(i)) for part, got in zip(self.parts, parts)
                   for i in expected if i not in got]
        if missing or indices != expected:
            raise CheckpointFormatError(f"checkpoint: {stem + self.native} is made of {', '.join(self.parts)} "
                                        f"for every index from 0; missing: {', '.join(missing) or 'index 0'}")
        try:
            stacked = [torch.stack([got[i] for i in expected]) if self.indexed else got[None] for got in parts]
            return torch.cat(stacked, dim=self.dim) if len(stacked) > 1 else stacked[0]
        except RuntimeError as exc:  # parts of different shapes
            raise CheckpointFormatError(f"checkpoint: the tensors of {stem + self.native} ({', '.join(self.parts)}) "
                                        f"do not stack: {exc}") from None

    def split(self, stem: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """The file tensors of a module tensor: the parts split evenly along ``dim``, then unstacked by index."""
        pieces = tensor.chunk(len(self.parts), dim=self.dim) if len(self.parts) > 1 else (tensor,)
        out: dict[str, torch.Tensor] = {}
        for part, piece in zip(self.parts, pieces, strict=True):
            if self.indexed:
                out.update({stem + part.replace("{}", str(i)): t for i, t in enumerate(piece.unbind(0))})
            else:
                out[stem + part] = piece
        return out


def _swap(key: str, old: str, new: str) -> str:
    """``key`` with the dotted fragment ``old`` replaced by ``new`` wherever it stands between key segments."""
    return re.sub(rf"(^|\.){re.escape(old)}(?=\.|$)", lambda m: m.group(1) + new, key)


def _leaf(key: str, fragment: str) -> tuple[str, str] | None:
    """(stem, leaf) of ``stem + fragment + "." + leaf`` with leaf ``weight`` or ``bias``, else None."""
    found = re.match(rf"^(.*\.)?{re.escape(fragment)}\.(weight|bias)$", key)
    return (found.group(1) or "", found.group(2)) if found else None


@dataclass(frozen=True)
class FileLayout:
    """How a family's files lay its tensors out when that is not its module tree, as transformers' conversion
    mapping (conversion_mapping.py) declares it: the file layout ``save_pretrained`` writes back, mapped to and
    from the module layout (transformers' module names, which ours are). Declared by data (``Family.file_layout``);
    ``KeyMap.merge`` applies ``load`` first, ``KeyMap.to_hf_state`` applies ``save`` last.

    ``renames``: (file, module) dotted fragments (WeightRenaming), each replaced at key-segment boundaries wherever
    it stands, in order on load and in reverse order on save. ``fused``: a file fragment and the module fragments
    it holds, concatenated along dim 0 (WeightConverter with ``Chunk(dim=0)``: split evenly on load, concatenated
    on save), for ``weight`` and ``bias``. ``strip_prefix``: a leading key segment dropped on load
    (PrefixChange(prefix_to_remove=...)); save does not add it back, as a model saved from scratch does not.
    A file already in the module layout loads as it is."""

    renames: tuple[tuple[str, str], ...] = ()
    fused: tuple[tuple[str, tuple[str, ...]], ...] = ()
    strip_prefix: str | None = None

    def load(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A file's tensors in the module layout; a fused tensor whose first size does not divide by its parts is a
        CheckpointFormatError naming its file key."""
        out: dict[str, torch.Tensor] = {}
        strip = self.strip_prefix
        for key, tensor in tensors.items():
            if not isinstance(key, str):  # KeyMap.normalise names it
                out[key] = tensor
                continue
            source = key
            if strip and key.startswith(strip + "."):
                key = key[len(strip) + 1:]
            for old, new in self.renames:
                key = _swap(key, old, new)
            for fragment, parts in self.fused:
                hit = _leaf(key, fragment)
                if hit is None:
                    continue
                if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0 or tensor.shape[0] % len(parts):
                    shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                    raise CheckpointFormatError(f"checkpoint: {source} ({shape}) holds {', '.join(parts)} "
                                                f"concatenated along dim 0: its first size must divide by {len(parts)}")
                for part, piece in zip(parts, tensor.chunk(len(parts), dim=0), strict=True):
                    out[hit[0] + part + "." + hit[1]] = piece.clone()  # a tensor of its own, as a parameter is
                break
            else:
                out[key] = tensor
        return out

    def save(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Tensors in the module layout -> the file layout: each fused group concatenated (a group lacking a part,
        never a whole model's, keeps each part under its own name), then the renames reversed."""
        groups: dict[tuple[int, str, str], dict[int, torch.Tensor]] = {}
        plain: dict[str, torch.Tensor] = {}
        for key, tensor in state.items():
            hit = next(((n, i, found) for n, (_, parts) in enumerate(self.fused)
                        for i, part in enumerate(parts) if (found := _leaf(key, part)) is not None), None)
            if hit is None:
                plain[key] = tensor
            else:
                n, i, (stem, leaf) = hit
                groups.setdefault((n, stem, leaf), {})[i] = tensor
        for (n, stem, leaf), pieces in groups.items():
            fragment, parts = self.fused[n]
            if len(pieces) == len(parts):
                plain[stem + fragment + "." + leaf] = torch.cat([pieces[i] for i in range(len(parts))], dim=0)
            else:
                plain.update({stem + parts[i] + "." + leaf: t for i, t in pieces.items()})
        out: dict[str, torch.Tensor] = {}
        for key, tensor in plain.items():
            for old, new in reversed(self.renames):
                key = _swap(key, new, old)
            out[key] = tensor
        return out


class KeyMap:
    """One family's key table: backbone prefix, invertible renames, one-way legacy suffixes, regexes of keys a
    checkpoint may carry that are skipped on load (besides IGNORED_KEY), merges, and the file layout. Per key
    (``to_native`` / ``to_hf``), names are transformers' module names, which PEFT's adapters use; the file layout
    applies to whole files only (``merge``, ``to_hf_state``)."""

    def __init__(self, prefix: str, renames: tuple[tuple[str, str], ...] = (),
                 legacy: tuple[tuple[str, str], ...] = (), ignored: tuple[str, ...] = (),
                 merges: tuple[Merge, ...] = (), layout: FileLayout | None = None) -> None:
        self.prefix = prefix
        self.layout = layout
        self.merges = tuple(merges)
        self.renames = tuple(renames)
        self.legacy = tuple(legacy)
        self.ignored = tuple(ignored)
        self._ignored = re.compile("|".join(f"(?:{p})" for p in self.ignored)) if self.ignored else None
        self._fwd = [(self._compile(hf), native) for hf, native in self.renames]
        self._rev = [(self._compile(native), hf) for hf, native in self.renames]

    @staticmethod
    def _compile(pattern: str) -> re.Pattern:
        return re.compile("^" + re.escape(pattern).replace(r"\{\}", r"([^.]+)") + "$")

    @staticmethod
    def _apply(table: list, key: str) -> str:
        for regex, target in table:
            match = regex.match(key)
            if match:
                return target.format(*match.groups())
        return key

    def to_native(self, key: str) -> str:
        """A checkpoint key (today's or a legacy spelling) -> the module key (a merge's part: the merged key)."""
        for merge in self.merges:
            hit = merge.match_part(key)
            if hit is not None:
                return hit[1] + merge.native
        for old, new in self.legacy:
            if key.endswith(old):
                key = key[: -len(old)] + new
                break
        return self._apply(self._fwd, key)

    def to_hf(self, key: str) -> str:
        """A module key -> the key transformers writes (a merge of several file tensors keeps its own name here:
        ``to_hf_state`` writes its parts)."""
        for merge in self.merges:
            stem = merge.stem(key)
            if stem is not None and len(merge.parts) == 1 and not merge.indexed:
                return stem + merge.parts[0]
        return self._apply(self._rev, key)

    def module_name(self, key: str) -> str:
        """A module key -> its name in transformers' model (the renames only: a merge converts between the file and
        transformers' modules, so Mixtral's ``mlp.gate.weight`` stays that, where its file says
        ``block_sparse_moe.gate.weight``). PEFT's adapter keys follow these names."""
        return self._apply(self._rev, key)

    def to_hf_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Module tensors -> the tensors transformers' save_pretrained writes, merged ones split into their parts,
        then in the file layout."""
        out: dict[str, torch.Tensor] = {}
        for key, tensor in state.items():
            merge, stem = next(((m, s) for m in self.merges if (s := m.stem(key)) is not None), (None, None))
            if merge is None:
                out[self.to_hf(key)] = tensor
            else:
                out.update(merge.split(stem, tensor))
        return self.layout.save(out) if self.layout is not None else out

    def merge(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A file's tensors in the module layout, with each merge's parts joined into its module tensor (the rest
        as they are)."""
        if self.layout is not None:
            tensors = self.layout.load(tensors)
        if not self.merges:
            return tensors
        out: dict[str, torch.Tensor] = {}
        groups: dict[tuple[int, str], list[dict[int | None, torch.Tensor]]] = {}
        for key, tensor in tensors.items():
            hit = next(((n, h) for n, m in enumerate(self.merges) if isinstance(key, str)
                        and (h := m.match_part(key)) is not None), None)
            if hit is None:
                out[key] = tensor
                continue
            n, (part, stem, index) = hit
            groups.setdefault((n, stem), [{} for _ in self.merges[n].parts])[part][index] = tensor
        for (n, stem), parts in groups.items():
            out[stem + self.merges[n].native] = self.merges[n].join(stem, parts)
        return out

    def normalise(self, tensors: dict[str, torch.Tensor], shapes: dict[str, torch.Size],
                  aliases: dict[str, str], under_prefix: bool,
                  untied: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """A checkpoint's tensors under the model's keys. ``under_prefix``: the model is a task model
        (its backbone sits under ``prefix``); else a bare backbone. Tied copies fold into one key; a tied
        alias the file holds with *different* values than its canonical key goes to ``untied`` (when
        given): transformers 5 keeps such a file tensor and unties the pair, so we do too."""
        known = set(shapes) | set(aliases)
        state: dict[str, torch.Tensor] = {}
        for key, tensor in self.merge(tensors).items():  # no-op without merges or a file layout
            if not isinstance(key, str):
                raise CheckpointFormatError(f"state_dict key {key!r} is a {type(key).__name__}, not a tensor name (str)")
            if not isinstance(tensor, torch.Tensor):
                raise CheckpointFormatError(f"state_dict entry {key!r} is a {type(tensor).__name__}, not a tensor")
            if IGNORED_KEY.search(key) or (self._ignored is not None and self._ignored.search(key)):
                continue
            state[self.to_native(key)] = tensor
        prefix = self.prefix + "."
        if under_prefix:
            # A backbone saved without its prefix, loaded into a head model.
            if not any(k.startswith(prefix) for k in state):
                state = {(prefix + k if prefix + k in known else k): t for k, t in state.items()}
        elif any(k.startswith(prefix) for k in state):
            # A head checkpoint loaded into a bare backbone: the backbone is under the prefix, the rest is unused.
            state = {(k[len(prefix):] if k.startswith(prefix) else k): t for k, t in state.items()}
        for alias, canonical in aliases.items():
            if alias in state:
                tensor = state.pop(alias)
                if canonical not in state:
                    state[canonical] = tensor
                elif untied is not None and not _same_values(tensor, state[canonical]):
                    untied[alias] = tensor
                # else: a tied copy in the file is redundant
        return state


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    if a.dtype != b.dtype:
        b = b.to(a.dtype)
    return bool(torch.equal(a, b))


def expected(model: nn.Module) -> tuple[dict[str, torch.Size], dict[str, str]]:
    """Canonical key -> shape, and alias -> canonical key for every tied tensor, found by identity."""
    first: dict[int, str] = {}
    shapes: dict[str, torch.Size] = {}
    aliases: dict[str, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in first:
            aliases[name] = first[id(tensor)]
        else:
            first[id(tensor)] = name
            shapes[name] = tensor.shape
    return shapes, aliases


def normalise(model: nn.Module, tensors: dict[str, torch.Tensor], shapes: dict[str, torch.Size] | None = None,
              aliases: dict[str, str] | None = None,
              untied: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """``tensors`` under ``model``'s keys, by its family's KeyMap (see ``KeyMap.normalise``)."""
    if shapes is None or aliases is None:
        shapes, aliases = expected(model)
    key_map = model.family.key_map()
    if model.base_model_prefix and model.base_model_prefix != key_map.prefix:  # a task model's own mount point
        key_map = KeyMap(model.base_model_prefix, key_map.renames, key_map.legacy, key_map.ignored, key_map.merges,
                         key_map.layout)
    return key_map.normalise(tensors, shapes, aliases, bool(model.base_model_prefix), untied)


def init_fresh(owner: nn.Module, name: str, std: float) -> None:
    """Initialise one parameter that the checkpoint lacks, as transformers' ``_init_weights`` does
    (``layers.fresh_rule``: the defaults, or the module's own ``fresh_init``)."""
    with torch.no_grad():
        init_fresh_module_parameter(owner, name, std)
