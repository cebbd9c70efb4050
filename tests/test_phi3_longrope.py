"""Phi-3's longrope RoPE (Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini) against transformers 5.24 in the same run.

The shared tables (tests/cases/phi3.py, ``phi3-hd24-longrope``: original_max_position_embeddings 8, batches of 13
tokens) run every head on the long frequencies. Here: both sides of the switch on both attention paths and every
head, the switch at exactly original_max_position_embeddings (``max(position_ids) + 1`` against it, per forward,
so a cached decoding step turns with the long frequencies once its position passes it), the inverse frequencies and
attention factor as ``_compute_longrope_parameters`` gives them, the old type names, a dtype cast, ``generate``
across the boundary (transformers' Phi3 drops the cache there and runs the whole sequences again), and bad fields
as typed ConfigErrors where transformers raises. Every expected value comes from transformers in this run.
"""

from __future__ import annotations

import importlib
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from flodl_hf.auto import load_model
from flodl_hf.core.errors import ConfigError
from flodl_hf.generation.generate import generate_ids
from flodl_hf.roundtrip.parity import check_parity, quiet_transformers, reference_model

from cases import CASES
from cases.phi3 import LONGROPE
from helpers import make_checkpoint, one_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

VARIANT = "phi3-hd24-longrope"
OLD = 8  # the variant's original_max_position_embeddings
HEADS = ("base", "causal_lm", "seqcls", "tokcls")
IMPLS = ("eager", "sdpa")


def _fields(variant: str = VARIANT, task: str = "causal_lm") -> dict:
    fields = next(f for case_id, t, f in CASES if case_id == f"{variant}-{task}")
    return json.loads(json.dumps(fields))  # transformers' config fills nested RoPE dicts in place: keep ours clean


def _source(task: str = "causal_lm", **changes) -> Path:
    return make_checkpoint({**_fields(task=task), **changes}, task)


