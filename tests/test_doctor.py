"""``flodl-hf doctor``: what it reports is this machine's, and its parity self-test is a real comparison."""

from __future__ import annotations

import json

import torch

from flodl_hf.cli import main
from flodl_hf.roundtrip.doctor import PROOF_FULL_ROWS, PROOF_GATHERED, Report, machine


def test_doctor_reports_machine_proofs_and_exact_parity(capsys):
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["machine"] == machine()
    assert report["machine"]["threads"] == str(torch.get_num_threads())
    # Each proof is a verdict of this machine for one (full rows, gathered rows) class, whatever it is.
    assert {(p["full_rows"], p["gathered_rows"]) for p in report["proofs"]} == \
        {(r, m) for r in PROOF_FULL_ROWS for m in PROOF_GATHERED}
    assert all(isinstance(p["equal"], bool) for p in report["proofs"])
    # The self-test compares against transformers on both attention paths and two heads.
    assert {(p["task"], p["attn"]) for p in report["parity"]} == {(t, a) for t in ("base", "mlm")
                                                                   for a in ("sdpa", "eager")}
    assert report["exact"] and all(p["max_abs_diff"] == 0 for p in report["parity"])
    # The text form says the same.
    text = Report(report["machine"], report["proofs"], report["parity"], report["seconds"]).format()
    assert machine()["cpu"] in text and "exact on this machine" in text and "NOT" not in text


def test_doctor_says_whether_torch_and_transformers_lie_in_the_tested_range():
    import transformers

    from flodl_hf.core.version import TESTED_RANGE, tested
    from flodl_hf.roundtrip.doctor import _range_line
    line = machine()["tested range"]
    inside = tested("torch", torch.__version__) and tested("transformers", transformers.__version__)
    assert line.endswith("both inside") == inside
    for name, (low, high) in TESTED_RANGE.items():
        assert f"{name} {low} to {high}" in line
    assert _range_line({"torch": "2.4.1+cu121", "transformers": "5.25.0"}).endswith(
        "OUTSIDE (torch 2.4.1+cu121: untested here)")
    assert _range_line({"torch": "2.14.1", "transformers": "5.24.0"}).endswith("both inside")
    assert not tested("transformers", "5.23.0") and not tested("torch", "2.15.0")
