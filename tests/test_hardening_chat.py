"""Hardening of chat templates and tokenizer directories, against transformers in the same run where it is meaningful.

1. A template that would work without end (a loop of 10^10 iterations, ``lipsum(10**6)``, a string multiplied to
   gigabytes, macros recursing without end, a value printed through shared references) stops with
   ``ChatTemplateLimitError`` naming the template; the guarded operations at ordinary sizes render what transformers
   renders. 2. A message, tool, document or variable nested thousands deep is an ``InputError`` naming it, where
   transformers raises a bare RecursionError. 3. A file of a tokenizer directory that links out of it is refused,
   naming it, where transformers follows the link; links inside it and a hub snapshot's links into its blobs are read.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest

from flodl_hf import AutoTokenizer
from flodl_hf.core.errors import CheckpointFormatError, InputError
from flodl_hf.core.samples import sample_path
from flodl_hf.roundtrip.parity import quiet_transformers
from flodl_hf.tokenization import sandbox
from flodl_hf.tokenization.chat import ChatTemplateLimitError, render_chat

CHAT = [{"role": "user", "content": "hi"}]
ORIGIN = "the test template"


def _render(template: str, chat: list | None = None, **variables) -> str:
    return render_chat([chat or CHAT], template, ORIGIN, variables=variables)[0][0]


def _theirs(template: str, chat: list | None = None, **variables) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template
    quiet_transformers()
    return render_jinja_template([chat or CHAT], chat_template=template, **variables)[0][0]


@pytest.fixture
def small(monkeypatch):
    """Bounds small enough to trip in milliseconds (the defaults are far above what real templates need)."""
    monkeypatch.setattr(sandbox, "LIMITS", dataclasses.replace(sandbox.LIMITS, steps=20_000, chars=200_000,
                                                               produced=1_000_000))


# ---- 1. templates that would work without end --------------------------------------------------------------

# (name, template, what the message names): each refused before the value is made, at the default bounds
AT_ONCE = [
    ("lipsum", "{{ lipsum(10**6) }}", "lipsum"),
    ("string-times", "{{ 'x' * 10**10 }}", "repeating a string"),
    ("list-times", "{{ ['x'] * 10**9 }}", "repeating a string"),
    ("printf-width", "{{ '%1000000000d' % 1 }}", "% formatting"),
    ("printf-star", "{{ '%*d' % (10**9, 1) }}", "% formatting"),
    ("format-width", "{{ '{:>{w}}'.format(1, w=10**9) }}", "str.format"),
    ("center-filter", "{{ 'x'|center(10**9) }}", "center filter"),
    ("ljust-method", "{{ 'x'.ljust(10**9) }}", "str.ljust"),
    ("power", "{{ 2 ** (10**9) }}", "integer"),
    ("to-bytes", "{{ (1).to_bytes(10**9, 'big') }}", "int.to_bytes"),
    ("replace", "{{ ('a' * 10000).replace('a', 'b' * 10000) }}", "replace"),
    ("translate", "{{ ('a' * 1000).translate({97: 'x' * 10**6}) }}", "str.translate"),
    ("batch-filter", "{{ [1]|batch(10**9, 'x') }}", "batch filter"),
    ("slice-filter", "{{ [1]|slice(10**9) }}", "slice filter"),
    ("strftime", "{{ strftime_now('%Y' * 10**7) }}", "strftime_now"),
]

# (name, template, what): at the small bounds, each trips after a little work
AFTER_WORK = [
    ("nested-loops", "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "steps"),
    ("exponential-macros",
     "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}", "steps"),
    ("output", "{{ 'x' * 100000 }}{{ 'y' * 100000 }}{{ 'z' * 100000 }}", "the output"),
    ("kept-in-a-macro", "{% set s = 'x' * 100000 %}{% macro m() %}{% for i in range(50) %}{{ s ~ i }}{% endfor %}"
     "{% endmacro %}{{ m()|length }}", "the values made"),
    ("doubling", "{% set ns = namespace(s='xx') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "~ would make"),
    ("doubling-plus", "{% set ns = namespace(s='xx') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
     "{% endfor %}", "\\+ would make"),
    ("printed-shared", "{% set s = 'x' * 100000 %}{{ [s] * 100 }}", "printing a value"),
    ("printed-namespace", "{% set ns = namespace(l=['x' * 100000] * 100) %}{{ ns }}", "printing a value"),
    ("joined-shared", "{% set s = 'x' * 100000 %}{{ ''.join([s] * 100) }}", "str.join"),
    ("join-filter", "{% set s = 'x' * 100000 %}{{ ([s] * 100)|join }}", "join filter"),
    ("tojson-shared", "{% set s = 'x' * 100000 %}{{ ([s] * 100)|tojson }}", "tojson"),
    ("tojson-indent", "{{ [[[1, 2], [3]]]|tojson(indent=10**6) }}", "tojson"),
    ("int-squaring", "{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
     "integer"),
]


@pytest.mark.parametrize("template, what", [c[1:] for c in AT_ONCE], ids=[c[0] for c in AT_ONCE])
def test_a_value_past_the_bound_is_refused_before_it_is_made(template, what):
    with pytest.raises(ChatTemplateLimitError, match=f"^{ORIGIN}: the chat template went past its bound on .*{what}"):
        _render(template)


@pytest.mark.parametrize("template, what", [c[1:] for c in AFTER_WORK], ids=[c[0] for c in AFTER_WORK])
def test_work_without_end_stops_at_a_bound(small, template, what):
    with pytest.raises(ChatTemplateLimitError, match=f"^{ORIGIN}: the chat template went past its bound on .*{what}"):
        _render(template)


def test_the_clock_and_recursion_are_bounds(monkeypatch):
    """Macros recursing without end, and a render that goes on past its time (steps left unbounded here)."""
    with pytest.raises(ChatTemplateLimitError, match="recursed too deeply"):
        _render("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}")
    monkeypatch.setattr(sandbox, "LIMITS", dataclasses.replace(sandbox.LIMITS, seconds=0.3, steps=10**12))
    with pytest.raises(ChatTemplateLimitError, match=r"went past its bound on time \(0.3 s\)"):
        _render("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}")


# (template, n at an ordinary size, n past the bound): the guarded operations render what transformers renders
GUARDED = [
    ("{{ 'ab' * n }}|{{ [1, 2] * n }}", 3, 10**10),
    ("{{ '%*d|%5.2f' % (n, 7, 3.14159) }}", 5, 10**9),
    ("{{ '{:>{w}}|{:^7}'.format('x', 'y', w=n) }}|{{ '{a}-{b}'.format_map({'a': 1, 'b': 2}) }}", 6, 10**9),
    ("{{ 'x'|center(n) }}|{{ 'x'.rjust(n, '.') }}|{{ '7'.zfill(n) }}", 9, 10**9),
    ("{{ 'a\nb\nc'|indent(n, first=true) }}", 2, 10**9),
    ("{{ [1, 2, 3, 4, 5]|batch(n, 0)|list }}|{{ [1, 2, 3, 4, 5]|slice(n)|list }}", 2, 10**9),
    ("{{ ('a-b-a' * n).replace('a', 'xyz') }}|{{ ('a-b' * n)|replace('b', 'q') }}", 2, 10**7),
    ("{{ (['p', 'q'] * n)|join(', ') }}|{{ ', '.join(['p'] * n) }}|{{ (['r'] * n)|join('+') }}", 3, 10**9),
    ("{{ {'a': [1, {'b': 'é\n'}], 'c': none}|tojson(indent=n) }}|{{ messages|tojson }}", 2, 10**8),
    ("{% set ns = namespace(s='ab', k=[]) %}{% for i in range(n) %}{% set ns.s = ns.s ~ ns.s %}"
     "{% set ns.k = ns.k + [i] %}{% endfor %}{{ ns.s }}{{ ns.k }}{{ 2 ** n }}{{ messages[0] }}", 4, 60),
    ("{{ lipsum(n, html=false)|length > 0 }}{% macro m(x) %}<{{ x }}>{{ caller() if caller is defined else '' }}"
     "{% endmacro %}{% set t %}{% for i in range(n) %}{{ m(i) }}{% endfor %}{% endset %}{{ t }}{% call m('c') %}in"
     "{% endcall %}{% filter upper %}f{% endfilter %}", 3, 10**7),
]


@pytest.mark.parametrize("template, ordinary, huge", GUARDED, ids=[f"guarded{i}" for i in range(len(GUARDED))])
def test_guarded_operations_render_as_transformers_until_their_bound(template, ordinary, huge):
    assert _render(template, n=ordinary) == _theirs(template, n=ordinary)
    with pytest.raises(ChatTemplateLimitError, match=f"^{ORIGIN}: the chat template went past its bound on "):
        _render(template, n=huge)


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory) -> Path:
    """A copy of a tiny checkpoint with a WordPiece tokenizer (tokenizer.json, tokenizer_config.json), plus a
    special_tokens_map.json."""
    from test_tasks import task_dir
    root = tmp_path_factory.mktemp("tok") / "bert"
    shutil.copytree(task_dir("bert/tokenizer.json", "mlm"), root)
    (root / "special_tokens_map.json").write_text(json.dumps({"unk_token": "[UNK]"}))
    return root


def test_the_bound_names_the_template_file(bert_dir, tmp_path):
    root = tmp_path / "tok"
    shutil.copytree(bert_dir, root)
    (root / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content * 10**10 }}{% endfor %}")
    tok = AutoTokenizer.from_pretrained(root)
    with pytest.raises(ChatTemplateLimitError, match=f"^{root / 'chat_template.jinja'}: .*repeating a string"):
        tok.apply_chat_template(CHAT, tokenize=False)


# ---- 2. deeply nested inputs -----------------------------------------------------------------------------------

def _nested(depth: int, leaf: object = "x") -> object:
    for _ in range(depth - 1):
        leaf = [leaf]
    return leaf


def test_deep_content_is_named_where_transformers_recurses(bert_dir):
    tok = AutoTokenizer.from_pretrained(bert_dir)
    theirs = quiet_transformers().AutoTokenizer.from_pretrained(str(bert_dir))
    template = "{% for m in messages %}{{ m.role }}:{{ m.content|tojson }};{% endfor %}"
    deep = [{"role": "user", "content": "hi"}, {"role": "user", "content": _nested(5000)}]
    with pytest.raises(RecursionError):
        theirs.apply_chat_template(deep, chat_template=template, tokenize=False)
    with pytest.raises(InputError, match=r"^conversation\[1\]: nested more than 100 lists and dicts deep"):
        tok.apply_chat_template(deep, chat_template=template, tokenize=False)
    with pytest.raises(InputError, match=r"^conversation\[1\]\[1\]: nested more than 100"):
        tok.apply_chat_template([CHAT, deep], chat_template=template, tokenize=False)
    with pytest.raises(InputError, match=r"^conversation\[0\]\[1\]: nested more than 100"):
        render_chat([deep], template)
    # the message itself is level 1, so content of 99 lists reaches level 100: read, as transformers reads it
    edge = [{"role": "user", "content": _nested(100)}]
    assert tok.apply_chat_template(edge, chat_template=template, tokenize=False) == \
        theirs.apply_chat_template(edge, chat_template=template, tokenize=False)
    with pytest.raises(InputError, match=r"^conversation\[0\]: nested more than 100"):
        tok.apply_chat_template([{"role": "user", "content": _nested(101)}], chat_template=template, tokenize=False)


def test_deep_tools_documents_variables_and_cycles_are_named(monkeypatch):
    template = "{{ messages|length }}"
    with pytest.raises(InputError, match=r"^tools\[1\]: nested more than 100"):
        render_chat([CHAT], template, tools=[{"name": "t"}, {"parameters": _nested(3000)}])
    with pytest.raises(InputError, match=r"^documents\[0\]: nested more than 100"):
        render_chat([CHAT], template, documents=[{"title": "t", "text": _nested(3000)}])
    with pytest.raises(InputError, match=r"^extra \(a template variable\): nested more than 100"):
        render_chat([CHAT], template, variables={"extra": _nested(3000)})
    loop: dict = {"role": "user"}
    loop["content"] = [loop]  # a message that holds itself
    with pytest.raises(InputError, match=r"^conversation\[0\]\[0\]: nested more than 100"):
        render_chat([[loop]], template)
    shared: list = ["x" * 10]
    for _ in range(40):  # 2**40 paths through 80 lists: copied out, it would never end
        shared = [shared, shared]
    monkeypatch.setattr(sandbox, "LIMITS", dataclasses.replace(sandbox.LIMITS, items=10_000))  # quicker to reach
    with pytest.raises(InputError, match=r"^conversation\[0\]\[0\]: holds more than 10,000"):
        render_chat([[{"role": "user", "content": shared}]], template)


# ---- 3. tokenizer files that link out of their directory ---------------------------------------------------

def _vocab_txt(root: Path) -> None:
    """The WordPiece vocabulary of root's tokenizer.json as vocab.txt, and tokenizer.json gone."""
    vocab = json.loads((root / "tokenizer.json").read_text())["model"]["vocab"]
    (root / "vocab.txt").write_text("".join(f"{t}\n" for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])))
    (root / "tokenizer.json").unlink()


