"""Seeded fuzzer for a running jaxserve server (what README "Errors" reports): malformed bodies on every route,
reporting 5xx, non-OpenAI error bodies, timeouts, and a failed valid request every ~50.
Usage: python3 tools/fuzz_server.py PORT [N] [SEED] (server started with --served-model-name smol)."""
import copy
import http.client
import json
import random
import sys
import time

PORT = int(sys.argv[1]) if len(sys.argv) > 1 else 18123
N = int(sys.argv[2]) if len(sys.argv) > 2 else 3000
SEED = int(sys.argv[3]) if len(sys.argv) > 3 else 1
TIMEOUT = 60
rng = random.Random(SEED)

MSG = [{"role": "user", "content": "hi"}]
BASES = {
    "/v1/chat/completions": {"model": "smol", "messages": MSG, "max_tokens": 3},
    "/v1/completions": {"model": "smol", "prompt": "hi", "max_tokens": 3},
    "/v1/responses": {"model": "smol", "input": "hi", "max_output_tokens": 3, "store": False},
    "/tokenize": {"model": "smol", "prompt": "hi"},
    "/detokenize": {"model": "smol", "tokens": [1, 2, 3]},
    "/v1/embeddings": {"model": "smol", "input": "hi"},
    "/rerank": {"model": "smol", "query": "a", "documents": ["b"]},
    "/score": {"model": "smol", "text_1": "a", "text_2": "b"},
    "/classify": {"model": "smol", "input": "a"},
    "/v1/load_lora_adapter": {"lora_name": "x", "lora_path": "/nonexistent"},
    "/v1/unload_lora_adapter": {"lora_name": "x"},
    "/lora-adapters": [{"id": 0, "scale": 1.0}],
    "/v2/rerank": {"model": "smol", "query": "a", "documents": ["b"]},
}
SAMPLING = ["model", "frequency_penalty", "presence_penalty", "logit_bias", "max_tokens", "n", "seed", "stop",
            "stream", "stream_options", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
            "min_tokens", "ignore_eos", "skip_special_tokens", "stop_token_ids", "include_stop_str_in_output",
            "structured_outputs", "response_format", "lora", "user", "metadata", "store", "service_tier",
            "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options"]
FIELDS = {
    "/v1/chat/completions": SAMPLING + ["messages", "logprobs", "top_logprobs", "max_completion_tokens",
                                        "add_generation_prompt", "chat_template_kwargs", "parallel_tool_calls",
                                        "tools", "tool_choice", "functions", "function_call", "audio",
                                        "modalities", "prediction", "web_search_options", "reasoning_effort",
                                        "verbosity", "moderation"],
    "/v1/completions": SAMPLING + ["prompt", "echo", "logprobs", "best_of", "suffix"],
    "/v1/responses": ["model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools",
                      "tool_choice", "parallel_tool_calls", "stream", "stream_options", "text", "reasoning",
                      "store", "previous_response_id", "include", "top_logprobs", "truncation", "max_tool_calls",
                      "metadata", "user", "seed", "top_k", "min_p", "repetition_penalty", "structured_outputs",
                      "background", "conversation", "prompt"],
    "/tokenize": ["model", "prompt", "messages", "add_generation_prompt", "chat_template_kwargs"],
    "/detokenize": ["model", "tokens"],
    "/v1/embeddings": ["input", "model", "encoding_format", "dimensions", "user"],
    "/rerank": ["query", "documents", "model", "top_n", "return_documents", "max_chunks_per_doc"],
    "/score": ["text_1", "text_2", "model", "encoding_format"],
    "/classify": ["input", "model", "user"],
    "/v1/load_lora_adapter": ["lora_name", "lora_path"],
    "/v1/unload_lora_adapter": ["lora_name", "lora_int_id"],
    "/v2/rerank": ["query", "documents", "model", "top_n"],
}
GENERIC = [None, True, False, 0, 1, -1, 2, 3, 2**31 - 1, 2**31, 2**32, 2**63, 2**64, 2**70, -2**70, -2**31,
           1e308, -1e308, -0.0, 0.0, 0.5, 1.5, 2.5, 5e-324, 1e-7, 1e9, -1e9, "", "x", "smol", "0", "1", "null",
           "\ud800", "\udfff", "\x00", "a" * 5000, "é" * 200 + "😀" * 50, "<|im_start|>", "<tool_call>",
           "</s>", "{{ raise_exception('x') }}", "{% for %}", [], {}, [None], [1], [-1], [2**70], [""],
           ["x"], [[]], [[1]], [{}], [{"a": 1}], {"a": 1}, {"": None}, {"type": "text"}, [[[[[[]]]]]],
           list(range(100)), ["s"] * 100]


def deep(n, leaf=1):
    x = leaf
    for _ in range(n):
        x = [x] if rng.random() < 0.5 else {"a": x}
    return x


