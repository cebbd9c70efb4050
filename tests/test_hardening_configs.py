"""Decoder configs and generation, hardened:

- every registered family's config is checked against one table (``flodl_hf.core.validate``: ``FIELD_RULES`` and
  ``RELATIONS``): each bad value of each rule, in each field the family's config has, is a ConfigError naming the
  field (and config.json when read from one), inside a RoPE dict too (every RoPE type the family takes), and so is a
  window in use; every config of tests/cases, and transformers' own default config of each decoder family (real
  width), still load. transformers loads these configs and computes NaN logits, or fails at the first forward;
- generation past a learned position table (GPT-2, OPT, GPT-J) is an InputError before decoding naming both
  numbers, where transformers fails midway with an IndexError; prompt lookup's candidates stay inside the table;
- sampling on NaN or infinite scores is a NonFiniteScoresError naming the step, where transformers raises torch's
  RuntimeError (or, on CUDA, asserts).
"""

from __future__ import annotations

import importlib
import json
import warnings
from dataclasses import fields

import pytest
import torch

from flodl_hf.auto import AutoConfig, load_model
from flodl_hf.core.decoder import FULL, ROPE_TYPES, SLIDING
from flodl_hf.core.errors import ConfigError, InputError, NonFiniteScoresError
from flodl_hf.core.registry import get_family, supported_model_types
from flodl_hf.core.validate import RELATIONS, rule_for
from flodl_hf.generation.generate import generate_ids
from flodl_hf.roundtrip.parity import quiet_transformers, reference_model

from decoder_checks import NARROW
from helpers import make_checkpoint, one_thread  # noqa: F401  (the fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

NAN, INF = float("nan"), float("inf")
FAMILIES = sorted({get_family(t).model_type for t in supported_model_types()})
DECODERS = [t for t in FAMILIES if "causal_lm" in get_family(t).tasks]


def _variants(model_type: str) -> dict[str, dict]:
    return importlib.import_module(f"cases.{model_type.replace('-', '_')}").CONFIGS


def _base(model_type: str) -> dict:
    """A real config of the family from tests/cases: a decoder's narrow variant, else the module's first."""
    variants = _variants(model_type)
    return dict(variants.get(NARROW.get(model_type), next(iter(variants.values()))))


def _load(model_type: str, **changes):
    return get_family(model_type).config_class.from_dict({**_base(model_type), **changes})


def _refused(model_type: str, changes: dict, *names: str) -> str:
    """The ConfigError of the family's config with ``changes``; its message names each of ``names``."""
    with pytest.raises(ConfigError) as info:
        _load(model_type, **changes)
    message = str(info.value)
    for name in names:
        assert name in message, (model_type, changes, message)
    return message


def _fields(model_type: str) -> set[str]:
    return {f.name for f in fields(get_family(model_type).config_class)}


def test_every_family_has_cases_and_every_real_config_loads():
    """The table refuses no real config: every variant of tests/cases (real width ones included) and transformers'
    default config of each decoder family (Llama at 4096 wide, Qwen2-MoE's sliding_window 0...) load."""
    transformers = quiet_transformers()
    for model_type in FAMILIES:
        for variant, config in _variants(model_type).items():
            get_family(model_type).config_class.from_dict(config)
    for model_type in DECODERS:
        theirs = transformers.AutoConfig.for_model(model_type).to_dict()
        get_family(model_type).config_class.from_dict(theirs)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_each_rule_of_the_table_refuses_its_bad_values_in_every_family(model_type):
    """For every field of the family's config that the table has a rule for, each of the rule's bad values (0, a
    negative, NaN, inf, past 2**31, outside (0, 1]...) is a ConfigError naming the field; a value the family declares
    as its "unset" spelling (Qwen2-MoE's sliding_window 0) loads."""
    cls = get_family(model_type).config_class
    checked = 0
    for name in sorted(n for n in _fields(model_type) if rule_for(n) is not None):
        for bad in rule_for(name).bad:
            if bad in getattr(cls, "unset_values", {}).get(name, ()):
                _load(model_type, **{name: bad})
                continue
            _refused(model_type, {name: bad}, f"field {name}=")
            checked += 1
    # every family has sizes, an epsilon or dropouts; a dual model's (CLIP's) are its towers', each their own family
    assert checked >= (3 if "text_config" in _fields(model_type) else 10), checked


