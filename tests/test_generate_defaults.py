"""generate's defaults follow transformers 5.24 (``_prepare_generation_config``): the checkpoint's
generation_config.json (an eos list, sampling fields, lengths), else transformers' global defaults (top_k 50);
unset seed draws from torch's global generator; fields we do not implement are refused, bad input is typed.
Also the decoder's RoPE precedence (rope_scaling over rope_parameters, as convert_rope_params_to_dict) and the
refusal of per-layer tuples for a sliding-window cache. Every comparison is against transformers in the run."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch

from flodl_hf.auto import load_model
from flodl_hf.core.decoder import Rope
from flodl_hf.core.errors import ConfigError, InputError
from flodl_hf.generation.generate import generate_ids
from flodl_hf.roundtrip.parity import quiet_transformers, reference_model

from helpers import make_checkpoint, one_thread  # noqa: F401  (the fixture)
from test_decoder import _fields, _left_padded

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.range_end]

LLAMA = "llama-hd24-bias-tied-llama3"
MISTRAL = "mistral-hd24-window4"


def _copy(variant: str, tmp_path, name: str = "ckpt"):
    root = tmp_path / name
    shutil.copytree(make_checkpoint(_fields(variant), "causal_lm"), root)
    return root


def _edit(path, **fields):
    data = json.loads(path.read_text()) if path.is_file() else {}
    data.update(fields)
    path.write_text(json.dumps(data))


def _both(root, impl: str = "sdpa"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = load_model(root, "causal_lm", dtype=torch.float32, attn_implementation=impl).eval()
        theirs = reference_model(root, "causal_lm", impl)
    return ours, theirs


def _theirs_generate(theirs, ids, mask, seed=None, **kwargs):
    if seed is not None:
        torch.manual_seed(seed)
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return theirs.generate(input_ids=ids, attention_mask=mask, **kwargs)


def test_generation_config_eos_list_lengths_and_sampling_fields(tmp_path):
    """Llama-3-Instruct style: eos a list in generation_config.json only; then its max_new_tokens, and its
    do_sample / temperature / top_p with top_k unset (transformers' 50), none of them passed to generate."""
    root = _copy(LLAMA, tmp_path)
    ours, _ = _both(root)
    ids, mask = _left_padded(ours.config.vocab_size)
    free = generate_ids(ours, ids, mask, max_new_tokens=6, eos_token_id=[])
    stop = int(free[0, ids.shape[1] + 2])  # row 0's third new token ends that row
    _edit(root / "generation_config.json", eos_token_id=[2, stop], max_new_tokens=6)
    ours, theirs = _both(root)
    reference = _theirs_generate(theirs, ids, mask)
    got = generate_ids(ours, ids, mask)
    assert torch.equal(got, reference)
    assert got.shape[1] == ids.shape[1] + 6 and (got[0, ids.shape[1] + 3:] == 0).all()  # row 0 padded after eos

    _edit(root / "generation_config.json", eos_token_id=2, do_sample=True, temperature=0.7, top_p=0.9,
          max_new_tokens=10)
    ours, theirs = _both(root)
    reference = _theirs_generate(theirs, ids, mask, seed=11)
    torch.manual_seed(11)
    assert torch.equal(generate_ids(ours, ids, mask), reference)
    # an argument overrides the file: greedy, as transformers with do_sample=False
    reference = _theirs_generate(theirs, ids, mask, do_sample=False, max_new_tokens=4)
    assert torch.equal(generate_ids(ours, ids, mask, do_sample=False, max_new_tokens=4), reference)


def test_sampling_applies_top_k_50_unless_told_and_draws_from_the_global_generator():
    """top_k unset is 50 (transformers' global default), 0 turns it off; seed=None samples from torch's global
    generator, so after torch.manual_seed(s) the ids and the generator's state equal transformers'."""
    ours, theirs = _both(make_checkpoint(_fields(LLAMA), "causal_lm"))
    ids, mask = _left_padded(ours.config.vocab_size)
    for top_k in (None, 0):
        extra = {} if top_k is None else {"top_k": top_k}
        reference = _theirs_generate(theirs, ids, mask, seed=5, do_sample=True, max_new_tokens=8, eos_token_id=[],
                                     **extra)
        after_theirs = torch.rand(4)
        torch.manual_seed(5)
        got = generate_ids(ours, ids, mask, do_sample=True, max_new_tokens=8, eos_token_id=[], top_k=top_k)
        assert torch.equal(got, reference), top_k
        assert torch.equal(torch.rand(4), after_theirs), top_k  # the global generator is used, not reseeded
    # an explicit seed: its own generator, the same stream as manual_seed(seed) on CPU; the global one untouched
    reference = _theirs_generate(theirs, ids, mask, seed=5, do_sample=True, max_new_tokens=8, eos_token_id=[])
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    got = generate_ids(ours, ids, mask, do_sample=True, seed=5, max_new_tokens=8, eos_token_id=[])
    assert torch.equal(got, reference) and torch.equal(torch.rand(4), expected)


@pytest.mark.parametrize("field,value", [("bad_words_ids", [[]]), ("num_beams", 0), ("no_repeat_ngram_size", -2),
                                         ("forced_eos_token_id", "2"), ("suppress_tokens", 5),
                                         ("num_return_sequences", 2)])
def test_generation_config_fields_bad_or_not_implemented_are_refused(tmp_path, field, value):
    root = _copy(LLAMA, tmp_path)
    _edit(root / "generation_config.json", **{field: value})
    ours = load_model(root, "causal_lm", dtype=torch.float32).eval()
    ids, mask = _left_padded(ours.config.vocab_size)
    with pytest.raises(ConfigError, match=rf"generation_config\.json: {field}="):
        generate_ids(ours, ids, mask, max_new_tokens=2)


def test_generation_config_neutral_values_run_and_malformed_files_are_typed(tmp_path):
    root = _copy(LLAMA, tmp_path)
    ours = load_model(root, "causal_lm", dtype=torch.float32).eval()
    ids, mask = _left_padded(ours.config.vocab_size)
    _edit(root / "generation_config.json", repetition_penalty=1.0, num_beams=1, guidance_scale=1.0, typical_p=1.0)
    generate_ids(ours, ids, mask, max_new_tokens=2)  # a guidance scale of 1 is no guidance
    _edit(root / "generation_config.json", token_healing=True)
    with pytest.raises(ConfigError, match=r"generation_config\.json: token_healing="):
        generate_ids(ours, ids, mask, max_new_tokens=2)
    _edit(root / "generation_config.json", token_healing=False)
    for bad, match in [("{not json", "not valid JSON"), ("[1, 2]", "must be a JSON object"),
                       (json.dumps({"eos_token_id": "2"}), "eos_token_id="),
                       (json.dumps({"top_k": -1}), "top_k="), (json.dumps({"do_sample": "yes"}), "do_sample=")]:
        (root / "generation_config.json").write_text(bad)
        with pytest.raises(ConfigError, match=rf"generation_config\.json: .*{match}"):
            generate_ids(ours, ids, mask, max_new_tokens=2)


def test_bad_generate_input_is_typed_and_a_0d_eos_tensor_is_accepted(tmp_path):
    ours, theirs = _both(make_checkpoint(_fields(LLAMA), "causal_lm"))
    ids, mask = _left_padded(ours.config.vocab_size)
    eos = int(generate_ids(ours, ids, mask, max_new_tokens=3, eos_token_id=[])[0, -2])
    reference = _theirs_generate(theirs, ids, mask, max_new_tokens=3, eos_token_id=torch.tensor(eos))
    assert torch.equal(generate_ids(ours, ids, mask, max_new_tokens=3, eos_token_id=torch.tensor(eos)), reference)
    cases = [(dict(do_sample=True, temperature=float("nan")), "temperature=nan"),
             (dict(do_sample=True, seed="1"), "seed='1'"), (dict(top_k=2.5), "top_k="),
             (dict(top_p=float("nan")), "top_p="),
             (dict(eos_token_id="2"), "eos_token_id="), (dict(max_new_tokens=0), "max_new_tokens=")]
    for kwargs, match in cases:
        with pytest.raises(InputError, match=match):
            generate_ids(ours, ids, mask, **{"max_new_tokens": 2, **kwargs})
    with pytest.raises(InputError, match=r"input_ids \(9,\)"):
        generate_ids(ours, ids[0], mask[0], max_new_tokens=2)
    with pytest.raises(InputError, match=r"input_ids \(1, 0\)"):
        generate_ids(ours, ids[:1, :0], max_new_tokens=2)
    root = _copy(LLAMA, tmp_path)
    _edit(root / "config.json", rope_parameters={"rope_type": "default", "rope_theta": "1e4x"})
    with pytest.raises(ConfigError, match=r"config\.json.*rope_parameters\.rope_theta='1e4x'"):
        load_model(root, "causal_lm")


@torch.inference_mode()
def test_per_layer_tuples_are_refused_for_a_sliding_window_cache():
    ours = load_model(make_checkpoint(_fields(MISTRAL), "causal_lm"), "causal_lm", dtype=torch.float32).eval()
    ids = torch.randint(3, ours.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    first = ours(input_ids=ids, use_cache=True)
    nxt = first.logits[:, -1].argmax(-1, keepdim=True)
    with pytest.raises(InputError, match="sliding-window"):
        ours(input_ids=nxt, past_key_values=first.past_key_values.to_legacy())


_L3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16)


@torch.inference_mode()
def test_rope_scaling_wins_over_rope_parameters_as_in_transformers(tmp_path):
    root = _copy(LLAMA, tmp_path)
    _edit(root / "config.json", rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
          rope_scaling={"type": "llama3", **_L3}, rope_theta=50000.0)
    ours, theirs = _both(root)
    assert ours.config.rope().rope_type == "llama3"
    ids = torch.randint(3, ours.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    assert torch.equal(ours(input_ids=ids).logits, theirs(input_ids=ids).logits)


def test_a_top_level_original_max_position_embeddings_wins_as_in_transformers(tmp_path):
    """standardize_rope_params: for llama3 the top-level field wins over the nested one (Rope.resolve takes it
    as ``original_max_position_embeddings``); the inverse frequencies equal transformers' for that config."""
    transformers = quiet_transformers()
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    root = _copy(LLAMA, tmp_path)
    _edit(root / "config.json", rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, **_L3},
          original_max_position_embeddings=32)
    config = transformers.AutoConfig.from_pretrained(root)
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config, None)
    raw = json.loads((root / "config.json").read_text())
    rope = Rope.resolve(raw["rope_parameters"], None, None, 10_000.0, raw["max_position_embeddings"],
                        raw["original_max_position_embeddings"])
    assert rope.original_max_position_embeddings == 32
    assert torch.equal(rope.inverse_frequencies(config.head_dim), theirs)