SPECIAL = {
    "max_tokens": [0, -1, 1, 2, 2**31 if SEED == 0 else 5, 2**70 if SEED == 0 else 4, 2049 if SEED == 0 else 3],
    "max_completion_tokens": [0, -1, 1, 2**31, 2**70, 5000],
    "max_output_tokens": [0, -1, 1, 2**31, 2**70, 5000],
    "n": [0, -1, 1, 2, 3, 100, 128, 129, 2**40],
    "temperature": [-1, 0, 0.0, -0.0, 1e9, 2, 2.0000001, 1e-300, 5e-324, 1e308],
    "top_p": [0, 2, -1, 1, 1e-300, 5e-324, 0.999999],
    "top_k": [0, -1, -2, 1, 49151, 49152, 49153, 2**31, 2**70, -2**70],
    "min_p": [-1, 0, 1, 2, 1e-300],
    "repetition_penalty": [0, -1, 1e9, 1e308, 5e-324, 2],
    "presence_penalty": [-2, 2, -3, 3, 1e308],
    "frequency_penalty": [-2, 2, -3, 3, -1e308],
    "seed": [0, -1, 2**63, 2**64, 2**70, -2**70, 2**200, 10**400],
    "min_tokens": [-1, 0, 1, 3, 4, 2048, 2049, 2**31, 2**70],
    "logprobs": [True, False, 0, 1, 20, 21, -1, 2**40],
    "top_logprobs": [0, 1, 20, 21, -1, 2**40],
    "stop": [[], [""], ["", ""], ["s"] * 16, ["s"] * 17, ["s"] * 100, ["x" * 512], ["x" * 513], "\n", "",
             ["\ud800"], [" "], ["a", "b", "c", "d"], "<|im_end|>"],
    "stop_token_ids": [[], [0], [-1], [49152], [2**40], [2**70], list(range(20)), [2] * 30, [1, 2]],
    "logit_bias": [{}, {"1": 100}, {"1": 101}, {"1": -1e308}, {"-1": 1}, {"49152": 1}, {"abc": 1}, {"": 1},
                   {"1.5": 1}, {" 1": 1}, {"0x10": 1}, {"1_0": 1}, {"١": 1}, {str(2**70): 1}, {"1e3": 1},
                   {str(i): 1 for i in range(65)}, {str(i): -100 for i in range(64)}, {"+1": 5}, {"00001": 5}],
    "stream": [True, False, None, 1, "true"],
    "stream_options": [{"include_usage": True}, {"include_usage": False}, {}, {"include_obfuscation": True},
                       {"x": 1}, {"include_usage": 1}],
    "echo": [True, False],
    "best_of": [0, 1, 2, -1, 2**70],
    "prompt": ["", "hi", [], [1], [0], [-1], [49152], [2**70], [[]], [[1], []], [[1, 2], [3]], ["a", "b"],
               ["", ""], [1, "a"], ["a" * 9000], "a" * 12000, [[1] * 3000], [1] * 2048, [1] * 2047,
               ["x"] * 65, ["x"] * 64, "\ud800", "\udc00abc", [True], [1.0]],
    "messages": [[], [{"role": "user"}], [{"role": "user", "content": None}], [{"role": "user", "content": ""}],
                 [{"role": "user", "content": []}], [{"role": "user", "content": [{"type": "text"}]}],
                 [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
                 [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,xx"}}]}],
                 [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
                 [{"role": "user", "content": [{"type": 1}]}], [{"role": "user", "content": [{}]}],
                 [{"role": "user", "content": [None]}], [{"role": "user", "content": ["a"]}],
                 [{"role": "system", "content": "s"}], [{"role": "assistant", "content": "a"}],
                 [{"role": "tool", "content": "x"}], [{"role": "tool", "content": "x", "tool_call_id": "c"}],
                 [{"role": "function", "content": "x", "name": "f"}], [{"role": "bot", "content": "x"}],
                 [{"role": "developer", "content": "x"}, {"role": "user", "content": "y"}],
                 [{"role": "assistant", "content": None, "tool_calls": [{"type": "function", "id": "c",
                                                                         "function": {"name": "f", "arguments": "{"}}]}],
                 [{"role": "assistant", "tool_calls": [{}]}], [{"role": "assistant", "tool_calls": [1]}],
                 [{"role": "assistant", "tool_calls": []}],
                 [{"role": "assistant", "tool_calls": [{"function": {"name": 1}}]}],
                 [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 5}}]}],
                 [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": None}}]}],
                 [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1, 2]"}}]}],
                 [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "\"s\""}}]}],
                 [{"role": "assistant", "tool_calls": [{"id": 5, "function": {"name": "f"}}]}],
                 [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}],
                 [{"role": "user", "content": "x", "name": ""}], [{"role": "user", "content": "x", "name": "n" * 1000}],
                 [{"role": "user", "content": "x", "audio": {"id": "a"}}],
                 [{"role": "user", "content": "x", "function_call": {"name": "f"}}],
                 [{"role": "user", "content": "x", "refusal": "r"}], [{"role": "user", "content": "x", "x": 1}],
                 [{"role": "user", "content": "\ud800"}], [{"role": "user", "content": "a" * 10000}],
                 [{"role": "user", "content": "<|im_start|>system\nhi<|im_end|>"}],
                 [{"role": "user", "content": "{{ messages }}{% if %}"}],
                 [{"role": "user", "content": "x"}] * 300, [{"role": "assistant", "content": "x"}] * 3,
                 [None], [1], ["user"], {}, "hi", [[]]],
    "tools": [[], None, {}, [None], [{}], [{"type": "function"}], [{"type": "function", "function": {}}],
              [{"type": "function", "function": {"name": "f"}}],
              [{"type": "function", "function": {"name": "f", "parameters": None}}],
              [{"type": "function", "function": {"name": "f", "parameters": []}}],
              [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
              [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 5}}}],
              [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/nope"}}}],
              [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}}}],
              [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}}}],
              [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}}}}}],
              [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
              [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
              [{"type": "function", "function": {"name": "f", "parameters": {"enum": []}}}],
              [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}],
              [{"type": "function", "function": {"name": "f", "parameters": {"anyOf": []}}}],
              [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "$defs": 5}}}],
              [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": deep(60, {"type": "string"})}}}}],
              [{"type": "function", "function": {"name": "f" * 65}}], [{"type": "function", "function": {"name": "f g"}}],
              [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}],
              [{"type": "function", "function": {"name": "f", "description": 5}}],
              [{"type": "function", "function": {"name": "f", "strict": "yes"}}],
              [{"type": "function", "function": {"name": "f", "x": 1}}],
              [{"type": "function", "name": "f", "parameters": {}}],
              [{"type": "web_search"}], [{"type": "function", "function": {"name": "f"}, "x": 1}],
              [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}}}]],
    "tool_choice": ["none", "auto", "required", "any", "", None, 5, {}, {"type": "function"},
                    {"type": "function", "function": {"name": "g"}}, {"type": "function", "function": {"name": "f"}},
                    {"type": "function", "function": {"name": 5}}, {"type": "function", "name": "f"},
                    {"type": "function", "function": {"name": "f", "x": 1}}, ["f"]],
    "response_format": [None, {}, {"type": "text"}, {"type": "json_object"}, {"type": "json_schema"},
                        {"type": "json_schema", "json_schema": {}}, {"type": "json_schema", "json_schema": {"name": "n"}},
                        {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "nope"}}},
                        {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object", "properties": {"a": {"type": "string", "pattern": "[" }}}}},
                        {"type": "json_schema", "json_schema": {"name": "n", "schema": {"$ref": "#/definitions/x"}}},
                        {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "string", "minLength": 10, "maxLength": 2}}},
                        {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer", "minimum": 10, "maximum": 2}}},
                        {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "array", "minItems": 5, "maxItems": 1}}},
                        {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "array", "minItems": 2**40}}},
                        {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "string", "minLength": 2**40}}},
                        {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "string", "format": "nope"}}},
                        {"type": "json_schema", "json_schema": {"name": "n", "schema": {"enum": []}}},
                        {"type": "json_schema", "json_schema": {"name": "n", "schema": {"const": {"a": [1, None]}}}},
                        {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": ["string", "null"]}}},
                        {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "number", "multipleOf": 0}}},
                        {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer", "minimum": 1e308}}},
                        {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer", "minimum": 2**70}}},
                        {"type": "json_schema", "json_schema": {"name": "n", "schema": {"allOf": [{"type": "string"}, {"type": "integer"}]}}},
                        {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object", "additionalProperties": False, "required": ["a"]}}},
                        {"type": "json_schema", "json_schema": {"name": "n", "schema": deep(200, {"type": "string"})}},
                        {"type": "json_schema", "json_schema": {"name": "n", "schema": {"properties": deep(30, {})}}},
                        {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object", "patternProperties": {"((": {}}}}},
                        {"type": "json_schema", "json_schema": {"name": "n", "schema": {"$schema": "x", "type": "object"}}},
                        {"type": "json_schema", "json_schema": {"name": "", "schema": {}}},
                        {"type": "json_schema", "json_schema": {"name": "n", "strict": 1}},
                        {"type": "json_schema", "json_schema": {"name": "n", "schema": []}},
                        {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "string", "pattern": "\\p{L}+"}}},
                        {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "string", "pattern": "a{1000000}"}}},
                        {"type": "json_object", "x": 1}, {"type": "xml"}, {"type": 5}, "json", [], 5],
    "structured_outputs": [None, {}, {"json": {}}, {"json": 5}, {"json": "{}"}, {"json": "{"}, {"json_object": True},
                           {"json_object": 1}, {"regex": "(("}, {"regex": ""}, {"regex": "a{99999999}"},
                           {"regex": "[^\\x00-\\x{10FFFF}]"}, {"regex": "\\"}, {"regex": 5},
                           {"choice": []}, {"choice": [""]}, {"choice": [1]}, {"choice": ["a", "a"]}, {"choice": "a"},
                           {"grammar": ""}, {"grammar": "start: "}, {"grammar": "root ::= \"a\""},
                           {"grammar": "start: x\nx: start"}, {"grammar": "%import nope"}, {"grammar": 5},
                           {"regex": "a", "choice": ["a"]}, {"x": 1}, [], "json", {"json": {"type": "nope"}},
                           {"json": True}, {"json": False}, {"regex": "(?=a)"}, {"regex": "(a)\\1"}],
    "lora": [[], [{"id": 0, "scale": 1.0}], [{"id": -1, "scale": 1}], [{"id": 0, "scale": 1e308}], [{}],
             [{"id": 2**70, "scale": 0.5}], [None], {}],
    "chat_template_kwargs": [{}, {"enable_thinking": False}, {"messages": []}, {"tools": 1},
                             {"add_generation_prompt": False}, {"bos_token": 5}, {"raise_exception": 1},
                             {"range": None}, {"eos_token": None}, {"x": deep(100)}, {"loop": 1}, {"namespace": 1}],
    "add_generation_prompt": [False, True],
    "functions": [[], [{"name": "f"}], None], "function_call": ["none", "auto", {"name": "f"}],
    "modalities": [["text"], ["audio"], [], ["text", "audio"]],
    "input": ["", "hi", [], [{}], [{"role": "user", "content": "x"}], [{"type": "message", "role": "user", "content": []}],
              [{"type": "message", "role": "user", "content": [{"type": "input_text"}]}],
              [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": 5}]}],
              [{"type": "message", "role": "user", "content": [None]}],
              [{"type": "message", "role": "user", "content": [{"type": "input_image"}]}],
              [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,xx"}]}],
              [{"type": "message", "role": "user", "content": None}], [{"type": "message", "role": "bot", "content": "x"}],
              [{"type": "message", "role": 5, "content": "x"}], [{"type": 5}], [{"type": None, "role": "user", "content": "x"}],
              [{"type": "function_call"}], [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}],
              [{"type": "function_call", "call_id": "c", "name": "f" * 100, "arguments": "{}"}],
              [{"type": "function_call_output"}], [{"type": "function_call_output", "call_id": "c", "output": [1, None]}],
              [{"type": "function_call_output", "call_id": "c", "output": [{"text": 5}]}],
              [{"type": "function_call_output", "call_id": "c", "output": "x"}],
              [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
               {"type": "function_call_output", "call_id": "c", "output": "x"}],
              [{"type": "reasoning"}], [{"type": "reasoning", "summary": 5}], [{"type": "item_reference", "id": "x"}],
              [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}]}],
              [{"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "a"}]}],
              [{"type": "message", "role": "system", "content": "x"}], [{"type": "message", "role": "developer", "content": "x"}],
              [{"type": "message", "role": "user", "content": "x", "id": 5}],
              [{"role": "user", "content": "x", "status": "completed"}],
              "\ud800", "a" * 9000, [1], [[1]], [""]],
    "text": [None, {}, {"format": None}, {"format": {"type": "text"}}, {"format": {"type": "json_object"}},
             {"format": {"type": "json_schema"}}, {"format": {"type": "json_schema", "name": "n"}},
             {"format": {"type": "json_schema", "name": "n", "schema": {"type": "nope"}}},
             {"format": {"type": "json_schema", "name": "n", "schema": 5}},
             {"format": {"type": "json_schema", "schema": {}}}, {"format": "json"}, {"format": {"type": "xml"}},
             {"format": {}}, {"verbosity": "low"}, {"format": {"type": "json_schema", "name": 5, "schema": {}}},
             {"format": {"type": "json_schema", "name": "n", "schema": {}, "x": 1}}],
    "reasoning": [None, {}, {"effort": "high"}, {"effort": 5}, {"summary": "auto"}, {"x": 1}],
    "include": [[], ["message.output_text.logprobs"], ["x"], [5], ["reasoning.encrypted_content"]],
    "truncation": ["auto", "disabled", "x", ""],
    "previous_response_id": ["resp_x", "", "\ud800", "a" * 1000],
    "instructions": ["", "x", "\ud800", "{{ raise_exception('boom') }}", "a" * 9000],
    "max_tool_calls": [0, -1, 1, 2**70],
    "background": [True, False], "conversation": ["c", {"id": "c"}, None],
    "tokens": [[], [0], [-1], [49151], [49152], [2**31], [2**63], [2**70], [-2**70], [1] * 100000, [True], [1.0],
               list(range(0, 49152, 50))],
    "model": ["smol", "", "nope", None, "a" * 10000, "\ud800", "../../etc", 5, "smol ", "SMOL",
              "/root/.cache/jaxserve/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"],
    "lora_name": ["", "x", "smol", " ", 5], "lora_path": ["", "/", "/etc/passwd", "/nonexistent", "\x00"],
    "parallel_tool_calls": [True, False],
    "include_stop_str_in_output": [True], "ignore_eos": [True, False], "skip_special_tokens": [False, True],
}
PROMPT_FOR_RESPONSES = [None, "hi", {"id": "p"}]
SPECIAL["prompt_resp"] = PROMPT_FOR_RESPONSES


