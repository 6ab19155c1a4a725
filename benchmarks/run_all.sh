#!/usr/bin/env bash
# Every CPU benchmark of BENCHMARKS.md, one after the other, each printing its markdown tables.
# GenAI and llama.cpp comparisons need their own venvs (see BENCHMARKS.md); without them those
# parts are skipped. Results land in benchmarks/results/.
set -euo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/results
mkdir -p "$out"

python benchmarks/single_stream.py --repetitions 5 | tee "$out/single_stream.md"
python benchmarks/concurrency.py --levels 1,2,4,8,16 --repetitions 5 | tee "$out/concurrency.md"
python benchmarks/mixed_workload.py --repetitions 5 | tee "$out/mixed_workload.md"
python benchmarks/llamacpp.py --levels 1,2,4,8,16 --repetitions 3 | tee "$out/llamacpp.md"
python benchmarks/profile_server.py --streams 8 --seconds 20 | tee "$out/profile_server.md"
python benchmarks/stream_cost.py --repetitions 5 | tee "$out/stream_cost.md"

# The load sweep with tokenwire's own bench command: 16 slots, so 32 streams queue.
model=$(python -c "from tokenwire.server.model_tools.pull import pull_model; print(pull_model(progress=False))")
log=$(mktemp)
tokenwire serve --model "$model" --host 127.0.0.1 --port 0 --device cpu --max-batch-size 16 \
    --intra-op-threads 2 >"$log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null || true; rm -f "$log"' EXIT
until grep -q "serving on" "$log"; do sleep 0.5; done
port=$(sed -n 's/^tokenwire: serving on [^:]*:\([0-9]*\)$/\1/p' "$log")
tokenwire bench --server "127.0.0.1:$port" --concurrency 1,2,4,8,16,32 --duration 20 --warmup 4 \
    --prompt-tokens 100 --max-new-tokens 128 --no-progress \
    --json "$out/bench_concurrency.json" --chart "$out/bench_concurrency.png" | tee "$out/bench_concurrency.md"
