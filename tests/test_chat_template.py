"""Chat templates: ``Tokenizer.apply_chat_template`` against transformers 5.24's ``AutoTokenizer`` on the same
directory (strings and ids compared exactly), where the template comes from (tokenizer_config.json, a list of
named templates, chat_template.jinja, additional_chat_templates/, the argument), the typed errors, and
``generate(chat, ...)`` against ``transformers.pipeline("text-generation")`` with chats. The tokenizer is the
LLaMA-style botchan SentencePiece one of test_decoder.py's ``_text_model``."""

from __future__ import annotations

import json
from datetime import datetime

import pytest
import torch

from flodl_hf import AutoTokenizer
from flodl_hf.core.errors import ConfigError, InputError
from flodl_hf.tasks.generate import generate
from flodl_hf.roundtrip.parity import quiet_transformers
from flodl_hf.tokenization.chat import ChatTemplateError

from test_decoder import _text_model

# ChatML-like: a default system message, a loop, the eos after each assistant turn, the generation prompt.
CHATML = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Alternating roles or raise_exception; tojson, namespace, loop controls, tools, documents, extra kwargs,
# strftime_now and a {% generation %} block.
STRICT = """{% set ns = namespace(turns=0) %}
{% if tools %}Tools: {{ tools | tojson }}
{% endif %}
{% if documents %}{% for d in documents %}[{{ d['title'] }}] {{ d['text'] }}
{% endfor %}{% endif %}
{% if today %}Date: {{ strftime_now('%Y') }} {{ today }}
{% endif %}
{% for message in messages %}
    {% if message['role'] == 'system' %}{% continue %}{% endif %}
    {% if (message['role'] == 'user') != (ns.turns % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% set ns.turns = ns.turns + 1 %}
    {% if message['role'] == 'user' %}
[INST] {{ message['content'] | trim }} {{ message | tojson }} [/INST]
    {%- else %}
 {% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}
    {%- endif %}
    {% if ns.turns > 6 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %} ASSISTANT:{% endif %}"""

CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "It was the fourth day"},
        {"role": "assistant", "content": "Botchan said <b>\"hi\"</b> é"},
        {"role": "user", "content": "  Hello there  "}]
SHORT = [{"role": "user", "content": "Botchan said"}]


def _dir(tmp_path_factory, name, template=None, jinja=None, extra=None):
    root = _text_model(tmp_path_factory.mktemp(name))
    config = json.loads((root / "tokenizer_config.json").read_text())
    if template is not None:
        config["chat_template"] = template
    config.update(extra or {})
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (root / "chat_template.jinja").write_text(jinja)
    return root


def _both(root, **options):
    return AutoTokenizer.from_pretrained(str(root), **options), \
        quiet_transformers().AutoTokenizer.from_pretrained(str(root), **options)


def _same(ours, theirs):
    if hasattr(theirs, "keys"):  # transformers' BatchEncoding (a UserDict) and ours (a dict)
        assert type(ours).__name__ == type(theirs).__name__ and set(ours) == set(theirs)
        for key in theirs:
            _same(ours[key], theirs[key])
    elif isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor) and torch.equal(ours, theirs)
    else:
        assert ours == theirs and type(ours) is type(theirs)


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    return _dir(tmp_path_factory, "chatml", CHATML)


@pytest.fixture(scope="module")
def strict(tmp_path_factory):
    return _dir(tmp_path_factory, "strict", STRICT)


CALLS = [dict(tokenize=False), dict(tokenize=False, add_generation_prompt=True), dict(), dict(return_dict=False),
         dict(add_generation_prompt=True, return_tensors="pt"), dict(return_dict=False, return_tensors="pt"),
         dict(tokenize=False, continue_final_message=True), dict(continue_final_message=True, return_dict=False),
         dict(max_length=12, truncation=True), dict(tokenizer_kwargs={"return_offsets_mapping": True}),
         dict(tokenize=False, bos_token="<BOS>")]


@pytest.mark.parametrize("call", CALLS, ids=[",".join(f"{k}={v}" for k, v in c.items()) or "default" for c in CALLS])
def test_chatml_equals_transformers(chatml, call):
    ours, theirs = _both(chatml)
    for conversation in (CHAT, CHAT[:3], SHORT):
        _same(ours.apply_chat_template(conversation, **call), theirs.apply_chat_template(conversation, **call))


def test_a_batch_of_conversations(chatml):
    ours, theirs = _both(chatml)
    batch = [CHAT, SHORT, CHAT[1:3]]
    for call in (dict(tokenize=False), dict(), dict(return_dict=False), dict(padding=True, return_tensors="pt"),
                 dict(add_generation_prompt=True, padding="longest", return_dict=False)):
        out = ours.apply_chat_template(batch, **call)
        _same(out, theirs.apply_chat_template(batch, **call))
    assert isinstance(ours.apply_chat_template(batch, tokenize=False), list)