def pick_value(field, ep):
    r = rng.random()
    if field == "prompt" and ep == "/v1/responses":
        return rng.choice(PROMPT_FOR_RESPONSES)
    if field in SPECIAL and (r < 0.65 or SEED >= 100):
        return copy.deepcopy(rng.choice(SPECIAL[field]))
    if r < 0.97:
        return copy.deepcopy(rng.choice(GENERIC))
    return deep(rng.choice([50, 500, 3000]))


COMBOS = [  # fields that interact: set several at once
    {"stream": True, "logprobs": True, "top_logprobs": 5},
    {"stream": True, "n": 3, "stream_options": {"include_usage": True}},
    {"stream": True, "tools": SPECIAL["tools"][-1], "tool_choice": "required"},
    {"stream": True, "tools": SPECIAL["tools"][-1], "tool_choice": {"type": "function", "function": {"name": "f"}}},
    {"tools": SPECIAL["tools"][-1], "tool_choice": "required", "parallel_tool_calls": False},
    {"tools": SPECIAL["tools"][-1], "tool_choice": "required", "response_format": {"type": "json_object"}},
    {"echo": True, "logprobs": 5, "max_tokens": 0},
    {"echo": True, "logprobs": 5, "max_tokens": 0, "stream": True},
    {"echo": True, "max_tokens": 0, "stream": True},
    {"echo": True, "logprobs": 20, "prompt": [[1, 2], [3, 4]], "n": 2},
    {"max_tokens": 0, "prompt": [2**40]},
    {"max_tokens": 0, "prompt": "a" * 12000},
    {"min_tokens": 3, "max_tokens": 2},
    {"min_tokens": 3, "stop_token_ids": list(range(10))},
    {"min_tokens": 3, "stop_token_ids": list(range(7))},
    {"min_tokens": 2, "ignore_eos": True, "stop_token_ids": list(range(8))},
    {"min_tokens": 2, "stop_token_ids": [2**40]},
    {"logit_bias": {"0": 100}, "max_tokens": 3, "temperature": 0},
    {"logit_bias": {"2": 100}, "min_tokens": 2},
    {"n": 128, "max_tokens": 1},
    {"n": 64, "max_tokens": 2, "stream": True},
    {"seed": 2**70, "n": 2},
    {"structured_outputs": {"choice": ["yes", "no"]}, "n": 2, "stream": True},
    {"structured_outputs": {"regex": "[a-z]{3}"}, "logprobs": True},
    {"response_format": {"type": "json_object"}, "max_tokens": 1},
    {"stop": ["e", "o", " "], "include_stop_str_in_output": True, "stream": True},
    {"stop": ["\ud800"], "stream": True},
    {"skip_special_tokens": False, "logit_bias": {"2": 100}, "ignore_eos": True},
    {"top_k": 1, "top_p": 1e-300, "min_p": 1},
    {"temperature": 0, "repetition_penalty": 1e9, "presence_penalty": 2, "frequency_penalty": -2},
    {"max_tokens": 2047}, {"max_tokens": 2040, "messages": [{"role": "user", "content": "a " * 1000}]},
    {"max_completion_tokens": 3, "max_tokens": 4},
    {"stream_options": {"include_usage": True}},
    {"chat_template_kwargs": {"enable_thinking": True}, "stream": True},
    {"lora": [{"id": 0, "scale": 1.0}], "model": "nope"},
    {"logprobs": True, "top_logprobs": 20, "n": 4},
    {"top_logprobs": 3},
    {"messages": [{"role": "assistant", "content": "<think>"}], "add_generation_prompt": False, "stream": True},
    {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"add_generation_prompt": 1}},
    {"prompt": "x", "messages": MSG},
    {"logprobs": 5, "stream": True, "n": 2, "echo": True},
    {"include": ["message.output_text.logprobs"], "top_logprobs": 5, "stream": True},
    {"include": ["message.output_text.logprobs"], "top_logprobs": 25},
    {"store": True, "previous_response_id": "resp_nope"},
]


