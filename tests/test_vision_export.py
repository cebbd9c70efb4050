"""An export carries ``preprocessor_config.json`` byte-identical, and verify-export's check 8 compares the pixel
values of ours and transformers' processors on DIR with transformers' on the source (flodl_hf.roundtrip.pixels)."""

from __future__ import annotations

import json
import shutil

import pytest

from flodl_hf.roundtrip.export import export
from flodl_hf.roundtrip.matrix import tiny_config
from flodl_hf.roundtrip.verify import FAIL, PASS, verify_export
from helpers import make_checkpoint, one_thread  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

# a hub file as CLIP's is written: legacy int sizes, its own key order and spacing (bytes, not just fields, carried)
PROCESSOR = (b'{\n  "crop_size": 224,\n  "do_center_crop": true,\n  "do_normalize": true,\n  "do_resize": true,\n'
             b'  "feature_extractor_type": "CLIPFeatureExtractor",\n  "image_mean": [0.48145466, 0.4578275, '
             b'0.40821073],\n  "image_std": [0.26862954, 0.26130258, 0.27577711],\n  "resample": 3,\n  "size": 224\n}')


@pytest.fixture
def source(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(make_checkpoint(tiny_config("bert"), "seqcls"), src)
    (src / "preprocessor_config.json").write_bytes(PROCESSOR)
    return src


def test_export_carries_the_processor_and_verify_compares_pixels(source, tmp_path):
    out = tmp_path / "out"
    export(str(source), out)
    assert (out / "preprocessor_config.json").read_bytes() == PROCESSOR
    report = verify_export(out)
    check = report.check(8)
    assert check.status == PASS and "= the source's" in check.detail, report.format_table()
    assert report.ok, report.format_table()

    # an edited processor (another resample) in DIR: check 8 fails against the source (and check 7 on the file)
    data = json.loads(PROCESSOR)
    (out / "preprocessor_config.json").write_text(json.dumps({**data, "resample": 2}))
    report = verify_export(out)
    assert report.check(8).status == FAIL and "differ" in report.check(8).detail
    assert report.check(7).status == FAIL and not report.ok

    # DIR lost its processor while the source has one: a FAIL, not a silent skip
    (out / "preprocessor_config.json").unlink()
    assert "DIR has none" in verify_export(out).check(8).detail


def test_no_processor_no_row(tmp_path):
    src = make_checkpoint(tiny_config("bert"), "seqcls")
    export(str(src), tmp_path / "out")
    report = verify_export(tmp_path / "out")
    assert 8 not in {c.number for c in report.checks} and report.ok


def test_an_image_model_is_verified_on_real_pixels(tmp_path):
    """A ViT export: checks 3 and 4 run on the probe images through DIR's processor, not on random pixels."""
    fields = dict(model_type="vit", hidden_size=96, num_attention_heads=4, num_hidden_layers=2, intermediate_size=160,
                  image_size=40, patch_size=8, num_labels=3)
    src = tmp_path / "src"
    shutil.copytree(make_checkpoint(fields, "image_classification"), src)
    processor = {"image_processor_type": "ViTImageProcessor", "size": {"height": 40, "width": 40}}
    (src / "preprocessor_config.json").write_text(json.dumps(processor))
    export(str(src), tmp_path / "out")
    report = verify_export(tmp_path / "out")
    assert "through DIR's image processor" in report.inputs, report.format_table()
    assert report.ok and {c.number for c in report.checks if c.status == PASS} >= {1, 2, 3, 4, 7, 8}
