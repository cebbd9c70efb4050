"""GGUF out: ``export_gguf`` (``flodl-hf export --hub SOURCE --gguf OUT.gguf``) for every architecture in the table, on
checkpoints transformers generates with a byte-level BPE tokenizer and a chat template, and its proof
(``verify-export OUT.gguf --source SOURCE``): gguf reads it, transformers loads it, at f32 its logits are the
source's, ours equal transformers' on the file, the
embedded tokenizer gives the source's ids and renders its chat template. And the writes' safety: OUT is never a
partial file, ``--force`` replaces only a GGUF flodl-hf wrote, nothing is written inside the source."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from flodl_hf.core.errors import InputError, OutputExistsError
from flodl_hf.roundtrip import gguf_out
from flodl_hf.roundtrip.gguf_out import export_gguf
from flodl_hf.roundtrip.gguf_verify import verify_gguf

from decoder_checks import byte_level_tokenizer_dir
from helpers import make_checkpoint, one_thread  # noqa: F401  (one_thread: a fixture)
from test_gguf import ARCH_FIELDS

pytestmark = pytest.mark.usefixtures("one_thread")

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|endoftext|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
# transformers reads a GGUF's byte-level tokenizer under Gemma's tokenizer class, which wants its SentencePiece
# <unk>: a Gemma export is checked without the tokenizer (its source has none; the file's comes from elsewhere)
NO_TOKENIZER = {"gemma2", "gemma3_text"}
# llama.cpp's Qwen3-MoE always renormalises the top-k weights (transformers' GGUF default): a source that does not
# (norm_topk_prob False) is not the file's model
SOURCE_FIELDS = {"qwen3_moe": {"norm_topk_prob": True}}


def source_dir(model_type: str, tmp_path: Path, tokenizer: bool = True) -> Path:
    """A generated causal LM of ``model_type`` (vocab 512) with a byte-level BPE tokenizer and a chat template
    (in ``tmp_path/tok``, copied into the source with ``tokenizer``)."""
    src = tmp_path / "src"
    fields = {**ARCH_FIELDS[model_type], "vocab_size": 512, **SOURCE_FIELDS.get(model_type, {})}
    shutil.copytree(make_checkpoint(fields, "causal_lm"), src)
    tok = byte_level_tokenizer_dir("gguf", model_type, tmp_path / "tok")
    config = json.loads((tok / "tokenizer_config.json").read_text())
    (tok / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if tokenizer and (tok / name).is_file():
            shutil.copy(tok / name, src / name)
    return src


@pytest.mark.parametrize("model_type", list(ARCH_FIELDS))
def test_export_at_f32_is_the_source(model_type, tmp_path):
    src = source_dir(model_type, tmp_path, tokenizer=model_type not in NO_TOKENIZER)
    done = export_gguf(src, tmp_path / "out.gguf", outtype="f32", tokenizer=tmp_path / "tok" / model_type)
    assert done.out.is_file() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    report = verify_gguf(done.out, src)
    want = ["PASS"] * 4 + ["SKIP" if model_type in NO_TOKENIZER else "PASS"]
    assert [c.status for c in report.checks] == want, report.format_table()
    assert report.check(3).max_abs_diff == 0.0 and "torch.equal: True" in report.check(3).detail


def test_quantised_export_is_proven_against_transformers_and_reported(tmp_path):
    """q8_0: our load equals transformers' load of the file, and the difference from the source is reported."""
    src = source_dir("llama", tmp_path)
    done = export_gguf(src, tmp_path / "q8.gguf", outtype="q8_0")
    report = verify_gguf(done.out, src)
    assert report.ok and report.check(4).status == "PASS", report.format_table()
    assert "quantised" in report.check(3).detail and report.check(3).max_abs_diff > 0


def test_cli_export_and_verify(tmp_path, capsys):
    from flodl_hf.cli import main
    src = source_dir("qwen2", tmp_path)
    out = tmp_path / "cli.gguf"
    assert main(["export", "--hub", str(src), "--gguf", str(out), "--outtype", "bf16"]) == 0
    assert main(["verify-export", str(out), "--source", str(src)]) == 0
    assert "PASS: 5 checks passed" in capsys.readouterr().out