def _load(source: Path, task: str, impl: str | None = None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = load_model(source, task, dtype=torch.float32, attn_implementation=impl or "sdpa").eval()
        theirs = reference_model(source, task, impl)
    return ours, theirs


def _batch(lengths: tuple[int, ...], left: bool = False, vocab: int = 32000, seed: int = 1) -> dict:
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(1, vocab, (len(lengths), width), generator=gen)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        if left:
            mask[row, width - n:] = 1
        else:
            mask[row, :n] = 1
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


# (name, lengths, left padded): max(position_ids) + 1 below, at, and just past original_max_position_embeddings
BATCHES = [("short", (6, 3), False), ("at-old-max", (OLD, 5), False), ("just-past", (OLD + 1, 4), False),
           ("long-left-padded", (12, OLD + 1, 2), True), ("at-old-max-left-padded", (OLD, 3), True)]


@pytest.mark.parametrize("task", HEADS)
@pytest.mark.parametrize("impl", IMPLS)
def test_forwards_either_side_of_the_switch_equal_transformers(task, impl):
    source = _source(task)
    for name, lengths, left in BATCHES:
        batch = _batch(lengths, left)
        result = check_parity(source, task, impl, batch=batch)
        assert result.exact, (name, result.diffs)


@torch.inference_mode()
def test_the_switch_is_at_exactly_original_max_position_embeddings():
    """The same first OLD tokens: alone (max position OLD - 1: short) they give the logits transformers gives
    alone; with one token more (max position OLD: long) every position turns with the long frequencies and
    attention factor, so even the first OLD positions change, on both sides alike. Explicit position_ids move
    the switch with them: positions 1..OLD over OLD tokens are long."""
    ours, theirs = _load(_source(), "causal_lm", "sdpa")
    ids = _batch((OLD + 1,))["input_ids"]
    short_ours, short_theirs = ours(input_ids=ids[:, :OLD]).logits, theirs(input_ids=ids[:, :OLD]).logits
    long_ours, long_theirs = ours(input_ids=ids).logits, theirs(input_ids=ids).logits
    assert torch.equal(short_ours, short_theirs) and torch.equal(long_ours, long_theirs)
    assert (short_ours - long_ours[:, :OLD]).abs().max() > 1e-3  # the switch changed the earlier positions too
    shifted = torch.arange(1, OLD + 1)[None]
    a, b = ours(input_ids=ids[:, :OLD], position_ids=shifted).logits, theirs(input_ids=ids[:, :OLD],
                                                                               position_ids=shifted).logits
    assert torch.equal(a, b)
    # a rope with the long frequencies switched off (as short) would give other logits for the shifted positions
    assert not torch.equal(a, ours(input_ids=ids[:, :OLD], position_ids=shifted - 1).logits)


@pytest.mark.parametrize("impl", IMPLS)
@torch.inference_mode()
def test_cached_decoding_steps_across_the_switch_equal_transformers(impl):
    """A left-padded prefill below the switch, then one token at a time with the cache through positions OLD - 1,
    OLD, OLD + 1, ... (the model's forward alone, no cache dropped): each step's logits, and the caches at the
    end, torch.equal to transformers' with its DynamicCache."""
    from transformers import DynamicCache
    ours, theirs = _load(_source(), "causal_lm", impl)
    batch = _batch((5, 3), left=True)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    cache_ours, cache_theirs = ours.backbone.new_cache(), DynamicCache(config=theirs.config)
    step_ids, step_pos = ids, pos
    for step in range(8):
        a = ours(input_ids=step_ids, attention_mask=mask, position_ids=step_pos, cache=cache_ours, use_cache=True)
        b = theirs(input_ids=step_ids, attention_mask=mask, position_ids=step_pos, cache=cache_theirs,
                   use_cache=True)
        assert torch.equal(a.logits, b.logits), (step, int(step_pos.max()), (a.logits - b.logits).abs().max().item())
        nxt = b.logits[:, -1].argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(nxt)], dim=-1)
        step_pos, step_ids = step_pos[:, -1:] + 1, nxt
    assert int(step_pos.max()) > OLD + 1
    for i, layer in enumerate(cache_theirs.layers):
        assert torch.equal(cache_ours.keys[i], layer.keys) and torch.equal(cache_ours.values[i], layer.values)


@torch.inference_mode()
def test_frequencies_and_attention_factor_are_transformers():
    """decoder.Rope against _compute_longrope_parameters on the same config: the short frequencies (seq_len None),
    the long ones (seq_len OLD + 1), the attention factor (sqrt(1 + log(64 / 8) / log(8)) here), and a given
    factor / attention_factor."""
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from flodl_hf.core.registry import get_family
    compute = ROPE_INIT_FUNCTIONS["longrope"]
    fields = {k: v for k, v in _fields().items() if k != "model_type"}
    for extra in ({}, {"factor": 2.0}, {"attention_factor": 1.25}, {"factor": 0.5}, {"rope_theta": 500000}):
        fields["rope_parameters"] = {**LONGROPE, **extra}
        config = Phi3Config(**json.loads(json.dumps(fields)))
        short, scaling = compute(config, None)
        long, _ = compute(config, None, seq_len=OLD + 1)
        ours = get_family("phi3").config_class.from_dict({"model_type": "phi3", **json.loads(json.dumps(fields))})
        rope = ours.rope()
        assert rope.attention_scaling == scaling, extra
        assert torch.equal(rope.inverse_frequencies(ours.rotary_dim), short), extra
        assert torch.equal(rope.inverse_frequencies(ours.rotary_dim, long=True), long), extra
        assert not torch.equal(short, long)


