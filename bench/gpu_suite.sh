#!/bin/bash
# The standard H200 measurement set (bench/RESULTS.md "session 8"), for one device-tool call each:
#
#   bash bench/gpu_suite.sh PART [PART ...]     PART: startup bf16 bf16-32k bf16-256 int4 q4k q8_0 fp8
#                                               tests-fp8 startup-noat bf16-noat ksteps dp4a-split
#                                               per-sm-ab tests-attn attn-probe timeline split-sums-ab
#                                               fp8-mm fp8-e2e fp8-bk int4-ab per-sm-q
#                                               fp8-profile timeline-nographs fp8-warps
#                                               tests-bgemv bgemv-mm bgemv-ab bgemv-q4k seq32
#                                               tp2 tp2-70b (multi-GPU kinds only) xla-exh serve serve-1
#                                               pdl pdl-ab pdl-int4 l2 pdl-gen pdl-probe rope-norm-ab
#                                               moe moe-kernels fused-ab kv-fp8 moe-packed lora spec
#                                               kv-fp8-time moe-packed-tests kv-fp8-prof moe-engine mm-check
#                                               bf16-prof fp8-fold xla-int4 moe-engine-24
#                                               tests-s27 qk-norm moe-route
#                                               gemv-layout moe-gen-24 auto-width kmajor red-nk kmajor-all
#                                               kmajor-auto fp8-f16bits norm-xla-all bf16-1 bf16-32 gemv32
#
# On the device machine, from the repo root. It installs the wheels carried in bench/wheelhouse
# (build it here first, see below) and writes JSON rows under $OUT (default /tmp/out). Each part has
# its own timeout, so one slow part does not take the call's whole limit. Budget (one H200 machine):
# startup ~75 s, bf16 ~120 s, bf16-32k ~60 s, bf16-256 ~150 s, each quantized part ~60-110 s, tests-fp8 ~75 s.
#
# Wheelhouse (on the CPU machine; carry ["bench/wheelhouse"] with the call):
#   mkdir -p bench/wheelhouse && pip download -q --only-binary=:all: --python-version 3.12 \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     --platform any -d bench/wheelhouse tokenizers pydantic jinja2 aiohttp psutil tqdm safetensors \
#     pyyaml gguf pytest pytest-timeout pillow
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --find-links bench/wheelhouse tokenizers pydantic jinja2 aiohttp psutil \
  tqdm safetensors pyyaml gguf pytest pytest-timeout pillow 2>&1 | tail -2
