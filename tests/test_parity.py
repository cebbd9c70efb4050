"""Bit-exact parity with transformers for every (family variant x head x attention path) case.

Each case builds a transformers checkpoint at test time, then loads it natively and with
transformers in this process and compares every output field with ``torch.equal``.
"""

from __future__ import annotations

import pytest

from flodl_hf.roundtrip.parity import check_parity
from flodl_hf.core.registry import get_family

from cases import CASES
from helpers import make_checkpoint

pytestmark = pytest.mark.range_end  # also run at the other end of the supported range


def _params():
    for case_id, task, fields in CASES:
        impls = get_family(fields["model_type"]).attn_implementations
        for impl in impls:
            yield pytest.param(task, fields, impl, id=f"{case_id}-{impl}")


@pytest.mark.parametrize("task,fields,impl", list(_params()))
def test_parity_exact(task, fields, impl):
    source = make_checkpoint(fields, task)
    result = check_parity(source, task, impl)
    assert result.skipped is None, result.skipped
    assert result.diffs, "nothing was compared"
    assert result.exact, f"not bit-exact: {result.diffs}"
