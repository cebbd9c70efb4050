"""SmolLM3's, OLMo 3's and Ministral's own checks against transformers 5.25 in the same run: the config defaults,
the layer kinds and NoPE layers each config rule gives (transformers' config computes them: compared over a grid),
OLMo 3's RoPE per layer kind from each spelling, the configs refused with a ConfigError naming the field,
sampled and greedy ``model.generate``, mutations the parity tables catch (a NoPE layer turned, a sliding layer
made full, the layer kinds' RoPEs swapped), and the tokenizer class read from the model type. The forwards on both
paths, every head, the losses, caches, dtype casts, gradients and export round trips are in the shared tables
(tests/cases/smollm3.py, tests/cases/olmo3.py, tests/cases/ministral.py)."""

from __future__ import annotations

import itertools
import json
import shutil
import warnings

import pytest
import torch

from flodl_hf.auto import load_model
from flodl_hf.core.errors import ConfigError
from flodl_hf.roundtrip.parity import make_batch, quiet_transformers
from flodl_hf.core.registry import get_family

from decoder_checks import assert_tokenizer_class_from_the_model_type, byte_level_tokenizer_dir, case_fields, case_pair
from helpers import assert_config_defaults_equal, assert_model_generate_equal, make_checkpoint, model_pair
from test_decoder import _left_padded

SMOL, SMOL_FIRST, OLMO3, MINISTRAL = ("smollm3-hd24-nope-sliding-bias", "smollm3-hd24-nope-first-layertypes",
                                      "olmo3-hd24-sliding-2rope", "ministral-hd24-window4-layertypes")
MODEL_TYPES = ("smollm3", "olmo3", "ministral")


def _theirs(model_type: str, **fields):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quiet_transformers().AutoConfig.for_model(model_type, **fields)


def _ours(model_type: str, **fields):
    return get_family(model_type).config_class.from_dict({**fields, "model_type": model_type})


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_config_defaults_are_transformers(model_type):
    """Every field both configs have, at its default (a config.json that leaves it out means the same), and what
    transformers derives from them: the KV heads, the layer kinds, the RoPE theta (per layer kind for OLMo 3), the
    NoPE layers (SmolLM3)."""
    ours, theirs, names = assert_config_defaults_equal(  # derived: compared below
        model_type, {"rope_parameters", "rope_scaling", "rope_theta", "num_key_value_heads", "layer_types",
                     "no_rope_layers", "head_dim"},
        {"vocab_size", "rms_norm_eps", "pad_token_id", "eos_token_id", "tie_word_embeddings"})
    assert ours.kv_heads == theirs.num_key_value_heads
    assert ours.layer_kinds() == theirs.layer_types
    if model_type == "olmo3":
        for kind in ("full_attention", "sliding_attention"):
            assert ours.rope(kind).theta == theirs.rope_parameters[kind]["rope_theta"] == 500_000.0
    else:
        assert ours.rope().theta == theirs.rope_parameters["rope_theta"]
    if model_type == "smollm3":
        assert ours.rope_layers() == [bool(v) for v in theirs.no_rope_layers]
        assert {"no_rope_layer_interval", "use_sliding_window", "sliding_window", "mlp_bias"} <= set(names)
    if model_type == "ministral":
        assert theirs.head_dim is None and ours.head_dim is None  # transformers cannot build it: ours runs hidden/heads
        assert "sliding_window" in names


_SMOL_GRID = [dict(num_hidden_layers=n, no_rope_layer_interval=interval, use_sliding_window=slide, sliding_window=window)
              for n, interval, slide, window in itertools.product((1, 4, 7), (1, 2, 3, 4, -3), (False, True), (None, 4))]
_SMOL_GRID += [dict(num_hidden_layers=3, no_rope_layers=[0, 1, 0]), dict(num_hidden_layers=2, no_rope_layers=[1, 0, 0]),
               dict(num_hidden_layers=3, no_rope_layers=[2, 0, 1], use_sliding_window=True, sliding_window=4),
               dict(num_hidden_layers=2, no_rope_layers=[0, 0], sliding_window=4,
                    layer_types=["full_attention", "sliding_attention"])]


