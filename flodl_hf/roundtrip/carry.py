"""The files that describe a model, carried into its export byte for byte.

An export rewrites the weights and ``config.json`` from our native modules. Every other file
that a HuggingFace library reads to use the model is copied from the source, unchanged:

- the model card (``README.md``) and licence files (``LICENSE*``, ``NOTICE``); a trainer checkpoint's export
  writes a fine-tune's card of its own instead (:func:`fine_tune_card`), unless ``--like`` names one;
- the sentence-transformers layout: ``modules.json``, each module folder it names (``1_Pooling/``,
  ``2_Dense/``...), whole and with its own weights (the export does not rewrite them), and
  ``config_sentence_transformers.json``, ``sentence_bert_config.json`` (older ``sentence_*_config.json``);
- ``generation_config.json``;
- ``preprocessor_config.json``, an image model's processor (flodl_hf.vision), so the export sees pixels as the source;
- the tokenizer's own files (``TOKENIZER_NAMES`` and SentencePiece ``*.model``). They replace
  what transformers' ``save_pretrained`` wrote, so the export tokenizes exactly as the source;
  what the source lacks (a ``tokenizer.json`` converted from a ``vocab.txt``) stays as
  transformers wrote it.

Never carried: weights of the model itself (the export writes its own), ``config.json``, any
other file at the root (training scripts, data lists, dotfiles) and any folder ``modules.json``
does not name. Only regular files inside the source are read: a symlink is followed only when
it stays inside (into the hub cache's ``blobs/`` for a hub snapshot), and a module path that is
absolute or has ``..`` is refused. Every check runs in :func:`plan`, before anything is written.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from flodl_hf.core import io
from flodl_hf.core.errors import CheckpointFormatError, ConfigError
from flodl_hf.core.source_files import MODULES_NAME, allowed_roots, checked_file, inside, module_path, read_modules

CARD_NAME = "README.md"
# Root files that describe the model (fnmatch patterns), taken from the description source.
DESCRIPTION_NAMES = ("README.md", "LICENSE", "LICENSE.*", "NOTICE", MODULES_NAME, "config_sentence_transformers.json",
                     "sentence_*_config.json", "generation_config.json", "preprocessor_config.json")
# Root files of the tokenizer, taken from the tokenizer source.
TOKENIZER_NAMES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.txt", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json", "*.model")


@dataclass(frozen=True)
class Carried:
    """One file to copy: ``name`` (a relative POSIX path, the same in source and export) under ``root``."""

    name: str
    root: Path
    kind: str  # "description", "tokenizer" or "module"


@dataclass
class CarryPlan:
    """What an export copies, from where, and what it should say about it."""

    files: list[Carried] = field(default_factory=list)
    description_root: Path | None = None
    tokenizer_root: Path | None = None
    why: str = "the source"     # where description_root came from, for the note
    notes: list[str] = field(default_factory=list)
    card: str | None = None     # a model card written in place of the source's (a fine-tune's, fine_tune_card)

    @property
    def names(self) -> list[str]:
        return sorted(f.name for f in self.files)

    def copy_into(self, directory: Path) -> list[str]:
        """Copy every planned file into ``directory`` (each re-checked first); returns the names copied."""
        for item in self.files:
            source = checked_file(item.root, item.name)
            target = directory / item.name
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
            except (FileExistsError, NotADirectoryError):
                raise ConfigError(f"{item.root / MODULES_NAME}: the module folder of {item.name} would replace "
                                  "a file the export writes; rename the module folder") from None
            shutil.copyfile(source, target)
        if self.card is not None:
            (directory / CARD_NAME).write_text(self.card, encoding="utf-8")
        return self.names

    def note(self) -> str | None:
        if not self.files:
            return None
        described = [f.name for f in self.files if f.kind != "tokenizer"]
        tokenizer = [f.name for f in self.files if f.kind == "tokenizer"]
        parts = []
        if described:
            parts.append(f"{_summary(described)} from {self.description_root} ({self.why})")
        if tokenizer:
            where = "the same directory" if self.tokenizer_root == self.description_root else str(self.tokenizer_root)
            parts.append(f"tokenizer files {', '.join(sorted(tokenizer))} from {where}")
        return "carried byte-identical: " + "; ".join(parts)


def _summary(names: list[str]) -> str:
    """'README.md, modules.json, 1_Pooling/ (1 file)': module folders counted, not listed."""
    top: dict[str, int] = {}
    for name in names:
        head, _, rest = name.partition("/")
        key = f"{head}/" if rest else head
        top[key] = top.get(key, 0) + 1
    return ", ".join(k if not k.endswith("/") else f"{k} ({n} file{'s' * (n > 1)})" for k, n in sorted(top.items()))


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _root_files(root: Path, patterns: tuple[str, ...], kind: str) -> list[Carried]:
    out = []
    for entry in sorted(os.listdir(root)):
        if not entry.startswith(".") and _matches(entry, patterns):
            checked_file(root, entry)
            out.append(Carried(entry, root, kind))
    return out


def _is_transformer(entry: dict) -> bool:
    # sentence-transformers < 5 writes sentence_transformers.models.Transformer, 6 writes
    # sentence_transformers.base.modules.transformer.Transformer: the class name is the same.
    return str(entry.get("type", "")).rpartition(".")[2] == "Transformer"


def _module_files(root: Path) -> tuple[list[Carried], list[str]]:
    """The files of every module folder modules.json names, and notes."""
    where = root / MODULES_NAME
    entries = read_modules(root)
    paths = [module_path(e, i, where) for i, e in enumerate(entries)]
    moved = [p for e, p in zip(entries, paths) if _is_transformer(e) and p is not None]
    if moved:
        # The Transformer's weights would come from that folder, not from the root the export
        # writes: carrying it would carry old weights, leaving it out would break the layout.
        return [], [f"{where} places the Transformer in {moved[0]}/, not at the model root that the export "
                    "writes: the sentence-transformers layout (modules.json and its folders) is not carried"]
    allowed = allowed_roots(root)
    files: list[Carried] = []
    for index, rel in enumerate(paths):
        if rel is None:
            continue  # the root: only its named files (DESCRIPTION_NAMES) are carried
        folder = root / rel
        for step in [root / p for p in reversed(rel.parents[:-1])] + [folder]:
            if step.is_symlink() and not inside(step.resolve(), [root.resolve()]):
                raise CheckpointFormatError(f"{where}: entry {index}'s folder {step} is a symlink to "
                                            f"{step.resolve()}, outside the source: refused, nothing was written")
        if not folder.exists():
            continue  # a module with no files of its own (Normalize in older layouts)
        if not folder.is_dir():
            raise ConfigError(f"{where}: entry {index}'s path {rel.as_posix()!r} is a file, not a module folder; "
                              "nothing was written")
        if not inside(folder.resolve(), allowed):
            raise CheckpointFormatError(f"{where}: entry {index}'s folder {folder} resolves outside the source; "
                                        "refused, nothing was written")
        for current, dirs, names in os.walk(folder):
            for d in dirs:
                if os.path.islink(os.path.join(current, d)):
                    raise CheckpointFormatError(f"{os.path.join(current, d)}: a symlinked folder inside module "
                                                f"folder {rel.as_posix()}: refused, nothing was written")
            for name in sorted(names):
                relname = Path(current, name).relative_to(root).as_posix()
                checked_file(root, relname)
                files.append(Carried(relname, root, "module"))
    return files, []


# ---- the plan -----------------------------------------------------------------------------------------

def plan(description_root: Path | None, tokenizer_root: Path | None, why: str = "the source") -> CarryPlan:
    """Every file to carry, checked; raises before anything is written. ``description_root``: where the
    model card and sentence-transformers layout come from; ``tokenizer_root``: the tokenizer's files."""
    result = CarryPlan(description_root=description_root, tokenizer_root=tokenizer_root, why=why)
    if description_root is None:
        result.notes.append(f"no model card, sentence-transformers layout or tokenizer carried: {why}")
    if description_root is not None and Path(description_root).is_dir():
        root = Path(description_root)
        described = _root_files(root, DESCRIPTION_NAMES, "description")
        if (root / MODULES_NAME).exists() or (root / MODULES_NAME).is_symlink():
            modules, notes = _module_files(root)
            result.notes += notes
            if notes:  # the layout is not carried: neither its modules.json
                described = [f for f in described if f.name != MODULES_NAME]
            result.files += modules
        result.files += described
    if tokenizer_root is not None and Path(tokenizer_root).is_dir():
        result.files += _root_files(Path(tokenizer_root), TOKENIZER_NAMES, "tokenizer")
    unique: dict[str, Carried] = {}
    for item in result.files:  # two module entries may name one folder, or nested ones
        unique.setdefault(item.name, item)
    result.files = list(unique.values())
    return result


