#!/usr/bin/env bash
# FlashInfer's modules for the benchmarks' architectures (all of head size 128: bf16 and fp8 caches, FA2 and
# FA3), built on this machine, which needs CUDA's compiler but no GPU, and packed as .cache/kernels.tar.xz in
# the layout bench/gpu.sh restores (fi_aot/<name>/<name>.so): a fresh GPU host then compiles none of them.
#
#   bench/prebuild_kernels.sh            (from the project root; carry .cache/kernels.tar.xz to the host)
#
# It installs, under $WORK (default /tmp/raylm-prebuild), the FlashInfer the GPU hosts run (0.5.3, with its
# tvm-ffi) for this machine's Python, and takes from PyPI the cuBLAS and cuRAND headers FlashInfer's sources
# include, which a compiler-only CUDA lacks. Seen on a 2-core machine with nvcc 13.0: about 10 minutes, FA3's
# module the longest (4); 3.6 MB packed.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=${WORK:-/tmp/raylm-prebuild}
ARCH=${ARCH:-9.0a}
# CUDA's folder: $CUDA_HOME, or the newest /usr/local/cuda* that holds the compiler and the runtime's headers
CUDA=${CUDA_HOME:-}
if [ -z "$CUDA" ]; then
  for d in $(ls -d /usr/local/cuda /usr/local/cuda-* 2>/dev/null | sort -V -r); do
    [ -x "$d/bin/nvcc" ] && [ -f "$d/include/cuda_runtime.h" ] && { CUDA=$d; break; }
  done
fi
[ -n "$CUDA" ] || { echo "no CUDA compiler found: set CUDA_HOME (FlashInfer's modules need nvcc)" >&2; exit 1; }
mkdir -p "$WORK/site" "$WORK/wheels" "$WORK/headers"
pip_quiet() { python3 -m pip "$@" 2>&1 | grep -v -e '^WARNING: Location' -e 'as the .root. user' || true; }

if [ ! -d "$WORK/site/flashinfer" ]; then
  pip_quiet install -q --no-deps --target "$WORK/site" flashinfer-python==0.5.3 apache-tvm-ffi==0.1.15.post2 nvidia-ml-py
fi
# a CUDA folder of links with the headers the compiler-only install lacks beside its own
if [ ! -e "$WORK/cuda/include/cublasLt.h" ]; then
  pip_quiet download -q --no-deps -d "$WORK/wheels" "nvidia-cublas==13.*" "nvidia-curand==10.*"
  for w in "$WORK"/wheels/nvidia_*.whl; do
    python3 -m zipfile -e "$w" "$WORK/headers/$(basename "$w" .whl)"
  done
  rm -rf "$WORK/cuda" && mkdir -p "$WORK/cuda/include" "$WORK/cuda/lib64/stubs"
  for d in "$CUDA"/*; do
    case $(basename "$d") in include | lib64) ;; *) ln -s "$d" "$WORK/cuda/" ;; esac
  done
  ln -s "$CUDA"/include/* "$WORK/cuda/include/"
  ln -s "$CUDA"/lib64/* "$WORK/cuda/lib64/"
  # FlashInfer links its modules with -lcuda, which a machine without a driver lacks: an empty stub with the
  # driver's soname serves the link, and the real driver is loaded on the GPU host
  if [ ! -e "$CUDA/lib64/stubs/libcuda.so" ]; then
    echo 'void raylm_libcuda_stub(void) {}' > "$WORK/stub.c"
    cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$WORK/cuda/lib64/stubs/libcuda.so" "$WORK/stub.c"
  fi
  for h in "$WORK"/headers/*/nvidia/*/include/*; do
    [ -e "$WORK/cuda/include/$(basename "$h")" ] || ln -s "$h" "$WORK/cuda/include/"
  done
fi

MODEL=$(cd bench && python3 -c "from common import model_folder; print(model_folder('qwen3-0.6b'))")
OUT=$WORK/pack/fi_aot
mkdir -p "$OUT"
for kv in auto fp8_e4m3; do
  CUDA_HOME=$WORK/cuda PYTHONPATH=$WORK/site:$ROOT python3 -m worker.kernel_prebuild \
    --model "$MODEL" --kv-cache-dtype "$kv" --cuda-arch "$ARCH" --into "$OUT"
done
# and the two more modules the peer (mini-sglang, ../shared/peer) loads: FlashInfer's sampling and page ops
CUDA_HOME=$WORK/cuda PYTHONPATH=$WORK/site FLASHINFER_CUDA_ARCH_LIST=$ARCH python3 - "$OUT" <<'PY'
import shutil, sys
from pathlib import Path
from flashinfer.jit.page import gen_page_module
from flashinfer.jit.sampling import gen_sampling_module
for spec in (gen_sampling_module(), gen_page_module()):
    dest = Path(sys.argv[1]) / spec.name / f"{spec.name}.so"
    if not dest.exists():
        spec.build(verbose=False)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(spec.jit_library_path, dest)
    print(f"peer     {spec.name}")
PY
mkdir -p .cache
tar -C "$WORK/pack" -cf - fi_aot | xz -T0 -6 > .cache/kernels.tar.xz
echo "$(ls "$OUT" | wc -l) modules in .cache/kernels.tar.xz ($(du -h .cache/kernels.tar.xz | cut -f1)): carry it"