def test_the_strict_template_and_its_variables(strict):
    ours, theirs = _both(strict)
    chat = [m for m in CHAT if m["role"] != "system"] + [{"role": "assistant", "content": "Yes", "extra": None}]
    tools = [{"type": "function", "function": {"name": "look", "parameters": {"x": "<é>"}}}]
    documents = [{"title": "Botchan", "text": "It was the fourth day"}]
    for call in (dict(tokenize=False), dict(tokenize=False, add_generation_prompt=True), dict(),
                 dict(tokenize=False, tools=tools, documents=documents, today="Monday"),
                 dict(return_assistant_tokens_mask=True), dict(return_assistant_tokens_mask=True, return_tensors="pt"),
                 dict(tokenize=False, continue_final_message=True)):
        _same(ours.apply_chat_template(chat, **call), theirs.apply_chat_template(chat, **call))
    text = ours.apply_chat_template(chat, tokenize=False, today="x")
    assert f"Date: {datetime.now().year} x" in text and '"extra"' not in text  # None-valued keys are dropped
    masks = ours.apply_chat_template([chat, chat[:2]], return_assistant_tokens_mask=True)["assistant_masks"]
    assert masks == theirs.apply_chat_template([chat, chat[:2]], return_assistant_tokens_mask=True)["assistant_masks"]
    assert any(masks[0]) and any(masks[1])


def test_raise_exception_is_a_typed_error(strict):
    ours, theirs = _both(strict)
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(Exception, match="must alternate"):
        theirs.apply_chat_template(bad, tokenize=False)
    with pytest.raises(ChatTemplateError, match="must alternate") as info:
        ours.apply_chat_template(bad, tokenize=False)
    assert "tokenizer_config.json: chat_template" in str(info.value) and isinstance(info.value, InputError)


def test_where_the_template_comes_from(tmp_path_factory):
    # chat_template.jinja wins over tokenizer_config.json's, as in transformers
    root = _dir(tmp_path_factory, "jinja", template="{{ 'config' }}", jinja=CHATML)
    ours, theirs = _both(root)
    assert ours.chat_template == theirs.chat_template == CHATML
    _same(ours.apply_chat_template(CHAT), theirs.apply_chat_template(CHAT))
    # a list of named templates: "default", "tool_use" with tools, a name, or a template as the argument
    named = [{"name": "default", "template": CHATML}, {"name": "tool_use", "template": STRICT}]
    root = _dir(tmp_path_factory, "named", template=named)
    ours, theirs = _both(root)
    assert ours.chat_template == theirs.chat_template
    chat = CHAT[1:]
    for call in (dict(), dict(tools=[{"name": "t"}]), dict(chat_template="tool_use"), dict(chat_template="{{ 'x' }}"),
                 dict(chat_template="default", tools=[{"name": "t"}])):
        _same(ours.apply_chat_template(chat, tokenize=False, **call), theirs.apply_chat_template(chat, tokenize=False,
                                                                                                 **call))
    # additional_chat_templates/<name>.jinja beside chat_template.jinja
    root = _dir(tmp_path_factory, "additional", jinja=CHATML)
    (root / "additional_chat_templates").mkdir()
    (root / "additional_chat_templates" / "strict.jinja").write_text(STRICT)
    ours, theirs = _both(root)
    assert ours.chat_template == theirs.chat_template
    _same(ours.apply_chat_template(chat, chat_template="strict"), theirs.apply_chat_template(chat, chat_template="strict"))
    # the from_pretrained option, and setting the attribute
    ours, theirs = _both(root, chat_template=STRICT)
    assert ours.chat_template == theirs.chat_template == STRICT
    ours.chat_template = theirs.chat_template = CHATML
    _same(ours.apply_chat_template(chat), theirs.apply_chat_template(chat))


def test_no_template_is_a_typed_error(tmp_path_factory):
    root = _dir(tmp_path_factory, "none")
    ours, theirs = _both(root)
    with pytest.raises(ValueError, match="chat_template is not set"):
        theirs.apply_chat_template(SHORT)
    with pytest.raises(InputError, match="tokenizer_config.json has no chat_template") as info:
        ours.apply_chat_template(SHORT)
    assert "chat_template.jinja" in str(info.value)
    assert ours.apply_chat_template(SHORT, chat_template=CHATML) == theirs.apply_chat_template(SHORT,
                                                                                                chat_template=CHATML)