# the real checkpoints' RoPE fields at 2 heads: Phi-3.5-mini (head_dim 96, all rotated: 48 factors, the older
# rope_scaling spelling) and Phi-4-mini (head_dim 128, partial 0.75: 48 factors, tied embeddings); 4096 / 131072
_SHORT = [round(1.0 + 0.02 * i ** 0.5, 4) for i in range(48)]
_LONG = [round(1.0 + (i / 47) ** 3 * 60 + 0.1 * (i % 3), 4) for i in range(48)]
REAL_SHAPES = {
    "phi3.5-mini": dict(hidden_size=192, num_attention_heads=2,
                        rope_scaling={"type": "longrope", "short_factor": _SHORT, "long_factor": _LONG}),
    "phi4-mini": dict(hidden_size=256, num_attention_heads=2, partial_rotary_factor=0.75, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "longrope", "short_factor": _SHORT, "long_factor": _LONG}),
}


@pytest.mark.parametrize("name", REAL_SHAPES)
def test_real_checkpoint_shapes_either_side_of_4096(name):
    """13 tokens at positions from 0, 4083 (the last at 4095: max + 1 = 4096, short), 4084 (the last at 4096:
    long) and 100000, both paths."""
    fields = dict(model_type="phi3", num_key_value_heads=2, num_hidden_layers=1, intermediate_size=128,
                  vocab_size=512, max_position_embeddings=131072, original_max_position_embeddings=4096,
                  pad_token_id=0, **json.loads(json.dumps(REAL_SHAPES[name])))
    source = make_checkpoint(fields, "causal_lm")
    batch = _batch((13, 9), vocab=512)
    for start in (0, 4083, 4084, 100000):
        batch["position_ids"] = (torch.arange(13) + start)[None].expand(2, -1)
        for impl in IMPLS:
            result = check_parity(source, "causal_lm", impl, batch=batch)
            assert result.exact, (start, impl, result.diffs)


def _edit_config(source: Path, tmp_path: Path, name: str, edit) -> Path:
    out = tmp_path / name
    shutil.copytree(source, out)
    data = json.loads((out / "config.json").read_text())
    edit(data)
    (out / "config.json").write_text(json.dumps(data))
    return out


def _to_rope_scaling(kind: str, nested_old: int | None):
    def edit(data: dict) -> None:
        params = {k: v for k, v in data.pop("rope_parameters").items()
                  if k in ("short_factor", "long_factor")}
        params["type"] = kind
        if nested_old is not None:
            params["original_max_position_embeddings"] = nested_old
        data["rope_scaling"] = params
    return edit


@pytest.mark.parametrize("kind,nested_old", [("su", 4096), ("yarn", None), ("longrope", 4096)])
def test_older_spellings_read_as_transformers_reads_them(tmp_path, kind, nested_old):
    """``rope_scaling`` with ``type`` ``su`` or ``yarn`` is longrope (Phi3Config renames them); the top-level
    original_max_position_embeddings (8) is used whatever the nested one says (4096), as transformers does."""
    source = _edit_config(_source(), tmp_path, kind, _to_rope_scaling(kind, nested_old))
    for name, lengths, left in (BATCHES[0], BATCHES[2]):
        result = check_parity(source, "causal_lm", "sdpa", batch=_batch(lengths, left))
        assert result.exact, (kind, name, result.diffs)


def test_su_without_its_own_old_max_reads_as_longrope(tmp_path):
    """An ``su`` dict without original_max_position_embeddings: transformers 5.25 renames su to longrope before
    standardizing, so the top-level field fills it; 5.24 failed on it (KeyError). Ours reads it as 5.25 does:
    equal to transformers' reading of the same file where it loads it, and always to its reading of the same dict
    spelled longrope."""
    su = _edit_config(_source(), tmp_path, "su", _to_rope_scaling("su", None))
    spelled = _edit_config(_source(), tmp_path, "longrope", _to_rope_scaling("longrope", None))
    ours = load_model(su, "causal_lm", dtype=torch.float32, attn_implementation="sdpa").eval()
    references = [reference_model(spelled, "causal_lm", "sdpa")]
    if not _transformers_refuses(su):
        references.append(reference_model(su, "causal_lm", "sdpa"))
    with torch.inference_mode():
        for lengths in ((6, 3), (12, 5)):  # short of original_max_position_embeddings, and past it
            batch = _batch(lengths)
            got = ours(**batch, use_cache=False).logits
            for theirs in references:
                assert torch.equal(got, theirs(**batch, use_cache=False).logits), lengths