export PYTHONPATH=$PWD
A="--random-weights --config llama-3.1-8b"
tp() {  # tp SECONDS ARGS...: bench/throughput.py under a timeout, per-run lines dropped
  timeout "$1" python3 bench/throughput.py $A --runs 5 --json "$OUT/throughput.jsonl" "${@:2}" 2>&1 | grep -v "^  run"
}
for part in "$@"; do
  echo "=== $part"
  case $part in
    startup) timeout 200 python3 bench/startup.py --model random:llama-3.1-8b --cache-dir "/tmp/jaxserve-suite-cache-$$" \
               --runs cold,warm --json "$OUT/startup.jsonl" 2>&1 | tail -4 ;;
    bf16) tp 200 --workloads 1x4096x256,1x128x256,32x1024x128 | tail -8 ;;
    bf16-32k) tp 100 --workloads 1x32768x256 | tail -3 ;;
    # Session 30: bs1 and 32 sequences from separate engines, so that each gets its own default layout
    # (kmajor auto: every dense weight [N, K] in the one-sequence engine, the small ones in the other)
    bf16-1) tp 200 --workloads 1x4096x256,1x128x256,1x2048x1 | tail -5 ;;
    bf16-32) tp 120 --workloads 32x1024x128 | tail -3 ;;
    # Session 31: the dense Pallas GEMV ('dot' mode) at 32 rows for q/k/v, o and down, its split-K partials
    # handed to the RoPE/norm kernels, against XLA's GEMMs. Measured (H100): ties on q/k/v and o, 1.9-4x slower
    # on down (bench/RESULTS.md session 31); the decode pair was not run
    gemv32) timeout 150 python3 bench/dense_gemv_gpu.py --M 32 --variant "" --variant "block_n=128,block_k=64" \
              --variant "block_n=64,block_k=128" --variant "block_n=128,block_k=128" \
              --variant "block_n=128,block_k=64,num_warps=8" --variant "block_n=64,block_k=64,max_splits=4" 2>&1 | tail -32
            timeout 240 python3 bench/decode.py --random-weights --config llama-3.1-8b --attention pallas_triton \
              --contexts 1024 --batch 32 --runs 3 --dense-gemv "auto;on:max_m=32" 2>&1 | tail -5 ;;
    bf16-256) tp 240 --workloads 256x1024x128 --runs 3 | tail -3 ;;  # issue 4: "256 concurrent: report"
    int4) tp 150 --workloads 1x128x512,32x1024x128 --quant int4 --int8-activations | tail -4 ;;
    q4k) tp 100 --workloads 1x128x512 --quant q4k --int8-activations | tail -3 ;;
    q8_0) tp 100 --workloads 1x128x512 --quant q8_0 --int8-activations | tail -3 ;;
    fp8) tp 150 --workloads 1x128x512,32x1024x128 --quant fp8 | tail -4 ;;
    # Mixture of experts (session 15, not yet measured): Qwen3-30B-A3B shape, bf16 (61 GB), grouped
    # matmuls (jax.lax.ragged_dot); bs1 reads ~3.3B active weights a token: roofline ~650 tok/s.
    moe) timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_moe.py -k routing 2>&1 | tail -2
         timeout 400 python3 bench/throughput.py --random-weights --config qwen3-30b-a3b --runs 3 \
           --workloads 1x128x256,32x1024x128 --json "$OUT/throughput.jsonl" 2>&1 | grep -v "^  run" | tail -4 ;;
    # The in-place MoE expert kernels (kernels/moe_gemv): the tests compiled on the GPU, then per layer
    # call at the Qwen3-30B-A3B shape against XLA's gathered-weights path (bs1 and 32 tokens); the engine
    # part needs an H200 (61 GB of bf16 weights: out of memory on an 80 GB H100, session 18)
    moe-kernels) XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 python3 -m pytest -q -p no:cacheprovider \
                   tests/test_moe_gemv.py 2>&1 | tail -15
                 timeout 300 python3 bench/moe_gpu.py 2>&1 | tail -40
                 timeout 400 python3 bench/throughput.py --random-weights --config qwen3-30b-a3b --runs 3 \
                   --workloads 1x128x256,32x1024x128 --moe-kernel-max-tile 16 --json "$OUT/throughput.jsonl" \
                   2>&1 | grep -v "^  run" | tail -4 ;;
    # Only the engine part of moe-kernels (session 21: the expert kernels against session 15's XLA-path
    # figures, bs1 80 and 32 sequences 609 tok/s on the H200); needs an H200 (61 GB of bf16 weights)
    # The same on an 80 GB card: the first 24 of the 48 layers (~31 GB), XLA's gathered-weights path (0)
    # against the expert kernels (16), a fresh process each (per-layer figures, not the whole model's)
    # Session 27: the new kernels compiled on the GPU; Qwen3's q/k norms inside the fused RoPE kernels
    # (off = XLA's norm, RoPE and scatter, the old path); the MoE routing kernel, A/B with a kernel table
    tests-s27) XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python3 -m pytest -q -p no:cacheprovider \
                 tests/test_moe_route.py tests/test_rope_kv.py tests/test_rope_attention.py -k "not engine" 2>&1 | tail -3 ;;
    qk-norm) timeout 200 python3 bench/decode.py --random-weights --config qwen3-8b --attention pallas_triton \
               --contexts 128,4096 --runs 3 --fused-rope-kv off,auto --json "$OUT/decode.jsonl" 2>&1 | tail -6 ;;
    moe-route) timeout 240 python3 bench/decode.py --random-weights --config qwen3-30b-a3b --num-layers 24 \
                 --attention pallas_triton --contexts 128 --runs 3 --moe-route off,on --profile 1 \
                 --json "$OUT/decode.jsonl" 2>&1 | grep -v "^  run" | grep -v "^| .* | 0.0[01]. |$" | tail -80 ;;
    # Session 28: one-row GEMVs by weight layout ([K, N] as held today vs the checkpoint's [N, K]), XLA's
    # and Pallas's; the MoE-24 model through generate with the session-27 defaults (routing kernel, dense GEMV)
    gemv-layout) timeout 360 python3 bench/gemv_layout.py --shapes qkv,o,down,gate_up,1b_o,1b_down 2>&1 | tail -130 ;;
    moe-gen-24) timeout 240 python3 bench/throughput.py --random-weights --config qwen3-30b-a3b --num-layers 24 \
                  --runs 3 --workloads 1x128x256,32x1024x128 --json "$OUT/throughput.jsonl" 2>&1 | grep -v "^  run" | tail -4 ;;
    # The dense GEMV auto rule with a wider column limit (AUTO_MAX_N 2,048 today): Llama-1B's q/k/v (3,072)
    # and gate/up (16,384)
    auto-width) timeout 150 python3 bench/decode.py --random-weights --config llama-3.2-1b --attention pallas_triton \
                  --contexts 128 --runs 3 --dense-gemv "auto;on:max_n=3072;on:max_n=16384" \
                  --json "$OUT/decode.jsonl" 2>&1 | tail -5 ;;
    # Session 28: the small matmul weights held [N, K] (models/kmajor; off = the session-27 default, the
    # Pallas GEMV for <= 2,048 columns): per matmul at 1 and 32 rows, then bs1 / 32 rows / prefill end to end
    kmajor) XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 100 python3 -m pytest -q -p no:cacheprovider \
              tests/test_kmajor.py -k "not engine" 2>&1 | tail -2
            timeout 120 python3 bench/gemv_layout.py --shapes 1b_qkv,1b_o,moe_o,moe_router,smol_o,smol_gate_up \
              --M 1,32 --variant xla_kn --variant xla_nk --variant pallas_kn 2>&1 | grep -v FAILED | tail -40
            for c in llama-3.2-1b smollm2-135m; do
              timeout 80 python3 bench/decode.py --random-weights --config $c --attention pallas_triton \
                --contexts 128 --runs 3 --kmajor off,on --json "$OUT/decode.jsonl" 2>&1 | tail -2
            done
            timeout 90 python3 bench/decode.py --random-weights --config llama-3.2-1b --attention pallas_triton \
              --batch 32 --contexts 1024 --runs 2 --kmajor off,on --json "$OUT/decode.jsonl" 2>&1 | tail -2
            timeout 150 python3 bench/decode.py --random-weights --config qwen3-30b-a3b --num-layers 24 \
              --attention pallas_triton --contexts 128 --runs 3 --kmajor off,on --json "$OUT/decode.jsonl" 2>&1 | tail -2
            for k in off on; do
              timeout 75 python3 bench/throughput.py --random-weights --config llama-3.2-1b --runs 3 \
                --workloads 1x2048x1,1x128x256 --kmajor-weights $k --json "$OUT/throughput.jsonl" 2>&1 | tail -2
            done ;;
    # The 8B's one-row matmuls written as XLA's row reduction over [N, K] (what it does below 10M elements)
    red-nk) timeout 150 python3 bench/gemv_layout.py --shapes qkv,o,down,gate_up,lm_head --M 1,2 \
              --variant xla_kn --variant xla_nk --variant red_nk 2>&1 | tail -32 ;;
    # --kmajor-weights all on the 8B (every weight [N, K], one-row matmuls as XLA's row reduction; session
    # 28 measured it per matmul only): the serial runner at 128 / 4k, then through generate (bs1 at 4k,
    # 32 sequences, prefill) against the default
    kmajor-all) timeout 240 python3 bench/decode.py --random-weights --config llama-3.1-8b --attention pallas_triton \
                  --contexts 128,4096 --runs 3 --kmajor on,all --json "$OUT/decode.jsonl" 2>&1 | tail -5
                for k in auto all; do
                  tp 200 --workloads 1x4096x256,32x1024x128,1x2048x1 --runs 3 --kmajor-weights $k | tail -4
                done ;;
    # Session 29 (prepared): the FP8 decode GEMV with its codes decoded by integer ops into f16 (one
    # conversion per weight instead of 1.5; the tensor-core kernel's tiles with none): GPU tests, per matmul at
    # 1 and 32 rows, then the serial runner at bs1 and 32 sequences (~300 s)
    fp8-f16bits) XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 100 python3 -m pytest -q -p no:cacheprovider \
                   tests/test_quant_matmul.py -k "fp8_gemv or f16bits" 2>&1 | tail -2
                 timeout 150 python3 bench/fp8_gpu.py --M 1,32 --only "engine,f16bits" 2>&1 | tail -30
                 timeout 150 python3 bench/decode.py $A --attention pallas_triton --quant fp8 --contexts 128 --runs 3 \
                   --fp8-kernel "gemv_decode=cvt;gemv_decode=f16bits" --json "$OUT/decode.jsonl" 2>&1 | tail -4
                 timeout 150 python3 bench/decode.py $A --attention pallas_triton --quant fp8 --contexts 1024 --batch 32 \
                   --runs 3 --fp8-kernel "decode=cvt;decode=f16bits" --json "$OUT/decode.jsonl" 2>&1 | tail -4 ;;
    # Session 29 (prepared): with every weight [N, K] the one-row matmuls are XLA row reductions, into whose
    # input fusion XLA may pull the norm's elementwise part when the norm is jnp (launched with PDL too)
    norm-xla-all) for n in default reference default reference; do
                    timeout 100 python3 bench/decode.py $A --attention pallas_triton --contexts 4096 --runs 3 \
                      --kmajor all --norm-impl $n --json "$OUT/decode.jsonl" 2>&1 | grep "tok/s (min"
                  done ;;
    # Session 29: a one-sequence engine's default (auto) holds every dense weight [N, K] (= all); against on
    kmajor-auto) for k in on auto; do
                   tp 200 --workloads 1x4096x256,1x2048x1 --runs 3 --kmajor-weights $k | tail -3
                 done ;;
    moe-engine-24) for t in 0 16; do
                     timeout 280 python3 bench/throughput.py --random-weights --config qwen3-30b-a3b --num-layers 24 \
                       --runs 3 --workloads 1x128x256,32x1024x128 --moe-kernel-max-tile $t \
                       --json "$OUT/throughput.jsonl" 2>&1 | grep -v "^  run" | tail -4
                   done ;;
    moe-engine) timeout 420 python3 bench/throughput.py --random-weights --config qwen3-30b-a3b --runs 3 \
                  --workloads 1x128x256,32x1024x128 --moe-kernel-max-tile 16 --json "$OUT/throughput.jsonl" \
                  2>&1 | grep -v "^  run" | tail -4 ;;
    # Packed (quantized) MoE experts (session 17; measured on an H100 in session 18): the grouped quantized
    # matmul's tests compiled on the GPU, per layer call at Qwen3-30B-A3B's shape (q4k, q8_0) against XLA's
    # gather + dequantize, then the engine (q4k experts and attention, random codes) on XLA's path and on
    # the kernel (~150-190 s each on an H100)
    moe-packed-tests) XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 120 python3 -m pytest -q -p no:cacheprovider \
                        tests/test_moe_quant.py -k "grouped or kernel_path" 2>&1 | tail -8 ;;
    moe-packed) XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 python3 -m pytest -q -p no:cacheprovider \
                  tests/test_moe_quant.py -k "grouped or kernel_path" 2>&1 | tail -8
                timeout 200 python3 bench/moe_gpu.py --quant q4k 2>&1 | tail -12
                timeout 150 python3 bench/moe_gpu.py --quant q8_0 --tokens 1 2>&1 | tail -6
                for t in 0 16; do
                  timeout 300 python3 bench/throughput.py --random-weights --config qwen3-30b-a3b --quant q4k \
                    --runs 3 --workloads 1x128x256,32x1024x128 --moe-packed-kernel-max-tile $t \
                    --json "$OUT/throughput.jsonl" 2>&1 | grep -v "^  run" | tail -3
                done ;;
    # What XLA's GEMM autotuning costs at start-up and buys at run time (measured: RESULTS.md session 9)
    startup-noat) XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" timeout 200 python3 bench/startup.py \
               --model random:llama-3.1-8b --cache-dir "/tmp/jaxserve-suite-cache-noat-$$" --runs cold \
               --json "$OUT/startup.jsonl" 2>&1 | tail -3 ;;
    bf16-noat) XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" tp 200 \
               --workloads 1x2048x1,1x4096x256,32x1024x128 | tail -5 ;;
    # Decode steps per dispatch (session 10): the server's default is 4, the figures above use 8.
    ksteps) tp 300 --workloads 1x4096x256,1x128x256,32x1024x128 --decode-steps 4,8,16 | tail -11
            tp 150 --workloads 1x128x512 --quant int4 --int8-activations --decode-steps 4,8,16 | tail -5 ;;
    # Fewer K splits for the int8 kernel (fewer partials for the norm kernels to add; session 10),
    # then where an int4 step goes now (per-kernel table).
    dp4a-split) for s in 4 6 8; do timeout 100 python3 bench/decode.py $A --attention pallas_triton --contexts 0 \
                  --runs 5 --quant int4,q8_0 --int8-activations --dp4a-per-sm $s 2>&1 | tail -2; done
                timeout 100 python3 bench/decode.py $A --attention pallas_triton --contexts 0 --runs 1 --quant int4 \
                  --int8-activations --profile 1 2>&1 | tail -40 ;;
    # The same through LLM.generate, interleaved on one machine (session 10)
    per-sm-ab) for q in int4 q8_0; do tp 200 --workloads 1x128x512 --quant $q --int8-activations \
                 --dp4a-per-sm 4,8,4,8 | tail -6; done ;;
    # The multimodal models (Qwen2-VL, Qwen2.5-VL, Gemma 3 with images) with the GPU's kernels against their CPU
    # runs (bench/mm_gpu_check.py --write bench/mm_fixture on the CPU first; carry bench/mm_fixture)
    mm-check) timeout 500 python3 bench/mm_gpu_check.py --check bench/mm_fixture 2>&1 | grep -E "^(qwen|gemma|device)" ;;
    tests-attn) XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 python3 -m pytest -q tests/test_paged_attention.py \
                  tests/test_rms_norm.py tests/test_rope_kv.py tests/test_rope_attention.py \
                  -k "not generates_the_same" 2>&1 | tail -3 ;;
    # RoPE + K/V write + decode attention in one kernel (kernels/rope_attention, session 16) against the
    # two kernels it replaces, interleaved, same weights; greedy-token digests printed per engine
    # An fp8 (e4m3) K/V cache for the bf16 model (session 16): half the K/V bytes read per step
    kv-fp8) timeout 240 python3 bench/kernels_gpu.py --only check 2>&1 | grep -E "fp8|fused|FAIL|ERROR" | head -30
            tp 300 --workloads 1x4096x256,1x32768x256,32x1024x128 --runs 3 --kv-dtype fp8 | tail -5 ;;
    # bf16 vs fp8 caches per kernel call, then through generate with the two decode-attention paths
    # (session 19, H100: the kernel gains 20-25%, generate about none; the f16 widening measured slower)
    kv-fp8-time) timeout 150 python3 bench/kernels_gpu.py --only fp8-time --reps 5 2>&1 | grep -E "us/layer|ERROR"
                 tp 150 --workloads 1x32768x256,32x1024x128 --runs 3 | tail -3
                 tp 260 --workloads 1x32768x256,32x1024x128 --runs 3 --kv-dtype fp8 \
                   --fused-decode-attention on,off | tail -6 ;;
    # Where the fp8 cache's kernel gain goes (session 20): the serial runner's decode program at bs1 32k
    # and 32 x 1,024 with per-kernel device tables, bf16 cache against fp8 (each path's default kernels)
    kv-fp8-prof) for kv in bfloat16 fp8; do
                   timeout 170 python3 bench/decode.py $A --attention pallas_triton --contexts 32768 --runs 3 \
                     --profile 1 --kv-dtype $kv --json "$OUT/decode.jsonl" 2>&1 | grep -v "^#" | tail -28
                   timeout 150 python3 bench/decode.py $A --attention pallas_triton --contexts 1024 --batch 32 \
                     --runs 3 --profile 1 --kv-dtype $kv --json "$OUT/decode.jsonl" 2>&1 | grep -v "^#" | tail -28
                 done ;;
    # Multi-LoRA (not yet run on a GPU): 4 random adapters of rank 16 on every projection against none
    # (prompts cycle over the adapters and the base model; bs1 runs adapter a0)
    # Speculative decoding by prompt lookup (session 18, not yet run on a GPU): the random model's greedy
    # output loops, so most drafts are accepted; compare with the bf16 part's figures (no drafts)
    spec) tp 250 --workloads 1x128x256,32x1024x128 --runs 3 --speculative 4 | tail -4 ;;
    lora) tp 280 --workloads 1x4096x256,32x1024x128 --runs 3 | tail -3
          tp 280 --workloads 1x4096x256,32x1024x128 --runs 3 --lora 4:16 | tail -3 ;;
    fused-ab) tp 300 --workloads 1x4096x256,32x1024x128 --runs 3 --fused-decode-attention on,off,on,off \
                --tokens-digest | tail -14
              tp 200 --workloads 1x128x512 --quant int4 --int8-activations --runs 3 --tokens-digest \
                --fused-decode-attention on,off,on,off | tail -10 ;;
    # Can XLA's GEMM stream uint4 weights (bench/xla_int4_gpu.py, session 24): the raw uint4 GEMV and an
    # exact grouped int4 formulation (scales and zeros behind a dot batched over K/128 groups)
    xla-int4) timeout 150 python3 bench/xla_int4_gpu.py --M 1,4 2>&1 ;;
    # FP8 decode through XLA's GEMM with the 128x128 block scales folded into x (bench/xla_fp8_fold.py,
    # session 24; measured slower than the Pallas kernels in session 25, not in the engine): per matmul
    fp8-fold) timeout 220 python3 bench/fp8_gpu.py --M 1,32 --only "xla bf16,engine,xla fold" --kernels 2>&1 ;;
    # Where a bf16 bs1 step goes at 4k context now (session 24: the fused RoPE + decode attention kernel
    # is the default since session 16; session 6's table predates it)
    bf16-prof) timeout 150 python3 bench/decode.py $A --attention pallas_triton --contexts 4096 --runs 3 \
                 --profile 1 --json "$OUT/decode.jsonl" 2>&1 | grep -v "^#" | tail -30 ;;
    # Where a bf16 step goes at 32 sequences (ctx 1024) and at bs1 32k, and decode-attention tuning
    # there (session 10: data for the 6,000 and 200 tok/s goals)
    attn-probe) D="timeout 110 python3 bench/decode.py $A --attention"
                $D pallas_triton --contexts 1024 --batch 32 --runs 1 --profile 1 2>&1 | grep -A18 "^| name"
                $D "pallas_triton,pallas_triton:num_splits=4,pallas_triton:num_splits=8,pallas_triton:num_stages=3,pallas_triton:block_k=128" \
                  --contexts 1024 --batch 32 --runs 3 2>&1 | tail -5
                $D pallas_triton --contexts 32768 --runs 1 --profile 1 2>&1 | grep -A14 "^| name"
                $D "pallas_triton,pallas_triton:block_k=128,pallas_triton:num_stages=3,pallas_triton:num_warps=8" \
                  --contexts 32768 --runs 3 2>&1 | tail -4 ;;
    # Prepared (session 10, not run yet): does the device wait for the host inside LLM.generate at 32
    # sequences (generate 5,258 tok/s vs the same program back to back 5,678)? Per program: device time
    # and the idle gap before each run.
    timeline) timeout 150 python3 bench/throughput.py $A --runs 2 --workloads 32x1024x128 --timeline \
                2>&1 | grep -v "^  run" | grep -A10 "device timeline" ;;
    # Prepared (session 11, not run yet): the same timeline with the decode loop outside CUDA graphs
    # (are the >10 ms "idle" gaps the graphs' own untraced kernels?), and fewer warps per FP8 GEMV
    # program (more programs per SM for the small o/qkv matmuls).
    timeline-nographs) JAXSERVE_XLA_DEFAULTS=0 timeout 150 python3 bench/throughput.py $A --runs 2 \
                  --workloads 32x1024x128 --timeline 2>&1 | grep -v "^  run" | grep -A10 "device timeline" ;;
    fp8-warps) timeout 150 python3 bench/fp8_gpu.py --M 1 --variant gemv_num_warps=2 \
                 --variant gemv_num_warps=2,gemv_per_sm=16 --variant gemv_num_warps=1,gemv_per_sm=16 2>&1 \
                 | grep "^|" | grep -v "xla bf16\|q0\|per-column" ;;
    # Where an FP8 bs1 step goes with the CUDA-core GEMV (session 11)
    fp8-profile) timeout 110 python3 bench/decode.py $A --attention pallas_triton --contexts 0 --runs 1 --quant fp8 \
                   --profile 1 2>&1 | grep -A30 "^| name" ;;
    # Prepared (session 10, not run yet): do the int8 kernel's split-K partials into the norm/RoPE
    # kernels still pay with the loop in CUDA graphs (the norm after down takes 3.85 us with 7
    # partials vs 2.3 us without; XLA's reduction was ~1.2-1.4 us)? Interleaved A/B through generate.
    split-sums-ab) for q in int4 q8_0; do tp 200 --workloads 1x128x512 --quant $q --int8-activations \
                     --dp4a-split-sums on,off,on,off | tail -6; done ;;
    # FP8 decode rows on the CUDA cores (pallas_fp8.gemv, session 11): per matmul against the tensor-core
    # kernel and its tuning, then end to end (gemv_max_m=0: the tensor-core kernel) and its split counts
    fp8-mm) timeout 220 python3 bench/fp8_gpu.py --M 1 2>&1 | grep "^|"
            timeout 120 python3 bench/fp8_gpu.py --shapes o,gate_up --M 2,4 --variant gemv_max_m=4 2>&1 | grep "^|" ;;
    fp8-e2e) timeout 300 python3 bench/decode.py $A --attention pallas_triton --contexts 0 --runs 3 --quant fp8 \
               --fp8-kernel "gemv_max_m=0;;gemv_per_sm=4;gemv_per_sm=2;gemv_num_warps=8;gemv_max_splits=4" 2>&1 | tail -7 ;;
    fp8-bk) timeout 150 python3 bench/fp8_gpu.py --M 1 --variant gemv_block_k=256 --variant gemv_block_k=512 \
              --variant gemv_block_k=256,gemv_num_warps=8 --variant gemv_block_k=256,gemv_block_n=16 2>&1 \
              | grep "^|" | grep -v "xla bf16\|q0\|per-column"
            timeout 200 python3 bench/decode.py $A --attention pallas_triton --contexts 0 --runs 3 --quant fp8 \
              --fp8-kernel ";gemv_block_k=256;gemv_block_k=512;" 2>&1 | tail -4 ;;
    # per-sm-ab and split-sums-ab for int4 only (one call's time); per_sm for q8_0 and q4k
    per-sm-q) for q in q8_0 q4k; do tp 200 --workloads 1x128x512 --quant $q --int8-activations \
                --dp4a-per-sm 4,8,4,8 | tail -6; done ;;
    int4-ab) tp 200 --workloads 1x128x512 --quant int4 --int8-activations --dp4a-per-sm 4,8,4,8 | tail -6
             tp 200 --workloads 1x128x512 --quant int4 --int8-activations --dp4a-split-sums on,off,on,off | tail -6 ;;
    tests-fp8) XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python3 -m pytest -q -x tests/test_fp8_engine.py \
                 tests/test_quant_matmul.py -k fp8 2>&1 | tail -2 ;;
    # One-row matmuls of byte-coded weights (q8_0, q6k) on the CUDA cores (pallas_byte_gemv, session 12):
    # GPU tests, per matmul against the int8 kernel with its tuning, then through generate, interleaved
    tests-bgemv) XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python3 -m pytest -q -x \
                   tests/test_quant_matmul.py -k "byte_gemv or dp4a" 2>&1 | tail -2 ;;
    bgemv-mm) timeout 200 python3 bench/byte_gemv_gpu.py --formats q8_0 --shapes o,gate_up 2>&1 | grep "^|"
              timeout 120 python3 bench/byte_gemv_gpu.py --formats q8_0,q6k --shapes qkv,down,head \
                --variant group_dot=1 --variant num_warps=8 2>&1 | grep "^|" | grep -v "format\|---" ;;
    bgemv-ab) tp 250 --workloads 1x128x512 --quant q8_0 --int8-activations --byte-gemv on,off,on,off | tail -6 ;;
    bgemv-q4k) tp 150 --workloads 1x128x512 --quant q4k --int8-activations --byte-gemv on,off | tail -4 ;;
    # 32 sequences after the scheduler change of session 12 (a sequence ending by length no longer cuts
    # the multi-step decode short or stops the step ahead): bf16, int4, FP8 (before: 5,255-5,275 / 4,642 / 4,924)
    seq32) tp 120 --workloads 32x1024x128 | tail -2
           tp 150 --workloads 32x1024x128 --quant int4 --int8-activations | tail -2
           tp 150 --workloads 32x1024x128 --quant fp8 | tail -2 ;;
    # Issue 7 (needs nvidia-h200-x2 or larger; never lent so far): tp=1 vs tp=2 on the 8B shape (greedy
    # tokens compared on 4 fixed prompts, bs1 and 32 sequences at each tp), then the 70B shape at tp=2.
    # On x4/x8 add 4 (and 8) to the lists.
    tp2) tp 500 --workloads 1x128x256,32x1024x128 --tp 1,2 --runs 3 | tail -6 ;;
    tp2-70b) timeout 500 python3 bench/throughput.py --random-weights --config llama-3.1-70b --tp 2 --runs 3 \
               --workloads 1x128x128,32x1024x128 --json "$OUT/throughput.jsonl" 2>&1 | grep -v "^  run" | tail -5 ;;
    # XLA's exhaustive GEMM tiling search for the bf16 decode GEMVs (qkv/o move 3.3-3.4 TB/s against
    # gate/up's 4.3; session 12): the serial runner at bs1, without and with the flag
    xla-exh) D="python3 bench/decode.py $A --attention pallas_triton --runs 3 --contexts 0,4096"
             timeout 120 $D 2>&1 | tail -3
             XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_exhaustive_tiling_search=true" timeout 420 $D 2>&1 | grep -v "^#" | tail -4 ;;
    # The server under load (issue 3's client, session 12): `jaxserve run --model random:llama-3.1-8b`
    # started by the script, streaming /v1/completions, 128 in / 64 out, sampling at temperature 1
    serve) timeout 420 python3 bench/serve.py --random-weights --config llama-3.1-8b --concurrency 1,32,256 \
             --server-args "--max-num-seqs 256" --json "$OUT/serve.json" 2>&1 | grep -v "^  " | tail -6 ;;
    # One stream through the server: sampling (temperature 1) against greedy, one server (session 12:
    # TPOT 4.5 ms at 1 stream vs ~4.2 ms a token through LLM.generate)
    serve-1) (python3 -m jaxserve.cli run --model random:llama-3.1-8b --port 2011 > "$OUT/serve1.log" 2>&1 &)
             for i in $(seq 1 150); do curl -sf localhost:2011/health > /dev/null && break; sleep 1; done
             for t in 1 0 1 0; do timeout 120 python3 bench/serve.py --url http://127.0.0.1:2011 --concurrency 1 \
               --num-requests 8 --output-len 256 --temperature $t 2>&1 | grep "^N=" | sed "s/^/temp $t: /"; done
             pkill -f "jaxserve.cli run --model random:llama-3.1-8b --port 2011" ;;
    # Session 13: is programmatic dependent launch (XLA's --xla_gpu_enable_pdl) on in jax 0.11.2, can
    # Pallas calls take it, and what does it change at bs1; then: is a GEMV faster from a warm L2?
    pdl) J=$(python3 -c "import jax, os; print(os.path.dirname(jax.__file__))")
         echo "jax files naming pdl: $(grep -rlE "uses_pdl|enable_pdl|griddepcontrol" "$J" --include=*.py | sed "s|$J/||" | tr '\n' ' ')"
         grep -rnE "uses_pdl|use_pdl" "$J" --include=*.py | head -8
         for v in "" "--xla_gpu_enable_pdl=true" "--xla_gpu_enable_pdl=false"; do d=$(mktemp -d)
           XLA_FLAGS="$v --xla_dump_to=$d" python3 -c "
