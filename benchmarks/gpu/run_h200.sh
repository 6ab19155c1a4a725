#!/usr/bin/env bash
# The H200 run: the raw ONNX Runtime CUDA loop, the engine's features on the device KV cache
# (features.py), then tokenwire serving on CUDA under tokenwire bench.
# Expects onnxruntime-gpu importable (PYTHONPATH) and the float16 model unpacked at $MODEL.
# usage: MODEL=/tmp/model OUT=/some/dir benchmarks/gpu/run_h200.sh
set -uo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
export PYTHONPATH="${PYTHONPATH:-}:$here/server:$here/client" PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python3}
MODEL=${MODEL:-/tmp/model}
DEVICE=${DEVICE:-cuda}
LEVELS=${LEVELS:-1,8,16,64}
DURATION=${DURATION:-8}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
[ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
"$PYTHON" -c "import onnxruntime as o; print(o.__version__, o.get_available_providers())"

if [ "$DEVICE" = cuda ]; then
  echo "== raw ONNX Runtime CUDA loop"
  timeout 120 "$PYTHON" "$here/benchmarks/gpu/raw_cuda_loop.py" "$MODEL" --batch "$LEVELS" | tee "$OUT/raw_cuda.jsonl"
fi

echo "== features on --device $DEVICE"
timeout 180 "$PYTHON" "$here/benchmarks/gpu/features.py" "$MODEL" --device "$DEVICE" --json "$OUT/features.json" \
  > "$OUT/features.log" 2>&1
echo "features exit: $?"; tail -c 3000 "$OUT/features.log"

echo "== tokenwire on --device $DEVICE"
"$PYTHON" -m tokenwire.server.cli serve --model "$MODEL" --device "$DEVICE" --host 127.0.0.1 --port 50051 \
  --max-batch-size 64 --max-queue-size 256 --max-context-length 512 > "$OUT/server.log" 2>&1 &
server=$!
for _ in $(seq 240); do grep -q "serving on" "$OUT/server.log" && break; sleep 0.5; done
grep -E "KV cache|serving on|CUDA|provider" "$OUT/server.log"
timeout 240 "$PYTHON" -m tokenwire.server.cli bench --server 127.0.0.1:50051 --concurrency "$LEVELS" \
  --prompt-tokens 100 --max-new-tokens 128 --duration "$DURATION" --warmup 4 --no-progress \
  --json "$OUT/tokenwire_bench.json" | tee "$OUT/bench.txt"
kill -TERM $server; wait $server
echo "server exit: $?"
tail -5 "$OUT/server.log"
