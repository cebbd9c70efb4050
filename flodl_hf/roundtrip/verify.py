"""Proof that an export changed nothing: ``verify_export`` (over the whole registry: ``flodl_hf.roundtrip.matrix``).

``verify_export(DIR)`` runs, and reports as a PASS/FAIL table:

1. loadable: DIR loads into the ``AutoModelFor*`` of ``architectures[0]`` with zero missing,
   unexpected or mismatched keys (so transformers initialises nothing new);
2. weights: every exported tensor is byte-identical to its source tensor after the declared
   key renames (or equal to the source tensor cast, when the export asked for a dtype);
3. transformers on DIR against transformers on the source: every output field ``torch.equal``;
4. our native model on DIR against transformers on DIR (``flodl_hf.roundtrip.parity``): every field
   ``torch.equal``, on each attention path transformers has for the family;
5. tokenizer: DIR's tokenizer gives the source tokenizer's ids on the prompts;
6. sentence-transformers, only when DIR or its source has a modules.json: it loads DIR and the
   source into the same module list, and their ``encode`` outputs on the prompts are ``torch.equal``
   (``flodl_hf.roundtrip.carry``); a source with modules.json and a DIR without fails;
7. files: every file of DIR as the export wrote it, by the sha256s in its stamp (config.json by its
   fields other than the stamp): an edit since (labels, a tokenizer file, an added file) fails;
8. image processor, only when DIR or its source has a preprocessor_config.json: ours and transformers' on DIR and
   transformers' on the source give torch.equal pixel values (``flodl_hf.roundtrip.pixels``).

The source is the one stamped in ``config.json`` by ``flodl_hf.roundtrip.export`` unless ``source`` is
given; ``no_source`` (a fine-tuned model with no upstream) runs checks 1 and 4 only. A PEFT adapter directory
(``adapter_config.json``, no ``config.json``) gets ``verify_adapter``'s two checks instead.
Inputs are a padded batch of prompts through DIR's tokenizer, or of random ids when DIR
has no tokenizer. Float32, CPU: the domain where the project promises exactness.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from flodl_hf.roundtrip import carry
from flodl_hf.core import io
from flodl_hf.auto import build_model, config_from_dict
from flodl_hf.core.config import BaseConfig
from flodl_hf.core.errors import (AdapterError, ConfigError, FlodlHFError, InputError, SourceNotFoundError,
                                  UnsupportedModelError)
from flodl_hf.core.fs import STAMP_KEY, sha256_file, written_files
from flodl_hf.roundtrip.export import architecture_task, has_tokenizer, read_trainer_checkpoint, same_bytes
from flodl_hf.core.keys import expected, has_pooler, normalise
from flodl_hf.lora import ADAPTER_CONFIG, adapter_task, load_adapter, read_adapter_config
from flodl_hf.roundtrip.parity import REFERENCE_CLASSES, check_parity, compare_outputs, make_batch, quiet_transformers
from flodl_hf.core.registry import get_family
from flodl_hf.core.registry import get_task

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
DEFAULT_PROMPTS = ("The quick brown fox jumps over the lazy dog near the river bank.", "Hello world!")
CHECK_NAMES = {
    1: "loadable by transformers",
    2: "weights identical to source",
    3: "transformers: export vs source",
    4: "native vs transformers (export)",
    5: "tokenizer ids equal to source's",
    6: "sentence-transformers: vs source",
    7: "files unchanged since export",
    8: "image processor: pixels equal",
}


@dataclass
class Check:
    number: int
    name: str
    status: str                        # PASS, FAIL or SKIP
    detail: str
    max_abs_diff: float | None = None  # over every compared output field (checks 3 and 4)


@dataclass
class VerifyReport:
    directory: str
    architecture: str
    task: str
    source: str | None
    inputs: str
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No check failed, and at least loadability and native parity ran."""
        ran = {c.number for c in self.checks if c.status == PASS}
        return not any(c.status == FAIL for c in self.checks) and {1, 4} <= ran

    @property
    def max_abs_diff(self) -> float | None:
        diffs = [c.max_abs_diff for c in self.checks if c.max_abs_diff is not None]
        return max(diffs) if diffs else None

    def check(self, number: int) -> Check:
        return next(c for c in self.checks if c.number == number)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok, "max_abs_diff": self.max_abs_diff}

    def format_table(self) -> str:
        lines = [f"verify-export {self.directory}",
                 f"  {self.architecture} ({self.task}); source: {self.source or 'none (--no-source)'}",
                 f"  inputs: {self.inputs}",
                 f"  {'#':>2}  {'check':34} {'result':6}  detail"]
        for c in self.checks:
            lines.append(f"  {c.number:>2}  {c.name:34} {c.status:6}  {c.detail}")
        failed = [c for c in self.checks if c.status == FAIL]
        passed = sum(c.status == PASS for c in self.checks)
        if self.ok:
            lines.append(f"PASS: {passed} checks passed, {len(self.checks) - passed} skipped")
        else:
            lines.append(f"FAIL: {', '.join(str(c.number) for c in failed) or 'checks 1 and 4 did not run'}")
        return "\n".join(lines)


