"""cuBLASLt's matrix products at an algorithm chosen by timing: y = x @ w.T in half precision at decode
batches' row counts. torch's F.linear runs cuBLAS's own pick. cuBLASLt's heuristic lists several algorithms
for a shape (other tiles, split K), and at some shapes another is faster: on an H100
(bench/cublaslt_algos.py, 2026-12-06) Qwen3-8B's down at 256 rows took 46.5 us against F.linear's 53.2, its
o at 16 rows 14.7 against 16.9, and Qwen3-0.6B's four layers at 256 rows 7-11% less. An engine times them
at start, before its KV cache takes the memory (`tune_products`: its linear layers' shapes at its CUDA
graphs' batch sizes), and worker/layers/linear.py runs the winners (`tuned`). Called through ctypes on the
library torch has loaded, on torch's current stream, so a product is captured in a CUDA graph as any other
kernel is. The timings are kept between starts (`cache_file`), by GPU and library version.

    lt = LtLinear(m, n, k, torch.bfloat16, device)
    lt.tune(x, weights)    # once, outside any graph capture
    lt(x, w)               # x[m, k] @ w[n, k].T"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from worker.cache_home import cache_home

# cublasLt.h's values
_COMPUTE_32F = 68
_CUDA_R_32F, _CUDA_R_16F, _CUDA_R_16BF = 0, 2, 14
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_OP_N, _OP_T = 0, 1
_PREF_MAX_WORKSPACE_BYTES, _PREF_REDUCTION_SCHEME_MASK = 1, 3
# split K's partial sums added in the compute type (float32) only, never in the output's half precision
# (INPLACE and OUTPUT_TYPE): a split product then rounds once, as an unsplit one does; unsplit algorithms stay
_REDUCTION_COMPUTE_TYPE = 2
# the pointers the heuristic's algorithms assume (cuBLASLt's default minimum alignment)
ALIGNMENT = 256
_CONFIG_ID, _CONFIG_TILE_ID, _CONFIG_SPLITK_NUM, _CONFIG_STAGES_ID = 0, 1, 2, 6
_DTYPES = {torch.bfloat16: _CUDA_R_16BF, torch.float16: _CUDA_R_16F}

WORKSPACE_BYTES = 32 << 20  # what torch gives cuBLASLt on a Hopper GPU
REQUESTED_ALGOS = 32


class CublasLtError(RuntimeError):
    """A cuBLASLt call returned a status other than success."""


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [
        ("algo", _Algo),
        ("workspace_size", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("waves_count", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


@functools.cache
def _library() -> ctypes.CDLL:
    """The libcublasLt torch loaded (a product first makes it load it), found in this process's maps."""
    a = torch.ones(8, 8, device="cuda", dtype=torch.bfloat16)
    torch.nn.functional.linear(a, a, torch.zeros(8, device="cuda", dtype=torch.bfloat16))  # addmm: cuBLASLt
    torch.cuda.synchronize()
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcublasLt" in line}
    if not paths:
        raise CublasLtError("libcublasLt is not loaded in this process")
    lib = ctypes.CDLL(sorted(paths)[0])
    # every argument typed: an untyped Python int goes as a 32-bit int, and a size_t would read garbage above it
    vp, i32, size, out = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p)
    signatures = {
        "cublasLtCreate": [out],
        "cublasLtMatmulDescCreate": [out, i32, i32],
        "cublasLtMatmulDescSetAttribute": [vp, i32, vp, size],
        "cublasLtMatrixLayoutCreate": [out, i32, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64],
        "cublasLtMatmulPreferenceCreate": [out],
        "cublasLtMatmulPreferenceSetAttribute": [vp, i32, vp, size],
        "cublasLtMatmulPreferenceDestroy": [vp],
        "cublasLtMatmulAlgoGetHeuristic": [vp] * 7 + [i32, ctypes.POINTER(_Heuristic), ctypes.POINTER(i32)],
        "cublasLtMatmulAlgoConfigGetAttribute": [ctypes.POINTER(_Algo), i32, vp, size, ctypes.POINTER(size)],
        "cublasLtMatmul": [vp] * 12 + [ctypes.POINTER(_Algo), vp, size, vp],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, i32
    lib.cublasLtGetVersion.argtypes, lib.cublasLtGetVersion.restype = [], size
    return lib


def _check(status: int, call: str) -> None:
    if status != 0:
        raise CublasLtError(f"{call} returned cuBLAS status {status}")


@functools.cache
def _handle() -> ctypes.c_void_p:
    handle = ctypes.c_void_p()
    _check(_library().cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    return handle


# one workspace a stream for the algorithms that need one (split K), as torch keeps cuBLASLt's: products on
# two streams may run at once, and a graph captured on a stream keeps that stream's workspace (never freed:
# a captured graph may still use it)
_WORKSPACES: dict[int, torch.Tensor] = {}


def _workspace(stream: torch.cuda.Stream) -> torch.Tensor:
    ws = _WORKSPACES.get(stream.cuda_stream)
    if ws is None:
        ws = _WORKSPACES[stream.cuda_stream] = _new_workspace(stream.device)
    return ws


def _new_workspace(device: torch.device) -> torch.Tensor:
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


@dataclass(frozen=True)
class AlgoInfo:
    """What an algorithm is, as cuBLASLt's configuration attributes read: its id, tile, K splits and
    pipeline stages (ids of cublasLt.h's enums), and the waves its programs make on this GPU."""

    algo_id: int
    tile_id: int
    split_k: int
    stages_id: int
    waves: float


class LtLinear:
    """One shape's product, its descriptors made once: out[m, n] = x[m, k] @ w[n, k].T (row-major), which
    column-major cuBLASLt computes as out.T = op_T(w as k x n) @ (x as k x m)."""

    def __init__(self, m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> None:
        lib, c = _library(), _DTYPES[dtype]
        self.m, self.n, self.k, self.device = m, n, k, device
        self.desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, _CUDA_R_32F), "MatmulDescCreate")
        for attr, value in ((_DESC_TRANSA, _OP_T), (_DESC_TRANSB, _OP_N)):
            v = ctypes.c_int32(value)
            _check(
                lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(v), ctypes.sizeof(v)),
                "MatmulDescSetAttribute",
            )
        self.a, self.b, self.c = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        for layout, rows, cols, ld in ((self.a, k, n, k), (self.b, k, m, k), (self.c, n, m, n)):
            _check(
                lib.cublasLtMatrixLayoutCreate(
                    ctypes.byref(layout), c, ctypes.c_uint64(rows), ctypes.c_uint64(cols), ctypes.c_int64(ld)
                ),
                "MatrixLayoutCreate",
            )
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self.candidates = self._heuristics()
        self.choice = self.candidates[0]  # cuBLASLt's own first pick until tuned
        self.baseline_us = self.best_us = float("nan")

    def _heuristics(self) -> list[_Heuristic]:
        lib = _library()
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "MatmulPreferenceCreate")
        size = ctypes.c_uint64(WORKSPACE_BYTES)
        reduction = ctypes.c_uint32(_REDUCTION_COMPUTE_TYPE)
        for attr, value in ((_PREF_MAX_WORKSPACE_BYTES, size), (_PREF_REDUCTION_SCHEME_MASK, reduction)):
            _check(
                lib.cublasLtMatmulPreferenceSetAttribute(pref, attr, ctypes.byref(value), ctypes.sizeof(value)),
                "MatmulPreferenceSetAttribute",
            )
        results = (_Heuristic * REQUESTED_ALGOS)()
        found = ctypes.c_int(0)
        _check(
            lib.cublasLtMatmulAlgoGetHeuristic(
                _handle(),
                self.desc,
                self.a,
                self.b,
                self.c,
                self.c,
                pref,
                REQUESTED_ALGOS,
                results,
                ctypes.byref(found),
            ),
            "MatmulAlgoGetHeuristic",
        )
        lib.cublasLtMatmulPreferenceDestroy(pref)
        picks = [_Heuristic.from_buffer_copy(results[i]) for i in range(found.value) if results[i].state == 0]
        if not picks:
            raise CublasLtError(f"cuBLASLt has no algorithm for {self.m} x {self.n} x {self.k}")
        return picks

    def info(self, index: int) -> AlgoInfo:
        """Candidate `index`'s configuration."""
        lib, algo = _library(), self.candidates[index].algo
        values = []
        for attr in (_CONFIG_ID, _CONFIG_TILE_ID, _CONFIG_SPLITK_NUM, _CONFIG_STAGES_ID):
            v, written = ctypes.c_uint32(0), ctypes.c_size_t(0)
            lib.cublasLtMatmulAlgoConfigGetAttribute(
                ctypes.byref(algo), attr, ctypes.byref(v), ctypes.sizeof(v), ctypes.byref(written)
            )
            values.append(v.value)
        return AlgoInfo(*values, waves=self.candidates[index].waves_count)

    @property
    def algo(self) -> _Algo:
        return self.choice.algo

    def run(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        out: torch.Tensor | None = None,
        choice: _Heuristic | None = None,
        workspace: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """out = x @ w.T with candidate `choice` (the tuned one by default), on torch's current stream; an
        algorithm that needs a workspace takes `workspace`, or else the stream's."""
        choice = choice or self.choice
        if out is None:
            out = torch.empty(self.m, self.n, dtype=x.dtype, device=x.device)
        if x.shape != (self.m, self.k) or w.shape != (self.n, self.k) or out.shape != (self.m, self.n):
            raise ValueError(f"shapes {tuple(x.shape)}, {tuple(w.shape)}, {tuple(out.shape)} are not this product's")
        if not (x.is_contiguous() and w.is_contiguous() and out.is_contiguous()):
            raise ValueError("x, w and out must be contiguous")
        stream = torch.cuda.current_stream(self.device)
        need = choice.workspace_size
        ws = None if need == 0 else workspace if workspace is not None else _workspace(stream)
        _check(
            _library().cublasLtMatmul(
                _handle(),
                self.desc,
                ctypes.byref(self.alpha),
                ctypes.c_void_p(w.data_ptr()),
                self.a,
                ctypes.c_void_p(x.data_ptr()),
                self.b,
                ctypes.byref(self.beta),
                ctypes.c_void_p(out.data_ptr()),
                self.c,
                ctypes.c_void_p(out.data_ptr()),
                self.c,
                ctypes.byref(choice.algo),
                ctypes.c_void_p(None if ws is None else ws.data_ptr()),
                ctypes.c_size_t(0 if ws is None else ws.numel()),
                ctypes.c_void_p(stream.cuda_stream),
            ),
            "cublasLtMatmul",
        )
        return out

    __call__ = run

    def tune(
        self, x: torch.Tensor, weights: list[torch.Tensor], reps: int = 10, workspace: torch.Tensor | None = None
    ) -> list[float]:
        """Times every candidate, and F.linear beside them (`baseline_us`), over `weights` (distinct copies,
        so that L2 holds none of them), keeps the fastest candidate as this product's algorithm, and returns
        each candidate's median microseconds a call. The timings' algorithms share `workspace` (one of
        their own by default), not a stream's. Not inside a graph capture."""
        out = torch.empty(self.m, self.n, dtype=x.dtype, device=x.device)
        ws = workspace if workspace is not None else _new_workspace(x.device)
        timings = [
            _graph_us(lambda w, c=cand: self.run(x, w, out, c, ws), weights, self.device, reps)
            for cand in self.candidates
        ]
        self.baseline_us = _graph_us(lambda w: F.linear(x, w), weights, self.device, reps)
        best = min(range(len(self.candidates)), key=timings.__getitem__)
        self.choice, self.best_us = self.candidates[best], timings[best]
        return timings


@functools.cache
def _timing_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream a device for every timing graph."""
    return torch.cuda.Stream(device)


def _graph_us(
    call: Callable[[torch.Tensor], object], weights: list[torch.Tensor], device: torch.device, reps: int
) -> float:
    """Median microseconds of `call(w)` a weight, over `reps` replays of a CUDA graph calling it once for each
    of `weights` (so the host's launch cost stays out of the figure); run once outside the graph first."""
    side = _timing_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for w in weights:
            call(w)
    side.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        for w in weights:
            call(w)
    return replay_median_us(graph, reps, len(weights))


def replay_median_us(graph: torch.cuda.CUDAGraph, reps: int, calls: int = 1) -> float:
    """Median microseconds of one of a captured graph's `calls` calls, over `reps` timed replays after one
    untimed replay."""
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


# -- the products an engine tunes at start ---------------------------------------------------------------

# A tuned algorithm replaces F.linear only where it was at least this much faster (timing noise aside)
MIN_GAIN = 0.02
# Copies of a weight timed in turn: at least this many bytes, past any GPU's L2 (an H100's or H200's 50 MB)
L2_FLUSH_BYTES = 128 << 20
# but no more copies than this: a small weight (a router's, a tiny test model's) would take a hundred
# thousand, each a node of every candidate's timing graph (minutes at start); below 1 MB its copies then
# stay partly in L2, for F.linear's timing as for the candidates'
MAX_WEIGHT_COPIES = 128


def weight_copies(n: int, k: int, dtype: torch.dtype) -> int:
    """How many copies of an [n, k] weight a tuning times in turn."""
    return max(1, min(MAX_WEIGHT_COPIES, -(-L2_FLUSH_BYTES // (n * k * dtype.itemsize))))


_TUNED: dict[tuple[int, int, int, torch.dtype, int | None], LtLinear] = {}


@dataclass(frozen=True)
class TunedProduct:
    """One product's tuning: x [m, k] @ w [n, k].T, F.linear's microseconds and the fastest algorithm's,
    whether that algorithm now runs it, and whether its timings came from an earlier start."""

    m: int
    n: int
    k: int
    baseline_us: float
    best_us: float
    chosen: bool
    cached: bool = False  # its timings read from the cache file, not taken at this start


def tuned(x: torch.Tensor, weight: torch.Tensor) -> LtLinear | None:
    """The tuned product for x @ weight.T, where `tune_products` found one faster than F.linear, and the
    operands are as its algorithm assumes (one dtype, aligned as the heuristic takes them)."""
    if not _TUNED or x.dtype != weight.dtype or x.data_ptr() % ALIGNMENT or weight.data_ptr() % ALIGNMENT:
        return None
    return _TUNED.get((x.shape[0], weight.shape[0], weight.shape[1], x.dtype, x.device.index))


def forget() -> None:
    """Drops every tuned product: linear layers go back to F.linear until products are tuned again."""
    _TUNED.clear()


def tune_products(
    shapes: set[tuple[int, int]], rows: list[int], dtype: torch.dtype, device: torch.device
) -> list[TunedProduct]:
    """Times cuBLASLt's algorithms for each weight shape (n, k) at each row count against F.linear, on random
    operands, and hands out (`tuned`) every algorithm that won by MIN_GAIN, all at once at the end (a failure
    midway hands out nothing). Timings are kept in the cache file for this GPU and cuBLASLt, so a later start
    times only what it has not seen. The operands and the timings' workspace are freed after (and torch's
    cache of them emptied), so a KV cache sized after this gets that memory back."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    path = cache_file()
    cache, where = read_cache(path) if path else {}, _platform(device)
    results, timed, winners, losers = [], {}, {}, {}
    workspace = _new_workspace(device) if device.type == "cuda" else None
    try:
        for n, k in sorted(shapes):
            weights: list[torch.Tensor] = []
            for m in rows:
                try:
                    lt = LtLinear(m, n, k, dtype, device)
                except CublasLtError:  # no algorithm for this shape: it stays on F.linear
                    continue
                key = cache_key(where, dtype, m, n, k)
                record = cache.get(key)
                kept = kept_choice(record, lt.candidates)
                cached = kept is not None
                if cached:
                    lt.choice = kept
                    lt.best_us, lt.baseline_us = record["best_us"], record["baseline_us"]
                else:
                    if not weights:  # enough copies to pass L2, made once a shape
                        copies = weight_copies(n, k, dtype)
                        weights = [torch.randn(n, k, dtype=dtype, device=device) * 0.05 for _ in range(copies)]
                    lt.tune(torch.randn(m, k, dtype=dtype, device=device), weights, workspace=workspace)
                    timed[key] = {"algo": algo_id(lt.choice), "best_us": lt.best_us, "baseline_us": lt.baseline_us}
                chosen = lt.best_us <= lt.baseline_us * (1 - MIN_GAIN)
                (winners if chosen else losers)[(m, n, k, dtype, device.index)] = lt
                results.append(TunedProduct(m, n, k, lt.baseline_us, lt.best_us, chosen, cached))
            del weights
    finally:
        del workspace
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
    if timed and path:
        write_cache(path, timed)
    for key in losers:  # an earlier engine's winner that lost here
        _TUNED.pop(key, None)
    _TUNED.update(winners)
    return results


# -- the timings kept between starts ----------------------------------------------------------------------

# where the timings are kept (None: `cache_file`'s default, under $XDG_CACHE_HOME or ~/.cache)
CACHE_FILE: Path | None = None


def cache_file() -> Path | None:
    """The file of kept timings; None where no home folder can be found (every start then times afresh)."""
    if CACHE_FILE is not None:
        return CACHE_FILE
    try:
        return cache_home() / "gemm_tuning.json"
    except RuntimeError:  # no $HOME and no user entry (a container's arbitrary uid)
        return None


def _platform(device: torch.device) -> str:
    """What a timing holds for: the GPU's name, cuBLASLt's version, the CUDA and torch versions (the
    heuristic's list and F.linear's own pick follow from these) and the heuristic's preferences."""
    return (
        f"{torch.cuda.get_device_name(device)}|cublasLt {_library().cublasLtGetVersion()}|cuda {torch.version.cuda}"
        f"|torch {torch.__version__}"
        f"|{REQUESTED_ALGOS} algorithms, workspace {WORKSPACE_BYTES}, reduction {_REDUCTION_COMPUTE_TYPE}"
    )


def cache_key(platform: str, dtype: torch.dtype, m: int, n: int, k: int) -> str:
    return f"{platform}|{str(dtype).removeprefix('torch.')}|{m}x{n}x{k}"


def algo_id(candidate: _Heuristic) -> str:
    """A listed algorithm's identity across starts: its configuration's bytes, in hex."""
    return bytes(candidate.algo).hex()


def kept_choice(record: object, candidates: list[_Heuristic]) -> _Heuristic | None:
    """The listed algorithm a kept timing picked, where the heuristic still lists it and the timing's
    figures are numbers; None otherwise (the product is timed again)."""
    if not isinstance(record, dict):
        return None
    if not all(isinstance(record.get(t), int | float) for t in ("best_us", "baseline_us")):
        return None
    return next((c for c in candidates if algo_id(c) == record.get("algo")), None)


def read_cache(path: Path) -> dict[str, dict]:
    """The timings kept at `path` ({} where there are none, or the file is not a JSON object)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_cache(path: Path, records: dict[str, dict]) -> None:
    """Adds `records` to the timings at `path`, written whole to a file beside it and moved over it, so a
    reader (another engine starting on this host) sees the old file or the new one, never part of one. A
    cache that cannot be written is left as it is: the next start times those products again."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        merged = {**read_cache(path), **records}
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name, suffix=".tmp", delete=False) as f:
            tmp = f.name
            json.dump(merged, f, indent=0, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
