#!/usr/bin/env bash
# The GPU driver: one device call runs the named suites in turn on this tree, each step under a time limit
# (a failure does not stop the rest), logs into $OUT, and prints a table of the figures at the end.
#
#   bench/gpu.sh SUITE [SUITE ...]
#
# suites:
#   tests          the GPU tests (those marked gpu in the files that hold them)
#   offline        (a) offline throughput, Qwen3-0.6B's architecture, RUNS runs (one process each)
#   latency        (b) batch 1, ms per output token (5 runs in one process)
#   fp8            (a) over an fp8 KV cache
#   decode_triton  (a) with the Triton decode kernel at every batch over the bf16 cache (FlashInfer's tensor
#                  cores by default above 8 rows)
#   decode_order   the Triton decode kernel's programs started in row order and longest first
#                  (DECODE_ORDERS): fp8_decode.py at 256, 128 and 64 rows (DECODE_ORDER_KERNEL=0: not),
#                  then (a) over fp8 and bf16 caches (DECODE_ORDER_ARGS: more flags, e.g. --arch qwen3-8b)
#   sorted_rows, qwen3_8b_sorted  offline and qwen3_8b with each decode step's rows put longest KV first by the
#                  scheduler (--decode-order sorted_rows: FlashInfer's kernels start the longest requests first)
#   decode_heads   the decode kernel at other models' heads (DECODE_HEADS, Q:KV pairs, default 32:8 for Qwen3-8B):
#                  FlashInfer against the Triton kernel's tiles started longest first, bf16 cache, 256 and 64 rows
#   qwen3_8b       (a)'s shape on Qwen3-8B's architecture
#   decode_fi, qwen3_8b_fi  offline and qwen3_8b with FlashInfer's tensor-core decode at every batch
#   decode_steps, qwen3_8b_steps  offline and qwen3_8b with the Triton decode in every pure decode step on any
#                  GPU (Kernels.decode triton_steps; auto does so from Hopper on)
#   moe            (b) and (a) on Qwen3-30B-A3B's architecture (a mixture of experts, the fused Triton path)
#   fp8_weights    Qwen3-8B's architecture with its weights quantized to FP8 at load against bf16: (a) and
#                  (b) batch 1, each for both
#   fp8_weights_kv Qwen3-8B's (a) with FP8 weights over an fp8 KV cache (beside fp8_weights' bf16 runs)
#   moe_latency    (b) alone on Qwen3-30B-A3B's architecture, on this tree and BASE's
#   pdl            (b) without and with programmatic dependent launch (--pdl off, on), alternated: Qwen3-8B in
#                  bf16 and with FP8 weights, Qwen3-30B-A3B and Qwen3-0.6B (PDL_MODELS: others, one word each)
#   pdl_offline    (a) over bf16 and fp8 caches with --pdl off and on, alternated, RUNS runs each
#   decode_merge   (b) with the Triton decode's split results merged by a launch and by the last split's program
#                  (--decode-merge launch, last), alternated: Qwen3-0.6B, Qwen3-8B with FP8 weights and in bf16,
#                  Qwen3-30B-A3B (MERGE_MODELS: others, e.g. "qwen3-0.6b qwen3-8b_fp8"); then the kernel alone at
#                  batches 1 and 8 (fp8_decode.py)
#   small_gemm     batch 1's dense layers and LM heads: cuBLAS against the Triton GEMV, without and with
#                  programmatic dependent launch, and the GEMV's tiles (bench/small_gemm.py)
#   pdl_prefetch   batch 1's dense GEMVs of Qwen3-8B (bf16 and FP8) and Qwen3-0.6B in one graph: without PDL,
#                  and with it by how many of each GEMV's programs prefetch their weights (bench/pdl_prefetch.py)
#   fp8_blocks     the FP8 GEMV over 128 x 128 block-scaled weights: a scale loaded for every weight against one a
#                  block (bench/fp8_gemv.py --blocks)
#   fp8_head       (b) of Qwen3-8B with FP8 weights, the LM head in bf16 and quantized (--quantize-lm-head),
#                  alternated FP8_HEAD_ROUNDS times (default 2), then bf16 weights for the ratio; then (a) with the
#                  head quantized and not (FP8_HEAD_BF16_A=1: and with bf16 weights); fp8_head_a: that (a) alone
#   fp8_norms      (b) of Qwen3-8B with FP8 weights by where its residual norms run (--fp8-norms apart, folded,
#                  inside; FP8_NORMS_MODES: others), then in bf16 for the ratio
#   kernels        the MoE experts (bench/moe_decode.py: per-row and grouped paths at 1-4 tokens, the grouped
#                  GEMMs' tile sweep at 64, 256 and 8,192) and the FP8 GEMV's tile sweep (bench/fp8_gemv.py)
#   prologue       the attention prologue's tiles at a decode batch and a prompt chunk (bench/prologue.py)
#   ragged_prefill FA3 over a prompt chunk's own keys and values (ragged, the earlier tokens paged and merged;
#                  or split: continuing rows paged, fresh ones ragged) against over the paged cache alone, one
#                  layer, pages of RAGGED_PAGES tokens (default 16 64; bench/ragged_prefill.py)
#   decode_kernels the Triton decode kernel over fp8 and bf16 caches at batches 256 and 1 against FlashInfer, with
#                  its CUDA-core and prefetching variants and V converted first (bench/fp8_decode.py --variants)
#   profile        (a) once, with the kernels of 50 decode steps from steps 50, 500 and 800 (the batch full,
#                  about half, a quarter)
#   prefill_heavy  128 prompts of 3,000-6,000 tokens, 32-128 output tokens
#   prefill_sweep  prefill_heavy and (a) at chunks of 8192, 16384 and 32768 tokens, mixed steps on and off
#   moe_fp8        FP8 experts on Qwen3-30B-A3B's architecture against bf16: the experts alone (bench/moe_decode.py
#                  at 1, 4, 64 and 256 tokens: bf16, e4m3 with a scale a row and with one for each 128 columns),
#                  then (b) with --quantization fp8 and in bf16
#   moe_fp8_rows   the FP8 experts' per-row tiles swept at one token (bench/moe_decode.py --sweep --fp8 0, 128)
#   moe_fp8_grouped  the FP8 experts' grouped GEMMs' tiles swept at MOE_FP8_GROUPED tokens (default 64 256 8192),
#                  a scale a row and each 128 columns
#   moe_fp8_chunk  the experts at a prompt chunk and at decode batches (8,192, 256 and 64 tokens): bf16, e4m3 with
#                  a scale a row and with one each 128 columns (bench/moe_decode.py)
#   moe_w8a8       the FP8 experts at prompt chunks (8,192, 2,048 and 1,024 tokens), a scale a row and each 128
#                  columns: activations quantized to e4m3 (the default there) against widened weights, bf16 beside;
#                  then the w8a8 tiles swept at 8,192 (bench/moe_decode.py --w8a8, --grouped-sweep)
#   moe_fp8_ranks  the FP8 experts at a tensor-parallel rank's width (bench/moe_decode.py --inter): 192 (tp 4) with
#                  scale groups of 128 (ranks 0, 2) and 64 (ranks 1, 3), 96 (tp 8) with 64 and 32, at 1, 4, 64, 256
#   moe_fp8_a      (a) on Qwen3-30B-A3B's architecture with --quantization fp8 and in bf16
#   moe_fp8_kv     (a) on Qwen3-30B-A3B's architecture with --quantization fp8 over an fp8 KV cache
#   moe_rows       the MoE per-row kernels at 1, 2 and 4 tokens with their tile sweep, the down kernel's
#                  at-once variant included (bench/moe_decode.py --sweep)
#   fp8_gemm       Qwen3-8B's linears at 256 and 64 rows, bf16 and FP8: cuBLAS, cuBLASLt with and without fast
#                  accumulation, the Triton GEMM (bench/fp8_gemm.py; FP8_GEMM_ARGS, e.g. "--m 16 64 --sweep")
#   gemm_ab        (a) with the Triton GEMM at decode batches (--decode-gemm triton) and with cuBLAS/cuBLASLt
#                  only (--decode-gemm vendor) alternated, RUNS each, for each of GEMM_AB_MODELS
#   cublaslt       bf16 linear layers at decode batches: F.linear against each algorithm cuBLASLt's heuristic
#                  lists, timed (bench/cublaslt_algos.py)
#   tuned_ab       (a) with the linear products on the algorithms timed at start (the default) and with
#                  --no-tuned-gemms, alternated, RUNS each, for each of TUNED_MODELS (default qwen3-0.6b qwen3-8b)
#   sample_kernel  the sampler's Gumbel-max kernels at batches 256, 64 and 1: tiles against the default
#                  (bench/sample_kernel.py)
#   row_fusion     batch-1 decode's fused residual-norm and SiLU GEMVs against the launches they replace
#                  (bench/row_fusion.py)
#   prefill_kernels  prefill_heavy with FlashInfer's FA2 prefill forced (beside the default's runs of the
#                  suite above)
#   prefill_launch one prompt's eager extend step (TTFT's at low load): host launch and device time at 128, 512
#                  and 1,024 tokens, greedy and seeded, and the blocking CUDA calls under torch's profiler
#   profile_extend one prefill_heavy run, then the kernels of 20 extend steps of another draw
#   mixed          decode latency under arriving prompts, mixed steps against prefill-first
#   sampling       what penalties, filters and grammars cost beside plain sampling
#   online         the HTTP path against the offline engine at concurrency 1 and 256
#   hops           where the online TTFT goes at concurrency 1: each hop's mean beside the offline TTFT
#   spec           speculative decoding: batch 1 ms per token and decode throughput at 64 and 256, off,
#                  n-gram and a draft identical to the target (random weights, greedy)
#   spec_a         (a) without speculation, with n-gram and with a draft identical to the target (RUNS each;
#                  SPEC_A_METHODS picks among none, ngram and draft)
#   real           the real model (SmolLM2-135M-Instruct's GGUF) in bf16 against transformers' bf16,
#                  bench/real_text.py and bench/real_spec.py (n-gram speculation on an editing task); the
#                  file from .real/ (split parts, carried over calls) or the cache; transformers reads it
#                  through the `gguf` package, which the GPU hosts lack (`pip download --no-deps -d .whl gguf`)
#   peer           mini-sglang on the same token lists ((a) and (b); needs .peer/, see ../shared/peer)
#   peer_prefill_heavy  mini-sglang on prefill_heavy's token lists, RUNS runs (bench/peer_prefill_heavy.py)
#   save           FlashInfer's built modules and Triton's cache into $OUT/kernels.tar.xz
#
# environment:
#   OUT    where logs and JSON go (default ./bench_out)
#   BASE   another tree (e.g. `git worktree add .base <commit>`): offline, latency, prefill_heavy and online run
#          there too, right after this tree's, so the two are compared in one call
#   RUNS   processes per throughput figure (default 3; the table quotes the median)
#   REPEATS  runs of (b) in its one process (default 5)
#   TESTS  the test files `tests` runs (default: every file that holds GPU tests)
#   TEST_TIMEOUT  seconds a GPU test may take before it fails (default 150; stacks printed 30 s before)
#   LATENCY_ARCHS  the architectures `latency` runs (default qwen3-0.6b; e.g. "qwen3-0.6b qwen3-8b")
#   LATENCY_ARGS   more flags for `latency`'s bench/decode_latency.py (e.g. --profile)
#   HOPS_ARGS      more flags for `hops`'s bench/first_token_hops.py (e.g. "--profile-replica $OUT/prof": the
#                  replica's scheduler thread and the offline engine under cProfile, side by side)
#   CHUNKS   the prefill chunk sizes `mixed` runs at (default 2048)
#   ARCH   the peer's architecture (default qwen3-0.6b)
#   GEMM_AB_MODELS  the architectures `gemm_ab` runs, _fp8 for FP8 weights (default "qwen3-8b_fp8 qwen3-8b")
#   FP8_GEMM_ARGS  the arguments of `fp8_gemm`'s bench/fp8_gemm.py (default --m 256 64)
#   PEER_ARGS  more arguments for the peer's bench_minisgl.py (e.g. --draws prefill_heavy:2 --b1-repeat 0)
#   ONLINE_ARGS  more flags for `online`'s bench/online_serving.py (e.g. --extend-graph-tokens 0)
#   LAUNCH_ARGS  more flags for `prefill_launch`'s bench/prefill_launch.py (e.g. --arch qwen3-8b)
#   SPEC_ARGS  more arguments for `spec`'s bench/spec_decode.py (e.g. --methods off draft draft-always)
#
# Wheels come from .whl/ (../shared/gpu/wheels.sh fills it); a machine still warm from the last call keeps
# them, and nothing is reinstalled then (a reinstalled FlashInfer loses the kernels restored into it).
# .cache/kernels.tar.xz, when carried, is the last call's `save` or what bench/prebuild_kernels.sh built on a
# machine without a GPU: restored before anything runs, it spares FlashInfer's kernel builds (minutes on a
# fresh host).
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/bench_out}; mkdir -p "$OUT"
SITE=/tmp/site
RUNS=${RUNS:-3}
LOG=$OUT/gpu.log
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 HF_HUB_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # NVLink multicast stays off

