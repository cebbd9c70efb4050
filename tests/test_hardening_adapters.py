"""Hardening the LoRA adapter readers: a refused adapter leaves the model as it was, no file of an adapter
directory is read through a link out of it, regular expressions from adapter settings run in bounded time, and
the adapter config reader gives a clean read or a typed error whatever a field holds (hypothesis).

Each refusal is compared with peft in the same run where peft does something else: it leaves its base model
adapted after a refused adapter, loads integer tensors, follows links out, and matches a catastrophic regex
without bound. The bad inputs are built from one adapter that peft wrote on a tiny BERT.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

peft = pytest.importorskip("peft")

from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from flodl_hf import lora
from flodl_hf.auto import AutoModelForSequenceClassification, load_model
from flodl_hf.core.errors import (AdapterBaseMismatchError, AdapterError, UnsupportedAdapterError,
                                  WeightsMismatchError)
from flodl_hf.roundtrip.parity import make_batch, reference_model

from cases import CASES
from helpers import make_checkpoint

BERT = "bert-hd24-seqcls"
TASK = "seqcls"
CONFIG, WEIGHTS, STAMP = lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS, lora.BASE_STAMP
A_KEY = "base_model.model.bert.encoder.layer.0.attention.self.query.lora_A.weight"
B_KEY = "base_model.model.bert.encoder.layer.0.attention.self.value.lora_B.weight"
HEAD_W, HEAD_B = "base_model.model.classifier.weight", "base_model.model.classifier.bias"
# A regular expression that backtracks exponentially on any module name of a few dozen characters.
CATASTROPHIC = r"(.+)+X"

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Interrupt the block after ``seconds`` (SIGALRM; the re module checks signals while it matches), so that
    a call that would run without bound fails the test instead of hanging it."""
    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"still running after {seconds} s")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> tuple[Path, Path, torch.Tensor]:
    """The tiny BERT base, a PEFT adapter on it (query and value at r 4, the classifier saved; B perturbed so the
    adapter changes the outputs) and the logits of the base with that adapter."""
    source = make_checkpoint(next(f for c, t, f in CASES if c == BERT), TASK)
    torch.manual_seed(0)
    theirs = peft.get_peft_model(reference_model(source, TASK, "sdpa"),
                                 peft.LoraConfig(r=4, lora_alpha=8, task_type="SEQ_CLS",
                                                 target_modules=["query", "value"]))
    with torch.no_grad():
        for name, param in theirs.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    out = tmp_path_factory.mktemp("adapters") / "good"
    theirs.save_pretrained(str(out))
    model = lora.load_adapter(load_model(source, TASK), out)
    with torch.no_grad():
        logits = model(**make_batch(model.config, TASK)).logits
    return source, out, logits


def snapshot(model: torch.nn.Module) -> dict[str, Any]:
    """What a refused adapter must leave as it was: the state_dict (keys and values), each parameter's
    requires_grad and identity (a tied weight stays tied), the module tree, and the model's attributes."""
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "grad": {n: p.requires_grad for n, p in model.named_parameters(remove_duplicate=False)},
            "ids": [(n, id(p)) for n, p in model.named_parameters(remove_duplicate=False)],
            "modules": [(n, type(m).__name__) for n, m in model.named_modules()],
            "repr": str(model), "attrs": sorted(vars(model))}


def assert_unchanged(model: torch.nn.Module, before: dict[str, Any]) -> None:
    after = snapshot(model)
    assert after["modules"] == before["modules"] and after["repr"] == before["repr"]
    assert after["state"].keys() == before["state"].keys()
    assert all(torch.equal(after["state"][k], v) for k, v in before["state"].items())
    assert after["grad"] == before["grad"] and after["ids"] == before["ids"]
    assert after["attrs"] == before["attrs"]


def _edit_config(directory: Path, **changes: Any) -> None:
    path = directory / CONFIG
    data = {**json.loads(path.read_text()), **changes}
    path.write_text(json.dumps({k: v for k, v in data.items() if v is not _DROP}))


