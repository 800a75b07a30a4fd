"""Turning validated requests into engine inputs: SamplingParams and prompt token ids."""

from __future__ import annotations

import json
import re

from jaxserve.engine.sampling_params import SamplingParams, SamplingParamsError
from jaxserve.server import tools
from jaxserve.server.errors import APIError, bad_request
from jaxserve.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest

MAX_N = 128
MAX_STOP = 16
MAX_STOP_LEN = 512
try:  # the sampler's fixed-size tables; the engine raises inside a step when they overflow
    from jaxserve.engine.sampling_tensors import DEFAULT_MAX_BIAS as MAX_LOGIT_BIAS
    from jaxserve.engine.sampling_tensors import DEFAULT_MAX_EOS as MAX_SUPPRESSED_IDS
except Exception:  # pragma: no cover
    MAX_LOGIT_BIAS, MAX_SUPPRESSED_IDS = 64, 8

# a negative id is refused later with the out-of-range message; 10 digits hold any int32 id (and int() of a
# 5,000-digit string raises past Python's conversion limit)
_TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,10}")
_COPY = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
         "repetition_penalty", "seed", "min_tokens", "ignore_eos", "skip_special_tokens",
         "include_stop_str_in_output")


def _common(state, req, max_tokens: int | None) -> dict:
    kw = dict(state.defaults)
    for f in _COPY:
        v = getattr(req, f)
        if v is not None:
            kw[f] = v
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_N:
        raise bad_request(f"n must be between 1 and {MAX_N}, got {n}", "n")
    kw["n"] = n
    if req.temperature is not None and req.temperature > 2:
        raise bad_request(f"temperature must be between 0 and 2, got {req.temperature}", "temperature")
    stop = req.stop
    if isinstance(stop, str):
        stop = [stop]
    if stop:
        if len(stop) > MAX_STOP:
            raise bad_request(f"at most {MAX_STOP} stop sequences are allowed, got {len(stop)}", "stop")
        if any(len(s) > MAX_STOP_LEN for s in stop):
            raise bad_request(f"stop sequences may be at most {MAX_STOP_LEN} characters", "stop")
        kw["stop"] = list(stop)
    if req.stop_token_ids:
        kw["stop_token_ids"] = list(req.stop_token_ids)
    if req.logit_bias:
        if len(req.logit_bias) > MAX_LOGIT_BIAS:
            raise bad_request(f"logit_bias may have at most {MAX_LOGIT_BIAS} entries, got {len(req.logit_bias)}",
                              "logit_bias")
        bias = {}
        for k, v in req.logit_bias.items():
            # plain decimal digits only: int() would also take "1_0", " 7" or "+3"
            if not _TOKEN_ID_KEY.fullmatch(k):
                raise bad_request(f"logit_bias keys must be token ids (decimal digits), got {k!r}", "logit_bias")
            bias[int(k)] = v
        kw["logit_bias"] = bias
    if max_tokens is not None:
        if max_tokens < 1:
            raise bad_request(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    kw["max_tokens"] = max_tokens
    # the sampler packs these into int32 tables: keep them in range instead of failing a whole step
    vocab = state.engine.cfg.vocab_size
    if kw.get("top_k") is not None and kw["top_k"] >= vocab:
        kw["top_k"] = 0  # keeping the whole vocabulary is no top-k at all
    L = state.engine.ecfg.max_model_len
    if kw.get("min_tokens") is not None and kw["min_tokens"] > L:
        raise bad_request(f"min_tokens must be at most max_model_len ({L}), got {kw['min_tokens']}", "min_tokens")
    if max_tokens is not None and max_tokens > 2**31 - 1:
        kw["max_tokens"] = None  # no limit but the context length
    if kw.get("min_tokens", 0) and kw.get("min_tokens", 0) > 0:
        eos = set(getattr(state.engine.cfg, "eos_token_ids", ()) or ())
        ids = set(kw.get("stop_token_ids", ())) | (set() if kw.get("ignore_eos") else eos)
        if len(ids) > MAX_SUPPRESSED_IDS:
            raise bad_request(f"with min_tokens, at most {MAX_SUPPRESSED_IDS} stop/EOS token ids can be "
                              f"suppressed, got {len(ids)}", "stop_token_ids")
    return kw


def _make(kw: dict) -> SamplingParams:
    try:
        return SamplingParams(**kw)
    except SamplingParamsError as e:
        raise bad_request(str(e), e.param) from None
    except (TypeError, ValueError) as e:
        raise bad_request(str(e)) from None


def _check_logprobs(state, k: int | None, param: str) -> None:
    lim = state.engine.ecfg.max_logprobs
    if k is not None and not 0 <= k <= lim:
        raise bad_request(f"{param} must be between 0 and {lim}, got {k}", param)


def chat_params(state, req: ChatCompletionRequest, spec=None) -> SamplingParams:
    if req.max_tokens is not None and req.max_completion_tokens is not None \
            and req.max_tokens != req.max_completion_tokens:
        raise bad_request("give max_completion_tokens or max_tokens, not both", "max_tokens")
    mt = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    kw = _common(state, req, mt)
    kw["structured"] = spec  # response_format, structured_outputs or a forced tool call (chat.py)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("logprobs must be true when top_logprobs is given", "top_logprobs")
    if req.logprobs:
        _check_logprobs(state, req.top_logprobs, "top_logprobs")
        kw["logprobs"] = req.top_logprobs or 0
    return _make(kw)


def completion_params(state, req: CompletionRequest, spec=None) -> tuple[SamplingParams, bool]:
    """(params, discard_output): max_tokens=0 with echo still runs one step for prompt logprobs and
    throws the generated token away."""
    mt = 16 if req.max_tokens is None else req.max_tokens  # OpenAI's default for completions
    if mt < 0:
        raise bad_request(f"max_tokens must be >= 0, got {mt}", "max_tokens")
    discard = mt == 0
    kw = _common(state, req, 1 if discard else mt)
    kw["structured"] = None if discard else spec  # max_tokens 0: nothing is generated to constrain
    if req.best_of is not None and req.best_of != kw["n"]:
        raise bad_request("best_of other than n is not implemented", "best_of", "unsupported_parameter")
    _check_logprobs(state, req.logprobs, "logprobs")
    if req.logprobs is not None:
        kw["logprobs"] = req.logprobs
        if req.echo:
            kw["prompt_logprobs"] = req.logprobs
    if discard:
        kw["min_tokens"] = 0
    return _make(kw), discard


# ----------------------------------------------------------------------------- prompts

def _tool_calls_for_template(calls: list, where: str) -> list[dict]:
    """An assistant message's tool_calls as templates read them: OpenAI's shape, arguments as an object
    when they are JSON (Llama 3.1 / Qwen templates apply `tojson` to them)."""
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or c.get("type", "function") != "function":
            raise bad_request("a tool call must be {\"type\": \"function\", \"id\": ..., \"function\": "
                              "{\"name\": ..., \"arguments\": \"...\"}}", f"{where}.tool_calls[{j}]")
        args = f.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        out.append({"id": c.get("id"), "type": "function", "function": {"name": f["name"], "arguments": args}})
    return out


def messages_for_template(messages: list[ChatMessage], native_tools: bool = True,
                          images: list | None = None) -> list[dict]:
    """The messages as template dicts. native_tools: the template renders tool calls and tool results
    itself; otherwise they become text in the Hermes format (server/tools.py). images: a list for a
    multimodal model: every content becomes a list of text and {"type": "image"} parts (as LLaVA's
    templates take them) and the image sources (URLs) are appended to it in order; None: text only."""
    if not messages:
        raise bad_request("messages must contain at least one message", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.role == "function":
            raise bad_request("role 'function' (the deprecated functions API) is not supported: use 'tool'",
                              f"{where}.role", "unsupported_parameter")
        if m.tool_calls and m.role != "assistant":
            raise bad_request("only assistant messages carry tool_calls", f"{where}.tool_calls")
        if m.role == "tool" and not m.tool_call_id:
            raise bad_request("a tool message needs tool_call_id", f"{where}.tool_call_id")
        calls = _tool_calls_for_template(m.tool_calls, where) if m.tool_calls else None
        for f in ("audio", "function_call"):
            if getattr(m, f) is not None:
                raise bad_request(f"'{f}' in messages is not supported", f"{where}.{f}", "unsupported_parameter")
        content = m.content
        if images is not None and m.role in ("user", "system", "assistant", "developer") and not calls:
            from jaxserve.loader.image import ImageError, split_content

            parts = [{"type": "text", "text": content or ""}] if not isinstance(content, list) else \
                [p.model_dump() for p in content]
            try:
                parts, srcs = split_content(parts, f"{where}.content")
            except ImageError as e:
                raise bad_request(str(e), f"{where}.content") from None
            images += srcs
            d = {"role": "system" if m.role == "developer" else m.role, "content": parts}
            if m.name is not None:
                d["name"] = m.name
            out.append(d)
            continue
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise bad_request(f"content parts of type '{part.type}' are not supported (text only)",
                                      f"{where}.content[{j}].type", "unsupported_parameter")
                texts.append(part.text)
            content = "".join(texts) if len(texts) == 1 else "\n".join(texts)
        if content is None:
            if m.role != "assistant":
                raise bad_request(f"a {m.role} message needs content", f"{where}.content")
            content = ""
        # 'developer' is OpenAI's new name for 'system'; chat templates only know the latter
        d = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.name is not None:
            d["name"] = m.name
        if calls and native_tools:
            d["tool_calls"] = calls
        elif calls:
            d["content"] = "\n".join([content] * bool(content) + [tools.call_as_text(c) for c in calls])
        if m.role == "tool":
            if native_tools:
                d["tool_call_id"] = m.tool_call_id
            else:
                d["content"] = f"<tool_response>\n{content}\n</tool_response>"
        out.append(d)
    return out


_RESERVED_TEMPLATE_VARS = ("messages", "tools", "add_generation_prompt")


def chat_prompt_ids(state, messages: list[ChatMessage], add_generation_prompt: bool | None,
                    funcs: list[dict] | None = None, template_kwargs: dict | None = None,
                    images: list | None = None, with_text: bool = False):
    """The prompt's token ids (with_text: and the rendered prompt); funcs: the declared tools
    (server/tools.check_tools) or None; template_kwargs: extra variables for the chat template (vLLM's
    chat_template_kwargs, e.g. {"enable_thinking": false} for Qwen3); images: see messages_for_template."""
    bad = sorted(set(template_kwargs or {}) & set(_RESERVED_TEMPLATE_VARS))
    if bad:
        raise bad_request(f"chat_template_kwargs cannot set {', '.join(bad)} (they are request fields)",
                          "chat_template_kwargs")
    if state.template is None:
        raise bad_request(f"chat is not available for this model: {state.template_error}", "messages")
    native = tools.uses_tools(state.template.source)
    msgs = messages_for_template(messages, native, images)
    if funcs and not native:  # the template cannot show tools: describe them in the system turn
        prompt = tools.system_prompt(funcs)
        if msgs[0]["role"] == "system" and isinstance(msgs[0]["content"], list):
            msgs[0] = dict(msgs[0], content=msgs[0]["content"] + [{"type": "text", "text": "\n\n" + prompt}])
        elif images is not None:
            msgs.insert(0, {"role": "system", "content": [{"type": "text", "text": prompt}]})
        elif msgs[0]["role"] == "system":
            msgs[0] = dict(msgs[0], content=f"{msgs[0]['content']}\n\n{prompt}")
        else:
            msgs.insert(0, {"role": "system", "content": prompt})
    try:
        text = state.template.render(msgs, tools=tools.template_tools(funcs) if funcs and native else None,
                                     add_generation_prompt=True if add_generation_prompt is None
                                     else add_generation_prompt, **(template_kwargs or {}))
    except Exception as e:  # template errors and roles the template cannot render
        raise bad_request(f"chat template error: {e}", "messages") from None
    ids = state.engine.tokenizer.encode(text)
    return (ids, text) if with_text else ids


def completion_prompts(state, prompt) -> list[tuple[list[int], str | None]]:
    """[(token ids, text or None)] for each prompt of a completions request."""
    tok = state.engine.tokenizer
    if isinstance(prompt, str):
        items = [prompt]
    elif not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    elif isinstance(prompt[0], int):
        items = [prompt]
    else:
        items = list(prompt)
    out = []
    for i, p in enumerate(items):
        if isinstance(p, str):
            ids = tok.encode(p)
            out.append((ids, p))
        else:
            if not p:
                raise bad_request(f"prompt {i} is an empty token list", "prompt")
            out.append((list(p), None))
    return out


def check_ids(state, ids: list[int], param: str) -> None:
    V = state.engine.cfg.vocab_size
    for t in ids:
        if not 0 <= t < V:
            raise bad_request(f"token id {t} is out of range [0, {V})", param)


def value_error_to_api(e: Exception) -> APIError:
    return bad_request(str(e), getattr(e, "param", None))
