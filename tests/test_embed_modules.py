"""embed on sentence-transformers directories saved by sentence-transformers itself: every Pooling mode
(the current ``pooling_mode`` spelling and the legacy booleans, several modes concatenated), Dense and
Normalize from modules.json, equal (torch.equal) to sentence-transformers' own encode; and the typed
errors for the modules, modes and options embed does not run.

Both sides forward one text at a time (``batch_size=1``), so no row is padded and the results are
bit-equal. The checkpoints are BERTs of realistic width (hidden 384, head_dim 64)."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from flodl_hf import ConfigError, InputError, embed
from helpers import one_thread  # noqa: F401  (the fixture)
from test_tasks import TOKENIZERS, task_dir

pytest.importorskip("sentence_transformers")
from sentence_transformers import SentenceTransformer, models  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/helpers.py

WIDE = dict(hidden_size=384, num_attention_heads=6, intermediate_size=768, num_hidden_layers=2)
TEXTS = ["hello", "Paris is the capital of France.",
         "John Smith lives in New York and works for Google, where the weather is sunny almost every day."]


def _save(modules: list, directory: Path, **options) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        SentenceTransformer(modules=modules, device="cpu").save(str(directory), **options)
    return directory


def _transformer(base: Path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return models.Transformer(str(base))


def _theirs(directory: Path, **options) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = SentenceTransformer(str(directory), device="cpu")
        return model.encode(TEXTS, convert_to_tensor=True, batch_size=1, **options)


@pytest.fixture(scope="module")
def base() -> Path:
    return task_dir(TOKENIZERS[0], "base", **WIDE)


@pytest.fixture(scope="module")
def st_dir(base, tmp_path_factory) -> Path:
    """Transformer -> Pooling (mean), saved by sentence-transformers; tests rewrite 1_Pooling."""
    directory = tmp_path_factory.mktemp("st") / "model"
    return _save([_transformer(base), models.Pooling(WIDE["hidden_size"], pooling_mode="mean")], directory)


def _pooling_dir(st_dir: Path, tmp_path: Path, config: dict | None = None, **pooling) -> Path:
    """A copy of st_dir whose 1_Pooling/config.json is ``config``, or what sentence-transformers'
    Pooling(**pooling) writes."""
    directory = tmp_path / "model"
    shutil.copytree(st_dir, directory)
    if config is not None:
        (directory / "1_Pooling" / "config.json").write_text(json.dumps(config))
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            models.Pooling(WIDE["hidden_size"], **pooling).save(str(directory / "1_Pooling"))
    return directory


MODES = ["cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken",
         ("cls", "mean"), ("lasttoken", "max", "weightedmean", "mean_sqrt_len_tokens")]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: "+".join(m) if isinstance(m, tuple) else m)
def test_every_pooling_mode_equals_sentence_transformers(st_dir, tmp_path, mode):
    directory = _pooling_dir(st_dir, tmp_path, pooling_mode=mode)
    written = json.loads((directory / "1_Pooling" / "config.json").read_text())["pooling_mode"]
    assert written == (list(mode) if isinstance(mode, tuple) else mode)  # sentence-transformers 6's spelling
    theirs = _theirs(directory)
    ours = embed(TEXTS, directory, normalize=False, batch_size=1)
    width = WIDE["hidden_size"] * (len(mode) if isinstance(mode, tuple) else 1)
    assert ours.shape == theirs.shape == (len(TEXTS), width)
    assert torch.equal(ours, theirs), (mode, (ours - theirs).abs().max().item())
    # normalize=True (the default): encode's normalize_embeddings
    assert torch.equal(embed(TEXTS, directory, batch_size=1), _theirs(directory, normalize_embeddings=True))


def test_legacy_pooling_booleans_concatenate_in_their_order(st_dir, tmp_path):
    """sentence-transformers < 5's spelling: several booleans set, concatenated in the fixed order
    cls, max, mean, mean_sqrt_len_tokens, weightedmean, lasttoken; include_prompt=false pools alike
    when no prompt is used."""
    config = {"word_embedding_dimension": WIDE["hidden_size"], "pooling_mode_cls_token": False,
              "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False,
              "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
              "pooling_mode_lasttoken": True, "include_prompt": False}
    directory = _pooling_dir(st_dir, tmp_path, config=config)
    theirs = _theirs(directory)
    ours = embed(TEXTS, directory, normalize=False, batch_size=1)
    assert ours.shape == (len(TEXTS), 2 * WIDE["hidden_size"])
    assert torch.equal(ours, theirs)


def test_dense_and_normalize_modules_equal_sentence_transformers(base, tmp_path):
    """Transformer -> Pooling -> Dense (Tanh) -> Normalize: the default embed (normalize=True) equals
    encode, normalised once; normalize=False is what the modules give (still unit length)."""
    torch.manual_seed(0)
    directory = _save([_transformer(base), models.Pooling(WIDE["hidden_size"], pooling_mode="cls"),
                       models.Dense(WIDE["hidden_size"], 128), models.Normalize()], tmp_path / "dense")
    assert (directory / "2_Dense" / "model.safetensors").is_file()
    theirs = _theirs(directory)
    assert theirs.shape == (len(TEXTS), 128)
    assert torch.equal(embed(TEXTS, directory, batch_size=1), theirs)
    assert torch.equal(embed(TEXTS, directory, normalize=False, batch_size=1), theirs)
    assert torch.equal(embed(TEXTS[0], directory, batch_size=1), theirs[0])
    assert embed([], directory).shape == (0, 128)


def test_two_dense_modules_identity_no_bias_residual_and_bin_weights(base, tmp_path):
    """Dense without bias and activation (Identity), residual connections (projected and plain), the
    weights in pytorch_model.bin, no Normalize."""
    torch.manual_seed(1)
    modules = [_transformer(base), models.Pooling(WIDE["hidden_size"], pooling_mode="mean"),
               models.Dense(WIDE["hidden_size"], 256, bias=False, activation_function=torch.nn.Identity(),
                            use_residual=True),
               models.Dense(256, 256, activation_function=torch.nn.GELU(), use_residual=True)]
    directory = _save(modules, tmp_path / "dense2", safe_serialization=False)
    assert (directory / "2_Dense" / "pytorch_model.bin").is_file()
    theirs = _theirs(directory)
    ours = embed(TEXTS, directory, normalize=False, batch_size=1)
    assert ours.shape == theirs.shape == (len(TEXTS), 256)
    assert torch.equal(ours, theirs)


# ---- refused: typed errors naming the file and the field -------------------------------------------

def _edit(directory: Path, name: str, change) -> None:
    path = directory / name
    data = json.loads(path.read_text())
    path.write_text(json.dumps(change(data)))


@pytest.mark.parametrize("config, field", [
    ({"embedding_dimension": 384, "pooling_mode": "median"}, "pooling_mode"),
    ({"embedding_dimension": 384, "pooling_mode": []}, "pooling_mode"),
    ({"embedding_dimension": 384, "pooling_mode": "mean", "pooling_mode_attention": True}, "pooling_mode_attention"),
    ({"embedding_dimension": 384, "pooling_mode": "mean", "include_prompt": "no"}, "include_prompt"),
])
def test_unknown_pooling_is_a_config_error(st_dir, tmp_path, config, field):
    directory = _pooling_dir(st_dir, tmp_path, config=config)
    with pytest.raises(ConfigError, match=rf"1_Pooling/config\.json.*{field}"):
        embed(TEXTS, directory)


def test_pooling_argument_replaces_the_checkpoints(st_dir, tmp_path):
    with pytest.raises(InputError, match="pooling='median'"):
        embed(TEXTS, st_dir, pooling="median")
    theirs = _theirs(_pooling_dir(st_dir, tmp_path, pooling_mode="lasttoken"))
    assert torch.equal(embed(TEXTS, st_dir, pooling="lasttoken", normalize=False, batch_size=1), theirs)


@pytest.mark.parametrize("entry, match", [
    ({"idx": 2, "name": "2", "path": "2_LayerNorm", "type": "sentence_transformers.models.LayerNorm"}, "LayerNorm"),
    ({"idx": 2, "name": "2", "path": "2_Custom", "type": "my_package.MyPooling"}, "my_package.MyPooling"),
])
def test_unknown_module_is_a_config_error(st_dir, tmp_path, entry, match):
    directory = tmp_path / "model"
    shutil.copytree(st_dir, directory)
    _edit(directory, "modules.json", lambda modules: modules + [entry])
    with pytest.raises(ConfigError, match=rf"modules\.json.*{match}"):
        embed(TEXTS, directory)


def test_transformer_outside_the_root_is_a_config_error(st_dir, tmp_path):
    directory = tmp_path / "model"
    shutil.copytree(st_dir, directory)
    _edit(directory, "modules.json", lambda modules: [{**modules[0], "path": "0_Transformer"}] + modules[1:])
    with pytest.raises(ConfigError, match=r"modules\.json.*Transformer"):
        embed(TEXTS, directory)


@pytest.mark.parametrize("change, field", [
    (lambda c: {**c, "activation_function": "my_package.Swish"}, "activation_function"),
    (lambda c: {**c, "module_input_name": "token_embeddings"}, "module_input_name"),
    (lambda c: {**c, "in_features": 100}, "linear.weight"),
    (lambda c: {**c, "dropout": 0.1}, "dropout"),
])
def test_unusable_dense_is_a_config_error(base, tmp_path, change, field):
    directory = _save([_transformer(base), models.Pooling(WIDE["hidden_size"]), models.Dense(WIDE["hidden_size"], 64)],
                      tmp_path / "dense")
    _edit(directory, "2_Dense/config.json", change)
    with pytest.raises(ConfigError, match=field):
        embed(TEXTS, directory)


def test_a_default_prompt_is_a_config_error(st_dir, tmp_path):
    """sentence-transformers would prepend it to every text; embed does not."""
    directory = tmp_path / "model"
    shutil.copytree(st_dir, directory)
    _edit(directory, "config_sentence_transformers.json",
          lambda c: {**c, "prompts": {"query": "query: ", "document": ""}, "default_prompt_name": "query"})
    with pytest.raises(ConfigError, match=r"config_sentence_transformers\.json.*default_prompt_name"):
        embed(TEXTS, directory)
    _edit(directory, "config_sentence_transformers.json", lambda c: {**c, "default_prompt_name": "document"})
    assert torch.equal(embed(TEXTS, directory, normalize=False, batch_size=1), _theirs(directory))
