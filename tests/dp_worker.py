"""Run in a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=8 (set before JAX starts).

Usage: dp_worker.py MODEL_DIR TP DP -> one JSON line: greedy tokens, logprobs, top ids, prompt logprobs,
and how the work was spread over the replicas.
"""

import json
import sys

from jaxserve import LLM, SamplingParams

model_dir, tp, dp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = LLM(model_dir, tensor_parallel_size=tp, data_parallel_size=dp, max_model_len=96, max_num_seqs=2,
          prefill_chunk_size=16, block_size=4)
prompts = [[5 + i for i in range(40)], [200, 100, 50, 25, 12, 6, 3], [7] * 19]
p = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
outs = llm.generate(prompts, p)
again = llm.generate(prompts[0][:36] + [9, 9], p)[0]  # the shared prefix comes from the prefix cache
text = llm.generate("Hello world, this is", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
scores = llm.score([bytes(range(65, 91)).decode() * 2])
eng = llm.engine
replicas = getattr(eng, "replicas", [eng])
print(json.dumps({
    "tokens": [o.outputs[0].token_ids for o in outs],
    "logprobs": [[lp for lp, _ in o.outputs[0].logprobs] for o in outs],
    "top": [[[t for t, _ in top] for _, top in o.outputs[0].logprobs] for o in outs],
    "again": again.outputs[0].token_ids, "again_cached": again.num_cached_tokens,
    "score": scores[0].logprobs[1:],
    "text": text[0].outputs[0].text,
    "replica_devices": [sorted(d.id for d in e.runner.state["k"].sharding.device_set) for e in replicas],
    "replica_steps": [e.num_steps for e in replicas],
    "stats": {k: v for k, v in eng.stats().items() if k != "replicas"},
}))
