"""``zero_shot_image`` against ``pipeline("zero-shot-image-classification")`` with CLIP and SigLIP at real width
(both towers hidden 768, 2 layers, 224-pixel images), each with its own processor and a word-level tokenizer built
here; ``embed_image`` against CLIP's ``get_image_features``; the ``zero-shot-image`` command."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from flodl_hf.cli import main
from flodl_hf.core import samples
from flodl_hf.core.errors import InputError
from flodl_hf.roundtrip.parity import quiet_transformers
from flodl_hf.tasks.image import embed_image, zero_shot_image
from helpers import make_checkpoint, one_thread  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

TOWER = dict(hidden_size=768, num_attention_heads=12, num_hidden_layers=2, intermediate_size=3072)
CLIP = dict(model_type="clip", projection_dim=512,
            text_config=dict(TOWER, vocab_size=1024, max_position_embeddings=32, bos_token_id=1022,
                             eos_token_id=1023, projection_dim=512),
            vision_config=dict(TOWER, image_size=224, patch_size=32, projection_dim=512))
SIGLIP = dict(model_type="siglip", text_config=dict(TOWER, vocab_size=1024, max_position_embeddings=64),
              vision_config=dict(TOWER, image_size=224, patch_size=16))
WORDS = "this is a photo of an the cat dog car bird plane ship house tree".split()
LABELS = ["cat", "dog", "car", "bird in a tree", "plane"]


def word_tokenizer(out: Path, bos: str, eos: str, pad: str, length: int) -> None:
    """A word-level tokenizer (tokenizers' own classes): lower-cased words, ``eos`` appended (``bos`` first when
    given), written as tokenizer.json with its tokenizer_config.json."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    vocab = {"[UNK]": 0, "<pad>": 1, **{w: i + 3 for i, w in enumerate(WORDS + ["."])}, bos: 1022, eos: 1023}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    template = f"{bos} $A {eos}" if bos else f"$A {eos}"
    specials = [(t, vocab[t]) for t in (bos, eos) if t]
    tok.post_processor = processors.TemplateProcessing(single=template, special_tokens=specials)
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "pad_token": pad,
              "unk_token": "[UNK]", "model_max_length": length}
    (out / "tokenizer_config.json").write_text(json.dumps({**config, **({"bos_token": bos} if bos else {})}))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dual")
    out = {}
    for name, fields, processor, tokens in (
            ("clip", CLIP, "CLIPImageProcessor", ("<|startoftext|>", "<|endoftext|>", "<|endoftext|>", 32)),
            ("siglip", SIGLIP, "SiglipImageProcessor", ("", "</s>", "<pad>", 64))):
        directory = root / name
        shutil.copytree(make_checkpoint(fields, "base"), directory)
        (directory / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": processor}))
        word_tokenizer(directory, *tokens)
        out[name] = directory
    return out


def images(n: int) -> list:
    folder = samples.local_path("images")
    if folder is not None:
        return [str(p) for p in sorted(folder.glob("imagenet_*.jpg"))[:n]]
    rng = np.random.RandomState(0)
    return [Image.fromarray(rng.randint(0, 256, (90 + 7 * i, 130 - 5 * i, 3), dtype=np.uint8)) for i in range(n)]


def pipeline(directory: Path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quiet_transformers().pipeline("zero-shot-image-classification", model=str(directory), device="cpu")


@pytest.mark.parametrize("name", ["clip", "siglip"])
def test_zero_shot_image_equals_the_pipeline(models, name):
    pipe, photos = pipeline(models[name]), images(3)
    # one image: one pass on both sides, the same batch: the same scores, bit for bit
    assert zero_shot_image(photos[0], LABELS, model=models[name]) == pipe(photos[0], candidate_labels=LABELS)
    template = "a photo of the {}."
    ours = zero_shot_image(photos, LABELS, model=models[name], hypothesis_template=template)
    theirs = pipe(photos, candidate_labels=LABELS, hypothesis_template=template)
    for a, b in zip(ours, theirs):
        assert [r["label"] for r in a] == [r["label"] for r in b]
        assert max(abs(x["score"] - y["score"]) for x, y in zip(a, b)) <= 1e-6
    if name == "clip":
        assert all(abs(sum(r["score"] for r in a) - 1) < 1e-5 for a in ours)  # a softmax over the labels


def test_embed_image_is_clip_image_features(models):
    transformers = quiet_transformers()
    photos = images(2)
    reference = transformers.CLIPModel.from_pretrained(str(models["clip"])).eval()
    processor = transformers.AutoImageProcessor.from_pretrained(str(models["clip"]), use_fast=False)
    loaded = [Image.open(p).convert("RGB") if isinstance(p, str) else p for p in photos]
    with torch.inference_mode():
        expected = reference.get_image_features(**processor(loaded, return_tensors="pt"))
    expected = expected if isinstance(expected, torch.Tensor) else expected.pooler_output
    ours = embed_image(photos, model=models["clip"])
    assert ours.shape == (2, 512) and torch.equal(ours, expected)


def test_bad_labels_and_the_command(models, tmp_path, capsys):
    with pytest.raises(InputError, match="candidate_labels"):
        zero_shot_image(images(1), [], model=models["clip"])
    with pytest.raises(InputError, match="hypothesis_template"):
        zero_shot_image(images(1), LABELS, model=models["clip"], hypothesis_template="no slot")
    paths = [p for p in images(2) if isinstance(p, str)]
    if not paths:
        for i, image in enumerate(images(2)):
            image.save(tmp_path / f"photo{i}.png")
            paths.append(str(tmp_path / f"photo{i}.png"))
    assert main(["zero-shot-image", *paths, "--labels", ",".join(LABELS[:3]), "--model", str(models["clip"]),
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == zero_shot_image(paths, LABELS[:3], model=models["clip"])


@pytest.mark.parametrize("name", ["clip", "siglip"])
def test_rank_images_and_the_text_side_equal_transformers(models, name):
    from flodl_hf.tasks.image import embed_image_text, rank_images
    transformers = quiet_transformers()
    reference = transformers.AutoModel.from_pretrained(str(models[name])).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(models[name]))
    options = {"padding": "max_length", "max_length": 64, "truncation": True} if name == "siglip" else {"padding": True}
    texts = ["a photo of a cat.", "the dog is a bird in a tree"]
    with torch.inference_mode():
        expected = reference.get_text_features(**tokenizer(texts, return_tensors="pt", **options))
    expected = expected if isinstance(expected, torch.Tensor) else expected.pooler_output
    assert torch.equal(embed_image_text(texts, model=models[name]), expected)
    photos = images(3)
    ranked = rank_images(texts[0], photos, model=models[name])
    vectors = torch.nn.functional.normalize(embed_image(photos, model=models[name]), dim=-1)
    cosine = vectors @ torch.nn.functional.normalize(expected[0], dim=-1)
    assert [r["index"] for r in ranked] == cosine.argsort(descending=True).tolist()
    assert max(abs(r["score"] - cosine[r["index"]].item()) for r in ranked) <= 1e-6
    assert len(rank_images(texts[0], photos, model=models[name], top_k=2)) == 2


@pytest.mark.parametrize("name", ["clip", "siglip"])
def test_embed_and_rank_take_the_text_tower(models, name):
    """``embed(texts, model=CLIP or SigLIP)`` is the text side of the dual model (its projected features, unit
    length by default), and ``rank`` ranks texts by it."""
    from flodl_hf.tasks.embed import embed, rank
    from flodl_hf.tasks.image import embed_image_text
    texts = ["a photo of a cat.", "the dog is a bird in a tree", "a car"]
    features = embed_image_text(texts, model=models[name])
    assert torch.equal(embed(texts, model=models[name], normalize=False), features)
    assert torch.equal(embed(texts, model=models[name]), features / features.norm(p=2, dim=-1, keepdim=True))
    assert torch.equal(embed(texts[0], model=models[name], normalize=False), embed_image_text(texts[:1],
                                                                                             model=models[name])[0])
    ranked = rank("a photo of a dog.", texts, model=models[name])
    query = embed_image_text(["a photo of a dog."], model=models[name], normalize=True)[0]
    unit = embed_image_text(texts, model=models[name], normalize=True)
    assert [r["index"] for r in ranked] == sorted(range(3), key=lambda i: -float(unit[i] @ query))
    with pytest.raises(InputError, match="pooling"):
        embed(texts, model=models[name], pooling="mean")