def _prompt(lengths=(5, 3)) -> tuple[torch.Tensor, torch.Tensor]:
    batch = _batch(lengths, left=True, seed=3)
    return batch["input_ids"], batch["attention_mask"]


def _generate_both(ours, theirs, ids, mask, **settings):
    # no eos (greedy); with beams the config's (32000, outside the vocabulary: never picked), as transformers'
    # beam search needs one with pad id 0
    settings = {"eos_token_id": [] if settings.get("num_beams", 1) == 1 else None, **settings}
    with torch.inference_mode():
        reference = theirs.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=0,
                                    return_dict_in_generate=True, output_logits=True, **settings)
    got = generate_ids(ours, ids, mask, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                       output_logits=True, **settings)
    return got, reference


@pytest.mark.parametrize("impl", IMPLS)
def test_generate_across_the_switch_equals_transformers(impl):
    """Greedy from prompts of 5 and 3 tokens (left padded) to 17: the sequences reach OLD + 1 tokens at the 5th
    forward, where transformers' Phi3ForCausalLM.prepare_inputs_for_generation drops the cache and runs the whole
    sequences again; ids, every step's logits and the final cache torch.equal. Without that recompute (the cache
    kept, its first keys turned with the short frequencies) the logits differ, so the drop is what matches."""
    ours, theirs = _load(_source(), "causal_lm", impl)
    ids, mask = _prompt()
    got, reference = _generate_both(ours, theirs, ids, mask, max_new_tokens=12)
    assert torch.equal(got.sequences, reference.sequences)
    assert len(got.logits) == len(reference.logits) == 12
    for step, (a, b) in enumerate(zip(got.logits, reference.logits)):
        assert torch.equal(a, b), (step, (a - b).abs().max().item())
    for i, layer in enumerate(reference.cache.layers):
        assert torch.equal(got.cache.keys[i], layer.keys) and torch.equal(got.cache.values[i], layer.values)
    # the model's generate, and a prompt already past the switch (its prefill is long)
    with torch.inference_mode():
        expected = theirs.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                   eos_token_id=[], pad_token_id=0)
    assert torch.equal(ours.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                     eos_token_id=[], pad_token_id=0), expected)
    long_ids, long_mask = _prompt((11, 6))
    got, reference = _generate_both(ours, theirs, long_ids, long_mask, max_new_tokens=5)
    assert torch.equal(got.sequences, reference.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, reference.logits))


def test_generate_keeps_the_cache_where_transformers_keeps_it(monkeypatch):
    """The recompute is what makes the logits equal: with the family's hook off, the steps after the switch use
    keys turned with the short frequencies and differ."""
    from flodl_hf.families.phi3 import Phi3Model
    ours, theirs = _load(_source(), "causal_lm", "sdpa")
    ids, mask = _prompt()
    monkeypatch.setattr(Phi3Model, "drops_cache", lambda self, length, past: False)
    got, reference = _generate_both(ours, theirs, ids, mask, max_new_tokens=8)
    assert all(torch.equal(a, b) for a, b in zip(got.logits[:4], reference.logits[:4]))  # 5 to 8 tokens
    assert not torch.equal(got.logits[4], reference.logits[4])  # 9: transformers' whole sequences, ours cached