def _edit_tensors(directory: Path, change: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> None:
    path = directory / WEIGHTS
    save_file(change(load_file(str(path))), str(path))


def _link_out(directory: Path, name: str) -> None:
    """Move ``name`` out of the adapter directory and leave a symlink to it in its place."""
    outside = directory.parent / f"elsewhere-{name}"
    shutil.move(str(directory / name), str(outside))
    os.symlink(outside, directory / name)


def _stamp_of_another_base(directory: Path) -> None:
    (directory / STAMP).write_text(json.dumps({"task": TASK, "base": {"source": "x", "weights_sha256": {
        "model.safetensors": "0" * 64}}}))


_DROP = object()

# (id, change to a copy of the good adapter, error type, what the message must name: a regex)
BAD_ADAPTERS: list[tuple[str, Callable[[Path], None], type[Exception], str]] = [
    # config fields
    ("r-zero", lambda d: _edit_config(d, r=0), AdapterError, f"{CONFIG}.*'r'"),
    ("alpha-string", lambda d: _edit_config(d, lora_alpha="8"), AdapterError, f"{CONFIG}.*'lora_alpha'"),
    ("peft-type", lambda d: _edit_config(d, peft_type="IA3"), UnsupportedAdapterError, f"{CONFIG}.*IA3"),
    ("config-not-json", lambda d: (d / CONFIG).write_text("{r: 4"), AdapterError, f"{CONFIG}.*not valid JSON"),
    ("target-matches-nothing", lambda d: _edit_config(d, target_modules=["q_lin"]), AdapterError,
     "target_modules.*q_lin"),
    ("target-regex-invalid", lambda d: _edit_config(d, target_modules="(query"), AdapterError,
     f"{CONFIG}.*'target_modules'"),
    ("target-regex-huge-repeat", lambda d: _edit_config(d, target_modules="a{99999999999999999999}"),
     AdapterError, f"{CONFIG}.*'target_modules'"),
    ("target-regex-too-long", lambda d: _edit_config(d, target_modules="(query)" + "|x" * 40000), AdapterError,
     f"{CONFIG}.*'target_modules'.*80007 characters"),
    ("target-parameters-match-nothing", lambda d: _edit_config(d, target_parameters=["nope"]), AdapterError,
     "target_parameters.*nope"),
    ("task-type-of-another-head", lambda d: _edit_config(d, task_type="TOKEN_CLS"), AdapterBaseMismatchError,
     "TOKEN_CLS"),
    ("token-id-out-of-range", lambda d: _edit_config(d, trainable_token_indices=[10**6]), AdapterError,
     f"{CONFIG}.*trainable_token_indices"),
    ("module-to-save-a-target", lambda d: _edit_config(d, modules_to_save=["query"]), WeightsMismatchError,
     f"{WEIGHTS}.*missing keys.*query.weight.*unexpected keys.*query.lora_A"),
    ("rank-pattern-global-flag", lambda d: _edit_config(d, rank_pattern={"(?i)query": 2}), AdapterError,
     f"{CONFIG}.*'rank_pattern'"),
    ("base-stamp-of-another-base", _stamp_of_another_base, AdapterBaseMismatchError, "sha256"),
    # keys
    ("missing-key", lambda d: _edit_tensors(d, lambda t: {k: v for k, v in t.items() if k != B_KEY}),
     WeightsMismatchError, f"{WEIGHTS}.*missing keys.*value"),
    ("missing-head", lambda d: _edit_tensors(d, lambda t: {k: v for k, v in t.items() if k != HEAD_W}),
     WeightsMismatchError, f"{WEIGHTS}.*missing keys.*classifier"),
    ("extra-key", lambda d: _edit_tensors(d, lambda t: {**t, "base_model.model.bert.extra.lora_A.weight":
                                                          torch.zeros(1)}), WeightsMismatchError,
     f"{WEIGHTS}.*unexpected keys.*extra"),
    # shapes
    ("lora-A-rank", lambda d: _edit_tensors(d, lambda t: {**t, A_KEY: torch.zeros(5, t[A_KEY].shape[1])}),
     AdapterBaseMismatchError, f"{WEIGHTS}.*shapes differ.*lora_A"),
    ("lora-B-scalar", lambda d: _edit_tensors(d, lambda t: {**t, B_KEY: torch.tensor(0.5)}),
     AdapterBaseMismatchError, f"{WEIGHTS}.*shapes differ.*lora_B"),
    ("head-labels", lambda d: _edit_tensors(d, lambda t: {**t, HEAD_W: torch.zeros(6, t[HEAD_W].shape[1])}),
     AdapterBaseMismatchError, f"{WEIGHTS}.*shapes differ.*classifier"),
    # dtypes
    ("lora-A-int64", lambda d: _edit_tensors(d, lambda t: {**t, A_KEY: t[A_KEY].to(torch.int64)}), AdapterError,
     f"{WEIGHTS}.*lora_A.*int64"),
    ("head-bias-bool", lambda d: _edit_tensors(d, lambda t: {**t, HEAD_B: t[HEAD_B] > 0}), AdapterError,
     f"{WEIGHTS}.*classifier.bias.*bool"),
    ("lora-B-complex", lambda d: _edit_tensors(d, lambda t: {**t, B_KEY: t[B_KEY].to(torch.complex64)}),
     AdapterError, f"{WEIGHTS}.*lora_B.*complex64"),
    # the files themselves
    ("weights-truncated", lambda d: (d / WEIGHTS).write_bytes((d / WEIGHTS).read_bytes()[:300]), AdapterError,
     f"{WEIGHTS}.*safetensors"),
    ("weights-empty", lambda d: (d / WEIGHTS).write_bytes(b""), AdapterError, f"{WEIGHTS}.*safetensors"),
    ("weights-missing", lambda d: (d / WEIGHTS).unlink(), AdapterError, f"no {WEIGHTS}"),
    ("weights-a-directory", lambda d: ((d / WEIGHTS).unlink(), (d / WEIGHTS).mkdir()), AdapterError, WEIGHTS),
    ("config-link-loop", lambda d: ((d / CONFIG).unlink(), os.symlink(CONFIG, d / CONFIG)), AdapterError, CONFIG),
    # files that point outside the adapter directory
    ("config-links-out", lambda d: _link_out(d, CONFIG), AdapterError, f"{CONFIG}.*outside"),
    ("weights-link-out", lambda d: _link_out(d, WEIGHTS), AdapterError, f"{WEIGHTS}.*outside"),
    ("stamp-links-out", lambda d: ((d / STAMP).write_text('{"task": "seqcls"}'), _link_out(d, STAMP)),
     AdapterError, f"{STAMP}.*outside"),
    # regular expressions that backtrack without bound on BERT's module names
    ("target-regex-catastrophic", lambda d: _edit_config(d, target_modules=CATASTROPHIC), AdapterError,
     f"{CONFIG}.*'target_modules'.*backtrack"),
    ("exclude-regex-catastrophic", lambda d: _edit_config(d, exclude_modules=CATASTROPHIC), AdapterError,
     f"{CONFIG}.*'exclude_modules'.*backtrack"),
    ("rank-pattern-catastrophic", lambda d: _edit_config(d, rank_pattern={CATASTROPHIC: 2}), AdapterError,
     f"{CONFIG}.*'rank_pattern'.*backtrack"),
    ("alpha-pattern-catastrophic", lambda d: _edit_config(d, alpha_pattern={CATASTROPHIC: 2}), AdapterError,
     f"{CONFIG}.*'alpha_pattern'.*backtrack"),
    ("layers-pattern-catastrophic", lambda d: _edit_config(d, layers_to_transform=[0], layers_pattern=CATASTROPHIC),
     AdapterError, f"{CONFIG}.*'layers_pattern'.*backtrack"),
]


@pytest.mark.parametrize("change,error,names", [pytest.param(c, e, n, id=i) for i, c, e, n in BAD_ADAPTERS])
def test_a_refused_adapter_leaves_the_model_as_it_was(change, error, names, good, tmp_path):
    """load_adapter refuses each bad adapter with a typed error naming the file, key or field; the model's
    state_dict, requires_grad, parameters, module tree and attributes are as before, and the good adapter then
    loads and gives the good adapter's outputs. from_pretrained(BASE, adapter=) refuses it the same way."""
    source, good_dir, logits = good
    bad = tmp_path / "bad"
    shutil.copytree(good_dir, bad)
    change(bad)
    model = load_model(source, TASK)
    before = snapshot(model)
    with deadline(10), pytest.raises(error, match=f"(?s){names}"):
        lora.load_adapter(model, bad)
    assert_unchanged(model, before)
    with deadline(10), pytest.raises(error, match=f"(?s){names}"):
        AutoModelForSequenceClassification.from_pretrained(source, adapter=bad)
    lora.load_adapter(model, good_dir)
    with torch.no_grad():
        assert torch.equal(model(**make_batch(model.config, TASK)).logits, logits)


def test_peft_leaves_its_base_adapted_after_a_refusal_and_loads_integer_tensors(good, tmp_path):
    """What peft does with two of the cases above, in the same run: a lora_A of another rank fails in
    load_state_dict after LoRA layers were put on transformers' model (it stays adapted and frozen); an int64
    lora_A loads, cast."""
    source, good_dir, _ = good
    bad = tmp_path / "bad"
    shutil.copytree(good_dir, bad)
    _edit_tensors(bad, lambda t: {**t, A_KEY: torch.zeros(5, t[A_KEY].shape[1])})
    base = reference_model(source, TASK, "sdpa")
    with pytest.raises(RuntimeError, match="size mismatch"):
        peft.PeftModel.from_pretrained(base, str(bad))
    assert any("lora_A" in name for name, _ in base.named_modules())
    assert not any(p.requires_grad for p in base.parameters())
    _edit_tensors(bad, lambda t: {**t, A_KEY: torch.ones(4, t[A_KEY].shape[1], dtype=torch.int64)})
    peft.PeftModel.from_pretrained(reference_model(source, TASK, "sdpa"), str(bad))


def test_add_lora_refused_late_leaves_the_model_as_it_was(good):
    """add_lora checks target_parameters after putting the LoRA layers on: the refusal takes them off again."""
    source, good_dir, logits = good
    model = load_model(source, TASK)
    before = snapshot(model)
    with pytest.raises(AdapterError, match="target_parameters.*nope"):
        lora.add_lora(model, r=4, target_modules=["query", "value"], target_parameters=["nope"])
    assert_unchanged(model, before)
    lora.load_adapter(model, good_dir)
    with torch.no_grad():
        assert torch.equal(model(**make_batch(model.config, TASK)).logits, logits)


def test_a_refused_trainer_checkpoint_adapter_leaves_the_model_as_it_was(good):
    """load_checkpoint_adapter (export --checkpoint of a LoRA checkpoint) with a tensor of another shape and one
    of an integer dtype: refused, the base as it was; the checkpoint's own tensors then load."""
    source, _, _ = good
    trained = lora.add_lora(load_model(source, TASK), r=4, target_modules=["query", "value"])
    entry = lora.trainer_entry(trained)
    saved = lora.trainer_model_state(trained)
    settings = lora.lora_settings(entry["config"], "entry", defaults=False)
    key = next(k for k in saved if k.endswith("lora_A.weight"))
    for bad, error in (({**saved, key: torch.zeros(5, saved[key].shape[1])}, AdapterBaseMismatchError),
                       ({**saved, key: saved[key].to(torch.int32)}, AdapterError)):
        model = load_model(source, TASK)
        before = snapshot(model)
        with pytest.raises(error, match=f"ckpt.*{key}"):
            lora.load_checkpoint_adapter(model, entry, settings, bad, "ckpt")
        assert_unchanged(model, before)
        lora.load_checkpoint_adapter(model, entry, settings, saved, "ckpt")
        assert all(torch.equal(v, saved[k]) for k, v in lora.adapter_state(model).items())


# ---- links: out of the adapter directory refused, inside it (or into a hub cache's blobs/) followed ---------

def test_peft_follows_a_link_out_and_we_refuse_it(good, tmp_path):
    source, good_dir, _ = good
    adapter = tmp_path / "adapter"
    shutil.copytree(good_dir, adapter)
    _link_out(adapter, WEIGHTS)
    peft.PeftModel.from_pretrained(reference_model(source, TASK, "sdpa"), str(adapter))  # read through the link
    with pytest.raises(AdapterError, match=f"{WEIGHTS}.*outside"):
        lora.load_adapter(load_model(source, TASK), adapter)
    with pytest.raises(AdapterError, match=f"{CONFIG}.*outside"):
        _link_out(adapter, CONFIG)
        lora.read_adapter_config(adapter)


def test_links_inside_the_adapter_and_into_hub_blobs_are_followed(good, tmp_path):
    source, good_dir, logits = good
    inside = tmp_path / "inside"
    shutil.copytree(good_dir, inside)
    (inside / "files").mkdir()
    for name in (CONFIG, WEIGHTS):
        shutil.move(str(inside / name), str(inside / "files" / name))
        os.symlink(Path("files") / name, inside / name)
    # a hub cache snapshot: every file a link into the repo's blobs/
    repo = tmp_path / "hub" / "models--someone--adapter"
    snapshot_dir = repo / "snapshots" / "0123abcd"
    snapshot_dir.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for number, name in enumerate((CONFIG, WEIGHTS)):
        shutil.copy(good_dir / name, repo / "blobs" / f"blob{number}")
        os.symlink(Path("..") / ".." / "blobs" / f"blob{number}", snapshot_dir / name)
    for directory in (inside, snapshot_dir):
        model = lora.load_adapter(load_model(source, TASK), directory)
        with torch.no_grad():
            assert torch.equal(model(**make_batch(model.config, TASK)).logits, logits)


# ---- regular expressions: bounded, and every pattern a PEFT user writes still selects as PEFT selects -------

def test_peft_matches_a_catastrophic_pattern_without_bound():
    """peft's matcher on one BERT module name and the pattern of the table above: still running after 0.5 s
    (about 2^40 steps)."""
    from peft.tuners.tuners_utils import check_target_module_exists
    config = peft.LoraConfig(target_modules=CATASTROPHIC)
    with pytest.raises(TimeoutError), deadline(0.5):
        check_target_module_exists(config, "bert.encoder.layer.0.attention.self.query")


@pytest.mark.parametrize("field", ["target_modules", "exclude_modules", "rank_pattern", "alpha_pattern",
                                   "layers_pattern"])
def test_add_lora_refuses_a_catastrophic_pattern_naming_it(field, good):
    source, _, _ = good
    given = {"target_modules": {"target_modules": CATASTROPHIC}, "exclude_modules": {"exclude_modules": CATASTROPHIC},
             "rank_pattern": {"rank_pattern": {CATASTROPHIC: 2}}, "alpha_pattern": {"alpha_pattern": {CATASTROPHIC: 2}},
             "layers_pattern": {"layers_pattern": CATASTROPHIC, "layers_to_transform": [0]}}[field]
    model = load_model(source, TASK)
    before = snapshot(model)
    with deadline(10), pytest.raises(AdapterError, match=rf"'{field}'.*{re.escape(CATASTROPHIC)}.*backtrack"):
        lora.add_lora(model, r=4, **{"target_modules": ["query", "value"], **given})
    assert_unchanged(model, before)


# Patterns PEFT users write (PEFT's docs and issues, and this suite's): on BERT, each selects what PEFT selects.
LEGITIMATE = [
    r".*\.(query|value)", r".*(query|value)$", r"(.*\.)?(query|value)", r".*\.(?:query|key)", r".*?\.(query|value)",
    r"bert\.encoder\.layer\.\d+\.attention\.self\.(query|key|value)", r".*encoder.*(self|output).*(query|dense)$",
    r"^(?!.*layer\.0\.).*\.(query|value)$", r".*layer\.[01]\.attention\.self\.query", r"(?i).*QUERY",
    r".*dense", r".*\.\d+\..*\.value", r"(\w+\.)*query", r"[a-z.0-9]*value", r".*(attention\.self)\.(query|value)",
    r"bert\.encoder\.layer\.(0|1)\.attention\.self\.query", r"(?:bert\.)?encoder\.layer\.\d\.intermediate\.dense",
    r".*(?<=self\.)(query|key)", r".*\b(query|value)\b", r"(.*)(query)",
]


def test_legitimate_patterns_select_as_peft_selects(good):
    source, _, _ = good
    for pattern in LEGITIMATE:
        theirs = peft.get_peft_model(reference_model(source, TASK, "sdpa"),
                                     peft.LoraConfig(r=2, target_modules=pattern, task_type="SEQ_CLS"))
        with deadline(10):
            ours = lora.add_lora(load_model(source, TASK), r=2, target_modules=pattern)
        assert sorted(lora.lora_layers(ours)) == sorted(theirs.targeted_module_names), pattern
    for extra in ({"exclude_modules": r".*layer\.1\..*"}, {"alpha_pattern": {r".*\.query": 4}},
                  {"rank_pattern": {r"layer.1.attention.self.query": 3, r"value": 2}},
                  {"layers_pattern": "layer", "layers_to_transform": [1]}):
        theirs = peft.get_peft_model(reference_model(source, TASK, "sdpa"), peft.LoraConfig(
            r=2, target_modules=["query", "value"], task_type="SEQ_CLS", **extra))
        ours = lora.add_lora(load_model(source, TASK), r=2, target_modules=["query", "value"], **extra)
        got = {n: (m.r, m.lora_alpha) for n, m in lora.lora_layers(ours).items()}
        want = {n: (m.r["default"], m.lora_alpha["default"]) for n, m in theirs.base_model.model.named_modules()
                if isinstance(m, peft.tuners.lora.LoraLayer)}
        assert got == want, extra


REGEX_TOKENS = ["a", "e", "r", "q", "X", ".", r"\.", "*", "+", "?", "*?", "{2}", "{1,3}", "{2,}", "(", ")", "(?:",
                "|", r"\w", r"\d", "[a-z]", "[^.]", ".*", ".+", "(?=", "(?!", "(?<=e)", "^", "$", "query", "layer",
                r"\b", "(?i)", "(?>", "++"]


@settings(max_examples=100, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(tokens=st.lists(st.sampled_from(REGEX_TOKENS), min_size=1, max_size=14),
       field=st.sampled_from(["target_modules", "exclude_modules", "rank_pattern", "layers_pattern"]))
def test_fuzz_every_accepted_pattern_matches_in_bounded_time(tokens, field, good):
    """Random patterns of regex pieces, in each place a pattern is matched: add_lora either refuses the pattern
    with an AdapterError or adapts the model, within 3 s (before: some ran without bound)."""
    pattern = "".join(tokens)
    try:
        re.compile(pattern)
    except (re.error, OverflowError):
        assume(False)
    source, _, _ = good
    given = {"target_modules": {"target_modules": pattern}, "exclude_modules": {"exclude_modules": pattern},
             "rank_pattern": {"rank_pattern": {pattern: 2}},
             "layers_pattern": {"layers_pattern": pattern, "layers_to_transform": [0]}}[field]
    model = load_model(source, TASK)
    try:
        with deadline(3):
            lora.add_lora(model, r=2, **{"target_modules": ["query", "value"], **given})
    except AdapterError:
        pass


# ---- the adapter config reader: a clean read or a typed error naming the file, whatever a field holds ------

FIELDS = ["r", "lora_alpha", "lora_dropout", "target_modules", "modules_to_save", "use_rslora", "bias", "task_type",
          "peft_type", "fan_in_fan_out", "init_lora_weights", "base_model_name_or_path", "auto_mapping",
          "rank_pattern", "alpha_pattern", "exclude_modules", "layers_to_transform", "layers_pattern", "use_dora",
          "lora_bias", "trainable_token_indices", "target_parameters", "layer_replication", "use_qalora",
          "alora_invocation_tokens", "arrow_config", "revision", "inference_mode"]
json_scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats()
                | st.text(max_size=8) | st.sampled_from(["LORA", "all-linear", "SEQ_CLS", "none", "pissa", "query"]))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6) | st.sampled_from(FIELDS), inner, max_size=3),
                           max_leaves=10)