import jax, jax.numpy as jnp
f = jax.jit(lambda x, w: (jax.nn.silu(x @ w) * 2.0) @ w.T)
x = jnp.ones((1, 4096), jnp.bfloat16); w = jnp.ones((4096, 4096), jnp.bfloat16)
f(x, w).block_until_ready()" 2>&1 | tail -2
           echo "flag '$v': $(cat $d/*.ptx 2>/dev/null | grep -c griddepcontrol) griddepcontrol lines in $(ls $d/*.ptx 2>/dev/null | wc -l) ptx files"
         done ;;
    pdl-ab) for v in true false true false; do echo "pdl $v:"; XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_pdl=$v" \
              timeout 110 python3 bench/decode.py $A --attention pallas_triton --contexts 0,4096 --runs 3 2>&1 | tail -2; done ;;
    pdl-int4) for v in true false; do echo "pdl $v:"; XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_pdl=$v" \
              timeout 110 python3 bench/decode.py $A --attention pallas_triton --contexts 0 --runs 3 --quant int4 \
              --int8-activations 2>&1 | tail -1; done ;;
    pdl-gen) B="${XLA_FLAGS:-}"
             (for v in true false true false; do export XLA_FLAGS="$B --xla_gpu_enable_pdl=$v"; echo "pdl $v:"
               tp 150 --workloads 1x128x512 --quant int4 --int8-activations --runs 3 --tokens-digest | grep -E "digest|: prefill"
             done)
             (for v in true false; do export XLA_FLAGS="$B --xla_gpu_enable_pdl=$v"; echo "pdl $v:"
               tp 150 --workloads 1x4096x256 --runs 3 --tokens-digest | grep -E "digest|: prefill"; done) ;;
    # Session 13: one small kernel in a dependent chain, by launch kind (Pallas Triton, Mosaic GPU with
    # and without griddepcontrol.wait, XLA), with XLA's PDL on (default) and off
    pdl-probe) timeout 150 python3 bench/pdl_probe.py 2>&1 | tail -8
               XLA_FLAGS="--xla_gpu_enable_pdl=false" timeout 150 python3 bench/pdl_probe.py 2>&1 | tail -6 ;;
    # Session 13: with XLA's kernels launched early (PDL), are XLA fusions now cheaper than the Pallas
    # RoPE + K/V write and add+RMSNorm kernels? (bench/decode.py, serial runner and device only)
    rope-norm-ab) D="timeout 110 python3 bench/decode.py $A --attention pallas_triton --contexts 0,4096 --runs 3"
                  for r in on off on off; do echo "rope_kv $r:"; $D --fused-rope-kv $r 2>&1 | tail -2; done
                  for n in default reference; do echo "norm $n:"; $D --norm-impl $n 2>&1 | tail -2; done ;;
    l2) timeout 120 python3 bench/l2_probe.py 2>&1 | tail -26 ;;
    *) echo "unknown part $part (see the header)"; exit 2 ;;
  esac
done