@pytest.mark.parametrize("fields", _SMOL_GRID, ids=[json.dumps(f, separators=(",", ":")) for f in _SMOL_GRID])
def test_smollm3_nope_layers_and_layer_kinds_are_transformers(fields):
    """SmolLM3Config.__post_init__'s rules: a NoPE layer every interval-th layer (Python's modulo, a negative
    interval as well), or no_rope_layers as given (a longer list read up to the layer count, any non-zero int a
    RoPE layer); the NoPE layers slide when use_sliding_window and sliding_window are both set; layer_types given
    wins. And the built attentions turn where transformers' do (SmolLM3Attention.use_rope)."""
    theirs, ours = _theirs("smollm3", **fields), _ours("smollm3", **fields)
    assert ours.layer_kinds() == theirs.layer_types
    assert ours.rope_layers() == [bool(v) for v in theirs.no_rope_layers[:theirs.num_hidden_layers]]
    windows = [ours.window(kind) for kind in ours.layer_kinds()]
    assert windows == [theirs.sliding_window if t == "sliding_attention" else None for t in theirs.layer_types]


@pytest.mark.parametrize("layers", [1, 3, 4, 5, 8, 9])
def test_olmo3_and_ministral_default_layer_kinds_are_transformers(layers):
    """Olmo3Config: three sliding layers to one full; MinistralConfig: every layer sliding (a window is set)."""
    for model_type in ("olmo3", "ministral"):
        theirs, ours = _theirs(model_type, num_hidden_layers=layers), _ours(model_type, num_hidden_layers=layers)
        assert ours.layer_kinds() == theirs.layer_types, model_type
        assert [ours.window(k) for k in ours.layer_kinds()] == [
            theirs.sliding_window if t == "sliding_attention" else None for t in theirs.layer_types], model_type


_OLMO3_ROPES = [dict(), dict(rope_theta=1000.0), dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
                dict(rope_scaling={"type": "linear", "factor": 3.0}, rope_theta=20.0),
                dict(rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10.0}}),
                dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 7.0}},
                     rope_theta=99.0)]


@pytest.mark.parametrize("fields", _OLMO3_ROPES, ids=[json.dumps(f, separators=(",", ":")) for f in _OLMO3_ROPES])
def test_olmo3_rope_per_layer_kind_is_transformers(fields):
    """Olmo3Config.convert_rope_params_to_dict: rope_scaling updates the full layers' dict only; a missing theta is
    rope_theta for the full layers and 500000 for the sliding ones (rope_theta is popped by the first lookup)."""
    theirs, ours = _theirs("olmo3", num_hidden_layers=2, **fields), _ours("olmo3", num_hidden_layers=2, **fields)
    for kind in ("full_attention", "sliding_attention"):
        params = theirs.rope_parameters[kind]
        rope = ours.rope(kind)
        assert rope.theta == params["rope_theta"], kind
        assert rope.rope_type == params["rope_type"], kind
        if params["rope_type"] != "default":  # a default RoPE reads no factor (one merged in by "type" stays unread)
            assert rope.factor == params["factor"], kind


@pytest.mark.parametrize("impl,extra", [("sdpa", dict(rope_theta=1000.0)),
                                        ("eager", dict(rope_theta=1000.0, rope_scaling={"type": "linear", "factor": 3.0})),
                                        ("sdpa", dict(rope_scaling={"rope_type": "linear", "factor": 3.0}))])
def test_olmo3_older_rope_spellings_run_as_transformers(impl, extra, tmp_path):
    """A config.json in the older spellings (no rope_parameters; transformers writes the per-kind dicts, so the
    file is rewritten): a top-level rope_theta reaches the full layers only (sliding layers at 500000, the full one
    at 1000); rope_scaling updates the full layers' dict (with "type", the "rope_type": "default" already there
    wins, as in transformers). The forward equals transformers' loaded from the same file."""
    root = tmp_path / "olmo3"
    shutil.copytree(make_checkpoint(case_fields(OLMO3), "causal_lm"), root)
    config = json.loads((root / "config.json").read_text())
    del config["rope_parameters"]
    (root / "config.json").write_text(json.dumps({**config, **extra}))
    ours, theirs = model_pair(root, "causal_lm", impl)
    for kind in ("full_attention", "sliding_attention"):
        assert ours.config.rope(kind).theta == theirs.config.rope_parameters[kind]["rope_theta"], kind
    batch = {**make_batch(ours.config, "causal_lm"), "use_cache": False}
    with torch.inference_mode():
        assert torch.equal(ours(**batch).logits, theirs(**batch).logits)