LINKED = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json", "chat_template.jinja",
          "vocab.txt", "additional_chat_templates/tool_use.jinja", "additional_chat_templates", "tokenizer.model"]


@pytest.mark.parametrize("name", LINKED)
def test_a_tokenizer_file_linking_out_is_refused_where_transformers_follows_it(bert_dir, tmp_path, name):
    root = tmp_path / "tok"
    if name == "tokenizer.model":  # a SentencePiece tokenizer that transformers builds
        root.mkdir()
        (root / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
        shutil.copy(sample_path("botchan") / "botchan_en_bpe_1000.model", root / name)
    else:
        shutil.copytree(bert_dir, root)
        if name == "vocab.txt":
            _vocab_txt(root)
        if name.startswith("additional_chat_templates"):
            (root / "additional_chat_templates").mkdir()
            (root / "additional_chat_templates" / "tool_use.jinja").write_text("{{ 'tools' }}")
        (root / "chat_template.jinja").write_text("{{ 'inside' }}")
    outside = tmp_path / "elsewhere" / name
    outside.parent.mkdir(parents=True)
    (root / name).rename(outside)
    if name == "chat_template.jinja":
        outside.write_text("{{ 'read from outside' }}")
    (root / name).symlink_to(outside, target_is_directory=outside.is_dir())
    if name == "chat_template.jinja":  # transformers reads the file the link points to
        theirs = quiet_transformers().AutoTokenizer.from_pretrained(str(root))
        assert theirs.chat_template == "{{ 'read from outside' }}"
    elif name == "tokenizer.model":
        assert quiet_transformers().AutoTokenizer.from_pretrained(str(root)).vocab_size == 1000
    expected = name if name != "additional_chat_templates" else name + ": is a symlink"
    with pytest.raises(CheckpointFormatError, match=f"{expected}.* outside the tokenizer directory"):
        AutoTokenizer.from_pretrained(root)
    (root / name).unlink()  # the same file linked from inside the directory is the directory's own
    (root / "real").mkdir()
    outside.rename(root / "real" / outside.name)
    (root / name).symlink_to(Path("../" * name.count("/") + "real") / outside.name,
                             target_is_directory=name == "additional_chat_templates")
    AutoTokenizer.from_pretrained(root)


def test_a_hub_snapshot_reads_its_blobs_and_nothing_else(bert_dir, tmp_path):
    """huggingface_hub lays a snapshot out as links into the cache's blobs/: read; a link elsewhere: refused."""
    plain = AutoTokenizer.from_pretrained(bert_dir)
    cache = tmp_path / "hub" / "models--org--tok"
    snapshot = cache / "snapshots" / "0123abcd"
    (cache / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    for f in [*bert_dir.glob("*.json"), tmp_path / "chat_template.jinja"]:
        blob = cache / "blobs" / f"sha-{f.name}"
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", blob.name))
    hub = AutoTokenizer.from_pretrained(snapshot)
    assert hub("Hello world")["input_ids"].tolist() == plain("Hello world")["input_ids"].tolist()
    assert hub.apply_chat_template(CHAT, tokenize=False) == "hi"
    (snapshot / "chat_template.jinja").unlink()
    (snapshot / "chat_template.jinja").symlink_to(tmp_path / "chat_template.jinja")
    with pytest.raises(CheckpointFormatError, match="chat_template.jinja: is a symlink to .* outside the tokenizer"):
        AutoTokenizer.from_pretrained(snapshot)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_in_place_of_a_template_is_refused(bert_dir, tmp_path):
    """Reading it would block for ever (transformers blocks)."""
    root = tmp_path / "tok"
    shutil.copytree(bert_dir, root)
    os.mkfifo(root / "chat_template.jinja")
    with pytest.raises(CheckpointFormatError, match="chat_template.jinja: is not a regular file"):
        AutoTokenizer.from_pretrained(root)
