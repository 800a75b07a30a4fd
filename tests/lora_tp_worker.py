"""Run in a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=2: multi-LoRA at tp=2
(tests/test_multi_lora.py::test_tensor_parallel). argv: base dir, adapter x dir, adapter y dir, engine
keywords (JSON), prompt. Prints one JSON line: the adapter stacks' shardings and greedy tokens/logprobs
per adapter choice."""

import json
import sys

from jaxserve import LLM, LoRARequest, SamplingParams

base, x, y, kw, prompt = sys.argv[1:6]
kw = {k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(kw).items()}
llm = LLM(base, lora_modules={"x": x}, max_loras=2, max_lora_rank=8, tensor_parallel_size=2, **kw)
layers = llm.engine.runner.weights["layers"]
lora = (layers[0] if isinstance(layers, list) else layers)["lora"]
specs = {f"{t}.{k}": [str(a) for a in lora[t][k].sharding.spec] for t in lora for k in ("a", "b")}
llm.add_lora(LoRARequest("y", 2, y))  # into the spare slot, sharded
sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
out = {}
for label, lr in (("x", "x"), ("y", "y"), ("base", None), ("xy", {"x": 1, "y": 1})):
    o = llm.generate(prompt, sp, lora_request=lr)[0].outputs[0]
    out[label] = [o.token_ids, [lp for lp, _ in o.logprobs]]
print(json.dumps({"devices": len(llm.engine.runner.mesh.devices.flat), "specs": specs, "out": out}))
