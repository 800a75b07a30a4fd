"""ChatTemplate renders exactly what transformers' apply_chat_template renders."""

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from jaxserve.loader.chat_template import ChatTemplate, ChatTemplateError, ChatTemplateMissing
from jaxserve.loader.gguf_loader import meta_get
from model_files import readers

# Llama-3.1-like: date via strftime_now, tools as indented JSON, tool calls and ipython results.
LLAMA3_STYLE = r"""{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none %}
    {{- "Call a function by answering {\"name\": name, \"parameters\": {...}}. Functions:\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in loop_messages %}
    {%- if message.role == 'assistant' and message.tool_calls %}
        {%- for tc in message.tool_calls %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tc.function.name + '", "parameters": ' + (tc.function.arguments | tojson) + '}' }}
            {{- "<|eot_id|>" }}
        {%- endfor %}
    {%- elif message.role == 'tool' %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {{- message.content | tojson if message.content is mapping else message.content }}
        {{- "<|eot_id|>" }}
    {%- else %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# Qwen2.5-like: <tools> block in the system turn, <tool_call> / <tool_response>, a {% generation %} block.
QWEN_STYLE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- else %}
        {{- 'You are a helpful assistant.\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions.\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nReturn each call as JSON within <tool_call></tool_call> tags.<|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>assistant' }}
        {%- generation %}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tc in message.tool_calls or [] %}
            {%- set f = tc.function if tc.function is defined else tc %}
            {{- '\n<tool_call>\n{"name": "' + f.name + '", "arguments": ' }}
            {{- f.arguments if f.arguments is string else f.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {%- endgeneration %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != "tool" %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Gemma-like: system folded into the first user turn, strict alternation, namespace and loop controls.
GEMMA_STYLE = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- set ns = namespace(turns=0) -%}
{%- for message in loop_messages -%}
    {%- if message['role'] == 'tool' -%}{%- continue -%}{%- endif -%}
    {%- if (message['role'] == 'user') != (ns.turns % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {%- set ns.turns = ns.turns + 1 -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") + message['content'] | trim + '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}
"""

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Météo actuelle — current weather for a city (°C)",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "e.g. Zürich"}},
                   "required": ["city"]}}}]

CONVERSATIONS = {
    "single": [{"role": "user", "content": "Hello! Wie geht's? 你好"}],
    "system": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    "multi": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "2+2?"},
              {"role": "assistant", "content": "4"}, {"role": "user", "content": "  and 3+3?  "}],
    "multi_no_system": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                        {"role": "user", "content": "c"}],
}
TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
    {"role": "tool", "content": "21 °C, sunny"},
    {"role": "assistant", "content": "It is 21 °C and sunny."},
    {"role": "user", "content": "Thanks"},
]


@pytest.fixture(scope="module")
def reference():
    """A transformers tokenizer that only serves apply_chat_template."""
    backend = HFTokenizer(WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _templates():
    smollm = meta_get(readers("smollm2"), "tokenizer.chat_template")
    return {"smollm2": smollm, "llama3": LLAMA3_STYLE, "qwen": QWEN_STYLE, "gemma": GEMMA_STYLE}


@pytest.fixture(scope="module")
def templates():
    return _templates()


@pytest.mark.parametrize("name", ["smollm2", "llama3", "qwen", "gemma"])
@pytest.mark.parametrize("conv", sorted(CONVERSATIONS))
@pytest.mark.parametrize("gen", [True, False])
def test_matches_transformers(reference, templates, name, conv, gen):
    source = templates[name]
    messages = CONVERSATIONS[conv]
    ours = ChatTemplate(source, "<s>", "</s>").render(messages, add_generation_prompt=gen, date_string="26 Jul 2024")
    want = reference.apply_chat_template(messages, chat_template=source, tokenize=False, add_generation_prompt=gen,
                                         date_string="26 Jul 2024")
    assert ours == want


@pytest.mark.parametrize("name", ["llama3", "qwen"])
@pytest.mark.parametrize("gen", [True, False])
def test_tools_match_transformers(reference, templates, name, gen):
    source = templates[name]
    ours = ChatTemplate(source, "<s>", "</s>").render(TOOL_CONVERSATION, tools=TOOLS, add_generation_prompt=gen)
    want = reference.apply_chat_template(TOOL_CONVERSATION, tools=TOOLS, chat_template=source, tokenize=False,
                                         add_generation_prompt=gen)
    assert ours == want
    assert "Météo" in ours and "\\u" not in ours  # tojson keeps non-ASCII
    if name == "llama3":
        assert '{\n    "type": "function",\n    "function": {\n        "name"' in ours  # tojson(indent=4)


def test_smollm2_default_system_prompt(templates):
    out = ChatTemplate(templates["smollm2"], "<|im_start|>", "<|im_end|>").render([{"role": "user", "content": "Hi"}])
    assert out.startswith("<|im_start|>system\n") and out.endswith("<|im_start|>assistant\n")


def test_errors(templates):
    with pytest.raises(ChatTemplateMissing):
        ChatTemplate(None)
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        ChatTemplate(templates["gemma"]).render([{"role": "assistant", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{% for m in messages %}{{ m.content }")  # syntax error
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ messages[0]['content'] + 1 }}").render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError):  # the sandbox refuses Python internals
        ChatTemplate("{% set ns = namespace() %}{% set ns._x = 1 %}").render([])
    assert isinstance(ChatTemplateError("x"), ValueError) and isinstance(ChatTemplateMissing("x"), ValueError)


def test_extra_variables_and_messages_untouched():
    tpl = ChatTemplate("{{ bos_token }}{% for m in messages %}{{ m.role }}:{{ m.reasoning_content }}|{% endfor %}"
                       "{{ enable_thinking }}", "<s>", "</s>")
    messages = [{"role": "assistant", "content": "a", "reasoning": "because"}]
    assert tpl.render(messages, enable_thinking=False) == "<s>assistant:because|False"
    assert messages == [{"role": "assistant", "content": "a", "reasoning": "because"}]