def test_the_writes_are_safe(tmp_path, monkeypatch):
    src = source_dir("qwen2", tmp_path)
    out = tmp_path / "safe.gguf"
    with pytest.raises(InputError, match="must end in .gguf"):
        export_gguf(src, tmp_path / "x.bin")
    with pytest.raises(OutputExistsError, match="inside the source"):
        export_gguf(src, src / "in.gguf")
    foreign = tmp_path / "foreign.gguf"
    foreign.write_bytes(b"not ours")
    with pytest.raises(OutputExistsError, match="already exists"):
        export_gguf(src, foreign)
    with pytest.raises(OutputExistsError, match="did not write"):
        export_gguf(src, foreign, force=True)
    assert foreign.read_bytes() == b"not ours"

    def broken(*args, **kwargs):
        raise RuntimeError("disk full")
    with monkeypatch.context() as patch:  # a write that fails leaves neither OUT nor a partial file
        patch.setattr(gguf_out, "quantise", broken)
        with pytest.raises(RuntimeError, match="disk full"):
            export_gguf(src, out, outtype="f32")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["foreign.gguf", "src", "tok"]
    first = export_gguf(src, out, outtype="f32").out.read_bytes()
    with pytest.raises(OutputExistsError, match="already exists"):
        export_gguf(src, out, outtype="f16")
    export_gguf(src, out, outtype="f16", force=True)  # ours: replaced
    assert out.read_bytes() != first and not any(p.name.endswith("gguf") for p in src.iterdir())


def test_a_trainer_checkpoint_goes_out_as_its_model(tmp_path):
    """export --checkpoint CKPT --gguf: the checkpoint's weights (here: the source's, as a trainer checkpoint holds
    them), with the tokenizer given; verified against the source at f32 like a directory."""
    import torch
    from flodl_hf.auto import load_model
    src = source_dir("qwen2", tmp_path)
    model = load_model(src, "causal_lm")
    ckpt = tmp_path / "step-00000010.pt"
    torch.save({"format": "flodl-hf/trainer-checkpoint", "version": 1, "model": model.state_dict(),
                "config": model.config.to_dict(), "step": 10, "worker": {"rng": {"torch": torch.get_rng_state()}}},
               ckpt)
    done = export_gguf(ckpt, tmp_path / "ckpt.gguf", outtype="f32", checkpoint=True, tokenizer=src)
    report = verify_gguf(done.out, src)
    assert report.ok and report.check(3).max_abs_diff == 0.0, report.format_table()


def test_a_sentencepiece_tokenizer_goes_out_as_llama_s(tmp_path):
    """A LLaMA source with a SentencePiece BPE tokenizer (the botchan sample's model, LlamaTokenizer): written as
    tokenizer.ggml.model "llama" (tokens, scores, types, merges), and the embedded tokenizer gives the source's ids."""
    from flodl_hf.core.samples import local_path
    botchan = local_path("botchan")
    if botchan is None:  # CI fetches it (flodl-hf samples fetch)
        pytest.skip("the botchan sample is not fetched (flodl-hf samples fetch botchan)")
    src = tmp_path / "src"
    shutil.copytree(make_checkpoint({**ARCH_FIELDS["mistral"], "model_type": "llama", "vocab_size": 1000,
                                     "num_hidden_layers": 1}, "causal_lm"), src)
    shutil.copy(botchan / "botchan_en_bpe_1000.model", src / "tokenizer.model")
    (src / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    done = export_gguf(src, tmp_path / "spm.gguf", outtype="f32")
    report = verify_gguf(done.out, src, prompts=["It was the fourth day of my stay in the country.", " Hello  world"])
    assert report.ok and [c.status for c in report.checks] == ["PASS"] * 5, report.format_table()
    import gguf
    assert gguf.GGUFReader(done.out).fields["tokenizer.ggml.model"].contents() == "llama"