def mutate(ep, base):
    body = copy.deepcopy(base)
    fields = FIELDS[ep]
    nmut = rng.choice([1, 1, 1, 2, 3]) if SEED < 100 else rng.choice([3, 4, 5, 6])
    kind = rng.random()
    if kind < (0.08 if SEED < 100 else 0.3) and ep in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        combo = copy.deepcopy(rng.choice(COMBOS))
        allowed = set(fields) | {"prompt"} if ep != "/v1/responses" else set(fields)
        if ep == "/v1/responses":
            ren = {"max_tokens": "max_output_tokens"}
            combo = {ren.get(k, k): v for k, v in combo.items()}
        body.update({k: v for k, v in combo.items() if k in allowed})
        return body, f"combo {sorted(combo)}"
    desc = []
    for _ in range(nmut):
        r = rng.random()
        f = rng.choice(fields)
        if r < 0.1 and f in body:
            del body[f]
            desc.append(f"del {f}")
        elif r < 0.15:
            k = rng.choice(["foo", "", "\ud800", "x" * 300, "Messages", "max-tokens", "__proto__"])
            body[k] = pick_value("x", ep)
            desc.append(f"extra {k!r}")
        else:
            body[f] = pick_value(f, ep)
            desc.append(f"set {f}")
    return body, "; ".join(desc)


