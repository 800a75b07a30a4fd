"""Offline API: `LLM(model=...).generate(...)`, `.chat(...)`, `.score(...)`.

All prompts of a call are submitted at once and run as one continuously batched job.
"""

from __future__ import annotations

import itertools
import math
import numbers
import operator
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence as Seq

from jaxserve.config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list | None = None  # per token: (logprob, [(token_id, logprob), ...])

    @property
    def cumulative_logprob(self) -> float | None:
        return None if self.logprobs is None else float(sum(lp for lp, _ in self.logprobs))


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list | None = None  # [None, (lp, top), ...] aligned with prompt_token_ids
    num_cached_tokens: int = 0


@dataclass
class ScoreOutput:
    text: str
    token_ids: list[int]
    logprobs: list[float | None]  # logprobs[0] is None (nothing predicts the first token)

    @property
    def total_logprob(self) -> float:
        return float(sum(x for x in self.logprobs if x is not None))

    @property
    def perplexity(self) -> float:
        n = sum(1 for x in self.logprobs if x is not None)
        return math.exp(-self.total_logprob / n) if n else float("nan")


_ENGINE_KEYS = {f for f in EngineConfig.__dataclass_fields__}


class LLM:
    def __init__(self, model: str | None = None, *, file: str | None = None,
                 weights_file: str | None = None, yarn_scaling_factor: float | None = None,
                 tensor_parallel_size: int | None = 1, devices=None, data_parallel_size: int = 1,
                 num_nodes: int = 1, node_rank: int = 0, master_addr: str = "127.0.0.1",
                 master_port: int = 29500, revision: str | None = None, task: str = "auto",
                 hf_overrides: dict | None = None, **engine_kwargs: Any):
        """devices: jax devices, or device ids of this host ("0,1" or [0, 1]); tensor_parallel_size=None
        uses all of them. data_parallel_size: replicas of tensor_parallel_size devices each (DataParallelEngine).
        num_nodes > 1: multi-host through jax.distributed; on node_rank > 0 the constructor runs rank 0's
        steps until rank 0 exits, then returns an LLM with `is_follower` set and no engine.
        task: "auto", "generate", "embed" or "classify" (see embedder.pooling_task); hf_overrides:
        config.json fields replaced for a pooling model (models/decoder_pooling.OVERRIDE_KEYS)."""
        from jaxserve.config import speculative_fields

        engine_kwargs.update(speculative_fields(engine_kwargs.pop("speculative_config", None)))
        unknown = set(engine_kwargs) - _ENGINE_KEYS
        if unknown:
            raise TypeError(f"LLM: unknown option(s) {sorted(unknown)}; known: {sorted(_ENGINE_KEYS)}")
        if task not in ("auto", "generate", "embed", "classify"):
            raise ValueError(f"task must be auto, generate, embed or classify, got {task!r}")
        by_id = isinstance(devices, str) or (bool(devices) and isinstance(list(devices)[0], int))
        from jaxserve.engine.embedder import EmbeddingEngine, is_embedding_model

        if is_embedding_model(model, revision, task, hf_overrides):  # embed / rerank / score / classify only
            if (tensor_parallel_size or 1) != 1 or data_parallel_size != 1 or num_nodes != 1:
                raise ValueError("embedding models run on one device")
            if engine_kwargs.get("lora") or engine_kwargs.get("lora_modules") or engine_kwargs.get("max_loras"):
                raise ValueError("lora adapters apply to generative models only")
            kw = {k: engine_kwargs[k] for k in ("dtype", "max_model_len") if k in engine_kwargs}
            self.engine = EmbeddingEngine(model, revision=revision, task=task, hf_overrides=hf_overrides, **kw)
            self.is_follower, self.tokenizer = False, self.engine.tokenizer
            self._ids = itertools.count()
            return
        if hf_overrides:
            raise ValueError("hf_overrides apply to pooling models (task embed or classify) only")
        if task in ("embed", "classify"):
            raise ValueError(f"{model}: task {task!r} needs a Hugging Face safetensors directory or Hub id "
                             "with tokenizer.json")
        if (data_parallel_size == 1 and num_nodes == 1 and revision is None and not by_id
                and tensor_parallel_size is not None):
            self.engine = LLMEngine(model, engine_config=EngineConfig(**engine_kwargs), file=file,
                                    weights_file=weights_file, yarn_scaling_factor=yarn_scaling_factor,
                                    tp=tensor_parallel_size, devices=devices)
        else:
            from jaxserve.parallel.launch import build_engine

            self.engine = build_engine(model, engine_config=EngineConfig(**engine_kwargs), file=file,
                                       weights_file=weights_file, yarn_scaling_factor=yarn_scaling_factor,
                                       revision=revision, tp=tensor_parallel_size, dp=data_parallel_size,
                                       devices=devices, num_nodes=num_nodes, node_rank=node_rank,
                                       master_addr=master_addr, master_port=master_port)
        self.is_follower = self.engine is None
        self.tokenizer = None if self.is_follower else self.engine.tokenizer
        self._ids = itertools.count()

    @classmethod
    def from_engine(cls, engine) -> "LLM":
        """Wrap an engine built elsewhere (e.g. LLMEngine(LoadedModel(...)) with weights made in code)."""
        self = cls.__new__(cls)
        self.engine, self.is_follower, self.tokenizer = engine, False, engine.tokenizer
        self._ids = itertools.count()
        return self

    def embed(self, inputs: str | list[str] | list[int] | list[list[int]], dimensions: int | None = None):
        """Sentence embeddings (an embedding model's): float32 numpy [n, dim], one row per input (texts
        or token-id lists), in order; normalized when the model's pooling config says so. dimensions:
        a Matryoshka model's shorter size (the first `dimensions`, normalized again)."""
        if not getattr(self.engine, "is_embedding", False):
            raise ValueError("this model generates text; embeddings need an embedding model (BERT, RoBERTa, "
                             "XLM-RoBERTa sentence-transformers checkpoints, decoder ones such as Qwen3-Embedding, "
                             "or task='embed')")
        self.engine.check_dimensions(dimensions)
        return self.engine.shorten(self.engine.embed(self._token_lists(inputs)), dimensions)

    def _token_lists(self, inputs) -> list[list[int]]:
        if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        return [self.engine.tokenizer.encode(x) if isinstance(x, str) else list(x) for x in inputs]

    def classify(self, inputs: str | list[str] | list[int] | list[list[int]]):
        """Class probabilities of a sequence-classification model, float32 numpy [n, labels] (softmax;
        a one-label model's sigmoid), one row per input; the labels' names are `LLM.labels`."""
        if not getattr(self.engine, "is_classifier", False):
            raise ValueError("classify needs a sequence-classification model (*ForSequenceClassification)")
        return self.engine.classify(self._token_lists(inputs))

    @property
    def labels(self) -> tuple[str, ...]:
        """A classifier's label names (config id2label), in the order of classify's columns."""
        return tuple(getattr(getattr(self.engine, "cfg", None), "labels", ()) or ())

    def rerank(self, query: str, documents: list[str]):
        """Relevance of each document to the query, float32 numpy [n] in the documents' order: a
        cross-encoder's score in (0, 1), or an embedding model's cosine similarity."""
        eng = self.engine
        if not getattr(eng, "is_embedding", False):
            raise ValueError("rerank needs a pooling model (a cross-encoder / reranker or an embedding model)")
        if eng.is_classifier:
            return eng.score(eng.tokenizer.encode_pairs(query, list(documents), eng.cfg.max_seq_len))
        from jaxserve.engine.embedder import cosine_to_first

        return cosine_to_first(self.embed([query] + list(documents)))

    def _need_generative(self) -> None:
        if getattr(self.engine, "is_embedding", False):
            raise ValueError(f"{self.engine.model.name} is an embedding model: use LLM.embed")

    def _run(self, prompts: list[str | list[int]], params: list[SamplingParams], use_tqdm: bool, loras: list):
        from tqdm import tqdm

        self._need_generative()
        if self.is_follower:
            raise RuntimeError("this process was a multi-host follower (node_rank > 0): only rank 0 generates")

        from jaxserve.engine.lora_slots import LoraSlotsFull

        eng = self.engine
        order, seqs_of = [], {}
        texts: dict[int, list[str]] = {}
        bar = tqdm(total=len(prompts), disable=not use_tqdm, desc="generate")
        done = 0

        def step():
            nonlocal done
            for out in eng.step():
                texts.setdefault(out.seq.seq_id, []).append(out.new_text)
            n = sum(all(s.is_finished for s in seqs) for seqs in seqs_of.values())
            bar.update(n - done)
            done = n

        try:
            for p, sp, lr in zip(prompts, params, loras):
                rid = f"offline-{next(self._ids)}"
                while True:
                    try:
                        seqs_of[rid] = eng.add_request(rid, p, sp, lora_request=lr)
                        break
                    except LoraSlotsFull:  # more adapters than slots: run until a running one ends
                        if not eng.has_unfinished():
                            raise
                        step()
                order.append((rid, p))
            while eng.has_unfinished():
                step()
        except BaseException:  # a bad prompt (or Ctrl-C): none of this call's requests stay queued
            for rid in seqs_of:
                eng.abort_request(rid)
            raise
        bar.close()
        results = []
        for rid, prompt in order:
            seqs = seqs_of[rid]
            outs = [CompletionOutput(index=s.choice_index, text="".join(texts.get(s.seq_id, [])),
                                     token_ids=list(s.output_token_ids),
                                     finish_reason=s.finish_reason.value if s.finish_reason else None,
                                     stop_reason=s.stop_reason,
                                     logprobs=list(s.output_logprobs) if s.params.logprobs is not None else None)
                    for s in seqs]
            s0 = seqs[0]
            plp = None
            if s0.params.prompt_logprobs is not None:
                plp = [None] + list(s0.prompt_logprobs)
            if not isinstance(prompt, (str, list)):  # a MultiModalPrompt
                prompt = prompt.text
            results.append(RequestOutput(rid, prompt if isinstance(prompt, str) else None,
                                         list(s0.prompt_token_ids), outs, plp, s0.num_cached_tokens))
        return results

    def generate(self, prompts: str | dict | list[str] | list[dict] | list[list[int]] | list[int],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False, lora_request=None) -> list[RequestOutput]:
        """prompts: texts, token-id lists, or (vLLM's shape) dicts {"prompt": text or
        "prompt_token_ids": ids, "multi_modal_data": {"image": a PIL image or a list of them}} for a
        multimodal model, one image per image placeholder in the prompt.
        lora_request: a LoRARequest (or the name of a loaded adapter) for every prompt, or a list of them
        (None entries: the base model), one per prompt; the prompts run in one batch. A LoRARequest whose
        lora_path is not loaded yet is loaded on demand into a free adapter slot (max_loras), evicting
        the least recently used on-demand adapter; more adapters than slots run in turns."""
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        if prompts and isinstance(prompts[0], numbers.Integral):
            prompts = [prompts]  # one prompt of token ids (a list, tuple or 1-d array)
        prompts = [self._prompt_from_dict(p) if isinstance(p, dict) else _prompt_value(p) for p in prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(loras)} lora requests")
        return self._run(prompts, list(sampling_params), use_tqdm, loras)

    def _prompt_from_dict(self, p: dict):
        unknown = set(p) - {"prompt", "prompt_token_ids", "multi_modal_data"}
        if unknown or ("prompt" in p) == ("prompt_token_ids" in p):
            raise ValueError("a prompt dict has 'prompt' or 'prompt_token_ids' (one of them) and optionally "
                             f"'multi_modal_data'; got keys {sorted(p)}")
        text = p.get("prompt")
        mm = dict(p.get("multi_modal_data") or {})
        images = mm.pop("image", None)
        if mm:
            raise ValueError(f"multi_modal_data: only 'image' is supported, got {sorted(mm)}")
        if images is None:
            return text if text is not None else _prompt_value(p["prompt_token_ids"])
        images = images if isinstance(images, (list, tuple)) else [images]
        return self.engine.multimodal_prompt(text if text is not None else p["prompt_token_ids"], list(images))

    def get_tokenizer(self):
        """The model's tokenizer (jaxserve.loader.tokenizer.Tokenizer: encode, decode,
        apply_chat_template's template), as vLLM's LLM.get_tokenizer()."""
        return self.tokenizer

    def apply_chat_template(self, messages: list[dict], tools: list | None = None,
                            add_generation_prompt: bool = True, **kwargs) -> str:
        from jaxserve.loader.chat_template import ChatTemplate

        tok = self.tokenizer
        tmpl = ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token)
        return tmpl.render(messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             tools: list | None = None, add_generation_prompt: bool = True,
             use_tqdm: bool = False, lora_request=None, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; each RequestOutput's `prompt` is the rendered
        template text. chat_template_kwargs: extra template variables (e.g. {"enable_thinking": False})."""
        self._need_generative()
        kw = dict(chat_template_kwargs or {})
        clash = sorted(set(kw) & {"messages", "tools", "add_generation_prompt"})
        if clash:
            raise ValueError(f"chat_template_kwargs cannot set {clash}: pass them as chat()'s own arguments")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for c in convs:
            if getattr(self.engine, "vision", None) is None:
                prompts.append(self.apply_chat_template(c, tools, add_generation_prompt, **kw))
                continue
            # multimodal: image parts become {"type": "image"} for the template, the images go alongside
            from jaxserve.loader.image import load_source, split_content

            msgs, images = [], []
            for i, m in enumerate(c):
                content = m.get("content")
                parts = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
                parts, srcs = split_content(parts, f"messages[{i}].content")
                msgs.append(dict(m, content=parts))
                images += [load_source(x) for x in srcs]
            text = self.apply_chat_template(msgs, tools, add_generation_prompt, **kw)
            prompts.append(self.engine.multimodal_prompt(self.tokenizer.encode(text), images, text))
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def add_lora(self, lora_request) -> int:
        """Load a LoRARequest(name, id, path) into a free adapter slot (max_loras): later requests name it.
        Returns the slot. Nothing compiles."""
        return self.engine.add_lora(lora_request.lora_name, lora_request.lora_path)

    def remove_lora(self, name) -> None:
        """Unload an adapter (a name or a LoRARequest); its slot is free for the next one."""
        self.engine.remove_lora(getattr(name, "lora_name", name))

    def list_loras(self) -> dict[str, str]:
        """The loaded adapters: name -> directory."""
        return dict(self.engine.lora_paths)

    def score(self, texts: str | list[str], use_tqdm: bool = False, lora_request=None) -> list[ScoreOutput]:
        """Per-token log-probabilities of each text under the model, or under an adapter of lora_modules
        (lora_request as in generate) (batch scoring, perplexity)."""
        if isinstance(texts, str):
            texts = [texts]
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        outs = self.generate(list(texts), params, use_tqdm, lora_request)
        res = []
        for text, o in zip(texts, outs):
            lps = [None] + [lp for lp, _ in o.prompt_logprobs[1:]]
            res.append(ScoreOutput(text, o.prompt_token_ids, lps))
        return res


def _prompt_value(p):
    """A text, a MultiModalPrompt, or token ids from any sequence of integers (list, tuple, numpy array)."""
    from jaxserve.engine.multimodal import MultiModalPrompt

    if isinstance(p, (str, MultiModalPrompt)):
        return p
    try:
        return [operator.index(t) for t in p]
    except TypeError:
        raise TypeError(f"a prompt is a string, a sequence of integer token ids or a dict; got "
                        f"{type(p).__name__}") from None
