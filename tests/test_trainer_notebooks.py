"""The notebooks run end to end (small setting) on the real samples, when those are in the cache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
NEEDS = {"01": ("minilm", "sms-spam"), "02": ("splade", "botchan"), "03": ("minilm", "sms-spam"),
         "04": ("minilm", "sms-spam"), "05": ("mnist",), "06": ("smollm2", "sms-spam"), "07": ("smollm2",)}


def _missing_samples(names: tuple[str, ...]) -> list[str]:
    try:
        from flodl_hf.core.samples import local_path
    except ImportError as exc:  # the samples module is not there yet
        return [f"flodl_hf.core.samples ({exc})"]
    return [n for n in names if local_path(n) is None]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nbformat = pytest.importorskip("nbformat", reason="executing notebooks needs nbformat, nbclient, ipykernel")
    nbclient = pytest.importorskip("nbclient", reason="executing notebooks needs nbformat, nbclient, ipykernel")
    pytest.importorskip("ipykernel", reason="executing notebooks needs nbformat, nbclient, ipykernel")
    missing = _missing_samples(NEEDS[path.stem[:2]])
    if missing:
        pytest.skip(f"samples not in the cache: {', '.join(missing)} (run `flodl-hf samples fetch`)")
    monkeypatch.setenv("FLODL_HF_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    book = nbformat.read(path, as_version=4)
    # Runs in tmp_path, so what the notebook writes (runs/...) stays out of the repository.
    nbclient.NotebookClient(book, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in book.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