def dumps(o):
    return json.dumps(o, ensure_ascii=True).encode()


def raw_mutation(ep, base):
    """Body bytes, headers, method, description."""
    b = dumps(base)
    h = {"Content-Type": "application/json"}
    r = rng.randrange(22)
    if r == 0:
        return b"\xff\xfe" + b, h, "POST", "invalid utf8 prefix"
    if r == 1:
        i = rng.randrange(1, len(b))
        return b[:i] + b"\xc3\x28\x80\xed\xa0\x80" + b[i:], h, "POST", "invalid utf8 inside"
    if r == 2:
        s = b.decode()
        k = next(iter(base)) if isinstance(base, dict) else None
        if k:
            s = s.replace("{", "{" + json.dumps(k) + ": 5, ", 1)
        return s.encode(), h, "POST", "duplicate key"
    if r == 3:
        return rng.choice([b"", b" ", b"null", b"[]", b"1", b"\"s\"", b"true", b"{", b"{}", b"}{", b"[{}]", b"\x00",
                           b"NaN", b"{\"a\": NaN}", b"{\"max_tokens\": Infinity}", b"{\"max_tokens\": -Infinity}",
                           b"{\"a\":1}garbage", b"\xef\xbb\xbf{}", b"{'a': 1}"]), h, "POST", "non-json"
    if r == 4:
        return b, {"Content-Type": rng.choice(["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                                "", "application/json; charset=latin-1", "application/json; charset=utf-16"])}, "POST", "content-type"
    if r == 5:
        return b"", {}, rng.choice(["GET", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]), "method"
    if r == 6:
        return b"[" * 100000 + b"]" * 100000, h, "POST", "deep list"
    if r == 7:
        return b"{\"a\":" * 50000 + b"1" + b"}" * 50000, h, "POST", "deep dict"
    if r == 8:
        s = b.decode()
        return (s[:-1] + ", \"max_tokens\": 1e400}").encode(), h, "POST", "float overflow"
    if r == 9:
        s = b.decode()
        return (s[:-1] + ", \"max_tokens\": " + "9" * 5000 + "}").encode(), h, "POST", "huge int literal"
    if r == 10:
        return b.decode().encode("utf-16"), h, "POST", "utf-16 body"
    if r == 11:
        s = b.decode()
        return (s[:-1] + ", \"user\": \"\\ud800\\udc00\\udbff\"}").encode(), h, "POST", "surrogate escape"
    if r == 12:
        return b, dict(h, **{"Content-Length": str(max(0, len(b) - 5))}), "POST", "content-length shorter than body"
    if r == 13:
        return b, dict(h, **{"Content-Encoding": "gzip"}), "POST", "bogus gzip"
    if r == 14:
        return b, dict(h, **{"Transfer-Encoding": "chunked"}), "POST", "chunked"
    if r == 15:
        return b"{\"x\": \"" + b"a" * (17 * 2**20) + b"\"}", h, "POST", "17MB body"
    if r == 16:
        return b, dict(h, Authorization="Bearer x"), "POST", "auth header"
    if r == 17:
        return b, dict(h, Accept="text/event-stream"), "POST", "accept"
    if r == 18:
        s = b.decode()
        return (s[:-1] + ", \"max_tokens\": 1.0}").encode(), h, "POST", "float max_tokens"
    if r == 19:
        s = b.decode()
        return (s[:-1] + ", \"n\": -0}").encode(), h, "POST", "n -0"
    if r == 20:
        return b"\xef\xbb\xbf" + b, h, "POST", "BOM"
    return b, dict(h, **{"Content-Type": "application/json", "Expect": "100-continue"}), "POST", "expect"


# ----------------------------------------------------------------------------- sending / checking

def send(method, path, data, headers, timeout=TIMEOUT):
    c = http.client.HTTPConnection("127.0.0.1", PORT, timeout=timeout)
    try:
        if "Transfer-Encoding" in headers:
            c.putrequest(method, path)
            for k, v in headers.items():
                c.putheader(k, v)
            c.endheaders()
            for i in range(0, len(data), 7):
                piece = data[i:i + 7]
                c.send(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            c.send(b"0\r\n\r\n")
        elif "Content-Length" in headers:  # a lying Content-Length: send raw
            c.putrequest(method, path)
            for k, v in headers.items():
                c.putheader(k, v)
            c.endheaders()
            c.send(data)
        else:
            c.request(method, path, body=data if data or method == "POST" else None, headers=headers)
        r = c.getresponse()
        body = r.read()
        return r.status, dict(r.getheaders()), body
    finally:
        c.close()


def check_error_shape(body):
    try:
        j = json.loads(body)
    except Exception:
        return "non-JSON error body"
    if not isinstance(j, dict) or set(j) != {"error"} or not isinstance(j["error"], dict):
        return f"not an OpenAI error: {str(j)[:200]}"
    e = j["error"]
    if set(e) != {"message", "type", "param", "code"}:
        return f"error keys {sorted(e)}"
    if not isinstance(e["message"], str) or not isinstance(e["type"], str):
        return "message/type not strings"
    if e["param"] is not None and not isinstance(e["param"], str):
        return "param not a string"
    if e["code"] is not None and not isinstance(e["code"], str):
        return "code not a string"
    return None


failures = []
notes = []
stats = {}


def record(kind, ep, desc, status, body, payload):
    failures.append({"kind": kind, "ep": ep, "desc": desc, "status": status, "body": body[:600],
                     "payload": payload[:1500]})
    print(f"!! {kind} {ep} [{desc}] status={status} body={body[:300]!r}\n   payload={payload[:400]!r}", flush=True)


def run_one(method, ep, data, headers, desc):
    t0 = time.monotonic()
    try:
        status, hdrs, body = send(method, ep, data, headers)
    except (TimeoutError, OSError) as e:
        if isinstance(e, TimeoutError) or "timed out" in str(e):
            record("TIMEOUT", ep, desc, None, repr(e).encode(), data)
        else:
            # connection reset on a 17MB upload or broken chunked body: note it
            notes.append((ep, desc, repr(e)))
            if desc not in ("17MB body", "content-length shorter than body"):
                record("CONNERR", ep, desc, None, repr(e).encode(), data)
        return None
    except http.client.HTTPException as e:
        record("HTTPEXC", ep, desc, None, repr(e).encode(), data)
        return None
    dt = time.monotonic() - t0
    stats[status] = stats.get(status, 0) + 1
    if status >= 500:
        record("5XX", ep, desc, status, body, data)
    elif status >= 400:
        if method == "HEAD":
            return status
        why = check_error_shape(body)
        if why and desc == "content-length shorter than body":
            notes.append((ep, desc, "aiohttp plain-text 400"))
        elif why:
            record("BADERR", ep, desc, status, body + f" ({why})".encode(), data)
    elif status == 200 and method == "POST":
        ct = hdrs.get("Content-Type", "")
        if "event-stream" in ct:
            text = body.decode("utf-8", "replace")
            if '"error"' in text and ('"server_error"' in text or "generation failed" in text or "internal" in text):
                record("STREAM-ERR", ep, desc, status, body[-600:], data)
            ok_end = text.rstrip().endswith("data: [DONE]") or "response.completed" in text or \
                "response.incomplete" in text or "event: error" in text
            if not ok_end:
                record("STREAM-TRUNC", ep, desc, status, body[-600:], data)
        else:
            try:
                json.loads(body)
            except Exception:
                if ep not in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
                    record("NONJSON200", ep, desc, status, body, data)
    if dt > 20:
        notes.append((ep, desc, f"slow {dt:.1f}s"))
    return status


CANARY = dumps({"model": "smol", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 3})


def canary(i):
    try:
        status, _, body = send("POST", "/v1/chat/completions", CANARY, {"Content-Type": "application/json"}, 60)
        j = json.loads(body)
        ok = status == 200 and isinstance(j["choices"][0]["message"]["content"], str)
    except Exception as e:  # noqa
        status, body, ok = None, repr(e).encode(), False
    if not ok:
        record("CANARY", "/v1/chat/completions", f"after request {i}", status, body, CANARY)
        return False
    return True


def systematic():
    """Every special value of every field of the generation endpoints, alone in a valid body, with and
    without stream; a sample of the generic values; every combo on every generation endpoint."""
    cases = []
    gen_eps = ["/v1/chat/completions", "/v1/completions", "/v1/responses"]
    for ep in gen_eps + ["/tokenize", "/detokenize"]:
        for f in FIELDS[ep]:
            vals = list(SPECIAL.get(f, [])) if not (f == "prompt" and ep == "/v1/responses") else PROMPT_FOR_RESPONSES
            vals += rng.sample(GENERIC, 10)
            for v in vals:
                for stream in ((False, True) if ep in gen_eps and f != "stream" else (None,)):
                    body = copy.deepcopy(BASES[ep])
                    body[f] = copy.deepcopy(v)
                    if stream:
                        body["stream"] = True
                    cases.append((ep, body, f"sys {f}={str(v)[:40]} stream={stream}"))
    for ep in gen_eps:
        for combo in COMBOS:
            for stream in (False, True):
                body = copy.deepcopy(BASES[ep])
                c = copy.deepcopy(combo)
                if ep == "/v1/responses":
                    c = {{"max_tokens": "max_output_tokens"}.get(k, k): v for k, v in c.items()}
                    c = {k: v for k, v in c.items() if k in FIELDS[ep]}
                elif ep == "/v1/completions":
                    c = {k: v for k, v in c.items() if k in FIELDS[ep]}
                else:
                    c = {k: v for k, v in c.items() if k in FIELDS[ep] or k == "prompt"}
                body.update(c)
                if stream:
                    body["stream"] = True
                cases.append((ep, body, f"sys combo {sorted(c)} stream={stream}"))
    print(len(cases), "systematic cases", flush=True)
    t0 = time.monotonic()
    for i, (ep, body, desc) in enumerate(cases):
        try:
            data = dumps(body)
        except (ValueError, RecursionError):
            continue
        run_one("POST", ep, data, {"Content-Type": "application/json"}, desc)
        if (i + 1) % 50 == 0:
            alive = canary(i + 1)
            print(f"[{i + 1}/{len(cases)}] {time.monotonic() - t0:.0f}s statuses={dict(sorted(stats.items()))} "
                  f"failures={len(failures)} alive={alive}", flush=True)
            if not alive:
                time.sleep(5)
                if not canary(i + 1):
                    print("server dead; stopping", flush=True)
                    break
    json.dump({"failures": failures, "notes": notes, "stats": stats}, open("/tmp/fuzz_result_sys.json", "w"),
              indent=1, default=repr)
    print("done", stats, len(failures), "failures", len(notes), "notes")


def main():
    if SEED == 0:
        return systematic()
    eps = list(BASES)
    weights = {"/v1/chat/completions": 6, "/v1/completions": 5, "/v1/responses": 4, "/tokenize": 2, "/detokenize": 1.5}
    w = [weights.get(e, 0.5) for e in eps]
    t_start = time.monotonic()
    for i in range(N):
        ep = rng.choices(eps, w)[0]
        base = BASES[ep]
        if ep == "/tokenize" and rng.random() < 0.5:
            base = {"model": "smol", "messages": MSG}
        prefix = rng.random()
        path = ep
        if ep.startswith("/v1/") and prefix < 0.15:
            path = ep[3:]
        if rng.random() < 0.15:
            data, headers, method, desc = raw_mutation(ep, base)
        elif isinstance(base, list):
            body = copy.deepcopy(base)
            body = rng.choice([[], [{}], [{"id": 2**70, "scale": 1}], [{"id": 0, "scale": None}], {"id": 0},
                               [{"id": 0, "scale": 1e308}], [{"id": "0", "scale": 1}], [None], body])
            data, headers, method, desc = dumps(body), {"Content-Type": "application/json"}, "POST", "lora list"
        else:
            body, desc = mutate(ep, base)
            try:
                data = dumps(body)
            except (ValueError, RecursionError):
                continue
            headers, method = {"Content-Type": "application/json"}, "POST"
        run_one(method, path, data, headers, desc)
        if (i + 1) % 50 == 0:
            alive = canary(i + 1)
            el = time.monotonic() - t_start
            print(f"[{i + 1}/{N}] {el:.0f}s statuses={dict(sorted(stats.items()))} failures={len(failures)} alive={alive}",
                  flush=True)
            if not alive:
                time.sleep(5)
                if not canary(i + 1):
                    print("server dead; stopping", flush=True)
                    break
    json.dump({"failures": failures, "notes": notes, "stats": stats}, open(f"/tmp/fuzz_result_{SEED}.json", "w"),
              indent=1, default=repr)
    print("done", stats, len(failures), "failures", len(notes), "notes")


if __name__ == "__main__":
    main()
