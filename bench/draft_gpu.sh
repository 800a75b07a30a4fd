nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-index --find-links bench/wheelhouse tokenizers pydantic jinja2 aiohttp psutil tqdm safetensors pyyaml gguf 2>&1 | tail -1
export PYTHONPATH=$PWD
T="python3 bench/throughput.py --random-weights --config llama-3.1-8b --runs 3 --tokens-digest"
echo "=== plain"; timeout 130 $T --workloads 1x128x256,32x1024x128 2>&1 | grep -v "^  run" | grep -v "^#.*built\|KV cache" | tail -6
echo "=== self draft"; timeout 140 $T --workloads 1x128x256,32x1024x128 --speculative 4 --draft random:llama-3.1-8b 2>&1 | grep -v "^  run" | tail -7
echo "=== 1b draft"; timeout 130 $T --workloads 1x128x256,32x1024x128 --speculative 4 --draft random:llama-3.2-1b 2>&1 | grep -v "^  run" | tail -7
