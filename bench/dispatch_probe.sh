#!/bin/bash
# Where a small model's decode dispatch loses time on the GPU (session 26): XLA re-records a CUDA graph
# (command buffer) whenever a buffer it uses moved since its last run. Prints, for bs1 decode of the
# model given as throughput.py arguments ($@, e.g. --config qwen3-30b-a3b --num-layers 24):
#   1. tok/s at 8 and 32 decode steps per dispatch, async scheduling on and off;
#   2. XLA's own log of command-buffer updates (count, mean us, commands) during one generate.
# From the repo root on the device machine (bench/gpu_suite.sh installs the wheels).
set -u
export PYTHONPATH=$PWD
T="python3 bench/throughput.py --random-weights --runs 3 --workloads 1x128x256 $*"
echo "--- K=8,32 x async on,off"
timeout 200 $T --decode-steps 8,32 --async-scheduling on,off 2>&1 | grep "^| [0-9]"
echo "--- command-buffer updates (XLA VLOG 3: warm-up + one run): count x (commands, changed allocations), then times"
TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3 timeout 200 $T --runs 1 > /tmp/probe.log 2>&1
grep -o "num_commands=[0-9]*; updated_allocs=[0-9]*" /tmp/probe.log | sort | uniq -c | sort -rn | head -8
grep -o "Updated command buffer in [0-9]* " /tmp/probe.log | awk '{ n++; s += $5; if ($5 > m) m = $5 }
  END { printf "updates %d, mean %.0f us, max %d us\n", n, n ? s / n : 0, m }'
grep -c "Execute command buffer on device" /tmp/probe.log | sed 's/^/command-buffer executions: /'