_START = 8
_OLMO3_SCALINGS = {
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=_START),
    # a nested truncate is never read (_compute_yarn_parameters reads config.rope_parameters' top level)
    "yarn-untruncated": dict(rope_type="yarn", factor=3.0, original_max_position_embeddings=_START, truncate=False,
                             beta_fast=16, beta_slow=2),
    "dynamic": dict(rope_type="dynamic", factor=3.0),
}


@pytest.mark.parametrize("name", list(_OLMO3_SCALINGS))
def test_olmo3_scaled_rope_on_the_full_layers_equals_transformers(name):
    """A scaling on the full layers' RoPE (the sliding ones keep theirs): yarn (a nested truncate is never read, as
    in transformers), and dynamic over a run of forwards under, past and back under max_position_embeddings (the
    frequencies' state per layer kind, as Olmo3RotaryEmbedding keeps it)."""
    fields = json.loads(json.dumps(case_fields(OLMO3)))
    fields["rope_parameters"]["full_attention"] = {"rope_theta": 10000.0, **_OLMO3_SCALINGS[name]}
    fields["max_position_embeddings"] = _START if name == "dynamic" else 4 * _START
    ours, theirs = model_pair(make_checkpoint(fields, "causal_lm"))
    runs = [(5, 3), (_START + 3, 4), (2 * _START, _START + 1), (6, 4)] if name == "dynamic" else [(2 * _START + 3, 3)]
    for seed, lengths in enumerate(runs):
        ids, mask = _left_padded(ours.config.vocab_size, lengths=lengths, seed=seed)
        with torch.inference_mode():
            a = ours(input_ids=ids, attention_mask=mask).logits
            b = theirs(input_ids=ids, attention_mask=mask).logits
        assert torch.equal(a, b), (name, lengths)


_NO_RULES = dict(no_rope_layers=None, layer_types=None)  # a saved config.json holds both, computed
_REFUSED = [
    ("smollm3", dict(num_hidden_layers=3, no_rope_layers=[1, 0]), "no_rope_layers"),
    ("smollm3", dict(no_rope_layers=[1, "0"]), "no_rope_layers"),
    ("smollm3", dict(no_rope_layers=[True, 0]), "no_rope_layers"),
    ("smollm3", dict(no_rope_layers=1), "no_rope_layers"),
    ("smollm3", dict(_NO_RULES, no_rope_layer_interval=0), "no_rope_layer_interval"),
    ("smollm3", dict(layer_types=["full_attention", "sliding_attention"], sliding_window=None), "sliding_window"),
    ("smollm3", dict(layer_types=["full_attention"], sliding_window=4), "layer_types"),
    ("olmo3", dict(sliding_window=None), "sliding_window"),
    ("olmo3", dict(rope_parameters={"rope_type": "default", "rope_theta": 10.0}), "rope_parameters"),
    ("olmo3", dict(rope_parameters={"full_attention": 3}), "rope_parameters.full_attention"),
    ("olmo3", dict(rope_parameters={"sliding_attention": {"rope_type": "nope"}}), "rope_parameters"),
    ("olmo3", dict(layer_types=["full_attention", "chunky"]), "layer_types"),
    ("ministral", dict(sliding_window=None), "sliding_window"),
    ("ministral", dict(layer_types=["sliding_attention"] * 3), "layer_types"),
]


@pytest.mark.parametrize("model_type,fields,field", _REFUSED,
                         ids=[f"{m}-{f}-{i}" for i, (m, _, f) in enumerate(_REFUSED)])