# what a regular-expression field may hold: pieces of regex syntax, and patterns Python's re refuses in other ways
patterns = (st.sampled_from(["(", "a{99999999999999999999}", "(?i)x", "x(?i)", "(?P<idx>a)", "[", "\\", ".*",
                             "(" * 1000 + ")" * 1000, CATASTROPHIC])
            | st.text(alphabet="()[]{}?*+|.\\^$aiPx<>=!0123456789,", max_size=12))


def _value_of(field: str) -> st.SearchStrategy:
    if field in ("target_modules", "exclude_modules", "layers_pattern"):
        return patterns | st.lists(patterns, max_size=2) | json_values | st.just(_DROP)
    if field in ("rank_pattern", "alpha_pattern"):
        return st.dictionaries(patterns, json_scalars, max_size=2) | json_values | st.just(_DROP)
    return json_values | st.just(_DROP)


PATTERN_FIELDS = ["target_modules", "exclude_modules", "layers_pattern", "rank_pattern", "alpha_pattern"]
config_changes = st.lists(st.sampled_from(PATTERN_FIELDS) | st.sampled_from(FIELDS) | st.text(max_size=6), min_size=1,
                          max_size=4, unique=True).flatmap(
    lambda names: st.fixed_dictionaries({name: _value_of(name) for name in names}))


@settings(max_examples=300, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(changes=config_changes)
@example(changes={"target_modules": "a{99999999999999999999}"})   # OverflowError before
@example(changes={"exclude_modules": "(" * 1000 + ")" * 1000})     # RecursionError before
def test_fuzz_adapter_config_reader(changes):
    """Any JSON value in any field of adapter_config.json (or a field removed): read_adapter_config and
    lora_settings either read it or raise an AdapterError naming the file; nothing else."""
    base = {"peft_type": "LORA", "task_type": "SEQ_CLS", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
            "target_modules": ["query", "value"], "bias": "none", "modules_to_save": None}
    data = {k: v for k, v in {**base, **changes}.items() if v is not _DROP}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / CONFIG
        path.write_text(json.dumps(data))  # NaN and Infinity as Python writes them: the reader must cope
        try:
            read = lora.read_adapter_config(tmp)
            lora.lora_settings(read, str(path))
        except AdapterError as exc:
            assert str(path) in str(exc), str(exc)