@torch.inference_mode()
def test_a_top_level_original_max_position_embeddings_end_to_end(tmp_path):
    root = _copy(LLAMA, tmp_path)
    _edit(root / "config.json", rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, **_L3},
          original_max_position_embeddings=32)
    ours, theirs = _both(root)
    ids = torch.randint(3, ours.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    assert torch.equal(ours(input_ids=ids).logits, theirs(input_ids=ids).logits)


def test_the_cli_leaves_unset_options_to_generation_config(monkeypatch):
    """`flodl-hf generate` passes None for what the user did not set, so generate() takes the file's values
    (it passed --max-new-tokens 20, do_sample False and temperature 1.0 over the file's); --no-sample forces
    greedy decoding over a file's do_sample."""
    from flodl_hf.cli import main
    from flodl_hf.commands import generate as command
    calls = []
    monkeypatch.setattr(command, "generate", lambda prompts, model, **kw: calls.append(kw) or [])
    keys = ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p")
    for argv, expected in ((["hi"], (None,) * 5), (["hi", "--sample"], (None, True, None, None, None)),
                           (["hi", "--no-sample", "--max-new-tokens", "3"], (3, False, None, None, None))):
        assert main(["generate", *argv, "--model", "m"]) == 0
        assert tuple(calls[-1][k] for k in keys) == expected, argv


@pytest.mark.parametrize("with_file", [True, False], ids=["generation_config.json", "from config.json"])
def test_save_pretrained_writes_the_generation_config_as_transformers(tmp_path, with_file):
    """``model.save_pretrained`` writes ``generation_config.json`` as transformers' does for a model that generates:
    the checkpoint's (or one made from config.json), then with edits, byte for byte the file transformers writes
    from the same edits; saved back, both generate the same tokens from it. An edit transformers refuses to save
    (temperature without sampling, strict once edited) is a ConfigError naming the file, and nothing is written
    (transformers has written config.json and the weights by then); unedited, the same file only warns there."""
    root = _copy(LLAMA, tmp_path)
    if not with_file:
        (root / "generation_config.json").unlink()
    ours, theirs = _both(root)
    edits = [{}, dict(do_sample=True, temperature=0.7, top_k=5, max_new_tokens=5, eos_token_id=[2, 3])]
    for i, edit in enumerate(edits):
        for model in (ours, theirs):
            for name, value in edit.items():
                setattr(model.generation_config, name, value)
        mine, reference = ours.save_pretrained(tmp_path / f"ours{i}"), tmp_path / f"theirs{i}"
        theirs.save_pretrained(reference)
        written = (mine / "generation_config.json").read_text()
        assert written == (reference / "generation_config.json").read_text()
        assert json.loads(written).get("temperature") == edit.get("temperature")
    ids, mask = _left_padded(ours.config.vocab_size)
    again, theirs_again = _both(mine)
    torch.manual_seed(3)
    got = generate_ids(again, ids, mask)
    assert torch.equal(got, _theirs_generate(theirs_again, ids, mask, seed=3))
    assert got.shape[1] == ids.shape[1] + 5

    ours.generation_config.do_sample = False  # temperature 0.7 left: strict validation refuses it
    theirs.generation_config.do_sample = False
    with pytest.raises(ValueError, match="Fix these issues"):
        theirs.save_pretrained(tmp_path / "theirs-bad")
    assert (tmp_path / "theirs-bad" / "config.json").is_file()
    with pytest.raises(ConfigError, match="generation_config.json: model.generation_config does not validate"):
        ours.save_pretrained(tmp_path / "ours-bad")
    assert not (tmp_path / "ours-bad").exists()
    if with_file:  # the same values read from a file are not an edit: saved with a warning, as transformers
        _edit(root / "generation_config.json", do_sample=False, temperature=0.7)
        ours, theirs = _both(root)
        theirs.save_pretrained(tmp_path / "theirs-read")
        ours.save_pretrained(tmp_path / "ours-read")
        assert (tmp_path / "ours-read" / "generation_config.json").read_text() == \
            (tmp_path / "theirs-read" / "generation_config.json").read_text()
