"""One rank of a two-process CPU cluster on 127.0.0.1 (jax.distributed, gloo collectives).

Usage: mh_worker.py MODEL_DIR MODE RANK PORT
  MODE single: one process, one device (the reference); prints one JSON line.
  MODE gen:    tp=2 over both processes; rank 0 prints one JSON line, rank 1 prints FOLLOWER-DONE.
  MODE hold:   like gen, but rank 0 prints READY and keeps generating until something kills it.
"""

import json
import sys

from jaxserve import LLM, SamplingParams

TEXT = "Hello world, this is"  # also sent over HTTP by test_multihost
model_dir, mode, rank, port = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
kw = dict(max_model_len=64, max_num_seqs=2, prefill_chunk_size=16, block_size=4)
if mode == "single":
    llm = LLM(model_dir, **kw)
else:
    llm = LLM(model_dir, tensor_parallel_size=2, num_nodes=2, node_rank=rank, master_addr="127.0.0.1",
              master_port=port, **kw)
if llm.is_follower:
    print("FOLLOWER-DONE", flush=True)
    sys.exit(0)
prompts = [[5 + i for i in range(21)], [200, 100, 50, 25, 12, 6, 3]]
p = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
if mode == "hold":
    print("READY", flush=True)
    while True:
        llm.generate(prompts, p)
outs = llm.generate(prompts, p)
text = llm.generate(TEXT, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].outputs[0].text
# a penalized request whose prompt is cached (by the first generate): its row is seeded on every rank
pen = llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, repetition_penalty=3.0,
                                               frequency_penalty=1.0))[0]
print(json.dumps({
    "text": text,
    "pen": pen.outputs[0].token_ids,
    "pen_cached": pen.num_cached_tokens,
    "tokens": [o.outputs[0].token_ids for o in outs],
    "logprobs": [[lp for lp, _ in o.outputs[0].logprobs] for o in outs],
    "devices": len(llm.engine.runner.state["k"].sharding.device_set),
}), flush=True)