def test_generate_with_beams_and_default_rope_windows_across_the_cache_drop():
    """transformers drops the cache at original_max_position_embeddings + 1 for every Phi-3, whatever its RoPE:
    the windowed default-RoPE variant with original_max_position_embeddings 8, greedy and with 2 beams (the cache
    rebuilt for every beam row, then reordered), and the longrope variant with beams; ids and logits equal."""
    fields = {**_fields("phi3-hd24-partial-window4"), "original_max_position_embeddings": OLD}
    windowed = _load(make_checkpoint(fields, "causal_lm"), "causal_lm", "sdpa")
    longrope = _load(_source(), "causal_lm", "eager")
    ids, mask = _prompt()
    for (ours, theirs), beams in ((windowed, 1), (windowed, 2), (longrope, 2)):
        got, reference = _generate_both(ours, theirs, ids, mask, max_new_tokens=9, num_beams=beams)
        assert torch.equal(got.sequences, reference.sequences), beams
        assert all(torch.equal(a, b) for a, b in zip(got.logits, reference.logits)), beams


@torch.inference_mode()
def test_a_cast_rounds_the_long_frequencies_as_transformers_buffer_does():
    """transformers copies the long frequencies (computed in float32, a plain attribute) into the short ones'
    buffer, which a cast rounded: in bfloat16 both are rounded; after ``.bfloat16().float()`` only the short
    ones stay rounded. Both forwards, short and long, torch.equal after each cast."""
    source = _source()
    casts = {"bfloat16": lambda m: m.bfloat16(), "to_bf16_then_float": lambda m: m.to(dtype=torch.bfloat16).float()}
    for name, cast in casts.items():
        ours, theirs = _load(source, "causal_lm", "sdpa")
        ours, theirs = cast(ours), cast(theirs)
        for lengths in ((6, 3), (12, 5)):
            batch = _batch(lengths)
            a, b = ours(**batch, use_cache=False).logits, theirs(**batch, use_cache=False).logits
            assert a.dtype == b.dtype and torch.equal(a, b), (name, lengths, (a.float() - b.float()).abs().max())


def _factors(n: int) -> list[float]:
    return [1.0 + i / 10 for i in range(n)]


# (name, edit of config.json, the field our ConfigError names): each one transformers refuses too (at the config,
# the model's construction or the first forward)
def _set_rope(**changes):
    def edit(data: dict) -> None:
        data["rope_parameters"].update(changes)
        for key, value in changes.items():
            if value is _DROP:
                del data["rope_parameters"][key]
    return edit


_DROP = object()
BAD = [
    ("no-short-factor", _set_rope(short_factor=_DROP), "short_factor"),
    ("no-long-factor", _set_rope(long_factor=_DROP), "long_factor"),
    ("short-factor-too-short", _set_rope(short_factor=_factors(3)), "short_factor"),
    ("long-factor-too-long", _set_rope(long_factor=_factors(12)), "long_factor"),
    ("short-factor-strings", _set_rope(short_factor=["1.0"] * 9), "short_factor"),
    ("long-factor-a-number", _set_rope(long_factor=2.0), "long_factor"),
    ("long-factor-nested", _set_rope(long_factor=[[1.0]] * 9), "long_factor"),
    ("short-factor-null", _set_rope(short_factor=None), "short_factor"),
    ("factor-a-string", _set_rope(factor="2"), "factor"),
    ("attention-factor-a-string", _set_rope(attention_factor="1.2"), "attention_factor"),
    ("theta-a-string", _set_rope(rope_theta="10000"), "rope_theta"),
    ("old-max-zero", lambda d: d.update(original_max_position_embeddings=0), "original_max_position_embeddings"),
    ("old-max-one", lambda d: d.update(original_max_position_embeddings=1), "original_max_position_embeddings"),
    ("old-max-a-float", lambda d: d.update(original_max_position_embeddings=8.0), "original_max_position_embeddings"),
    ("old-max-a-string", lambda d: d.update(original_max_position_embeddings="8"), "original_max_position_embeddings"),
    ("rope-type-dynamic", _set_rope(rope_type="dynamic", factor=2.0), "rope_type"),
]


