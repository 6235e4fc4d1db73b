#!/usr/bin/env bash
# One device call on one H200: install (skipped on a warm machine), the FlashInfer JIT cache restored,
# then PART's GPU tests and benchmarks, each under its own timeout, logged into $OUT.
#   usage: bench/run_gpu_perf.sh PART   (see the case below; .old/ may hold an older tree to compare with)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/bench_out}; mkdir -p "$OUT"
LOG=$OUT/perf_$1.log
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
log() { echo "[$(date +%T)] $*" | tee -a "$LOG"; }
export PYTHONFAULTHANDLER=1  # a step stopped at its limit (SIGABRT) prints where every thread was
step() { local name=$1 limit=$2; shift 2; log "=== $name: $*"; local t0=$SECONDS
  timeout --signal=ABRT --kill-after=10 "$limit" "$@" 2>&1 | grep --line-buffered -v -E "Writing|Loading weights|capturing" | tee -a "$LOG"
  log "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s"; }
log "host: $(nvidia-smi --query-gpu=name --format=csv,noheader | tr '\n' ' ') commit $(git rev-parse --short HEAD 2>/dev/null)"
if [ ! -d /tmp/site/flashinfer ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
  if [ -f .cache/flashinfer-jit.tar.xz ]; then
    mkdir -p "$HOME/.cache" && tar -C "$HOME/.cache" -xJf .cache/flashinfer-jit.tar.xz
    find /tmp/site/flashinfer -exec touch -h -d '2020-01-01' {} +
  fi
fi
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
jit() { tar -C "$HOME/.cache" -cf - flashinfer | xz -T0 -9 > "$OUT/flashinfer-jit.tar.xz"; log "jit cache $(du -h "$OUT/flashinfer-jit.tar.xz" | cut -f1)"; }
B="python3 bench"; OLD="python3 .old/bench"
lat() { step "latency_$1" 100 "${@:2}" --repeats 3 --out "$OUT/latency_$1.json"; }
off() { step "offline_$1" 100 "${@:2}" --out "$OUT/offline_$1.json"; }
case $1 in
  1)
    step gpu_tests 260 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_gpu.py \
      -k "triton or sampling or cuda_graph or default or overlap"
    jit
    lat new16 $B/decode_latency.py --page-size 16
    lat new256 $B/decode_latency.py --page-size 256
    off new256 $B/offline_throughput.py --page-size 256 ;;
  2)
    step small_gemm 60 $B/small_gemm.py --m 1 4 --out "$OUT/small_gemm.json"
    lat new16 $B/decode_latency.py --page-size 16
    lat old16 $OLD/decode_latency.py --page-size 16
    lat old256 $OLD/decode_latency.py --page-size 256
    off old256 $OLD/offline_throughput.py --page-size 256
    step gpu_tests_all 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py
    jit ;;
  3)
    step small_gemm 90 $B/small_gemm.py --m 1 --out "$OUT/small_gemm.json"
    step gpu_graph_tests 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py -k "decode_step or sampling"
    step latency_new16 120 $B/decode_latency.py --page-size 16 --repeats 3 --out "$OUT/latency_new16.json" ;;
  4)
    lat new16 $B/decode_latency.py --page-size 16 --profile
    lat new256 $B/decode_latency.py --page-size 256
    lat new16_cublas $B/decode_latency.py --page-size 16 --no-small-linear
    lat new16_cudacores $B/decode_latency.py --page-size 16 --decode-kernel cuda_cores
    off new16 $B/offline_throughput.py --page-size 16 --profile
    off new256 $B/offline_throughput.py --page-size 256
    off new256_cudacores $B/offline_throughput.py --page-size 256 --decode-kernel cuda_cores
    step gpu_tests_all 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py ;;
  5)  # the committed default, first compiling every FlashInfer module the benchmarks use (a fresh JIT
      # cache lacks some: a step killed mid-compile loses the build), then (b) 5 times, profiled, and (a)
    step jit_warmup 300 $B/decode_latency.py --output-len 16 --repeats 1
    jit
    step latency5 150 $B/decode_latency.py --repeats 5 --profile --out "$OUT/latency5.json"
    off new16 $B/offline_throughput.py
    step gpu_tests_all 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py ;;
  6)  # the GPU tests, then (b) on this tree (5 runs) and on .old/ (the tree before, 3 runs)
    step gpu_tests 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_sampling.py $(ls tests/test_kv_fp8.py 2>/dev/null) \
      tests/test_gpu.py
    jit
    step latency_new 110 $B/decode_latency.py --repeats 5 --out "$OUT/latency_new.json"
    step latency_old 90 $OLD/decode_latency.py --repeats 3 --out "$OUT/latency_old.json" ;;
  7)  # (a) on this tree and on .old/, the processors' cost, and (a) with an FP8 KV cache
    off new $B/offline_throughput.py
    off old $OLD/offline_throughput.py
    step sampling_cost 200 $B/sampling_cost.py --share 0.1 1.0 --out "$OUT/sampling_cost.json"
    step grammar_cost 150 $B/grammar_cost.py --share 0.1 --out "$OUT/grammar_cost.json"
    off fp8 $B/offline_throughput.py --kv-cache-dtype fp8_e4m3
    step mixed_steps 150 $B/mixed_steps.py --out "$OUT/mixed_steps.json" ;;
  8)  # (a) and (b) by default (the Triton prologue), without it, and (a) prefill-first
    off new $B/offline_throughput.py
    off no_triton $B/offline_throughput.py --no-triton-kernels
    jit
    step latency_new 110 $B/decode_latency.py --repeats 5 --out "$OUT/latency_new.json"
    step latency_no_triton 110 $B/decode_latency.py --repeats 5 --no-triton-kernels --out "$OUT/latency_no_triton.json"
    off nomixed $B/offline_throughput.py --no-mixed-steps
    jit ;;
  10) # (a) by default and without the Triton prologue; the processors', grammars' and FP8's cost; mixed steps
    off new $B/offline_throughput.py
    off no_triton $B/offline_throughput.py --no-triton-kernels
    step sampling_cost 120 $B/sampling_cost.py --share 0.1 --out "$OUT/sampling_cost.json"
    step grammar_cost 120 $B/grammar_cost.py --share 0.1 --out "$OUT/grammar_cost.json"
    off fp8 $B/offline_throughput.py --kv-cache-dtype fp8_e4m3
    step mixed_steps 100 $B/mixed_steps.py --out "$OUT/mixed_steps.json"
    jit ;;
  11) # the processors' and grammars' cost (few rows redrawn alone), the GPU tests, mixed steps, (a) bf16 and FP8
    step sampling_cost 100 $B/sampling_cost.py --share 0.1 --out "$OUT/sampling_cost.json"
    step grammar_cost 100 $B/grammar_cost.py --share 0.1 --out "$OUT/grammar_cost.json"
    step gpu_tests 270 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_sampling.py tests/test_gpu.py \
      tests/test_kv_fp8.py
    jit
    step mixed_steps 90 $B/mixed_steps.py --out "$OUT/mixed_steps.json"
    off new $B/offline_throughput.py
    off fp8 $B/offline_throughput.py --kv-cache-dtype fp8_e4m3
    jit ;;
  12) # the processors' cost, the GPU tests changed since part 11, (b) 5 runs with the batch-1 kernel profile
    step sampling_cost 120 $B/sampling_cost.py --share 0.1 1.0 --out "$OUT/sampling_cost.json"
    step gpu_tests 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_sampling.py \
      tests/test_gpu.py -k "redrawing or flashinfer_agrees or triton"
    step latency_profile 120 $B/decode_latency.py --repeats 5 --profile --out "$OUT/latency_profile.json"
    jit ;;
  13) # the online path (e) against the offline engine: launch.py and the benchmark client in their own processes
    step online 220 $B/online_serving.py --arch qwen3-0.6b --num-prompts 256 --input-len 100 1024 \
      --output-len 100 1024 --concurrency 1 256 --c1-prompts 8 --offline --out "$OUT/online.json" ;;
  14) # (b) 5 runs: idle split by whether the host launched late, the host's own work, and a host+device
      # trace of 50 steps; then the online path with the router in the launching process and in 2 and
      # 4 router actors, the client in 4 processes
    step latency_trace 150 $B/decode_latency.py --repeats 5 --profile --trace "$OUT/trace_b1.json.gz" \
      --out "$OUT/latency_trace.json"
    jit
    ON="$B/online_serving.py --arch qwen3-0.6b --num-prompts 256 --input-len 100 1024 --output-len 100 1024 \
      --c1-prompts 8 --client-procs 4"
    step online_r0 200 $ON --concurrency 1 256 --offline --routers 0 --out "$OUT/online_r0.json"
    step online_r2 150 $ON --concurrency 1 256 --routers 2 --out "$OUT/online_r2.json"
    step online_r4 150 $ON --concurrency 256 --routers 4 --out "$OUT/online_r4.json" ;;
  15) # (b): the host's parts of a step, timed without a profiler
    step latency_sections 150 $B/decode_latency.py --repeats 3 --out "$OUT/latency_sections.json" ;;
  16) # (b): where the idle between steps is (the scheduler stream's part against the compute stream's steps)
    step latency_sched 150 $B/decode_latency.py --repeats 3 --out "$OUT/latency_sched.json" ;;
  17) # the GPU tests of the attention plan's paths; (b) 5 runs on this tree and 3 on .old/; (a) on both
    step gpu_tests 240 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py tests/test_kv_fp8.py \
      tests/test_gpu_sampling.py -k "flashinfer or overlap or cuda_graph or triton_kernels or graph"
    jit
    step latency_new 150 $B/decode_latency.py --repeats 5 --out "$OUT/latency_new.json"
    step latency_old 100 $OLD/decode_latency.py --repeats 3 --out "$OUT/latency_old.json"
    off new $B/offline_throughput.py
    off old $OLD/offline_throughput.py ;;
  18) # the online path (e): the router in the launching process and in 2 router actors, the client in 4
      # processes; the offline engine's throughput and TTFT (one prompt at a time) on the same requests
    ON="$B/online_serving.py --arch qwen3-0.6b --num-prompts 256 --input-len 100 1024 --output-len 100 1024 \
      --c1-prompts 8 --client-procs 4"
    step online_r0 200 $ON --concurrency 1 256 --offline --routers 0 --out "$OUT/online_r0.json"
    step online_r2 150 $ON --concurrency 1 256 --routers 2 --out "$OUT/online_r2.json" ;;
  19) # the online path at saturation with 4 router actors (after the replica's per-router wakeups)
    step online_r4 170 $B/online_serving.py --arch qwen3-0.6b --num-prompts 256 --input-len 100 1024 \
      --output-len 100 1024 --client-procs 4 --concurrency 256 --offline --routers 4 --out "$OUT/online_r4.json" ;;
  20) # the online path over the replicas' direct channel against Ray calls (2 router actors), and with 4
      # actors; the offline engine's throughput and TTFT first
    ON="$B/online_serving.py --arch qwen3-0.6b --num-prompts 256 --input-len 100 1024 --output-len 100 1024 \
      --c1-prompts 8 --client-procs 4"
    step online_r2 220 $ON --concurrency 1 256 --offline --routers 2 --out "$OUT/online_r2.json"
    step online_r0 110 $ON --concurrency 1 256 --routers 0 --out "$OUT/online_r0.json"
    step online_r4 110 $ON --concurrency 256 --routers 4 --out "$OUT/online_r4.json" ;;
  21) # the Triton decode kernel over an fp8 cache: its tests and the fp8 cache's, one layer's decode
      # against FlashInfer's, then (a) in bf16, over fp8 with the Triton kernel (the default) and with FlashInfer's
    step decode_tests 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_triton_decode.py tests/test_kv_fp8.py
    jit
    step fp8_decode 120 $B/fp8_decode.py --out "$OUT/fp8_decode.json"
    off bf16 $B/offline_throughput.py
    off fp8 $B/offline_throughput.py --kv-cache-dtype fp8_e4m3
    off fp8_flashinfer $B/offline_throughput.py --kv-cache-dtype fp8_e4m3 --decode-kernel tensor_cores
    jit ;;
  22) # (a) over an fp8 cache (the Triton decode kernel) and in bf16, the fp8 cache's GPU tests, then the
      # online path's TTFT at concurrency 1 (16 requests, a connection opened first) and saturation
    off fp8 $B/offline_throughput.py --kv-cache-dtype fp8_e4m3
    off bf16 $B/offline_throughput.py
    step fp8_tests 130 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_kv_fp8.py tests/test_triton_decode.py
    step online_r2 120 $B/online_serving.py --arch qwen3-0.6b --num-prompts 256 --input-len 100 1024 \
      --output-len 100 1024 --c1-prompts 16 --client-procs 4 --concurrency 1 256 --routers 2 --out "$OUT/online_r2.json" ;;
  23) # the whole GPU test file, then (b) by default against the Triton decode kernel over bf16 (5 runs each)
    step gpu_tests_all 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py tests/test_gpu_sampling.py \
      tests/test_kv_fp8.py tests/test_triton_decode.py
    jit
    step latency_default 110 $B/decode_latency.py --repeats 5 --out "$OUT/latency_default.json"
    step latency_triton 110 $B/decode_latency.py --repeats 5 --decode-kernel triton --out "$OUT/latency_triton.json" ;;
  24) # the whole GPU test file, (b) by default and with the Triton decode kernel, then one layer's decode
      # attention at small batches (Triton against FlashInfer, bf16 and fp8)
    step gpu_tests_all 330 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py tests/test_gpu_sampling.py \
      tests/test_kv_fp8.py tests/test_triton_decode.py
    jit
    step latency_default 90 $B/decode_latency.py --repeats 3 --out "$OUT/latency_default.json"
    step latency_triton 90 $B/decode_latency.py --repeats 3 --decode-kernel triton --out "$OUT/latency_triton.json"
    step decode_small 100 $B/fp8_decode.py --batch 1 2 4 8 16 32 64 --sweep none --out "$OUT/decode_small.json" ;;
  25) # the Triton decode kernel's tests on the GPU, the default small-batch decode against FlashInfer's CUDA
      # cores, one layer's decode at batch 256, (a) over fp8
    step triton_decode_tests 150 python3 -m pytest -q -p no:cacheprovider tests/test_triton_decode.py
    step latency_small 100 $B/decode_latency.py --batch 1 2 4 8 --repeats 2 --out "$OUT/latency_small.json"
    step latency_small_cc 100 $B/decode_latency.py --batch 1 2 4 8 --repeats 2 --decode-kernel cuda_cores \
      --out "$OUT/latency_small_cc.json"
    step kernels_256 120 $B/fp8_decode.py --batch 256 --sweep none --out "$OUT/kernels_256.json"
    off fp8 $B/offline_throughput.py --kv-cache-dtype fp8_e4m3 ;;
  26) # the whole GPU test file, then (b) 5 runs and (a) in bf16, each beside the tree in .old/
    step gpu_tests_all 330 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py tests/test_gpu_sampling.py \
      tests/test_kv_fp8.py tests/test_triton_decode.py
    step latency_default 90 $B/decode_latency.py --repeats 5 --out "$OUT/latency_default.json"
    step latency_old 70 $OLD/decode_latency.py --repeats 3 --out "$OUT/latency_old.json"
    off bf16 $B/offline_throughput.py
    off bf16_old $OLD/offline_throughput.py
    off bf16_again $B/offline_throughput.py ;;
  27) # the sampling tests that compare a request's tokens across batches (the grammar test among them), the
      # Triton decode kernel's tests, then (b)
    step gpu_tests_small 150 python3 -m pytest -q -p no:cacheprovider tests/test_triton_decode.py \
      tests/test_gpu_sampling.py -k "triton or decode or grammar or plain"
    step latency_default 60 $B/decode_latency.py --repeats 3 --out "$OUT/latency_default.json" ;;
  9)  # the GPU tests, then the processors', grammars' and FP8's cost, and mixed steps
    step gpu_tests 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py tests/test_gpu_sampling.py \
      tests/test_kv_fp8.py
    jit
    step sampling_cost 120 $B/sampling_cost.py --share 0.1 --out "$OUT/sampling_cost.json"
    step grammar_cost 120 $B/grammar_cost.py --share 0.1 --out "$OUT/grammar_cost.json"
    off fp8 $B/offline_throughput.py --kv-cache-dtype fp8_e4m3
    step mixed_steps 100 $B/mixed_steps.py --out "$OUT/mixed_steps.json"
    jit ;;
  *) bash -c "$2" ;;
esac
