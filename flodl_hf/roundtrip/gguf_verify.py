"""``verify-export OUT.gguf --source SOURCE``: the proof of a GGUF export, as verify-export proves a directory.

1. gguf's reader reads the file (flodl_hf.gguf.reader: every tensor's type, size and extent checked).
2. transformers loads it: ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)``.
3. At f32 (every weight stored as F32), transformers' logits on the file are torch.equal to transformers' logits on
   the source; at other types, the largest difference from the source is reported (a quantised file is not the
   source).
4. Our load of the file and transformers' load of it give torch.equal logits.
5. The embedded tokenizer (transformers' ``gguf_file=`` tokenizer) gives the source tokenizer's ids on the prompts,
   and its chat template renders the source's text.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch

from flodl_hf.core.errors import InputError
from flodl_hf.gguf.reader import open_gguf
from flodl_hf.roundtrip.export import has_tokenizer
from flodl_hf.roundtrip.parity import quiet_transformers
from flodl_hf.roundtrip.verify import DEFAULT_PROMPTS, FAIL, PASS, SKIP, Check, VerifyReport

NAMES = {1: "gguf's reader reads the file", 2: "transformers loads it (gguf_file=)",
         3: "transformers: file vs source", 4: "ours vs transformers (same file)", 5: "tokenizer and chat template"}
CHAT = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "What is the capital of France?"}]


def _check(number: int, fn: Any, *args: Any) -> tuple[Check, Any]:
    """One check; an exception becomes its FAIL row."""
    try:
        out = fn(*args)
        return out if isinstance(out, tuple) else (out, None)
    except Exception as exc:  # noqa: BLE001 - a crash inside a check is a failed check, named in the table
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return Check(number, NAMES[number], FAIL, f"{type(exc).__name__}: {first}"), None


def _read(path: Path) -> tuple[Check, Any]:
    file = open_gguf(path)
    types = {t.tensor_type.name for t in file.tensors.values()}
    return Check(1, NAMES[1], PASS, f"{len(file.tensors)} tensors ({', '.join(sorted(types))}), "
                 f"architecture {file.get('general.architecture')}"), file


def _transformers_model(path: Path) -> tuple[Check, Any]:
    model = quiet_transformers().AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)
    return Check(2, NAMES[2], PASS, type(model).__name__), model.eval()


def _batch(tokenizer: Any, vocab: int, prompts: list[str]) -> dict[str, torch.Tensor]:
    if tokenizer is None:
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (2, 12), generator=gen)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return dict(tokenizer(prompts, return_tensors="pt", padding=True))


def _against_source(theirs: Any, reference: Any, batch: dict, exact: bool) -> Check:
    with torch.no_grad():
        got, want = theirs(**batch).logits, reference(**batch).logits
    diff = float((got - want).abs().max())
    if exact:
        status = PASS if torch.equal(got, want) else FAIL
        return Check(3, NAMES[3], status, f"f32: logits torch.equal: {status == PASS} (max abs diff {diff:.3g})",
                     max_abs_diff=diff)
    return Check(3, NAMES[3], PASS, f"quantised: max abs diff from the source {diff:.3g} (reported, not a "
                 "failure)", max_abs_diff=diff)


def _ours_equal(path: Path, theirs: Any, batch: dict) -> Check:
    from flodl_hf.auto import load_model
    ours = load_model(path.parent, "causal_lm", gguf_file=path.name)
    with torch.no_grad():
        equal = torch.equal(ours(**batch).logits, theirs(**batch).logits)
    return Check(4, NAMES[4], PASS if equal else FAIL, f"logits torch.equal: {equal}", max_abs_diff=None)


def _tokenizer(path: Path, source: Any, prompts: list[str]) -> Check:
    transformers = quiet_transformers()
    embedded = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    same_ids = embedded(prompts)["input_ids"] == source(prompts)["input_ids"]
    detail = [f"ids equal on {len(prompts)} prompts: {same_ids}"]
    same_chat = True
    if getattr(source, "chat_template", None):
        rendered = [t.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) for t in (embedded, source)]
        same_chat = rendered[0] == rendered[1]
        detail.append(f"chat template renders the same: {same_chat}")
    return Check(5, NAMES[5], PASS if same_ids and same_chat else FAIL, "; ".join(detail))


def verify_gguf(path: str | os.PathLike, source: str | os.PathLike, prompts: list[str] | None = None) -> VerifyReport:
    """Run the checks on a GGUF file against ``source`` (an HF directory); never raises on a failed check."""
    path = Path(path).expanduser().absolute()
    if source is None:
        raise InputError(f"verify-export {path}: a GGUF file is verified against its source: pass --source SOURCE")
    prompts = list(prompts or DEFAULT_PROMPTS)
    transformers = quiet_transformers()
    report = VerifyReport(str(path), "", "causal_lm", str(source), "")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check1, file = _check(1, _read, path)
        report.checks.append(check1)
        if file is None:
            return report
        report.architecture = str(file.get("general.architecture"))
        check2, theirs = _check(2, _transformers_model, path)
        report.checks.append(check2)
        source_tok = None
        if has_tokenizer(Path(source)):
            source_tok = transformers.AutoTokenizer.from_pretrained(str(source))
        reference = transformers.AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32).eval()
        batch = _batch(source_tok, reference.config.vocab_size, prompts)
        report.inputs = f"{len(prompts)} prompts" if source_tok is not None else "random ids (no tokenizer)"
        exact = all(t.tensor_type.name == "F32" for t in file.tensors.values())
        if theirs is None:
            for number in (3, 4):
                report.checks.append(Check(number, NAMES[number], SKIP, "transformers cannot load the file"))
        else:
            report.checks.append(_check(3, _against_source, theirs, reference, batch, exact)[0])
            report.checks.append(_check(4, _ours_equal, path, theirs, batch)[0])
        if source_tok is None:
            report.checks.append(Check(5, NAMES[5], SKIP, "the source has no tokenizer"))
        else:
            report.checks.append(_check(5, _tokenizer, path, source_tok, prompts)[0])
    return report