def test_bad_templates_and_messages_are_named(tmp_path_factory, chatml):
    root = _dir(tmp_path_factory, "syntax", template="{% for m in messages %}{{ m }")
    with pytest.raises(ConfigError, match=r"tokenizer_config.json: chat_template: not a valid Jinja template"):
        AutoTokenizer.from_pretrained(str(root)).apply_chat_template(SHORT)
    root = _dir(tmp_path_factory, "badjinja", jinja="{% if %}")
    with pytest.raises(ConfigError, match=r"chat_template.jinja: not a valid Jinja"):
        AutoTokenizer.from_pretrained(str(root)).apply_chat_template(SHORT)
    for value, match in ((3, r"chat_template is a int"), ([{"name": "default"}], r"chat_template\[0\]")):
        with pytest.raises(ConfigError, match=match):
            AutoTokenizer.from_pretrained(str(_dir(tmp_path_factory, "type", template=value)))
    tok = AutoTokenizer.from_pretrained(str(chatml))
    for conversation, match in (("hello", "conversation is a str"), ([], "conversation is empty"),
                                ([SHORT[0], "hi"], r"conversation\[1\]"), ([SHORT, ["x"]], r"conversation\[1\]\[0\]")):
        with pytest.raises(InputError, match=match):
            tok.apply_chat_template(conversation)
    with pytest.raises(InputError, match="chat_template is a int"):
        tok.apply_chat_template(SHORT, chat_template=3)
    with pytest.raises(InputError, match=r"chat_template argument: not a valid Jinja"):
        tok.apply_chat_template(SHORT, chat_template="{{")
    with pytest.raises(InputError, match=r"tools\[0\]"):
        tok.apply_chat_template(SHORT, tools=[3])
    with pytest.raises(InputError, match=r"documents\[0\]"):
        tok.apply_chat_template(SHORT, documents=["text"])
    with pytest.raises(InputError, match="add_generation_prompt"):
        tok.apply_chat_template(SHORT, continue_final_message=True, add_generation_prompt=True)
    with pytest.raises(InputError, match=r"tokenizer_kwargs\['nope'\]"):
        tok.apply_chat_template(SHORT, tokenizer_kwargs={"nope": 1})
    with pytest.raises(ChatTemplateError, match="sandbox|unsafe|underscore"):
        tok.apply_chat_template(SHORT, chat_template="{% set ns = namespace(_x=1) %}")
    with pytest.raises(ChatTemplateError, match="unsafe|sandbox|access"):
        tok.apply_chat_template(SHORT, chat_template="{{ messages.__class__.__mro__ }}")


# ---- generate(chat, ...) as the text-generation pipeline -----------------------------------------------

@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    root = _dir(tmp_path_factory, "chat_model", CHATML)
    return str(root), quiet_transformers().pipeline("text-generation", model=str(root), tokenizer=str(root))


PREFILL = CHAT[:2] + [{"role": "assistant", "content": "Botchan"}]


@pytest.mark.parametrize("options", [{}, {"return_full_text": False}, {"return_tensors": True},
                                     {"continue_final_message": True}, {"continue_final_message": False},
                                     {"skip_special_tokens": False}], ids=str)
def test_generate_a_chat_equals_the_pipeline(chat_model, options):
    root, pipe = chat_model
    greedy = dict(do_sample=False, max_new_tokens=5, **options)
    for prompts in (CHAT, SHORT, PREFILL, [CHAT, SHORT, PREFILL]):
        ours = generate(prompts, root, **greedy)
        assert ours == pipe(prompts, **greedy), (prompts, options)
    record = generate(CHAT, root, do_sample=False, max_new_tokens=3)[0]["generated_text"]
    assert record[:-1] == CHAT and record[-1]["role"] == "assistant"
    prefill = generate(PREFILL, root, do_sample=False, max_new_tokens=3)[0]["generated_text"]
    assert len(prefill) == len(PREFILL) and prefill[-1]["content"].startswith("Botchan")


def test_generate_chats_samples_as_the_pipeline(chat_model):
    root, pipe = chat_model
    for prompts in (CHAT, [CHAT, SHORT]):
        torch.manual_seed(7)
        theirs = pipe(prompts, max_new_tokens=4, num_return_sequences=2)
        assert generate(prompts, root, max_new_tokens=4, num_return_sequences=2, seed=7) == theirs


def test_generate_chat_errors(chat_model, tmp_path_factory):
    root, _ = chat_model
    with pytest.raises(InputError, match=r"prompts\[1\]"):
        generate([SHORT[0], {"role": "user"}], root, max_new_tokens=2)
    with pytest.raises(InputError, match="prompts"):
        generate([SHORT, "text"], root, max_new_tokens=2)
    plain = _dir(tmp_path_factory, "plain_model")
    with pytest.raises(InputError, match="prompts is a chat: cannot apply a chat template"):
        generate(SHORT, str(plain), max_new_tokens=2)