log() { echo "[$(date +%T)] $*" | tee -a "$LOG"; }

step() {  # step NAME SECONDS COMMAND...: SIGABRT at the limit, so faulthandler prints every thread's stack
  local name=$1 limit=$2; shift 2
  log "=== $name: $*"
  local t0=$SECONDS
  timeout --signal=ABRT --kill-after=10 "$limit" "$@" 2>&1 \
    | grep --line-buffered -v -E "Writing|Loading weights|capturing|it/s\]" | tee -a "$LOG"
  log "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s"
}

setup() {
  local missing=() w base name ver
  for w in "$ROOT"/.whl/*.whl; do
    [ -f "$w" ] || continue
    base=$(basename "$w"); name=${base%%-*}; ver=${base#*-}; ver=${ver%%-*}
    [ -d "$SITE/$name-$ver.dist-info" ] || missing+=("$w")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${#missing[@]} wheel(s) into $SITE"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "${missing[@]}" 2>&1 | grep -v -e "Target directory" -e "already exists" -e "as the .root. user" | tail -3
  fi
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
  if [ -f .cache/kernels.tar.xz ] && [ ! -e /tmp/.kernels_restored ]; then
    local tmp; tmp=$(mktemp -d)
    tar -C "$tmp" -xJf .cache/kernels.tar.xz
    # FlashInfer loads a module found in its own AOT folder as it is, without ninja
    [ -d "$tmp/fi_aot" ] && mkdir -p "$SITE/flashinfer/data/aot" && cp -r "$tmp/fi_aot/." "$SITE/flashinfer/data/aot/"
    [ -d "$tmp/home" ] && cp -r "$tmp/home/." "$HOME/"
    find "$SITE/flashinfer" "$SITE/tvm_ffi" -exec touch -h -d 2020-01-01 {} + 2>/dev/null
    rm -rf "$tmp"
    # the peer's own setup (.peer/run_minisgl.sh) reads this mark and restores nothing more
    touch /tmp/.kernels_restored /tmp/.minisgl_kernels_restored
    log "restored $(ls "$SITE/flashinfer/data/aot" | wc -l) FlashInfer modules"
  fi
  log "host: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1);" \
      "tree $(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet 2>/dev/null || echo +changes)"
}

save() {  # the modules restored and those built here, as an AOT tree, with tvm-ffi's and Triton's caches
  local tmp so name d; tmp=$(mktemp -d); mkdir -p "$tmp/fi_aot" "$tmp/home"
  [ -d "$SITE/flashinfer/data/aot" ] && cp -r "$SITE/flashinfer/data/aot/." "$tmp/fi_aot/"
  for so in "$HOME"/.cache/flashinfer/*/*/cached_ops/*/*.so; do
    [ -f "$so" ] || continue
    name=$(basename "$(dirname "$so")"); [ "$(basename "$so")" = "$name.so" ] || continue
    mkdir -p "$tmp/fi_aot/$name" && cp "$so" "$tmp/fi_aot/$name/"
  done
  for d in .cache/tvm-ffi .triton/cache; do
    [ -d "$HOME/$d" ] && mkdir -p "$tmp/home/$(dirname "$d")" && cp -r "$HOME/$d" "$tmp/home/$d"
  done
  tar -C "$tmp" -cf - fi_aot home | xz -T0 -6 > "$OUT/kernels.tar.xz"
  log "saved $(ls "$tmp/fi_aot" | wc -l) FlashInfer modules: $(du -h "$OUT/kernels.tar.xz" | cut -f1) (carry it as .cache/kernels.tar.xz)"
  rm -rf "$tmp"
}

trees() { echo "$ROOT"; [ -n "${BASE:-}" ] && (cd "$BASE" && pwd); }
tag() { [ "$1" = "$ROOT" ] && echo "" || echo "_base"; }

offline() {  # offline NAME SECONDS ARGS...: RUNS processes on each tree
  local name=$1 limit=$2; shift 2
  local tree i
  for tree in $(trees); do
    for i in $(seq "$RUNS"); do
      (cd "$tree" && step "$name$(tag "$tree")_$i" "$limit" python3 bench/offline_throughput.py "$@" \
        --out "$OUT/$name$(tag "$tree")_$i.json")
    done
  done
}

summary() {
  python3 - "$OUT" <<'PY' | tee -a "$LOG"
import json, pathlib, re, statistics, sys
runs: dict[str, list[dict]] = {}
for p in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    try:
        r = json.loads(p.read_text())
    except ValueError:
        continue
    if isinstance(r, dict):
        runs.setdefault(re.sub(r"_\d+$", "", p.stem), []).append(r)
print(f"{'figure':<28} {'runs':>4} {'median':>10} {'min':>10} {'max':>10}  unit")
for name, rs in runs.items():
    for key, unit in (("output_tok_per_s", "out tok/s"), ("ms_per_token", "ms/token"), ("ttft_ms_mean", "TTFT ms")):
        vals = [r[key] for r in rs if isinstance(r.get(key), (int, float))]
        if vals:
            print(f"{name:<28} {len(vals):>4} {statistics.median(vals):>10.3f} {min(vals):>10.3f} {max(vals):>10.3f}  {unit}")
PY
}

[ $# -gt 0 ] || { sed -n '2,/^set -u/p' "$0" | sed 's/^# \{0,1\}//' | head -n -1; exit 2; }
setup
for suite in "$@"; do
  case $suite in
    tests)  # a test past TEST_TIMEOUT s fails (pytest-timeout), its stacks printed first, and the rest run
      step tests 480 python3 -m pytest -m gpu -q -p no:cacheprovider -o timeout="${TEST_TIMEOUT:-150}" \
        -o faulthandler_timeout="$(( ${TEST_TIMEOUT:-150} - 30 ))" ${TESTS:-tests/test_gpu.py tests/test_gpu_sampling.py \
      tests/test_kv_fp8.py tests/test_triton_decode.py tests/test_gpu_attention.py tests/test_moe.py \
      tests/test_fp8_gpu.py tests/test_spec_decode.py tests/test_row_fusion.py tests/test_eagle3.py tests/test_extend_graphs.py \
      tests/test_verify_rows.py tests/test_pdl_gpu.py tests/test_lm_head.py tests/test_fp8_norms.py tests/test_cublaslt.py} ;;
    offline) offline offline 150 ;;
    latency)  # LATENCY_ARCHS: the architectures (default qwen3-0.6b)
      for arch in ${LATENCY_ARCHS:-qwen3-0.6b}; do
        sfx=$([ "$arch" = qwen3-0.6b ] && echo "" || echo "_$arch")
        for tree in $(trees); do
          (cd "$tree" && step "latency$sfx$(tag "$tree")" 200 python3 bench/decode_latency.py --arch "$arch" \
            --repeats "${REPEATS:-5}" ${LATENCY_ARGS:-} --out "$OUT/latency$sfx$(tag "$tree").json")
        done
      done ;;
    moe_latency)  # (b) alone on the MoE architecture, on each tree
      for tree in $(trees); do
        (cd "$tree" && step "moe_latency$(tag "$tree")" 300 python3 bench/decode_latency.py --arch qwen3-30b-a3b \
          --repeats "${REPEATS:-5}" --out "$OUT/moe_latency$(tag "$tree").json")
      done ;;
    pdl)  # batch 1 without and with programmatic dependent launch (Kernels.pdl), alternated, on each model
      for model in ${PDL_MODELS:-qwen3-8b "qwen3-8b --quantization fp8" qwen3-30b-a3b qwen3-0.6b}; do
        name=$(echo "$model" | sed 's/ --quantization /_/; s/[.-]//g')
        for mode in off on; do
          flag=(--pdl "$mode")
          # shellcheck disable=SC2086  # the model's words are its flags
          step "pdl_${mode}_$name" 300 python3 bench/decode_latency.py --arch $model --repeats "${REPEATS:-3}" \
            "${flag[@]}" --out "$OUT/pdl_${mode}_$name.json"
        done
      done ;;
    pdl_offline)  # (a) over bf16 and fp8 caches without and with programmatic dependent launch, alternated
      for i in $(seq "$RUNS"); do
        for mode in off on; do
          flag=(--pdl "$mode")
          step "pdl_offline_${mode}_$i" 150 python3 bench/offline_throughput.py "${flag[@]}" \
            --out "$OUT/pdl_offline_${mode}_$i.json"
          step "pdl_offline_fp8_${mode}_$i" 150 python3 bench/offline_throughput.py --kv-cache-dtype fp8_e4m3 \
            "${flag[@]}" --out "$OUT/pdl_offline_fp8_${mode}_$i.json"
        done
      done ;;
    decode_merge)  # MERGE_MODELS: architectures, _fp8 for FP8 weights quantized at load
      for model in ${MERGE_MODELS:-qwen3-0.6b qwen3-8b_fp8 qwen3-8b qwen3-30b-a3b}; do
        flag=(); [ "${model%_fp8}" != "$model" ] && flag=(--quantization fp8)
        for mode in launch last; do
          step "merge_${mode}_$model" 300 python3 bench/decode_latency.py --arch "${model%_fp8}" "${flag[@]}" \
            --repeats "${REPEATS:-3}" --decode-merge "$mode" --out "$OUT/merge_${mode}_$model.json"
        done
      done
      step merge_kernel 200 python3 bench/fp8_decode.py --batch 1 8 --sweep none --out "$OUT/merge_kernel.json" ;;
    fp8) offline fp8 150 --kv-cache-dtype fp8_e4m3 ;;
    decode_triton) offline decode_triton 150 --decode-kernel triton ;;
    decode_order)  # the Triton decode's programs in row order and longest first: the kernel alone, then (a)
      [ "${DECODE_ORDER_KERNEL:-1}" = 0 ] || step decode_order_kernel 240 python3 bench/fp8_decode.py \
        --batch 256 128 64 --sweep none --out "$OUT/decode_order_kernel.json"
      # shellcheck disable=SC2086  # DECODE_ORDER_ARGS is split into its words on purpose
      for mode in ${DECODE_ORDERS:-rows longest_first}; do
        offline "decode_order_fp8_$mode" 240 --kv-cache-dtype fp8_e4m3 --decode-order "$mode" ${DECODE_ORDER_ARGS:-}
        offline "decode_order_bf16_$mode" 240 --decode-kernel triton --decode-order "$mode" ${DECODE_ORDER_ARGS:-}
      done ;;
    sorted_rows) offline sorted_rows 150 --decode-order sorted_rows ;;
    qwen3_8b_sorted) offline qwen3_8b_sorted 240 --arch qwen3-8b --decode-order sorted_rows ;;
    decode_heads)
      for heads in ${DECODE_HEADS:-32:8}; do
        step "decode_heads_${heads/:/_}" 300 python3 bench/fp8_decode.py --batch 256 64 --kv bf16 --sweep small \
          --sweep-order longest_first --heads "${heads%:*}" "${heads#*:}" --out "$OUT/decode_heads_${heads/:/_}.json"
      done ;;
    qwen3_8b) offline qwen3_8b 240 --arch qwen3-8b ;;
    decode_fi) offline decode_fi 150 --decode-kernel tensor_cores ;;
    qwen3_8b_fi) offline qwen3_8b_fi 240 --arch qwen3-8b --decode-kernel tensor_cores ;;
    decode_steps) offline decode_steps 150 --decode-kernel triton_steps ;;
    qwen3_8b_steps) offline qwen3_8b_steps 240 --arch qwen3-8b --decode-kernel triton_steps ;;
    moe)
      step moe_latency 300 python3 bench/decode_latency.py --arch qwen3-30b-a3b --repeats "${REPEATS:-5}" \
        --out "$OUT/moe_latency.json"
      offline moe 300 --arch qwen3-30b-a3b ;;
    fp8_weights)
      offline fp8_weights_bf16 240 --arch qwen3-8b
      offline fp8_weights_fp8 240 --arch qwen3-8b --quantization fp8
      for q in bf16 fp8; do
        flag=(); [ "$q" = fp8 ] && flag=(--quantization fp8)
        step "fp8_weights_latency_$q" 240 python3 bench/decode_latency.py --arch qwen3-8b --repeats "${REPEATS:-5}" \
          "${flag[@]}" --out "$OUT/fp8_weights_latency_$q.json"
      done ;;
    fp8_weights_kv) offline fp8_weights_fp8_kv 240 --arch qwen3-8b --quantization fp8 --kv-cache-dtype fp8_e4m3 ;;
    kernels)
      step moe_decode 420 python3 bench/moe_decode.py --tokens 1 4 64 256 8192 --grouped-sweep --out "$OUT/moe_decode.json"
      step fp8_gemv 200 python3 bench/fp8_gemv.py --out "$OUT/fp8_gemv.json" ;;
    moe_fp8)
      step moe_decode_bf16 150 python3 bench/moe_decode.py --tokens 1 4 64 256 --out "$OUT/moe_decode_bf16.json"
      step moe_decode_fp8_row 150 python3 bench/moe_decode.py --tokens 1 4 64 256 --fp8 0 \
        --out "$OUT/moe_decode_fp8_row.json"
      step moe_decode_fp8_128 150 python3 bench/moe_decode.py --tokens 1 4 64 256 --fp8 128 \
        --out "$OUT/moe_decode_fp8_128.json"
      for q in fp8 bf16; do
        flag=(); [ "$q" = fp8 ] && flag=(--quantization fp8)
        step "moe_latency_$q" 240 python3 bench/decode_latency.py --arch qwen3-30b-a3b --repeats "${REPEATS:-3}" \
          "${flag[@]}" --out "$OUT/moe_latency_$q.json"
      done ;;
    moe_fp8_rows)
      for group in 0 128; do
        step "moe_fp8_rows_$group" 280 python3 bench/moe_decode.py --tokens 1 --fp8 "$group" --sweep \
          --out "$OUT/moe_fp8_rows_$group.json"
      done ;;
    moe_fp8_grouped)
      for group in 0 128; do
        step "moe_fp8_grouped_$group" 280 python3 bench/moe_decode.py --tokens ${MOE_FP8_GROUPED:-64 256 8192} \
          --fp8 "$group" --grouped-sweep --out "$OUT/moe_fp8_grouped_$group.json"
      done ;;
    moe_fp8_chunk)
      for group in bf16 0 128; do
        flag=(); [ "$group" != bf16 ] && flag=(--fp8 "$group")
        step "moe_fp8_chunk_$group" 120 python3 bench/moe_decode.py --tokens 8192 256 64 "${flag[@]}" \
          --out "$OUT/moe_fp8_chunk_$group.json"
      done ;;
    moe_w8a8)
      step moe_w8a8_bf16 120 python3 bench/moe_decode.py --tokens 8192 2048 1024 --out "$OUT/moe_w8a8_bf16.json"
      for group in 0 128; do
        for mode in auto off; do
          step "moe_w8a8_${group}_$mode" 120 python3 bench/moe_decode.py --tokens 8192 2048 1024 --fp8 "$group" \
            --w8a8 "$mode" --out "$OUT/moe_w8a8_${group}_$mode.json"
        done
      done
      for group in 0 128; do
        step "moe_w8a8_sweep_$group" 240 python3 bench/moe_decode.py --tokens 8192 --fp8 "$group" --grouped-sweep \
          --out "$OUT/moe_w8a8_sweep_$group.json"
      done ;;
    moe_fp8_ranks)
      for shape in 192:128 192:64 96:64 96:32; do
        step "moe_fp8_ranks_${shape/:/_}" 90 python3 bench/moe_decode.py --tokens 1 4 64 256 --inter "${shape%%:*}" \
          --fp8 "${shape##*:}" --out "$OUT/moe_fp8_ranks_${shape/:/_}.json"
      done ;;
    moe_fp8_a)  # MOE_FP8_A: which weights run (default "fp8 bf16")
      for q in ${MOE_FP8_A:-fp8 bf16}; do
        flag=(); [ "$q" = fp8 ] && flag=(--quantization fp8)
        offline "moe_fp8_a_$q" 280 --arch qwen3-30b-a3b "${flag[@]}"
      done ;;
    moe_fp8_kv) offline moe_fp8_kv 280 --arch qwen3-30b-a3b --quantization fp8 --kv-cache-dtype fp8_e4m3 ;;
    moe_rows) step moe_rows 400 python3 bench/moe_decode.py --tokens 1 2 4 --sweep --out "$OUT/moe_rows.json" ;;
    fp8_blocks) step fp8_blocks 200 python3 bench/fp8_gemv.py --blocks --out "$OUT/fp8_blocks.json" ;;
    fp8_head)  # (b) of Qwen3-8B with FP8 weights, the LM head in bf16 and in e4m3, alternated, then bf16; (a) with both
      for i in $(seq "${FP8_HEAD_ROUNDS:-2}"); do
        for head in bf16 e4m3; do
          flag=(); [ "$head" = e4m3 ] && flag=(--quantize-lm-head)
          step "fp8_head_latency_${head}_$i" 240 python3 bench/decode_latency.py --arch qwen3-8b --quantization fp8 \
            "${flag[@]}" --repeats "${REPEATS:-3}" --out "$OUT/fp8_head_latency_${head}_$i.json"
        done
      done
      step fp8_head_latency_bf16_weights 240 python3 bench/decode_latency.py --arch qwen3-8b --repeats "${REPEATS:-3}" \
        --out "$OUT/fp8_head_latency_bf16_weights.json"
      offline fp8_head_a_e4m3 240 --arch qwen3-8b --quantization fp8 --quantize-lm-head
      offline fp8_head_a_bf16 240 --arch qwen3-8b --quantization fp8
      [ "${FP8_HEAD_BF16_A:-0}" = 1 ] && offline fp8_head_a_bf16_weights 240 --arch qwen3-8b ;;
    fp8_head_a)  # fp8_head's (a) alone: the head quantized and not
      offline fp8_head_a_e4m3 240 --arch qwen3-8b --quantization fp8 --quantize-lm-head
      offline fp8_head_a_bf16 240 --arch qwen3-8b --quantization fp8 ;;
    fp8_norms)  # (b) of Qwen3-8B with FP8 weights, its residual norms apart, inside its GEMVs, and folded, then bf16
      for mode in ${FP8_NORMS_MODES:-apart folded inside}; do
        step "fp8_norms_$mode" 240 python3 bench/decode_latency.py --arch qwen3-8b --quantization fp8 \
          --fp8-norms "$mode" --repeats "${REPEATS:-3}" --out "$OUT/fp8_norms_$mode.json"
      done
      step fp8_norms_bf16 240 python3 bench/decode_latency.py --arch qwen3-8b --repeats "${REPEATS:-3}" \
        --out "$OUT/fp8_norms_bf16.json" ;;
    pdl_prefetch)
      step pdl_prefetch_8b 150 python3 bench/pdl_prefetch.py --arch qwen3-8b --out "$OUT/pdl_prefetch_8b.json"
      step pdl_prefetch_8b_fp8 150 python3 bench/pdl_prefetch.py --arch qwen3-8b --fp8 --out "$OUT/pdl_prefetch_8b_fp8.json"
      step pdl_prefetch_0.6b 150 python3 bench/pdl_prefetch.py --arch qwen3-0.6b --out "$OUT/pdl_prefetch_0.6b.json" ;;
    small_gemm) step small_gemm 300 python3 bench/small_gemm.py --m 1 --out "$OUT/small_gemm.json" ;;
    # shellcheck disable=SC2086  # FP8_GEMM_ARGS is split into its words on purpose
    fp8_gemm) step fp8_gemm 400 python3 bench/fp8_gemm.py ${FP8_GEMM_ARGS:---m 256 64} --out "$OUT/fp8_gemm.json" ;;
    gemm_ab)  # (a) with the Triton GEMM at decode batches and with cuBLAS/cuBLASLt only, alternated
      for i in $(seq "$RUNS"); do
        for model in ${GEMM_AB_MODELS:-qwen3-8b_fp8 qwen3-8b}; do
          for gemm in triton vendor; do
            flag=(); [ "${model%_fp8}" != "$model" ] && flag=(--quantization fp8)
            step "gemm_${model}_${gemm}_$i" 240 python3 bench/offline_throughput.py --arch "${model%_fp8}" \
              "${flag[@]}" --decode-gemm "$gemm" --out "$OUT/gemm_${model}_${gemm}_$i.json"
          done
        done
      done ;;
    cublaslt) step cublaslt 300 python3 bench/cublaslt_algos.py --out "$OUT/cublaslt.json" ;;
    tuned_ab)
      for i in $(seq "$RUNS"); do
        for model in ${TUNED_MODELS:-qwen3-0.6b qwen3-8b}; do
          for mode in on off; do
            flag=(); [ "$mode" = off ] && flag=(--no-tuned-gemms)
            step "tuned_${mode}_${model}_$i" 240 python3 bench/offline_throughput.py --arch "$model" "${flag[@]}" \
              --out "$OUT/tuned_${mode}_${model}_$i.json"
          done
        done
      done ;;
    sample_kernel) step sample_kernel 200 python3 bench/sample_kernel.py --out "$OUT/sample_kernel.json" ;;
    row_fusion) step row_fusion 200 python3 bench/row_fusion.py --out "$OUT/row_fusion.json" ;;
    decode_kernels) step decode_kernels 400 python3 bench/fp8_decode.py --batch 256 1 --sweep none --variants \
      --out "$OUT/fp8_decode.json" ;;
    profile) step profile 300 python3 bench/offline_throughput.py --profile --profile-from 50 500 800 \
      --out "$OUT/profile.json" ;;
    prologue) step prologue 200 python3 bench/prologue.py --out "$OUT/prologue.json" ;;
    ragged_prefill)
        for page in ${RAGGED_PAGES:-16 64}; do
            step "ragged_prefill_p$page" 200 python3 bench/ragged_prefill.py --page-size "$page" \
                --out "$OUT/ragged_prefill_p$page.json"
        done ;;
    prefill_heavy) offline prefill_heavy 240 --workload prefill_heavy ;;
    prefill_sweep)
      for met in 8192 16384 32768; do
        offline "prefill_heavy_$met" 240 --workload prefill_heavy --max-extend-tokens "$met"
        offline "prefill_heavy_${met}_prefill_first" 240 --workload prefill_heavy --max-extend-tokens "$met" --no-mixed-steps
        offline "offline_$met" 150 --max-extend-tokens "$met"
      done ;;
    prefill_kernels)
      offline prefill_heavy_fa2 240 --workload prefill_heavy --prefill-kernel fa2 ;;
    prefill_launch) step prefill_launch 200 python3 bench/prefill_launch.py ${LAUNCH_ARGS:-} --out "$OUT/prefill_launch.json" ;;
    profile_extend)
      step profile_extend 240 python3 bench/offline_throughput.py --workload prefill_heavy --profile-extend \
        --out "$OUT/profile_extend.json" ;;
    mixed)
      for chunk in ${CHUNKS:-2048}; do
        step "mixed_$chunk" 200 python3 bench/mixed_steps.py --chunk "$chunk" --out "$OUT/mixed_$chunk.json"
      done ;;
    sampling)
      step sampling_cost 200 python3 bench/sampling_cost.py --share 0.1 1.0 --out "$OUT/sampling_cost.json"
      step grammar_cost 150 python3 bench/grammar_cost.py --share 0.1 --out "$OUT/grammar_cost.json" ;;
    online)
      for tree in $(trees); do
        (cd "$tree" && step "online$(tag "$tree")" 300 python3 bench/online_serving.py --arch qwen3-0.6b \
          --num-prompts 256 --input-len 100 1024 --output-len 100 1024 --concurrency 1 256 --c1-prompts 48 \
          --client-procs 4 --offline ${ONLINE_ARGS:-} --out "$OUT/online$(tag "$tree").json")
      done ;;
    hops)
      step first_token_hops 300 python3 bench/first_token_hops.py --arch qwen3-0.6b --num-prompts 48 \
        --input-len 100 1024 --output-len 100 1024 ${HOPS_ARGS:-} --out "$OUT/first_token_hops.json" ;;
    spec)
      # shlex-free on purpose: SPEC_ARGS is a plain list of flags (e.g. "--methods off draft --repeats 2")
      step spec 480 python3 bench/spec_decode.py --batches 1 64 256 ${SPEC_ARGS:-} --out "$OUT/spec.json" ;;
    spec_a)
      for method in ${SPEC_A_METHODS:-none ngram draft}; do
        if [ "$method" = none ]; then offline spec_a_none 300 --arch qwen3-0.6b
        else offline "spec_a_$method" 300 --arch qwen3-0.6b --speculative-method "$method"; fi
      done ;;
    peer)
      [ -f .peer/run_minisgl.sh ] || { log "peer: no .peer/ (../shared/peer/README.md makes it)"; continue; }
      # shellcheck disable=SC2086  # PEER_ARGS is split into its words on purpose
      OUT=$OUT step peer 540 bash .peer/run_minisgl.sh bench --arch "${ARCH:-qwen3-0.6b}" ${PEER_ARGS:-} ;;
    peer_prefill_heavy)  # mini-sglang on prefill_heavy's token lists (RUNS runs; bench/peer_prefill_heavy.py)
      [ -f .peer/run_minisgl.sh ] || { log "peer: no .peer/ (../shared/peer/README.md makes it)"; continue; }
      bash .peer/run_minisgl.sh setup || continue
      PYTHONPATH=/tmp/minisgl_src:$SITE OUT=$OUT step peer_prefill_heavy 540 python3 bench/peer_prefill_heavy.py \
        --runs "$RUNS" --arch "${ARCH:-qwen3-0.6b}" ;;
    real)
      gguf=$HOME/.cache/raylm/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
      if [ ! -f "$gguf" ] && ls .real/part.* >/dev/null 2>&1; then
        mkdir -p "$(dirname "$gguf")" && cat .real/part.* > "$gguf.tmp" && mv "$gguf.tmp" "$gguf"
      fi
      [ -f "$gguf" ] || { log "real: no $gguf and no .real/part.*"; continue; }
      log "real: $(sha256sum "$gguf" | cut -c1-16)"
      step real_tests 300 python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/test_real_model.py
      step real_text 300 python3 bench/real_text.py --out "$OUT/real_text.json"
      step real_spec 300 python3 bench/real_spec.py --out "$OUT/real_spec.json" ;;
    save) save ;;
    *) log "unknown suite $suite" ;;
  esac
done
summary