# ---- a fine-tune's own model card ----------------------------------------------------------------------

def hub_id(root: Path | None) -> str | None:
    """``org/name`` of a hub cache snapshot (``.../models--org--name/snapshots/REV``) or of a sample that is a copy
    of a hub repo (``samples/minilm``), else None."""
    from flodl_hf.core.samples import SAMPLES
    if root is None:
        return None
    real = Path(root).resolve()
    for sample in SAMPLES.values():
        if sample.hub and real == sample.path.resolve():
            return sample.hub
    repo = real.parent.parent.name if real.parent.name == "snapshots" else ""
    return repo[len("models--"):].replace("--", "/") if repo.startswith("models--") else None


def fine_tune_card(plan: CarryPlan, checkpoint: Path, data: dict, architecture: str, task: str) -> None:
    """Write a fine-tune's model card instead of carrying the base model's: the base card describes the base
    (its task, its evaluation, its intended use), not what the checkpoint was trained into. As transformers'
    Trainer.create_model_card: the base's ``license`` and ``language`` kept, ``base_model`` named (a hub id,
    where the base is a hub snapshot), ``library_name: transformers``. The base's card is read with
    huggingface_hub's ModelCard (its YAML metadata); one without metadata gives none."""
    from huggingface_hub import ModelCard, ModelCardData
    if plan.description_root is None:
        return
    base_card = next((f for f in plan.files if f.name == CARD_NAME and f.kind == "description"), None)
    base = Path(plan.description_root)
    meta: dict = {}
    if base_card is not None:
        try:
            meta = ModelCard(checked_file(base_card.root, CARD_NAME).read_text(encoding="utf-8")).data.to_dict()
        except (ValueError, UnicodeDecodeError, OSError) as exc:  # a card whose YAML does not parse
            plan.notes.append(f"{base / CARD_NAME}: its metadata could not be read ({exc}); the card names no licence")
        plan.files = [f for f in plan.files if f is not base_card]
    repo = hub_id(base)
    card_data = ModelCardData(base_model=repo, library_name="transformers", license=meta.get("license"),
                              language=meta.get("language"), tags=["flodl-hf"])
    named = f"[`{repo}`](https://huggingface.co/{repo})" if repo else f"`{base}`"
    trained = ", ".join(f"{data[k]} {k}" for k in ("step", "epoch", "samples")
                        if isinstance(data.get(k), int) and not isinstance(data.get(k), bool))
    body = (f"# {architecture}\n\nThis model is a fine-tuned version of {named}, exported by flodl-hf from the "
            f"trainer checkpoint `{checkpoint.name}`{f' ({trained})' if trained else ''}, as `{architecture}` "
            f"(task `{task}`).\n\nThe base model's card describes the base model and is not copied here"
            f"{'' if base_card is not None else ' (it has none)'}; its licence files are. More information "
            "needed: the data it was trained on, its intended uses and its evaluation.\n")
    plan.card = f"---\n{card_data.to_yaml()}\n---\n\n{body}"
    plan.notes.append(f"{CARD_NAME} written for the fine-tune (base_model "
                      f"{repo or base}{', licence ' + str(meta['license']) if meta.get('license') else ''}); the "
                      f"base model's card is not copied: pass --like DIR (like=) to carry a card of your own")


