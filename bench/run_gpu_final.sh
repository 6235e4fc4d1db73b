#!/usr/bin/env bash
# The second round on a 2-GPU host: GPU tests (fused kernels included), the benchmarks with and
# without FlashInfer's fused kernels, tp=1 against tp=2 on Qwen3-8B, tensor-parallel parity over NCCL,
# the broadcast time of a batch description, and the online path against the offline engine.
#   usage: bench/run_gpu_final.sh PART   (PART: 1, 2 or 8 on one GPU, 3 to 7 on two; each fits one device call)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/bench_out}; mkdir -p "$OUT"
LOG=$OUT/run_gpu_final_$1.log
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
log() { echo "[$(date +%T)] $*" | tee -a "$LOG"; }
step() { local name=$1 limit=$2; shift 2; log "=== $name: $*"; local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | grep --line-buffered -v -E "Writing|Loading weights|capturing" | tee -a "$LOG"
  log "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s"; }
# what the Ray actors said (a rank's traceback lands here, not in this script's output)
ray_logs() { tail -n 60 /tmp/ray/session_latest/logs/worker-*.err > "$OUT/ray_worker_err_tail.txt" 2>/dev/null || true; }
log "host: $(nvidia-smi --query-gpu=name --format=csv,noheader | tr '\n' ' ')"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
if [ -f .cache/flashinfer-jit.tar.xz ]; then
  mkdir -p "$HOME/.cache" && tar -C "$HOME/.cache" -xJf .cache/flashinfer-jit.tar.xz
  find /tmp/site/flashinfer -exec touch -h -d '2020-01-01' {} +
fi
B="python3 bench"
case $1 in
  1)  # one GPU
    step gpu_tests 200 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_gpu.py
    step offline 110 $B/offline_throughput.py --profile --out "$OUT/offline.json"
    step latency 60 $B/decode_latency.py --out "$OUT/latency.json"
    step offline_unfused 80 $B/offline_throughput.py --no-fused --out "$OUT/offline_unfused.json"
    step online 150 $B/online_serving.py --arch qwen3-0.6b --page-size 256 --num-prompts 256 \
      --input-len 100 1024 --output-len 100 1024 --concurrency 1 256 --c1-prompts 8 --offline --out "$OUT/online.json" ;;
  2)  # one GPU
    step online 170 $B/online_serving.py --arch qwen3-0.6b --page-size 256 --num-prompts 256 \
      --input-len 100 1024 --output-len 100 1024 --concurrency 1 256 --c1-prompts 8 --offline --out "$OUT/online.json"
    step fused_tests 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py -k fused
    step latency_unfused 45 $B/decode_latency.py --no-fused --repeats 1
    step latency_no_overlap 45 $B/decode_latency.py --no-overlap --repeats 1
    step q8b_tp1 75 $B/decode_latency.py --arch qwen3-8b --wall-clock --batch 64 --output-len 128 --repeats 2
    step q8b_tp1_b1 45 $B/decode_latency.py --arch qwen3-8b --wall-clock --batch 1 --output-len 256 --repeats 2
    step broadcast 30 $B/broadcast_desc.py --out "$OUT/broadcast.json" ;;
  3)  # two GPUs: NCCL first on its own, then the parity tests, then Qwen3-8B tp=2
    step nccl_broadcast 60 $B/broadcast_desc.py --device cuda --out "$OUT/broadcast_nccl.json"
    step tp_nccl_parity 300 python3 -m pytest -v -x -p no:cacheprovider -o faulthandler_timeout=100 \
      tests/test_tp.py -k "not stalled"
    step q8b_tp2 110 $B/decode_latency.py --arch qwen3-8b --tp-size 2 --batch 64 --output-len 128 --repeats 2
    ray_logs ;;
  4)  # two GPUs: the failure tests over NCCL, then Qwen3-8B tp=1 and tp=2 side by side
    step tp_nccl_faults 170 python3 -m pytest -v -p no:cacheprovider -o faulthandler_timeout=100 \
      tests/test_tp.py -k "killed or shutdown or stalled"
    ray_logs
    step q8b_tp1 150 $B/decode_latency.py --arch qwen3-8b --wall-clock --batch 64 1 --output-len 256 --repeats 2 \
      --max-running-reqs 64 --out "$OUT/q8b_tp1.json"
    step q8b_tp2 150 $B/decode_latency.py --arch qwen3-8b --tp-size 2 --batch 64 1 --output-len 256 --repeats 2 \
      --max-running-reqs 64 --out "$OUT/q8b_tp2.json"
    tar -C "$HOME/.cache" -cJf "$OUT/flashinfer-jit.tar.xz" flashinfer ;;
  5)  # two GPUs: the failure tests over NCCL, what the all-reduces of a decode step cost
    step tp_nccl_faults 200 python3 -m pytest -v -p no:cacheprovider -o faulthandler_timeout=60 \
      tests/test_tp.py -k "killed or shutdown or stalled or watchdog"
    ray_logs
    step allreduce 90 $B/allreduce.py --out "$OUT/allreduce.json" ;;
  6)  # two GPUs: tp=2 over NCCL after the group-timeout change, then Qwen3-8B decode steps timed on rank 0
    step tp_nccl 240 python3 -m pytest -v -p no:cacheprovider -o faulthandler_timeout=60 tests/test_tp.py \
      -k "qwen3-True-radix or llama-False-radix or seeded or killed or stalled or shutdown or watchdog"
    ray_logs
    step q8b_steps_tp2 120 $B/tp_step_time.py --arch qwen3-8b --tp-size 2 --batch 64 1 --out "$OUT/q8b_steps_tp2.json"
    step q8b_steps_tp1 100 $B/tp_step_time.py --arch qwen3-8b --tp-size 1 --batch 64 1 --out "$OUT/q8b_steps_tp1.json" ;;
  7)  # two GPUs: the online path against the offline engine (launch.py in its own process), tp=2 steps
    step online 170 $B/online_serving.py --arch qwen3-0.6b --page-size 256 --num-prompts 256 \
      --input-len 100 1024 --output-len 100 1024 --concurrency 1 256 --c1-prompts 8 --offline --out "$OUT/online.json"
    step q8b_steps_tp2 100 $B/tp_step_time.py --arch qwen3-8b --tp-size 2 --batch 64 1 --out "$OUT/q8b_steps_tp2.json" ;;
  8)  # one GPU: the Triton kernels (attention prologue, sampler), tested, then measured beside the default
    step triton_tests 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py -k "triton or fused"
    step latency 60 $B/decode_latency.py --repeats 2 --out "$OUT/latency.json"
    step latency_no_triton 60 $B/decode_latency.py --repeats 2 --no-triton-kernels --out "$OUT/latency_no_triton.json"
    step offline 110 $B/offline_throughput.py --out "$OUT/offline.json"
    step offline_no_triton 110 $B/offline_throughput.py --no-triton-kernels --out "$OUT/offline_no_triton.json" ;;
esac