@dataclass
class _Source:
    label: str
    kind: str                          # "hf" or "trainer"
    stamped: bool                      # taken from the stamp (so its sha256 can be checked)
    ckpt: io.Checkpoint | None = None  # kind hf
    path: Path | None = None           # kind trainer

    def tensors(self) -> dict[str, torch.Tensor]:
        if self.kind == "trainer":
            return read_trainer_checkpoint(self.path)[1]
        return io.load_tensors(self.ckpt)

    def weight_files(self) -> list[Path]:
        return [self.path] if self.kind == "trainer" else list(self.ckpt.weight_files)


def _read_stamp(raw: dict, config_path: Path) -> dict:
    """config.json's ``flodl_hf`` stamp, its fields checked for the types export writes (an edited or
    foreign stamp is a ConfigError naming the field, not a crash further on); {} where there is none."""
    stamp = raw.get(STAMP_KEY)
    if stamp is None:
        return {}
    if not isinstance(stamp, dict):
        raise ConfigError(f"{config_path}: field {STAMP_KEY!r} is a {type(stamp).__name__}, not flodl-hf "
                          "export's stamp (a JSON object)")
    def bad(key: str, what: str) -> ConfigError:
        return ConfigError(f"{config_path}: field {STAMP_KEY}.{key} is {stamp[key]!r}, not {what}")
    for key in ("source", "format", "commit", "revision", "task", "carried_from", "tokenizer_from"):
        if stamp.get(key) is not None and not isinstance(stamp[key], str):
            raise bad(key, "a string")
    dtype = stamp.get("dtype")
    if dtype is not None and dtype != "keep" and not isinstance(getattr(torch, str(dtype), None), torch.dtype):
        raise bad("dtype", "'keep' or a torch dtype's name")
    if not isinstance(stamp.get("fresh", []), (list, bool)):
        raise bad("fresh", "a list of keys")
    for key in ("weights_sha256", "files_sha256"):
        sums = stamp.get(key)
        if sums is not None and not (isinstance(sums, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                                     for k, v in sums.items())):
            raise bad(key, "an object of file names to sha256 strings")
    return stamp


def _find_source(directory: Path, stamp: dict, source: str | None, no_source: bool) -> _Source | None:
    if no_source:
        return None
    if source is None:
        source = stamp.get("source")
        if not source:
            raise ConfigError(f"{directory / io.CONFIG_NAME}: carries no '{STAMP_KEY}' source stamp (it was not "
                              "written by flodl-hf export); pass --source SOURCE, or --no-source to run checks 1, 4 and 7")
        if stamp.get("format") == "flodl-checkpoint":
            return _Source(source, "trainer", True, path=Path(source))
        return _Source(source, "hf", True, ckpt=io.resolve(source, stamp.get("commit") or stamp.get("revision")))
    path = Path(source).expanduser()
    if path.is_file() and path.suffix in (".pt", ".pth", ".ckpt"):
        try:
            read_trainer_checkpoint(path)
            return _Source(str(path), "trainer", False, path=path)
        except FlodlHFError:
            pass
    return _Source(str(source), "hf", False, ckpt=io.resolve(source))