def _transformers_refuses(source: Path) -> bool:
    transformers = quiet_transformers()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = transformers.AutoConfig.from_pretrained(source)
            model = transformers.Phi3ForCausalLM(config).eval()
            with torch.inference_mode():
                model(**_batch((OLD + 2, 3)))
    except Exception:  # noqa: BLE001  (KeyError, ValueError, TypeError, ZeroDivisionError...: any failure counts)
        return True
    return False


@pytest.mark.parametrize("name,edit,field", BAD, ids=[b[0] for b in BAD])
def test_bad_longrope_fields_are_config_errors_where_transformers_fails(tmp_path, name, edit, field):
    source = _edit_config(_source(), tmp_path, name, edit)
    assert _transformers_refuses(source), name
    with pytest.raises(ConfigError, match=field):
        load_model(source, "causal_lm")


def test_boolean_factors_are_refused_though_transformers_reads_them_as_numbers(tmp_path):
    """A JSON boolean is not a number: refused, as every RoPE number here (transformers takes ``true`` as 1.0)."""
    source = _edit_config(_source(), tmp_path, "bools", _set_rope(short_factor=[True] * 9))
    assert not _transformers_refuses(source)
    with pytest.raises(ConfigError, match="short_factor"):
        load_model(source, "causal_lm")


def test_generate_texts_equal_the_pipeline_across_the_switch(tmp_path, monkeypatch):
    """generate(prompts) batches greedy prompts with left padding, but a Phi-3 batch that reaches
    original_max_position_embeddings + 1 tokens decodes its short rows differently from each prompt alone (the
    cache dropped at the padded length, the long frequencies for every row: shown first on ids): such prompts run
    one at a time, as the text-generation pipeline runs them, and the records equal the pipeline's; a run that
    cannot get there stays one batch."""
    generation = importlib.import_module("flodl_hf.tasks.generate")  # the package exports a function of that name
    from flodl_hf.core.samples import sample_path
    ours, _ = _load(_source(), "causal_lm", "sdpa")
    ids, mask = _prompt((6, 3))
    batched = generate_ids(ours, ids, mask, do_sample=False, max_new_tokens=12, eos_token_id=[], pad_token_id=0)
    alone = generate_ids(ours, ids[1:, 3:], mask[1:, 3:], do_sample=False, max_new_tokens=12, eos_token_id=[],
                         pad_token_id=0)
    assert not torch.equal(batched[1, 3:], alone[0])

    root = tmp_path / "model"
    fields = {**_fields(), "vocab_size": 1000, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    shutil.copytree(make_checkpoint(fields, "causal_lm"), root)
    shutil.copy(sample_path("botchan") / "botchan_en_bpe_1000.model", root / "tokenizer.model")
    (root / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer",
                                                            "pad_token": "<unk>"}))
    pipe = quiet_transformers().pipeline("text-generation", model=str(root), tokenizer=str(root))
    prompts = ["It was the fourth day", "Botchan said", "Hello"]
    lengths = [len(pipe.tokenizer(p)["input_ids"]) for p in prompts]
    assert max(lengths) + 6 > OLD >= max(lengths) + 2, lengths  # 6 new tokens get a batch there, 2 do not
    rows_per_call: list[int] = []
    real = generation.generate_ids

    def spy(model, input_ids, *args, **kwargs):
        rows_per_call.append(input_ids.shape[0])
        return real(model, input_ids, *args, **kwargs)

    monkeypatch.setattr(generation, "generate_ids", spy)
    for new, calls in ((6, [1, 1, 1]), (2, [3])):
        rows_per_call.clear()
        ours = generation.generate(prompts, str(root), do_sample=False, max_new_tokens=new, eos_token_id=[])
        assert ours == pipe(prompts, do_sample=False, max_new_tokens=new, eos_token_id=[]), new
        assert rows_per_call == calls, new
