"""Run in a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=8 (set before JAX starts).

Usage: tp_worker.py MODEL_DIR TP  -> prints one JSON line: greedy tokens, top logprobs, prompt logprobs.
"""

import json
import sys

from jaxserve import LLM, SamplingParams

model_dir, tp = sys.argv[1], int(sys.argv[2])
llm = LLM(model_dir, tensor_parallel_size=tp, max_model_len=128, max_num_seqs=4, prefill_chunk_size=32,
          block_size=4)
prompts = [[5 + i for i in range(40)], [200, 100, 50, 25, 12, 6, 3], [7] * 19]
p = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
outs = llm.generate(prompts, p)
# Again: the shared prefix is served from the prefix cache this time.
again = llm.generate(prompts[0][:36] + [9, 9], p)[0]
scores = llm.score([bytes(range(65, 91)).decode() * 2])
print(json.dumps({
    "tokens": [o.outputs[0].token_ids for o in outs],
    "logprobs": [[lp for lp, _ in o.outputs[0].logprobs] for o in outs],
    "top": [[[t for t, _ in top] for _, top in o.outputs[0].logprobs] for o in outs],
    "again": again.outputs[0].token_ids, "again_cached": again.num_cached_tokens,
    "score": scores[0].logprobs[1:],
    "devices": len(llm.engine.runner.state["k"].sharding.device_set),
}))