def _inputs(directory: Path, config: BaseConfig, task: str, prompts: list[str] | None):
    """(batch, description, tokenizer or None): prompts through DIR's tokenizer, else random ids."""
    if not has_tokenizer(directory):
        from flodl_hf.roundtrip.pixels import image_inputs
        pictures = None if prompts else image_inputs(directory, config, task)  # an image model: real pixels
        if pictures is not None:
            return (*pictures, None)
        if prompts:
            raise InputError(f"--prompt needs a tokenizer, and {directory} has no tokenizer files")
        return make_batch(config, task), "random token ids, 2 sequences padded 13/8 (no tokenizer in DIR)", None
    transformers = quiet_transformers()
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    except Exception as exc:  # transformers raises many kinds: check 5 reports it, the other checks still run
        first = (str(exc).strip().splitlines() or [""])[0]
        broken = _BrokenTokenizer(f"transformers cannot load DIR's tokenizer files ({', '.join(_tokenizer_files(directory))}): "
                                  f"{type(exc).__name__}: {first}")
        return make_batch(config, task), "random token ids (DIR's tokenizer does not load: check 5)", broken
    if tokenizer.pad_token is None:  # decoders' tokenizers (LLaMA, Mistral) often have none: pad with EOS,
        # as generation does; the mask keeps the padding out, and both models see the same batch
        if tokenizer.eos_token is None:
            raise InputError(f"{directory}: the tokenizer has neither a pad token nor an EOS token to pad the "
                             "prompts with; set pad_token in tokenizer_config.json")
        tokenizer.pad_token = tokenizer.eos_token
    texts = list(prompts or DEFAULT_PROMPTS)
    limit = min(128, getattr(config, "max_position_embeddings", 256) // 2)
    enc = tokenizer(texts, padding=True, truncation=True, max_length=limit, return_tensors="pt")
    batch = {k: enc[k] for k in ("input_ids", "attention_mask") if k in enc}
    if "token_type_ids" in enc and getattr(config, "type_vocab_size", 0):
        batch["token_type_ids"] = enc["token_type_ids"]
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and int(batch["input_ids"].max()) >= vocab:
        raise InputError(f"{directory}: the tokenizer gives ids up to {int(batch['input_ids'].max())}, beyond "
                         f"the model's vocab_size={vocab}; the tokenizer does not belong to this model")
    if task in ("mc", "double_heads"):  # (B, S) -> (B, 2 choices, S), as parity.make_batch builds it
        batch = {k: torch.stack([v.roll(c, dims=0) for c in range(2)], dim=1) for k, v in batch.items()}
    lengths = "/".join(str(int(n)) for n in enc["attention_mask"].sum(-1))
    return batch, f"{len(texts)} prompt(s) through DIR's tokenizer, padded ({lengths} tokens)", tokenizer


@dataclass
class _BrokenTokenizer:
    """DIR has tokenizer files transformers cannot load: check 5 fails with ``reason``."""
    reason: str


def _tokenizer_files(directory: Path) -> list[str]:
    from flodl_hf.roundtrip.export import TOKENIZER_FILES
    return [n for n in TOKENIZER_FILES if (directory / n).is_file()] + sorted(p.name for p in directory.glob("*.model"))


def _own_memory(model: torch.nn.Module) -> torch.nn.Module:
    """Give every parameter and buffer a fresh allocation of its own. from_pretrained memory-maps the
    safetensors file, so a tensor's address (its alignment) depends on its offset in the file, and CPU
    kernels pick paths by alignment: two byte-identical models loaded from two files may differ by 1e-9."""
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.clone()
        for module in model.modules():
            for name, buf in list(module._buffers.items()):
                if buf is not None:
                    module._buffers[name] = buf.clone()
    return model


def _check_loadable(directory: Path, task: str, architecture: str):
    transformers = quiet_transformers()
    cls = getattr(transformers, get_task(task).auto_class)
    model, info = cls.from_pretrained(str(directory), dtype=torch.float32, output_loading_info=True)
    _own_memory(model)
    problems = {name: sorted(map(str, info.get(name) or [])) for name in
                ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")}
    bad = {k: v for k, v in problems.items() if v}
    name = f"{CHECK_NAMES[1]}"
    if type(model).__name__ != architecture:
        return Check(1, name, FAIL, f"{REFERENCE_CLASSES[task]} built {type(model).__name__}, "
                                    f"config.json names {architecture}"), model.eval()
    if bad:
        detail = "; ".join(f"{k.replace('_', ' ')}: {', '.join(v[:6])}{' ...' if len(v) > 6 else ''}"
                           for k, v in bad.items())
        return Check(1, name, FAIL, detail), model.eval()
    return Check(1, name, PASS, f"{type(model).__name__}: 0 missing, 0 unexpected, 0 mismatched keys"), model.eval()


def _check_weights(directory: Path, config: BaseConfig, task: str, stamp: dict, src: _Source,
                   cast: torch.dtype | None) -> Check:
    name = CHECK_NAMES[2]
    if src.stamped and stamp.get("weights_sha256"):
        now = {f.name: sha256_file(f) for f in src.weight_files()}
        if now != stamp["weights_sha256"]:
            return Check(2, name, FAIL, f"the source's weight files changed since the export (sha256 differs "
                                        f"from the stamp): {src.label}")
    exported = io.load_tensors(io.resolve(directory))
    with torch.device("meta"):
        skeleton = build_model(config, task, add_pooling_layer=has_pooler(exported))
    shapes, aliases = expected(skeleton)
    ours = normalise(skeleton, exported, shapes, aliases)
    theirs = normalise(skeleton, src.tensors(), shapes, aliases)
    key_map = skeleton.family.key_map()
    fresh = {key_map.to_native(k) for k in stamp.get("fresh", [])}
    differ, absent, compared, nbytes = [], [], 0, 0
    for key, tensor in ours.items():
        if key not in shapes:
            continue  # not a weight of this class: check 1 reports it
        if key not in theirs:
            if key not in fresh:
                absent.append(key)
            continue
        want = theirs[key]
        if cast is not None and want.is_floating_point():
            want = want.to(cast)
        compared += 1
        nbytes += tensor.numel() * tensor.element_size()
        if not same_bytes(tensor, want):
            differ.append(f"{key} ({want.dtype}->{tensor.dtype})" if want.dtype != tensor.dtype else key)
    if differ or absent:
        parts = []
        if differ:
            parts.append(f"{len(differ)} differ: {', '.join(differ[:6])}{' ...' if len(differ) > 6 else ''}")
        if absent:
            parts.append(f"{len(absent)} not in the source: {', '.join(absent[:6])}")
        return Check(2, name, FAIL, "; ".join(parts))
    how = f"equal to the source cast to {str(cast).removeprefix('torch.')}" if cast is not None else "byte-identical"
    extra = f"; {len(fresh)} fresh (not in source)" if fresh else ""
    return Check(2, name, PASS, f"{compared} tensors ({nbytes / 1e6:.2f} MB) {how}{extra}")


def _source_reference(src: _Source, task: str, cast: torch.dtype | None):
    """transformers' model of the source, loaded as the export's is: outside inference mode, even when called
    inside it (the load, the cast and _own_memory's copies). Parameters made under inference mode are inference
    tensors, and some kernels fold them otherwise (DeBERTa's talking heads moved by 4.5e-8), so check 3 would
    compare two loads rather than two checkpoints."""
    transformers = quiet_transformers()
    cls = getattr(transformers, get_task(task).auto_class)
    with torch.inference_mode(False):
        model = cls.from_pretrained(str(src.ckpt.root), dtype=cast or torch.float32)
        return _own_memory(model.to(torch.float32)).eval()


@torch.inference_mode()
def _check_against_source(directory: Path, task: str, src: _Source, cast: torch.dtype | None, fresh: bool,
                          ref_export, batch: dict[str, torch.Tensor]) -> Check:
    name = CHECK_NAMES[3]
    if src.kind == "trainer":
        return Check(3, name, SKIP, "the source is a flodl-hf trainer checkpoint, which transformers cannot load")
    fields = None
    if fresh:  # both heads would be random: compare the backbones
        transformers = quiet_transformers()
        with torch.inference_mode(False):  # as _source_reference loads
            ref_export = _own_memory(transformers.AutoModel.from_pretrained(str(directory), dtype=torch.float32)).eval()
        task, fields = "base", ["last_hidden_state"]
        batch = {k: v.reshape(-1, v.shape[-1]) for k, v in batch.items()}
    theirs = _source_reference(src, task, cast)
    out_export, out_source = ref_export(**batch), theirs(**batch)
    fields = fields or [k for k, v in out_export.items() if isinstance(v, torch.Tensor)]
    diffs, equal = compare_outputs(out_export, out_source, fields)
    status = PASS if all(equal.values()) else FAIL
    note = " (head fresh in the export: backbones compared)" if fresh else ""
    detail = ", ".join(f"{k} {'equal' if equal[k] else f'max abs diff {diffs[k]:.3g}'}" for k in fields) + note
    return Check(3, name, status, detail, max(diffs.values()))


def _check_native(directory: Path, task: str, batch: dict[str, torch.Tensor], impls: tuple[str, ...]) -> Check:
    parts, worst, exact = [], 0.0, True
    for impl in impls:
        result = check_parity(str(directory), task, impl, batch=batch)
        if result.skipped or not result.diffs:
            return Check(4, CHECK_NAMES[4], FAIL, f"{impl}: nothing compared ({result.skipped})")
        exact &= result.exact
        worst = max(worst, *result.diffs.values())
        parts.append(f"{impl}: " + ", ".join(f"{k} {'equal' if result.equal[k] else f'{v:.3g}'}"
                                             for k, v in result.diffs.items()))
    return Check(4, CHECK_NAMES[4], PASS if exact else FAIL, "; ".join(parts), worst)


def _check_tokenizer(src: _Source | None, tokenizer, prompts: list[str], stamp: dict | None = None) -> Check:
    stamp = stamp or {}
    name = CHECK_NAMES[5]
    if tokenizer is None:
        return Check(5, name, SKIP, "DIR has no tokenizer")
    if isinstance(tokenizer, _BrokenTokenizer):
        return Check(5, name, FAIL, tokenizer.reason)
    if src is None or src.kind != "hf":
        return Check(5, name, SKIP, "no source tokenizer to compare with")
    reference, note = src.ckpt.root, ""
    recorded = stamp.get("tokenizer_from") if src.stamped else None
    if recorded and Path(recorded).resolve() != Path(src.ckpt.root).resolve():
        # the export took its tokenizer from elsewhere (--tokenizer, --like): that is what DIR must equal
        reference, note = Path(recorded), f" (the export's tokenizer came from {recorded})"
        if not reference.is_dir() or not has_tokenizer(reference):
            return Check(5, name, SKIP, f"the export's tokenizer came from {recorded}, which has no tokenizer "
                                        "files now: nothing to compare with")
    if not has_tokenizer(reference):
        return Check(5, name, SKIP, "no source tokenizer to compare with")
    theirs = quiet_transformers().AutoTokenizer.from_pretrained(str(reference))
    a, b = tokenizer(prompts), theirs(prompts)
    differ = [k for k in set(a) | set(b) if a.get(k) != b.get(k)]
    if differ:
        return Check(5, name, FAIL, f"{', '.join(sorted(differ))} differ on the prompts{note}")
    return Check(5, name, PASS, f"{', '.join(sorted(a))} equal on {len(prompts)} prompt(s){note}")


def _check_sentence(directory: Path, src: _Source | None, stamp: dict, cast: torch.dtype | None,
                    prompts: list[str]) -> Check | None:
    """Check 6; None (no row) when neither DIR nor its source is a sentence-transformers model."""
    carried_from = stamp.get("carried_from")
    layout = Path(carried_from) if carried_from and Path(carried_from).is_dir() else None
    if src is None:
        reference, why, compare = None, "--no-source", True
    elif src.kind == "hf" and (not src.stamped or layout is None or layout.resolve() == src.ckpt.root.resolve()):
        reference, why, compare = src.ckpt.root, "", True
    elif src.kind == "hf":  # the layout came from --like, the weights from the source
        reference, why, compare = layout, f"the layout came from {layout}, the weights from the source", False
    else:  # a trainer checkpoint: its carried files came from carried_from, its weights were trained
        reference, compare = layout, False
        why = "the weights were trained" if layout else "no carried_from directory to compare with"
    if not carry.is_sentence_model(directory) and not (reference and carry.is_sentence_model(reference)):
        return None
    result = carry.check_sentence_transformers(directory, reference, prompts, cast, compare, why)
    status = SKIP if result.ok is None else PASS if result.ok else FAIL
    return Check(6, CHECK_NAMES[6], status, result.detail, result.max_abs_diff)


def _guard(number: int, fn, *args) -> tuple[Check, Any]:
    """Run one check; an exception becomes its FAIL row (the table still prints)."""
    try:
        out = fn(*args)
        return out if isinstance(out, tuple) else (out, None)
    except Exception as exc:  # a crash inside a check is a failed check, named in the table
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return Check(number, CHECK_NAMES[number], FAIL, f"{type(exc).__name__}: {first}"), None


def verify_export(directory: str | os.PathLike, source: str | None = None, no_source: bool = False,
                  prompts: list[str] | None = None) -> VerifyReport:
    """Run the checks on an exported directory; see the module docstring. Never raises on a failed check."""
    directory = Path(directory).expanduser().absolute()
    if not directory.is_dir():
        raise SourceNotFoundError(f"{directory}: no such directory")
    if (directory / ADAPTER_CONFIG).is_file() and not (directory / io.CONFIG_NAME).is_file():
        return verify_adapter(directory, base=source)  # a PEFT adapter: peft loads it, ours equals peft's
    config_path = directory / io.CONFIG_NAME
    if not config_path.is_file():
        raise ConfigError(f"{directory}: no config.json, so this is not a model directory "
                          "(point verify-export at a directory written by flodl-hf export or save_pretrained)")
    raw = io.read_json(config_path, "config.json")
    io.resolve(directory)  # no weights: SourceNotFoundError names the files looked for
    architectures = raw.get("architectures") or []
    if not architectures:
        raise ConfigError(f"{config_path}: has no architectures, so the head to verify is unknown")
    config = config_from_dict(raw, str(config_path))
    try:
        task = architecture_task(architectures[0], config.model_type)
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(f"{config_path}: architectures[0] is {architectures[0]!r}: {exc}") from None
    stamp = _read_stamp(raw, config_path)
    src = _find_source(directory, stamp, source, no_source)
    # What the export declared (a cast, fresh keys) holds whichever source it is compared with.
    cast_name = stamp.get("dtype") or "keep"
    cast = None if cast_name == "keep" else getattr(torch, cast_name)
    fresh = bool(stamp.get("fresh"))
    batch, described, tokenizer = _inputs(directory, config, task, prompts)
    report = VerifyReport(str(directory), architectures[0], task, src.label if src else None, described)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check1, ref_export = _guard(1, _check_loadable, directory, task, architectures[0])
        report.checks.append(check1)
        if src is None:
            report.checks.append(Check(2, CHECK_NAMES[2], SKIP, "--no-source"))
            report.checks.append(Check(3, CHECK_NAMES[3], SKIP, "--no-source"))
        else:
            report.checks.append(_guard(2, _check_weights, directory, config, task, stamp, src, cast)[0])
            if ref_export is None:
                report.checks.append(Check(3, CHECK_NAMES[3], SKIP, "transformers cannot load DIR (check 1)"))
            else:
                report.checks.append(_guard(3, _check_against_source, directory, task, src, cast, fresh,
                                            ref_export, batch)[0])
        impls = tuple(get_family(config.model_type).attn_implementations)
        report.checks.append(_guard(4, _check_native, directory, task, batch, impls)[0])
        report.checks.append(_guard(5, _check_tokenizer, src, tokenizer, list(prompts or DEFAULT_PROMPTS), stamp)[0])
        check6 = _guard(6, _check_sentence, directory, src, stamp, cast, list(prompts or DEFAULT_PROMPTS))[0]
        report.checks += [check6] if check6 is not None else []
        report.checks.append(_guard(7, _check_files, directory, stamp)[0])
        check8 = _guard(8, _check_pixels, directory, src)[0]
        report.checks += [check8] if check8 is not None else []
    return report


def _check_pixels(directory: Path, src: _Source | None) -> Check | None:
    from flodl_hf.roundtrip.pixels import compare_processors
    found = compare_processors(directory, src.ckpt.root if src is not None and src.ckpt is not None else None)
    return None if found is None else Check(8, CHECK_NAMES[8], *found)


def _check_files(directory: Path, stamp: dict) -> Check:
    name = CHECK_NAMES[7]
    recorded = stamp.get("files_sha256")
    if recorded is None:
        return Check(7, name, SKIP, "the stamp records no files (an export written before this check, or none)")
    now = written_files(directory)
    changed = [f for f in recorded if f in now and now[f] != recorded[f]]
    problems = [f"{what}: {', '.join(names[:6])}{' ...' if len(names) > 6 else ''}"
                for what, names in (("changed", changed), ("missing", [f for f in recorded if f not in now]),
                                    ("added", [f for f in now if f not in recorded])) if names]
    if problems:
        return Check(7, name, FAIL, "; ".join(problems) + " (since the export)")
    return Check(7, name, PASS, f"{len(now)} files as the export wrote them")


# ---- verify-export on an adapter directory --------------------------------------------------------------

ADAPTER_CHECKS = {1: "loadable by peft", 2: "native vs peft (eval)"}


class AdapterVerifyReport(VerifyReport):
    """verify-export's report for an adapter directory: checks 1 (peft loads it) and 2 (outputs equal)."""

    @property
    def ok(self) -> bool:
        ran = {c.number for c in self.checks if c.status == PASS}
        return not any(c.status == FAIL for c in self.checks) and {1, 2} <= ran


def verify_adapter(directory: str | os.PathLike, base: str | None = None) -> AdapterVerifyReport:
    """Two checks: PEFT loads the adapter onto transformers' base with no missing or unexpected keys, and our
    LoRA model's eval outputs are ``torch.equal`` to PeftModel's. Returns an :class:`AdapterVerifyReport`."""
    from flodl_hf.auto import load_model
    directory = Path(directory).expanduser().absolute()
    data = read_adapter_config(directory)
    base = base or data.get("base_model_name_or_path")
    if not base:
        raise AdapterError(f"{directory / ADAPTER_CONFIG}: no base_model_name_or_path; pass --source BASE")
    task = adapter_task(data, directory)
    if task is None:
        from flodl_hf.auto import AutoConfig, task_of
        task = task_of(AutoConfig.from_pretrained(base))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a head fresh on the base comes from the adapter (modules to save)
        ours = load_model(base, task)
        load_adapter(ours, directory)
    batch = make_batch(ours.config, task)
    report = AdapterVerifyReport(str(directory), f"LoRA adapter on {ours.architecture}", task, str(base),
                                 "random token ids (parity.make_batch)")
    state: dict[str, Any] = {}

    def peft_loads() -> Check:
        try:
            import peft
        except ImportError:
            return Check(1, ADAPTER_CHECKS[1], SKIP, "peft is not installed (pip install peft)")
        transformers = quiet_transformers()
        reference = getattr(transformers, get_task(task).auto_class).from_pretrained(str(base), dtype=torch.float32)
        model = peft.PeftModel.from_pretrained(reference, str(directory)).eval()
        saved = set(peft.utils.load_peft_weights(str(directory)))
        wanted = {k.replace(".default", "") for k in peft.utils.get_peft_model_state_dict(model)}
        missing, extra = sorted(wanted - saved), sorted(saved - wanted)
        state["peft"] = model
        if missing or extra:
            return Check(1, ADAPTER_CHECKS[1], FAIL, f"missing: {missing[:6]}; unexpected: {extra[:6]}")
        return Check(1, ADAPTER_CHECKS[1], PASS,
                     f"{type(model).__name__}: {len(saved)} tensors, 0 missing, 0 unexpected")

    def equal_outputs() -> Check:
        if "peft" not in state:
            return Check(2, ADAPTER_CHECKS[2], SKIP, "peft did not load the adapter (check 1)")
        with torch.inference_mode():
            mine, theirs = ours(**batch), state["peft"](**batch)
        fields = [k for k, v in theirs.items() if isinstance(v, torch.Tensor)]
        diffs, equal = compare_outputs(mine, theirs, fields)
        detail = ", ".join(f"{k} {'equal' if equal[k] else f'max abs diff {diffs[k]:.3g}'}" for k in fields)
        return Check(2, ADAPTER_CHECKS[2], PASS if all(equal.values()) else FAIL, detail, max(diffs.values()))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for number, check in ((1, peft_loads), (2, equal_outputs)):
            try:
                report.checks.append(check())
            except Exception as exc:  # a crash inside a check is a failed check, named in the table
                first = (str(exc).strip().splitlines() or [""])[0]
                report.checks.append(Check(number, ADAPTER_CHECKS[number], FAIL, f"{type(exc).__name__}: {first}"))
    return report


