"""The wheel works outside the checkout: built with ``pip wheel``, installed (not editable) into a fresh venv, and run
from a directory that is not the checkout: the families and heads, the CLI, ``fill_mask`` on a sample, ``doctor``
and the portal's saved page. Everything the code reads at run time must be inside the wheel for this to pass.

The fresh venv borrows its dependencies (torch, transformers...) from this environment through a ``.pth`` line, so
the test builds and installs only flodl-hf itself; the editable install of this checkout is not visible there (a
``.pth`` line adds a directory, it does not run that directory's ``.pth`` files)."""

from __future__ import annotations

import os
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{cmd}: {result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv holding the wheel built from this checkout; returns its bin directory."""
    work = tmp_path_factory.mktemp("wheel")
    _run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q",
          "-w", str(work / "dist")], cwd=work)
    wheels = list((work / "dist").glob("flodl_hf-*.whl"))
    assert len(wheels) == 1
    names = zipfile.ZipFile(wheels[0]).namelist()
    assert "flodl_hf/families/bert.py" in names and "flodl_hf/heads/masked_lm.py" in names
    assert not any(n.startswith(("tests/", "scripts/", "families/", "heads/")) for n in names)
    venv = work / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=work)
    purelib = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; "
                                   "print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip())
    (purelib / "borrowed_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n"
                                                      + "\n".join(site.getsitepackages()) + "\n")
    _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheels[0])],
         cwd=work)
    return venv / "bin"


def test_the_installed_wheel_is_what_runs(installed, tmp_path):
    out = _run([str(installed / "python"), "-c", "import flodl_hf, flodl_hf.families.bert, flodl_hf.heads.masked_lm;"
                "import flodl_hf.families as f; print(flodl_hf.__file__); print(f.__file__)"], cwd=tmp_path).stdout
    for line in out.split():
        assert line.startswith(str(installed.parent)) and "site-packages" in line, line


def test_the_cli_from_the_wheel(installed, tmp_path):
    assert "verify-export" in _run([str(installed / "flodl-hf"), "--help"], cwd=tmp_path).stdout


def test_fill_mask_on_a_sample_from_the_wheel(installed, tmp_path):
    from flodl_hf.core.samples import SAMPLES
    if not SAMPLES["splade"].path.is_dir():
        pytest.skip("samples/splade is not fetched (flodl-hf samples fetch)")
    out = _run([str(installed / "flodl-hf"), "fill-mask", "Paris is the [MASK] of France.", "--model",
                "samples/splade"], cwd=tmp_path).stdout
    assert "score" in out or "token_str" in out or out.strip()


def test_doctor_from_the_wheel(installed, tmp_path):
    out = _run([str(installed / "flodl-hf"), "doctor"], cwd=tmp_path, timeout=600).stdout
    assert "torch" in out and "transformers" in out


def test_the_portal_page_from_the_wheel(installed, tmp_path):
    code = ("from flodl_hf.training.records import TreeWriter; w = TreeWriter('run', ['h0']); "
            "w.event({'event': 'start', 'world_size': 1, 'total_steps': 4}); "
            "w.window({'step': 4, 'epoch': 0, 'time': 1.0}, [{'samples': 8, 'batches': 4, 'loss': 1.5, 'lr': 1e-4}])")
    _run([str(installed / "python"), "-c", code], cwd=tmp_path)
    _run([str(installed / "flodl-hf"), "portal", "run", "--save", "run.html"], cwd=tmp_path)
    page = (tmp_path / "run.html").read_text()
    assert page.lower().startswith("<!doctype html>") and "<script" in page