@pytest.mark.parametrize("model_type", FAMILIES)
def test_each_relation_between_fields_is_refused_naming_the_field(model_type):
    """Heads that do not divide the width, KV heads that do not divide the heads, a top-k above the experts, a
    layer_types list of another length than the layers: a ConfigError naming the field, in each family that has the
    two fields."""
    base, names = _load(model_type), _fields(model_type)
    for relation in RELATIONS:
        other = next((o for o in relation.others if o in names), None)
        if relation.field not in names or other is None:
            continue
        if relation.kind == "multiple":
            value = getattr(base, relation.field)
            changes = {other: value + 1}
        elif relation.kind == "at_most":
            changes = {relation.field: getattr(base, other) + 1}
        else:
            changes = {relation.field: [FULL] * (getattr(base, other) + 1)}
        _refused(model_type, changes, relation.field)


# a valid dict of each RoPE type, with the fields each reads (longrope's lists sized per family)
_ROPES = {"default": {}, "linear": {"factor": 2.0}, "dynamic": {"factor": 2.0},
          "yarn": {"factor": 2.0, "original_max_position_embeddings": 16, "attention_factor": 1.1, "beta_fast": 16,
                   "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 1.0},
          "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 16},
          "longrope": {"factor": 2.0, "attention_factor": 1.1}}
ROPE_FAMILIES = [t for t in FAMILIES if "rope_parameters" in _fields(t)
                 and callable(getattr(get_family(t).config_class, "rope", None))]


@pytest.mark.parametrize("model_type", ROPE_FAMILIES)
def test_every_field_of_every_rope_type_is_checked_by_the_same_table(model_type):
    """Each RoPE type the family takes, in rope_parameters (per layer kind where the family keys it so): a valid dict
    loads, and each field it reads set to each bad value of its rule (a factor of 0 or NaN, a theta of 0, a low
    frequency factor of 0, an original length of 0, NaN betas...) is a ConfigError naming it, as are llama3's high
    frequency factor not above its low one and YaRN's beta_fast below beta_slow. transformers warns on some of these
    and computes NaN or garbage frequencies from all of them. A family with a partial rotary factor refuses one
    outside (0, 1] in the dict too."""
    base = _load(model_type)
    per_kind = getattr(base, "rope_key", lambda kind: None)(FULL) is not None
    pairs = base.rotary_dim // 2 if hasattr(base, "rotary_dim") else base.attention_head_dim // 2

    def rope(params: dict) -> dict:
        return {"rope_parameters": {FULL: params, SLIDING: {"rope_type": "default"}} if per_kind else params,
                "rope_scaling": None}

    for rope_type in getattr(get_family(model_type).config_class, "rope_types", ROPE_TYPES):
        valid = {"rope_type": rope_type, "rope_theta": 10000.0, **_ROPES[rope_type]}
        if rope_type == "longrope":
            valid.update(short_factor=[1.0] * pairs, long_factor=[2.0] * pairs)
        _load(model_type, **rope(valid))
        # Phi3 reads the top-level original_max_position_embeddings (the field table checks it), not the dict's
        read = [n for n in valid if n != "rope_type" and not (rope_type == "longrope" and n.startswith("original"))]
        for name in read:
            for bad in rule_for(name).bad:
                value = [bad] * pairs if name.endswith("_factor") and isinstance(valid[name], list) else bad
                _refused(model_type, rope({**valid, name: value}), f".{name}=")
        if rope_type == "llama3":
            _refused(model_type, rope({**valid, "high_freq_factor": 1.0}), "high_freq_factor", "low_freq_factor")
        if rope_type == "yarn":
            _refused(model_type, rope({**valid, "beta_fast": 1, "beta_slow": 32}), "beta_fast", "beta_slow")
    if hasattr(base, "partial_rotary_factor"):
        for bad in rule_for("partial_rotary_factor").bad:
            _refused(model_type, rope({"rope_type": "default", "partial_rotary_factor": bad}), "partial_rotary_factor")


def test_a_window_in_use_is_checked_where_it_is_used():
    """Qwen2-MoE: transformers writes sliding_window 0 without use_sliding_window, which loads; with the window on,
    0 is refused, as is a negative one (which fails transformers' forward on a tensor size). A sliding layer with no
    window (layer_types naming one, the window off or null) is refused naming both fields, in every family with
    layer_types; transformers' sliding mask raises there."""
    theirs = quiet_transformers().Qwen2MoeConfig(use_sliding_window=False).to_dict()
    assert theirs["sliding_window"] == 0
    _load("qwen2_moe", sliding_window=0, use_sliding_window=False)
    _refused("qwen2_moe", {"sliding_window": 0, "use_sliding_window": True}, "sliding_window")
    for model_type in DECODERS:
        if "sliding_window" in _fields(model_type):
            _refused(model_type, {"sliding_window": -1, "use_sliding_window": True}, "field sliding_window=")
        if "layer_types" in _fields(model_type) and model_type != "qwen3_moe":  # Qwen3-MoE takes none at all
            layers = _base(model_type)["num_hidden_layers"]
            _refused(model_type, {"layer_types": [SLIDING] * layers, "sliding_window": None,
                                  "use_sliding_window": False}, "sliding_window")


def test_config_json_is_named_and_transformers_runs_the_bad_config_to_nan(tmp_path):
    """From a config.json the error names the file and the field. transformers loads the same config without a
    word: its logits are NaN (rms_norm_eps NaN), its RoPE frequencies infinite (a llama3 factor of 0)."""
    transformers = quiet_transformers()
    config = {**_base("llama"), "num_hidden_layers": 1, "vocab_size": 64, "hidden_size": 32, "num_attention_heads": 2,
              "num_key_value_heads": 1, "intermediate_size": 48}
    for bad, field in (({"rms_norm_eps": NAN}, "rms_norm_eps"),
                       ({"rope_parameters": {**config["rope_parameters"], "factor": 0}}, "rope_parameters.factor")):
        (tmp_path / "config.json").write_text(json.dumps({**config, **bad}))
        with pytest.raises(ConfigError, match=f"config\\.json.*field {field}="):
            AutoConfig.from_pretrained(tmp_path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = transformers.AutoConfig.from_pretrained(tmp_path)
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(theirs).eval()
        with torch.inference_mode():
            logits = model(torch.arange(1, 9)[None]).logits
        broken = logits if field == "rms_norm_eps" else model.model.rotary_emb.inv_freq
        assert not torch.isfinite(broken).any(), field


# ---- generation ---------------------------------------------------------------------------------------------

TABLE = 16
_TINY = {"gpt2": dict(model_type="gpt2", n_embd=32, n_head=2, n_layer=1, vocab_size=64, n_positions=TABLE,
                      pad_token_id=0),
         "opt": dict(model_type="opt", hidden_size=32, num_attention_heads=2, num_hidden_layers=1, ffn_dim=40,
                     vocab_size=64, max_position_embeddings=TABLE, pad_token_id=1),
         "gptj": dict(model_type="gptj", n_embd=32, n_head=2, n_layer=1, vocab_size=64, n_positions=TABLE,
                      rotary_dim=8, pad_token_id=0)}


def _pair(model_type: str, **changes):
    source = make_checkpoint({**_TINY[model_type], **changes}, "causal_lm")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model(source, "causal_lm").eval(), reference_model(source, "causal_lm", "sdpa")


def _theirs(theirs, ids: torch.Tensor, **settings):
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return theirs.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pad_token_id=0, **settings)


@pytest.mark.parametrize("model_type", sorted(_TINY))
def test_generation_past_the_position_table_is_refused_before_decoding(model_type):
    """A prompt of 6 and 11 new tokens feeds 16 positions (the last new token is never fed back): it fits a table of
    16 and equals transformers; 12 do not, nor does the pipeline's default of 256, nor a max_length of 18, nor beam
    search: an InputError naming the positions needed and the table's, where transformers fails midway with an
    IndexError. A prompt of 17 is refused as longer than the table (transformers: an IndexError at the prefill)."""
    ours, theirs = _pair(model_type)
    ids = torch.arange(3, 9)[None]
    fits = dict(max_new_tokens=TABLE + 1 - ids.shape[1], eos_token_id=[])
    assert torch.equal(generate_ids(ours, ids, **fits), _theirs(theirs, ids, **{**fits, "eos_token_id": None}))
    never = dict(eos_token_id=63, suppress_tokens=[63])  # an eos (beam search needs one) that never comes
    for settings in (dict(max_new_tokens=12), dict(max_new_tokens=256, do_sample=True), dict(max_length=18),
                     dict(max_new_tokens=12, num_beams=2)):
        with pytest.raises(IndexError):
            _theirs(theirs, ids, **never, **settings)
        with pytest.raises(InputError, match=f"past the position table of {TABLE} positions") as info:
            generate_ids(ours, ids, **never, **settings)
        needed = (settings.get("max_length") or ids.shape[1] + settings["max_new_tokens"]) - 1
        assert f"feed {needed} positions" in str(info.value), str(info.value)
        assert f"pass max_new_tokens={TABLE + 1 - ids.shape[1]} or fewer" in str(info.value)
    long = torch.arange(1, TABLE + 2)[None]  # a prompt past the table: transformers fails at its prefill
    with pytest.raises(IndexError):
        _theirs(theirs, long, max_new_tokens=1, eos_token_id=63)
    with pytest.raises(InputError, match=f"prompt of {TABLE + 1} positions is longer than the position table"):
        generate_ids(ours, long, max_new_tokens=1, eos_token_id=63)


def test_prompt_lookup_stops_its_candidates_at_the_position_table():
    """transformers' prompt lookup proposes candidates past max_length - 1, which on a learned position table runs
    past it (an IndexError, with a prompt whose n-grams repeat); ours stops the candidates at the table and gives
    transformers' greedy ids (greedy lookup is greedy decoding)."""
    ours, theirs = _pair("gpt2", vocab_size=4)
    ids = torch.tensor([[3, 1, 3, 1, 2, 1, 2, 2, 2, 1]])
    settings = dict(max_new_tokens=TABLE + 1 - ids.shape[1])
    with pytest.raises(IndexError):
        _theirs(theirs, ids, prompt_lookup_num_tokens=4, eos_token_id=None, **settings)
    got = generate_ids(ours, ids, prompt_lookup_num_tokens=4, eos_token_id=[], **settings)
    assert torch.equal(got, _theirs(theirs, ids, eos_token_id=None, **settings))


def _nan_at(step: int, prompt: int):
    """A logits processor that makes every score NaN at new token ``step`` (a broken model's logits)."""
    def processor(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return torch.full_like(scores, NAN) if input_ids.shape[1] - prompt + 1 == step else scores
    return processor


@pytest.mark.parametrize("mode", ["sample", "beam_sample", "lookup_sample"])
def test_sampling_on_nan_scores_is_a_typed_error_naming_the_step(mode):
    """Scores that are all NaN at the third new token: transformers' multinomial raises a bare RuntimeError; ours a
    NonFiniteScoresError (an InputError) naming the step, in plain, beam and prompt-lookup sampling. Greedy
    decoding is left as transformers has it."""
    ours, theirs = _pair("gpt2")
    ids = torch.tensor([[5, 6, 7, 5, 6, 7]])
    settings = dict(max_new_tokens=6, do_sample=True, suppress_tokens=[63],  # eos 63 never ends it before step 3
                    **({"num_beams": 2} if mode == "beam_sample" else
                       {"prompt_lookup_num_tokens": 2} if mode == "lookup_sample" else {}))
    with pytest.raises(RuntimeError, match="probability tensor contains"):
        _theirs(theirs, ids, logits_processor=[_nan_at(3, 6)], eos_token_id=63, **settings)
    torch.manual_seed(0)
    with pytest.raises(NonFiniteScoresError, match="sampling at (beam )?step 3") as info:
        generate_ids(ours, ids, logits_processor=[_nan_at(3, 6)], eos_token_id=63, **settings)
    assert isinstance(info.value, InputError) and "NaN or infinite" in str(info.value)
