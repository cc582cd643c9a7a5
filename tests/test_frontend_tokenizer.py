"""The frontend's own tokenizer (frontend/core/tokenizer.py, no transformers, no
torch) against transformers' AutoTokenizer on the embedded SmolLM2 and the
tests' tiny tokenizer: the same ids (with and without special tokens), the
same decoded text, the same token strings, special tokens and vocabulary, and
the same chat-template text for system prompts, tools, add_generation_prompt,
continue_final_message and extra template variables, on the model's template
and on a richer one (tools, namespace, loop controls, raise_exception, the
generation tag)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from models import train_tokenizer
from transformers import AutoTokenizer

from pagedserve.common.default_model import resolve_model
from pagedserve.frontend.core import tokenizer as ftok
from pagedserve.frontend.core.chat_template import render_chat

TEXTS = ["", "Hello world", "a <mask> and a <tool> token", "  leading and trailing  ", "héllo wörld 世界 🙂 \u00a0x", "a\n\n\tb\r\n c",
         "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|>x<|endoftext|>",
         "The quick brown fox jumps over the lazy dog. " * 20, "def f(x):\n    return x ** 2  # sq", "1234567890"]

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]

RICH = """{{ bos_token }}{% set ns = namespace(sys='', n=0) %}
{%- for m in messages %}{% if m['role'] == 'system' %}{% set ns.sys = m['content'] %}{% continue %}{% endif %}
{% set ns.n = ns.n + 1 %}{% if m['role'] not in ['user', 'assistant', 'tool'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}
<|im_start|>{{ m['role'] }}
{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}
{% if m.tool_calls is defined %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>{% if loop.index > 3 %}{% break %}{% endif %}{% endfor %}{% endif %}
<|im_end|>
{% endfor %}
{%- if tools %}<tools>{{ tools | tojson(indent=2) }}</tools>{% endif %}
{%- if ns.sys %}[system: {{ ns.sys }}]{% endif %}{% if documents %}{% for d in documents %}[doc {{ d.title }}: {{ d.text }}]{% endfor %}{% endif %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}[{{ ns.n }} {{ strftime_now('%Y')[:2] }} {{ eos_token }}]"""

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2? \"quoted\" <b>"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, how can I help?"},
     {"role": "user", "content": "Tell me a joke 🙂"}],
    [{"role": "user", "content": "Weather in Oslo?"},
     {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
         "name": "get_weather", "arguments": {"city": "Oslo"}}}]},
     {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": None}],
]


def _legacy(folder: Path) -> None:
    """The tiny tokenizer's folder as older checkpoints have it: special tokens in
    special_tokens_map.json (one not in the vocabulary), the template in the config."""
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").unlink()
    for k in ("bos_token", "pad_token"):
        config.pop(k)
    config["additional_special_tokens"] = ["<|im_end|>"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "special_tokens_map.json").write_text(json.dumps({
        "bos_token": {"content": "<|im_start|>", "lstrip": False, "rstrip": False, "normalized": False,
                      "single_word": False},
        "mask_token": "<mask>", "additional_special_tokens": ["<|im_end|>", "<tool>"]}))


@pytest.fixture(scope="module", params=["smollm2", "tiny", "legacy"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    if request.param == "smollm2":
        folder = resolve_model(None)
    else:
        folder = str(tmp_path_factory.mktemp("tok"))
        train_tokenizer(300).save_pretrained(folder)
        if request.param == "legacy":
            _legacy(Path(folder))
    ours = ftok.load(folder)
    assert isinstance(ours, ftok.FrontendTokenizer)  # not the transformers fallback
    return ours, AutoTokenizer.from_pretrained(folder)


def test_vocabulary_and_special_tokens(pair: tuple[Any, Any]) -> None:
    ours, hf = pair
    assert len(ours) == len(hf) and ours.vocab_size == hf.vocab_size
    assert ours.get_vocab() == hf.get_vocab()
    assert ours.special_tokens_map == hf.special_tokens_map
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"):
        assert getattr(ours, name) == getattr(hf, name), name
        assert getattr(ours, name + "_id") == getattr(hf, name + "_id"), name
    assert sorted(ours.all_special_ids) == sorted(hf.all_special_ids)
    assert ours.chat_template == hf.chat_template
    assert ours.backend_tokenizer.to_str() == hf.backend_tokenizer.to_str()


@pytest.mark.parametrize("add_special", [True, False])
def test_encode_decode_and_token_strings(pair: tuple[Any, Any], add_special: bool) -> None:
    ours, hf = pair
    for text in TEXTS:
        ids = hf(text, add_special_tokens=add_special).input_ids
        assert ours(text, add_special_tokens=add_special).input_ids == ids, text
        assert ours.encode(text, add_special_tokens=add_special) == ids, text
        assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
        for skip in (True, False):
            kw = {"skip_special_tokens": skip, "clean_up_tokenization_spaces": False}
            assert ours.decode(ids, **kw) == hf.decode(ids, **kw), (text, skip)
            assert ours.decode(ids[:3], spaces_between_special_tokens=False, **kw) == \
                hf.decode(ids[:3], spaces_between_special_tokens=False, **kw)
    ids = list(range(0, len(hf), max(1, len(hf) // 300)))  # across the vocabulary, special ids included
    assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)
    assert ours.convert_ids_to_tokens(ids, skip_special_tokens=True) == \
        hf.convert_ids_to_tokens(ids, skip_special_tokens=True)


CALLS: list[dict[str, Any]] = [
    {"add_generation_prompt": True},
    {"add_generation_prompt": False},
    {"add_generation_prompt": True, "tools": TOOLS},
    {"add_generation_prompt": True, "enable_thinking": False, "documents": [{"title": "A", "text": "alpha"}]},
]


@pytest.mark.parametrize("template", ["model's", "rich"])
def test_chat_templates_render_the_same_text(pair: tuple[Any, Any], template: str) -> None:
    ours, hf = pair
    extra = {} if template == "model's" else {"chat_template": RICH}
    for conv in CONVERSATIONS:
        for kw in CALLS:
            got = ours.apply_chat_template(conv, tokenize=False, **extra, **kw)
            assert got == hf.apply_chat_template(conv, tokenize=False, **extra, **kw), (conv, kw)
            assert ours.apply_chat_template(conv, **extra, **kw) == hf.apply_chat_template(
                conv, return_dict=False, **extra, **kw)
        # The frontend's own path (chat_template.render_chat): tools in a plain system message or the template's.
        for tools in (None, TOOLS):
            template_text = RICH if extra else None
            assert render_chat(ours, conv, tools, True, template_text) == render_chat(hf, conv, tools, True,
                                                                                      template_text)
    cont = CONVERSATIONS[2] + [{"role": "assistant", "content": "Why did the"}]
    got = ours.apply_chat_template(cont, tokenize=False, continue_final_message=True, **extra)
    assert got == hf.apply_chat_template(cont, tokenize=False, continue_final_message=True, **extra)
    assert got.endswith("Why did the")


def test_template_errors_are_errors_in_both(pair: tuple[Any, Any]) -> None:
    ours, hf = pair
    bad = [{"role": "robot", "content": "x"}]
    for tok in (ours, hf):
        with pytest.raises(Exception, match="bad role robot"):
            tok.apply_chat_template(bad, tokenize=False, chat_template=RICH)
        with pytest.raises(ValueError, match="not compatible"):
            tok.apply_chat_template(CONVERSATIONS[0], tokenize=False, add_generation_prompt=True,
                                    continue_final_message=True)
        with pytest.raises(Exception, match="underscore"):
            tok.apply_chat_template(CONVERSATIONS[0], tokenize=False,
                                    chat_template="{% set ns = namespace(_x=1) %}{{ ns._x }}")


def test_a_folder_without_tokenizer_json_falls_back_to_transformers(tmp_path: Path) -> None:
    tok = train_tokenizer(200)
    tok.save_pretrained(tmp_path)
    files = ftok.read_tokenizer_files(str(tmp_path))
    assert files.is_generic
    (tmp_path / "tokenizer.json").unlink()
    assert not ftok.read_tokenizer_files(str(tmp_path)).is_generic


def test_generation_config_sampling_fields_as_transformers_reads_them(tmp_path: Path) -> None:
    """tokenizer_files.generation_file_values against openai_args.generation_defaults (transformers')."""
    from pagedserve.frontend.openai_api.openai_args import SAMPLING_FIELDS, generation_defaults
    from pagedserve.frontend.core.tokenizer_files import generation_file_values

    def expected(folder: str) -> dict[str, Any]:
        out = generation_defaults("auto", folder, None)
        return {("max_new_tokens" if k == "max_tokens" else k): v for k, v in out.items()}

    smol = resolve_model(None)
    assert generation_file_values(smol, SAMPLING_FIELDS) == expected(smol)
    for i, fields in enumerate([{"temperature": 0.6, "top_p": 0.9, "do_sample": True},
                                {"temperature": 0.7, "do_sample": False, "top_k": 20, "max_new_tokens": 64},
                                {"repetition_penalty": 1.1, "min_p": 0.05, "top_k": None, "eos_token_id": [1, 2]}]):
        folder = tmp_path / str(i)
        folder.mkdir()
        (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, **fields}))
        assert generation_file_values(str(folder), SAMPLING_FIELDS) == expected(str(folder)), fields
    assert generation_file_values(str(tmp_path), SAMPLING_FIELDS) is None  # no file: transformers reads config.json
