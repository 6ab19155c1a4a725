#!/usr/bin/env bash
# The H200 benchmark: raw ONNX Runtime CUDA loop, then tokenwire serving on CUDA under tokenwire bench.
# Expects onnxruntime-gpu importable (PYTHONPATH) and the float16 model unpacked at $MODEL.
# usage: MODEL=/tmp/model OUT=/some/dir benchmarks/gpu/run_h200.sh
set -uo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
export PYTHONPATH="${PYTHONPATH:-}:$here/server:$here/client" PYTHONUNBUFFERED=1
MODEL=${MODEL:-/tmp/model}
DEVICE=${DEVICE:-cuda}
REQUESTS=${REQUESTS:-64}
LEVELS=${LEVELS:-1,8,16,64}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import onnxruntime as o; print(o.__version__, o.get_available_providers())"

if [ "$DEVICE" = cuda ]; then
  echo "== raw ONNX Runtime CUDA loop"
  timeout 150 python3 "$here/benchmarks/gpu/raw_cuda_loop.py" "$MODEL" --batch "$LEVELS" | tee "$OUT/raw_cuda.jsonl"
fi

echo "== tokenwire on CUDA"
python3 -m tokenwire.server.cli serve --model "$MODEL" --device "$DEVICE" --host 127.0.0.1 --port 50051 \
  --max-batch-size 64 --max-queue-size 256 --max-context-length 512 > "$OUT/server.log" 2>&1 &
server=$!
for _ in $(seq 120); do grep -q "serving on" "$OUT/server.log" && break; sleep 0.5; done
grep -E "KV cache|serving on|CUDA|provider" "$OUT/server.log"
timeout 300 python3 -m tokenwire.server.cli bench --server 127.0.0.1:50051 --concurrency "$LEVELS" \
  --prompt-tokens 100 --max-new-tokens 128 --requests "$REQUESTS" --warmup 4 --no-progress \
  --json "$OUT/tokenwire_cuda.json" | tee "$OUT/bench.txt"
kill -TERM $server; wait $server
echo "server exit: $?"
tail -5 "$OUT/server.log"