def recorded_source(checkpoint: Path) -> Path | None:
    """The directory a trainer checkpoint's model was loaded from (its ``source`` entry), if recorded.

    Read with ``mmap``: the tensors are not loaded.
    """
    import torch
    try:
        data = torch.load(str(checkpoint), map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # read_trainer_checkpoint already reported an unreadable file
        return None
    source = data.get("source") if isinstance(data, dict) else None
    return Path(source) if isinstance(source, str) and source else None


def checkpoint_roots(checkpoint: Path, tokenizer: Path | None, like: Path | None) -> tuple[Path | None, Path | None, str]:
    """(description root, tokenizer root, why) for a trainer checkpoint: ``like``, else ``tokenizer``,
    else the source the checkpoint records; the tokenizer from ``tokenizer``, else the same."""
    if like is not None:
        root, why = like, "--like"
    elif tokenizer is not None:
        root, why = tokenizer, "--tokenizer"
    else:
        recorded = recorded_source(checkpoint)
        if recorded is None:
            return None, None, ("the checkpoint records no source directory; pass --like DIR (like=) to carry "
                                "them from the model it was trained from")
        if not recorded.is_dir():
            return None, None, f"the checkpoint's recorded source {recorded} is gone; pass --like DIR (like=)"
        root, why = recorded, "the checkpoint's recorded source"
    return root, tokenizer or root, why


def like_root(like: str | os.PathLike) -> Path:
    """A ``--like`` source as a directory: a local directory or anything io.resolve knows."""
    path = Path(like).expanduser()
    return path if path.is_dir() else io.resolve(like).root


# ---- verify-export: sentence-transformers reads the export as it reads the source ---------------------

@dataclass
class SentenceCheck:
    """The outcome of :func:`check_sentence_transformers`: ``ok`` None when skipped."""

    ok: bool | None
    detail: str
    max_abs_diff: float | None = None


def _load_sentence_model(directory: Path, dtype):
    """sentence-transformers' model of ``directory`` on CPU, loaded in ``dtype``, run in float32."""
    import logging

    import torch
    from sentence_transformers import SentenceTransformer
    logging.getLogger("sentence_transformers").setLevel(logging.ERROR)
    model = SentenceTransformer(str(directory), device="cpu", model_kwargs={"dtype": dtype})
    return model.to(dtype=torch.float32).eval()


def is_sentence_model(directory: Path) -> bool:
    """A sentence-transformers model directory: it has a modules.json."""
    return (Path(directory) / MODULES_NAME).is_file()


def module_names(model) -> list[str]:
    return [type(m).__name__ for m in model]


def check_sentence_transformers(directory: Path, reference: Path | None, prompts: list[str], cast=None,
                                compare_outputs: bool = True, why_no_reference: str = "") -> SentenceCheck:
    """sentence-transformers loads ``directory`` and ``reference`` into the same module list, and
    (``compare_outputs``) their ``encode`` outputs on ``prompts`` are ``torch.equal``. Fails when
    ``reference`` has a modules.json and ``directory`` has none; ``ok`` None (skipped) when neither has.

    ``cast``: the dtype the export was cast to; the reference is loaded in it too, then both run in float32.
    """
    import torch
    if reference is None:
        return SentenceCheck(None, why_no_reference or "no source to compare with")
    if not (Path(directory) / MODULES_NAME).is_file():
        if (Path(reference) / MODULES_NAME).is_file():  # the layout was lost on the way
            return SentenceCheck(False, f"{reference} is a sentence-transformers model (modules.json), DIR has no "
                                        "modules.json: sentence-transformers would load it without its modules")
        return SentenceCheck(None, "DIR has no modules.json (not a sentence-transformers model)")
    try:
        import sentence_transformers  # noqa: F401
    except ImportError:
        return SentenceCheck(None, "sentence-transformers is not installed (pip install sentence-transformers)")
    dtype = cast or torch.float32
    ours, theirs = _load_sentence_model(directory, dtype), _load_sentence_model(reference, dtype)
    a, b = module_names(ours), module_names(theirs)
    if [type(m) for m in ours] != [type(m) for m in theirs]:
        return SentenceCheck(False, f"modules differ: export {' -> '.join(a)}, source {' -> '.join(b)}")
    if not compare_outputs:
        return SentenceCheck(True, f"{' -> '.join(a)} in both; embeddings not compared ({why_no_reference})")
    with torch.inference_mode():
        x = ours.encode(list(prompts), convert_to_tensor=True, show_progress_bar=False)
        y = theirs.encode(list(prompts), convert_to_tensor=True, show_progress_bar=False)
    diff = (x.float() - y.float()).abs().max().item() if x.shape == y.shape else float("inf")
    equal = x.shape == y.shape and torch.equal(x, y)
    what = f"{' -> '.join(a)} in both; encode on {len(prompts)} prompt(s), shape {tuple(x.shape)}"
    return SentenceCheck(equal, f"{what}: {'equal' if equal else f'max abs diff {diff:.3g}'}", diff)