def test_configs_transformers_cannot_run_are_config_errors_naming_the_field(model_type, fields, field, tmp_path):
    """Each is a ConfigError naming the field, from the config and from load_model on a checkpoint whose config.json
    says it (naming config.json); transformers raises on each (at the config, or at the forward: the mask without a
    window, the index past no_rope_layers, the modulo by zero) or ignores it silently (OLMo 3's flat
    rope_parameters)."""
    variant = {"smollm3": SMOL, "olmo3": OLMO3, "ministral": MINISTRAL}[model_type]
    pattern = field.replace(".", "[.]")
    with pytest.raises(ConfigError, match=pattern):
        _ours(**{**case_fields(variant), **fields})
    root = tmp_path / model_type
    shutil.copytree(make_checkpoint(case_fields(variant), "causal_lm"), root)
    config = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**config, **fields}))
    with pytest.raises(ConfigError, match=f"config.json.*{pattern}"):
        load_model(root, "causal_lm")


def test_ministral_without_head_dim_runs_hidden_over_heads():
    """transformers 5.25's MinistralAttention fails (a TypeError) without head_dim; ours runs heads of hidden_size
    // num_attention_heads, and a checkpoint that gives that head_dim is transformers' bit for bit."""
    fields = {k: v for k, v in case_fields(MINISTRAL).items() if k != "head_dim"}
    assert _ours(**fields).attention_head_dim == 24
    with pytest.raises(TypeError):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quiet_transformers().MinistralModel(_theirs("ministral", **{k: v for k, v in fields.items()
                                                                         if k != "model_type"}))


@pytest.mark.parametrize("variant,impl", [(SMOL, "sdpa"), (SMOL_FIRST, "eager"), (OLMO3, "eager"),
                                          (MINISTRAL, "sdpa")])
def test_model_generate_greedy_and_sampled_equal_transformers(variant, impl):
    """``model.generate`` on a left-padded batch (9, 6 and 3 tokens: the sliding layers' caches drop tokens past
    the window of 4, the NoPE layers attend unturned): greedy, and sampled from the same seed."""
    ours, theirs = case_pair(variant, impl)
    ids, mask = _left_padded(ours.config.vocab_size)
    settings = [dict(do_sample=False), dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9)]
    for kwargs in settings:
        assert_model_generate_equal(ours, theirs, ids, mask, **kwargs)


def _mutated_logits_differ(variant: str, mutate) -> None:
    ours, theirs = case_pair(variant)
    batch = {**make_batch(ours.config, "causal_lm"), "use_cache": False}
    with torch.inference_mode():
        reference = theirs(**batch).logits
        assert torch.equal(ours(**batch).logits, reference)
        mutate(ours)
        assert not torch.equal(ours(**batch).logits, reference)


def test_mutations_are_caught():
    """Each property the variants exercise changes the logits when broken on our side only, so the parity tables
    would fail: SmolLM3's NoPE layer turned with RoPE, its sliding layer made full; OLMo 3's two RoPEs swapped, its
    sliding layer made full; Ministral's sliding layer made full."""
    def turn_every_layer(model):
        for layer in model.backbone.layers:
            layer.self_attn.use_rope = True

    def no_windows(model):
        model.backbone.config.window = lambda kind: None

    def swap_ropes(model):
        config = model.backbone.config
        config.rope_key = lambda kind: "sliding_attention" if kind == "full_attention" else "full_attention"

    _mutated_logits_differ(SMOL, turn_every_layer)
    _mutated_logits_differ(SMOL_FIRST, turn_every_layer)
    _mutated_logits_differ(SMOL, no_windows)
    _mutated_logits_differ(OLMO3, swap_ropes)
    _mutated_logits_differ(OLMO3, no_windows)
    _mutated_logits_differ(MINISTRAL, no_windows)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_tokenizer_class_from_the_model_type(model_type, tmp_path):
    """A tokenizer_config.json naming no class (test_olmo2_granite's tokenizer): TOKENIZER_MAPPING_NAMES maps olmo3
    and ministral to TokenizersBackend; smollm3 has no entry there, and transformers falls back to TokenizersBackend
    as well."""
    root = byte_level_tokenizer_dir("olmo2-granite", model_type, tmp_path)
    assert_tokenizer_class_from_the_model_type(root, model_type, "TokenizersBackend")
