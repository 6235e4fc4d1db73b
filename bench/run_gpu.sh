#!/usr/bin/env bash
# Everything the GPU host runs, in one go, from the project root: installs the wheels in .whl/, runs the
# GPU tests, then the benchmarks and their ablations. Every step is guarded (a time limit each, and a
# failure does not stop the rest); results go to $OUT/results.json (merged after every step), the
# whole output to $OUT/run_gpu.log, and FlashInfer's compiled kernels to $OUT/flashinfer-jit.tar.xz
# (copy those into .cache/ for the next run: restoring them saves the JIT's minute or two).
#   usage: [TESTS=tests/test_gpu.py] bench/run_gpu.sh [STEP ...]   (default: every step; see STEPS below)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/bench_out}
mkdir -p "$OUT"
JSON=$(mktemp -d)  # one JSON per step here; only the merged file goes to $OUT (it may return few files)
LOG=$OUT/run_gpu.log
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

log() { echo "[$(date +%T)] $*" | tee -a "$LOG"; }

step() {  # step NAME SECONDS COMMAND...: runs COMMAND under a time limit, logs it, merges the JSONs
  local name=$1 limit=$2; shift 2
  log "=== $name: $*"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  log "=== $name: exit $rc after $((SECONDS - t0)) s"
  echo "{\"step\": \"$name\", \"exit\": $rc, \"seconds\": $((SECONDS - t0))}" > "$JSON/_status_$name.json"
  python3 - "$JSON" "$OUT/results.json" <<'PY'
import json, pathlib, sys
src = pathlib.Path(sys.argv[1])
merged = {p.stem: json.loads(p.read_text()) for p in sorted(src.glob("*.json"))}
pathlib.Path(sys.argv[2]).write_text(json.dumps(merged, indent=2))
PY
}

save_jit_cache() {  # FlashInfer's kernels and tvm-ffi's torch addon, both built on first use
  [ -d "$HOME/.cache/flashinfer" ] || return 0
  tar -C "$HOME/.cache" -cJf "$OUT/flashinfer-jit.tar.xz" flashinfer
  log "saved FlashInfer JIT cache: $(du -h "$OUT/flashinfer-jit.tar.xz")"
}

log "=== host: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  2>&1 | tail -3 | tee -a "$LOG"
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
if [ -f .cache/flashinfer-jit.tar.xz ]; then
  mkdir -p "$HOME/.cache" && tar -C "$HOME/.cache" -xJf .cache/flashinfer-jit.tar.xz
  # the freshly installed sources must look older than the restored build outputs, or ninja rebuilds them
  find /tmp/site/flashinfer -exec touch -h -d '2020-01-01' {} +
  log "restored FlashInfer JIT cache"
fi
python3 -c "import torch, flashinfer; print('torch', torch.__version__, 'flashinfer', flashinfer.__version__)" 2>&1 | tee -a "$LOG"

B="python3 bench"
STEPS=${*:-"tests offline latency offline_ablations latency_ablations batch qwen3_8b"}
for s in $STEPS; do
  case $s in
    tests)
      step tests 420 python3 -m pytest -m gpu -q -p no:cacheprovider ${TESTS:-tests}
      save_jit_cache ;;
    offline)
      step offline 240 $B/offline_throughput.py --profile --out "$JSON/offline.json" ;;
    latency)
      step latency 150 $B/decode_latency.py --out "$JSON/latency.json" ;;
    offline_ablations)
      step offline_no_overlap 150 $B/offline_throughput.py --no-overlap --out "$JSON/offline_no_overlap.json"
      step offline_no_cuda_graph 200 $B/offline_throughput.py --no-cuda-graph --out "$JSON/offline_no_cuda_graph.json"
      step offline_naive_cache 150 $B/offline_throughput.py --cache naive --out "$JSON/offline_naive_cache.json" ;;
    latency_ablations)
      step latency_no_overlap 120 $B/decode_latency.py --no-overlap --out "$JSON/latency_no_overlap.json"
      step latency_no_cuda_graph 150 $B/decode_latency.py --no-cuda-graph --out "$JSON/latency_no_cuda_graph.json"
      step latency_naive_cache 120 $B/decode_latency.py --cache naive --out "$JSON/latency_naive_cache.json" ;;
    batch)
      step batch64 120 $B/decode_latency.py --batch 64 --output-len 256 --out "$JSON/batch64.json" ;;
    qwen3_8b)
      step qwen3_8b_latency 240 $B/decode_latency.py --arch qwen3-8b --out "$JSON/qwen3_8b_latency.json"
      step qwen3_8b_batch64 150 $B/decode_latency.py --arch qwen3-8b --batch 64 --output-len 256 \
        --out "$JSON/qwen3_8b_batch64.json"
      save_jit_cache ;;
    *) log "unknown step $s" ;;
  esac
done

python3 - "$OUT/results.json" <<'PY' | tee -a "$LOG"
import json, sys
results = json.load(open(sys.argv[1]))
print(f"{'result':<24} {'out tok/s':>10} {'ms/token':>9} {'step ms':>8} {'idle %':>7}")
for name, r in results.items():
    if name.startswith("_status"):
        print(f"{name[8:]:<24} exit {r['exit']} after {r['seconds']} s")
        continue
    tok = r.get("output_tok_per_s") or r.get("decode_tok_per_s") or float("nan")
    print(f"{name:<24} {tok:>10.0f} {r.get('ms_per_token', float('nan')):>9.3f} "
          f"{r.get('decode_step_ms_median', float('nan')):>8.3f} {r.get('idle_pct_of_step_median', float('nan')):>7.2f}")
PY
