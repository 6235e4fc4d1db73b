"""FlashInfer paged attention (CUDA, float16/bfloat16 queries over a KV cache of the same dtype or of
float8 e4m3): a prefill wrapper (FA3 on Hopper, FA2 otherwise and for a float8 cache; causal) for extend
steps, a decode wrapper for decode steps, and one CUDA-graph decode wrapper per captured batch size.

The pool's pages are FlashInfer's pages (NHD layout). The page table holds token locations
(page * page_size + offset); a request's page ids are its row's locations at positions 0, page_size,
2 * page_size, ... divided by page_size, gathered on the device so the host never reads the table.

Planning runs on whatever stream is current (the engine's scheduler stream). Everything a plan
writes on the device (index buffers, FlashInfer's int workspace) is shared from step to step, so the
caller must order a plan after the previous step's attention kernels (the engine's `inputs_free`
event); `stage`, the plan's arrays copied into a staging ring of their own, need not wait, and the
engine runs it before. FlashInfer's plan also rewrites a pinned host buffer and copies from it asynchronously; the
`_plan_copied` event keeps the next plan from rewriting it while that copy may be pending."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from worker.attention.base import AttentionBackend
from worker.batch import BatchDesc, ForwardBatch
from worker.kv_cache import KVCachePool
from worker.staging import PinnedStaging, Staged
from worker.stream import HostWaits, current_stream, new_event

WORKSPACE_BYTES = 256 << 20  # FlashInfer's float workspace (split-KV partial results), shared by all wrappers
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
# a float8 cache is dequantized inside the kernels: FA2's prefill and both decode paths take it beside
# half-precision queries; FlashInfer 0.5.3's FA3 does not build for it. Its values are unscaled
# (worker/kv_cache.py), so run() gets no k_scale / v_scale (each would cost a multiply, v_scale a kernel).
FP8_KV_DTYPES = (torch.float8_e4m3fn,)
FA3_HEAD_DIMS = (64, 128, 256)
# Decode kernels by batch size over a half-precision cache (the faster on each side, docs/BENCHMARKS.md): the
# Triton split-KV kernel (triton_decode_rows) in every pure decode step on the GPUs it was measured ahead on
# (EVERY_STEP_MIN_CAPABILITY), with its programs started longest request first (Kernels.decode_order); a
# mixed step's decode rows, and every decode step on older GPUs, above TENSOR_CORE_ABOVE_BATCH rows on
# FlashInfer's tensor-core path (its prefill kernels, one query a row) and at and below it on the Triton
# kernel, lighter than FlashInfer's CUDA-core kernels and their merge at small batches. The graph buckets up to 8
# are 1, 2, 4, 8, so an eager step of n rows and the graph it would pad to use the same kernel.
# Kernels.decode forces one path (to compare). On an H100 (2026-12-06) the Triton kernel longest first took
# 308.7, 152.2 and 84.8 us a layer at 256, 128 and 64 rows against FlashInfer's 319.8, 161.8 and 88.0
# (bench/fp8_decode.py, Qwen3-0.6B's heads, lengths 150..1600). End to end, with the Triton kernel in every
# pure decode step (then Kernels.decode triton_steps), c430cfc: (a) 20,794 output tok/s (20,776 and
# 20,813) against 20,107 (20,036 and 20,179) with FlashInfer above 8 rows, 1.034x; Qwen3-8B's (a) 8,405
# against 8,313 (one run each), 1.011x. With it on a mixed step's decode rows too (decode triton), (a)'s
# extend steps took 421-485 ms of GPU time against 386 and (a) came out even (8ffc840): those stay on
# FlashInfer.
TENSOR_CORE_ABOVE_BATCH = 8


# a batch size no decode step reaches: "every decode step" in triton_decode_rows
EVERY_BATCH = 1 << 30
# the compute capability from which auto runs the Triton kernel in every pure decode step over a
# half-precision cache: Hopper, where it was measured ahead (above); FlashInfer's tensor cores above
# TENSOR_CORE_ABOVE_BATCH rows on older GPUs, where the two were never compared
EVERY_STEP_MIN_CAPABILITY = (9, 0)


def triton_decode_rows(kv_dtype: torch.dtype, device: torch.device, choice: str = "auto", mixed: bool = False) -> int:
    """The largest decode batch that worker/triton_decode.py's kernel attends instead of FlashInfer's (0:
    none); `mixed`: of the decode rows of an extend step (a mixed step). Every batch when `choice`
    (Kernels.decode) is triton, and by default over a float8 cache, which FlashInfer 0.5.3's decode
    kernels read far below the memory's speed (they dequantize slowly). By default over a half-precision
    cache, every pure decode step from EVERY_STEP_MIN_CAPABILITY (triton_steps asks for that on any GPU),
    and a mixed step's decode rows (every decode step on older GPUs) up to TENSOR_CORE_ABOVE_BATCH rows,
    where FlashInfer's CUDA-core kernel and its merge of split results took 15-18 us a layer at batch 1 on
    Qwen3-8B's and Qwen3-30B-A3B's heads (docs/BENCHMARKS.md); above, FlashInfer's tensor cores. None when
    `choice` forces a FlashInfer path. Needs Triton, and for float8 a GPU that converts it (compute
    capability 8.9 and up)."""
    if choice not in ("auto", "triton", "triton_steps"):
        return 0
    from worker import triton_ops

    if device.type != "cuda" or not triton_ops.triton_installed():
        return 0
    if not triton_ops.cache_dtype_supported(kv_dtype, device):
        return 0
    if choice == "triton" or kv_dtype in FP8_KV_DTYPES:
        return EVERY_BATCH
    every_step = choice == "triton_steps" or triton_ops.capability(device) >= EVERY_STEP_MIN_CAPABILITY
    return EVERY_BATCH if every_step and not mixed else TENSOR_CORE_ABOVE_BATCH


def decodes_with_triton(
    kv_dtype: torch.dtype, device: torch.device, choice: str = "auto", batch_size: int = 1, mixed: bool = False
) -> bool:
    """Whether a decode step of `batch_size` rows (`mixed`: a mixed step's decode rows) runs
    worker/triton_decode.py's kernel (triton_decode_rows)."""
    return batch_size <= triton_decode_rows(kv_dtype, device, choice, mixed)


def triton_decode_splits(batch_size: int, num_kv_heads: int, num_sms: int) -> int:
    """Splits of a request's KV in a Triton decode step: at and below TENSOR_CORE_ABOVE_BATCH rows the
    batch-1 count for every size, so that a request's result depends on its own KV alone and not on
    how many requests decode beside it (the graph buckets 1, 2, 4 and 8 agree); above, the count that
    fills the GPU at that size."""
    from worker import triton_decode

    small = batch_size <= TENSOR_CORE_ABOVE_BATCH
    return triton_decode.decode_num_splits(1 if small else batch_size, num_kv_heads, num_sms)


# FlashInfer's planner sizes split-KV work to two CTAs a multiprocessor (batch_prefill.cu's PrefillPlan)
SPLIT_CTAS_PER_SM = 2


def whole_kv_decode(batch_size: int, num_kv_heads: int, num_sms: int) -> bool:
    """Whether FlashInfer's tensor-core decode attends each request's KV in one chunk anyway: its planner
    splits KV only while the batch's (request, kv head) pairs fit in two CTAs a multiprocessor. In a
    CUDA graph it still plans such a batch as split, so every layer writes partial results and launches a
    merge that only copies them back (2% of (a)'s decode step at batch 256); `disable_split_kv` drops both
    and computes the same."""
    return batch_size * num_kv_heads > SPLIT_CTAS_PER_SM * num_sms


def exact_decode_grid(wrapper: object, batch_size: int, group: int) -> bool:
    """Cuts a tensor-core decode plan's grid to the scheduler entries it wrote. FlashInfer 0.5.3's
    CUDA-graph plan without split-KV still pads its grid to the split plan's size, and the padded CTAs
    would read entries the plan never wrote (flashinfer-ai/flashinfer#4002). A decode row's query heads
    (`group` of them) fill part of one query tile, so the entries are one a request: fixed by the batch
    size, the same at capture and at every replay. The plan's fields: PrefillPlanInfo::ToVector. False
    (the plan left as it is) where the fields are not that layout (another FlashInfer)."""
    info = getattr(wrapper, "_plan_info", None)
    if info is None or len(info) != _PLAN_INFO_FIELDS:
        return False
    values = [int(v) for v in info]
    padded, cta_tile_q, enable_cuda_graph, split_kv = values[0], values[3], values[13], values[14]
    entries = batch_size * -(-group // cta_tile_q)
    if enable_cuda_graph and not split_kv and padded > entries:
        values[0] = entries
        wrapper._plan_info = type(info)(values)
    return True


_PLAN_INFO_FIELDS = 15  # FlashInfer 0.5.3's PrefillPlanInfo


def use_tensor_cores(batch_size: int, choice: str = "auto") -> bool:
    """FlashInfer's decode path for a batch: its tensor-core kernels, or its CUDA-core ones."""
    if choice not in ("auto", "triton_steps"):
        return choice == "tensor_cores"
    return batch_size > TENSOR_CORE_ABOVE_BATCH


def prefill_backend(
    device: torch.device, head_dim: int, kv_dtype: torch.dtype = torch.bfloat16, choice: str = "auto"
) -> str:
    """FlashInfer's backend for extend steps. auto: FA3 on Hopper, where its paged prefill beats FA2; FA2
    elsewhere, for head sizes FA3 lacks and for a float8 cache. fa2 / fa3: that one, where it builds."""
    builds = device.type == "cuda" and fa3_builds(torch.cuda.get_device_capability(device)[0], head_dim, kv_dtype)
    if choice == "fa3" and not builds:
        raise ValueError(
            f"FlashInfer's FA3 prefill needs a Hopper GPU, head_dim in {FA3_HEAD_DIMS} and a half-precision "
            f"KV cache (here head_dim {head_dim}, cache {kv_dtype}); use Kernels(prefill='fa2') or 'auto'"
        )
    if choice == "auto":
        return "fa3" if builds else "fa2"
    return choice


def fa3_builds(major: int, head_dim: int, kv_dtype: torch.dtype) -> bool:
    """Whether FlashInfer 0.5's FA3 prefill builds: Hopper (compute capability 9.x), its head sizes, a
    half-precision cache."""
    return major == 9 and head_dim in FA3_HEAD_DIMS and kv_dtype in SUPPORTED_DTYPES


@dataclass
class _PlanArrays:
    """`FlashInferBackend.stage`'s result: a step's plan arrays, staged, for its `_plan`."""

    desc: BatchDesc | None
    rows: int  # the plan's batch size (a graph's bucket: rows past n are padding)
    n: int  # the step's requests
    num_real: int  # their pages
    staged: Staged
    # an extend step's leading one-token rows (its decodes, in a mixed step) attended by the decode
    # kernels, and their pages; 0 when the prefill kernel takes every row
    decode_rows: int = 0
    decode_pages: int = 0


class FlashInferBackend(AttentionBackend):
    def __init__(
        self,
        kv: KVCachePool,
        page_table: torch.Tensor,
        num_heads: int,
        q_dtype: torch.dtype | None = None,
        decode: str = "auto",
        waits: HostWaits | None = None,
        prefill: str = "auto",
        pdl: bool = False,
        merge: str = "auto",
        longest_first: bool = False,
    ) -> None:
        """q_dtype: the queries' (the model's) dtype; None: the cache's, or bfloat16 over a float8 cache.
        decode: Kernels.decode. waits: where the host's waits are counted (the engine's). prefill:
        Kernels.prefill. pdl: the Triton decode kernels launched with programmatic dependent launch
        (triton_ops.pdl_applies). merge: Kernels.decode_merge. longest_first: the Triton decode kernel starts
        the longest requests' programs first (Kernels.decode_longest_first)."""
        import flashinfer  # imported here: the package exists on GPU hosts only

        q_dtype = q_dtype or (torch.bfloat16 if kv.dtype in FP8_KV_DTYPES else kv.dtype)
        if q_dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"FlashInfer attention runs in float16 or bfloat16, not {q_dtype}; "
                f"use the torch backend (Kernels(attention='torch')) for {q_dtype}"
            )
        if kv.dtype != q_dtype and kv.dtype not in FP8_KV_DTYPES:
            raise ValueError(
                f"FlashInfer reads a KV cache of the model's dtype ({q_dtype}) or float8 e4m3, not {kv.dtype}"
            )
        self.flashinfer = flashinfer
        self.q_dtype = q_dtype
        self.decode_choice = decode
        self.pdl = pdl
        self.merge_in_last = {"auto": None, "launch": False, "last": True}[merge]
        self.longest_first = longest_first
        self.waits = waits or HostWaits()
        # tvm-ffi launches FlashInfer's kernels on torch's current stream when torch exports its DLPack
        # exchange API; without it they would go to the default stream, so the stream is set by hand
        if hasattr(torch.Tensor, "__dlpack_c_exchange_api__"):
            self._on_torch_stream = contextlib.nullcontext
        else:
            import tvm_ffi

            self._on_torch_stream = tvm_ffi.use_torch_stream
        self.kv, self.page_table = kv, page_table
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, kv.num_kv_heads, kv.head_dim
        self.page_size = kv.page_size
        device = kv.device
        rows, row_len = page_table.shape
        if rows * row_len >= 2**31:
            raise ValueError(f"a page table of {rows} x {row_len} entries is too large for int32 indexing")
        self.row_len = row_len
        layers = kv.buffer.shape[1]
        shape = (-1, self.page_size, self.num_kv_heads, self.head_dim)
        self.caches = [(kv.k(i).view(shape), kv.v(i).view(shape)) for i in range(layers)]
        # every row full, plus one scratch page for each padded row of a CUDA-graph batch
        capacity = rows * -(-row_len // self.page_size) + rows
        self.kv_indices = torch.zeros(capacity, dtype=torch.int32, device=device)
        self.page_starts = np.arange(capacity, dtype=np.int32) * self.page_size
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend=prefill_backend(device, self.head_dim, kv.dtype, prefill)
        )
        self.decode_wrappers = {
            tc: flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=tc)
            for tc in (False, True)
        }
        self.graph_wrappers: dict[int, object] = {}
        self.graph_indptr = torch.zeros(rows + 1, dtype=torch.int32, device=device)
        self.graph_last_page_len = torch.ones(rows, dtype=torch.int32, device=device)
        self.graph_order = torch.arange(rows, dtype=torch.int32, device=device)  # the Triton decode's `order`
        self.staging = PinnedStaging(device, capacity=1 << 16, waits=self.waits)
        self._plan_copied = new_event(device)
        self.wrapper = self.decode_wrappers[True]
        self.out_loc: torch.Tensor | None = None
        # the decode steps (graphs too) of up to this many rows run the Triton kernel, and the decode rows
        # of a mixed step up to mixed_triton_rows
        self.triton_rows = triton_decode_rows(kv.dtype, device, decode)
        self.mixed_triton_rows = triton_decode_rows(kv.dtype, device, decode, mixed=True)
        self._decode: _TritonDecode | None = None  # this step's, when the Triton kernel attends
        self._split: _SplitStep | None = None  # this step's, when an extend step's decode rows attend apart
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        # whether decode plans past the split bound drop FlashInfer's no-op split (whole_kv_decode); off for
        # good once a plan's fields turn out not to be the layout exact_decode_grid cuts
        self._whole_kv = True
        if self.triton_decode:
            from worker import triton_decode

            self._triton = triton_decode
            # the split results of any batch of bs <= rows: above TENSOR_CORE_ABOVE_BATCH rows
            # decode_num_splits gives ceil(4 SMs / (bs kv heads)) splits at most, so bs * splits < 4 SMs + bs;
            # at and below, the batch-1 count (at most MAX_SPLITS) for each of up to that many rows
            most = max(rows + 4 * self.num_sms, TENSOR_CORE_ABOVE_BATCH * triton_decode.MAX_SPLITS)
            self._part_out = torch.empty(most * num_heads * self.head_dim, dtype=torch.float32, device=device)
            self._part_lse = torch.empty(most * num_heads, dtype=torch.float32, device=device)
            # each (request, kv head)'s count of finished splits, for the merge in the last (merge_in_last)
            self._arrivals = torch.zeros(rows * self.num_kv_heads, dtype=torch.int32, device=device)

    @property
    def triton_decode(self) -> bool:
        """Whether some decode steps run the Triton kernel."""
        return self.triton_rows > 0

    # -- planning ------------------------------------------------------------------------------------

    def prepare(self, batch: ForwardBatch, staged: _PlanArrays | None = None) -> None:
        desc = batch.desc
        if desc.is_prefill:
            wrapper = self.prefill_wrapper
        elif desc.batch_size <= self.triton_rows:
            wrapper = None
        else:
            wrapper = self.decode_wrappers[use_tensor_cores(desc.batch_size, self.decode_choice)]
        self._plan(wrapper, staged or self.stage(desc, desc.batch_size), scratch_page=-1)
        self.wrapper, self.out_loc = wrapper, batch.out_loc

    def prepare_graph(
        self,
        desc: BatchDesc | None,
        bs: int,
        out_loc: torch.Tensor,
        scratch_page: int,
        staged: _PlanArrays | None = None,
    ) -> None:
        """Plans the CUDA-graph decode wrapper of batch size `bs` (made on first use) for `desc`; the rows
        past the batch (every row when `desc` is None, at capture) attend over the scratch page only."""
        wrapper = self.graph_wrappers.get(bs)
        if wrapper is None and bs > self.triton_rows:
            wrapper = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=use_tensor_cores(bs, self.decode_choice),
                paged_kv_indptr_buffer=self.graph_indptr[: bs + 1],
                paged_kv_indices_buffer=self.kv_indices,
                paged_kv_last_page_len_buffer=self.graph_last_page_len[:bs],
            )
            self.graph_wrappers[bs] = wrapper
        self._plan(wrapper, staged or self.stage(desc, bs), scratch_page)
        self.wrapper, self.out_loc = wrapper, out_loc

    def stage(self, desc: BatchDesc | None, rows: int) -> _PlanArrays:
        """The plan's arrays on the host and (one copy, into this backend's own staging ring) on the
        device: nothing the step in flight reads."""
        bs = rows
        n = 0 if desc is None else desc.batch_size
        seq = np.ones(bs, dtype=np.int64)  # padded rows: one token on the scratch page
        slots = np.zeros(bs, dtype=np.int64)
        if n:
            seq[:n] = desc.seq_lens
            slots[:n] = desc.slots
        pages = -(-seq // self.page_size)
        kv_indptr = np.zeros(bs + 1, dtype=np.int32)
        np.cumsum(pages, out=kv_indptr[1:])
        last_page_len = (seq - (pages - 1) * self.page_size).astype(np.int32)
        num_real = int(kv_indptr[n])
        # the page-table cell holding request i's page j is base[i] + page_starts[kv_indptr[i] + j]
        # (computed here: one host array in the step's one copy, where the device would take three kernels)
        base = (slots[:n] * self.row_len - kv_indptr[:n].astype(np.int64) * self.page_size).astype(np.int32)
        arrays = {
            "kv_indptr": kv_indptr,
            "last_page_len": last_page_len,
            "cells": np.repeat(base, pages[:n]) + self.page_starts[:num_real],
        }
        if bs <= self.triton_rows and self._ordered(bs) and (desc is None or not desc.is_prefill):
            arrays["order"] = self._triton.longest_first(seq)  # padded rows (one token) last
        d = 0
        if desc is not None and desc.is_prefill:
            qo_indptr = np.zeros(n + 1, dtype=np.int32)
            np.cumsum(desc.extend_lens, out=qo_indptr[1:])
            arrays["qo_indptr"] = qo_indptr
            d = leading_single_token_rows(desc.extend_lens)
            if d == n:
                d = 0  # nothing to split off: the prefill kernel takes them all
            if d:
                arrays.update(split_plan_arrays(qo_indptr, kv_indptr, last_page_len, d))
                if d <= self.mixed_triton_rows and self._ordered(d):
                    arrays["decode_order"] = self._triton.longest_first(seq[:d])
        return _PlanArrays(desc, bs, n, num_real, self.staging.upload(arrays), d, int(kv_indptr[d]) if d else 0)

    def _plan(self, wrapper, plan: _PlanArrays, scratch_page: int) -> None:
        """The part that rewrites what the step before reads (the page ids, FlashInfer's buffers): after
        that step's forward."""
        desc, bs, n, num_real, staged = plan.desc, plan.rows, plan.n, plan.num_real, plan.staged
        if n:
            self._gather_page_ids(staged.device["cells"])
        if bs > n:
            self.kv_indices[num_real : num_real + bs - n].fill_(scratch_page)
        indices = self.kv_indices[: num_real + bs - n]
        self._decode = self._split = None
        if wrapper is None:  # a decode step through the Triton kernel: its arrays where graphs read them
            self._decode = self._plan_triton(staged, bs)
            staged.release(current_stream(self.kv.device))
            return
        self.waits.wait(self._plan_copied)  # FlashInfer's pinned plan buffer is free again
        h = staged.host
        dims = (self.num_heads, self.num_kv_heads, self.head_dim, self.page_size)
        types = {"q_data_type": self.q_dtype, "kv_data_type": self.kv.dtype, "non_blocking": True}
        if plan.decode_rows:
            self._split = self._plan_split(plan, indices, dims, types)
        else:
            with self._on_torch_stream():
                if desc is not None and desc.is_prefill:
                    wrapper.plan(
                        h["qo_indptr"], h["kv_indptr"], indices, h["last_page_len"], *dims, causal=True, **types
                    )
                else:
                    whole = (
                        self._whole_kv
                        and wrapper.use_tensor_cores
                        and whole_kv_decode(bs, self.num_kv_heads, self.num_sms)
                    )
                    wrapper.plan(h["kv_indptr"], indices, h["last_page_len"], *dims, disable_split_kv=whole, **types)
                    if whole and not exact_decode_grid(wrapper, bs, self.num_heads // self.num_kv_heads):
                        # a plan this code cannot cut: FlashInfer's own split plan, merge and all, from now on
                        self._whole_kv = False
                        wrapper.plan(h["kv_indptr"], indices, h["last_page_len"], *dims, **types)
        stream = current_stream(self.kv.device)
        self._plan_copied.record(stream)
        staged.release(stream)  # every reader of the staged arrays (copies, gathers, plan) is on this stream

    def _plan_split(self, plan: _PlanArrays, indices: torch.Tensor, dims: tuple, types: dict) -> _SplitStep:
        """Plans an extend step in two parts: its leading one-token rows (a mixed step's decodes) on the
        decode kernels, the prompt chunks after them on the prefill kernel. One prefill kernel over both
        would pad each decode row to a whole query tile and read its KV at that tile's cost."""
        d, pages, h = plan.decode_rows, plan.decode_pages, plan.staged.host
        decode: object
        with self._on_torch_stream():
            if d <= self.mixed_triton_rows:
                decode = self._plan_triton(plan.staged, d, prefix="decode_")
            else:
                decode = self.decode_wrappers[use_tensor_cores(d, self.decode_choice)]
                decode.plan(h["decode_kv_indptr"], indices[:pages], h["decode_last_page_len"], *dims, **types)
            self.prefill_wrapper.plan(
                h["prefill_qo_indptr"],
                h["prefill_kv_indptr"],
                indices[pages:],
                h["prefill_last_page_len"],
                *dims,
                causal=True,
                **types,
            )
        return _SplitStep(d, decode)

    def _plan_triton(self, staged: Staged, bs: int, prefix: str = "") -> _TritonDecode:
        indptr, last_page_len = self.graph_indptr[: bs + 1], self.graph_last_page_len[:bs]
        indptr.copy_(staged.device[prefix + "kv_indptr"], non_blocking=True)
        last_page_len.copy_(staged.device[prefix + "last_page_len"], non_blocking=True)
        splits = triton_decode_splits(bs, self.num_kv_heads, self.num_sms)
        order = None
        if self._ordered(bs):
            order = self.graph_order[:bs]
            order.copy_(staged.device[prefix + "order"], non_blocking=True)
        h, d = self.num_heads, self.head_dim
        scratch = self._triton.DecodeScratch(
            self._part_out[: bs * h * splits * d].view(bs, h, splits, d),
            self._part_lse[: bs * h * splits].view(bs, h, splits),
            self._arrivals,
        )
        return _TritonDecode(indptr, last_page_len, splits, scratch, order)

    def _ordered(self, rows: int) -> bool:
        """Whether a Triton decode of `rows` rows starts its programs longest request first: above
        TENSOR_CORE_ABOVE_BATCH rows, where a step's programs outnumber what the GPU holds at once
        (decode_num_splits fits them to about four times that). At and below, the batch-1 split count leaves
        every program room to start at once, and the order would only put a load before each program's first
        (measured at 64 rows and up: docs/BENCHMARKS.md)."""
        return self.longest_first and rows > TENSOR_CORE_ABOVE_BATCH

    def _gather_page_ids(self, cells: torch.Tensor) -> None:
        """kv_indices[:len(cells)] = each request's page ids, in order: the page table's token
        locations at those cells (each the first position of a page), divided by the page size."""
        out = self.kv_indices[: cells.numel()]
        torch.index_select(self.page_table.view(-1), 0, cells, out=out)
        if self.page_size > 1:
            out.floor_divide_(self.page_size)

    # -- attention -----------------------------------------------------------------------------------

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`out`: where the output goes (an extend graph's static buffer, worker/extend_graphs.py)."""
        if k is not None:
            self.kv.store(layer_id, self.out_loc, k, v)
        if (dec := self._decode) is not None:
            k_cache, v_cache = self.caches[layer_id]
            return self._triton.paged_decode(
                q,
                k_cache,
                v_cache,
                dec.indptr,
                self.kv_indices,
                dec.last_page_len,
                num_splits=dec.splits,
                scratch=dec.scratch,
                out=out,
                pdl=self.pdl,
                merge_in_last=self.merge_in_last,
                order=dec.order,
            )
        if (split := self._split) is not None:
            return self._forward_split(q, layer_id, split, out)
        with self._on_torch_stream():
            return self.wrapper.run(q, self.caches[layer_id], out=out)

    def _forward_split(
        self, q: torch.Tensor, layer_id: int, split: _SplitStep, out: torch.Tensor | None
    ) -> torch.Tensor:
        d, cache = split.decode_rows, self.caches[layer_id]
        out = torch.empty_like(q) if out is None else out
        if isinstance(split.decode, _TritonDecode):
            dec = split.decode
            self._triton.paged_decode(
                q[:d],
                *cache,
                dec.indptr,
                self.kv_indices,
                dec.last_page_len,
                num_splits=dec.splits,
                scratch=dec.scratch,
                out=out[:d],
                pdl=self.pdl,
                merge_in_last=self.merge_in_last,
                order=dec.order,
            )
        with self._on_torch_stream():
            if not isinstance(split.decode, _TritonDecode):
                split.decode.run(q[:d], cache, out=out[:d])
            self.prefill_wrapper.run(q[d:], cache, out=out[d:])
        return out


def leading_single_token_rows(extend_lens: np.ndarray) -> int:
    """How many rows at the front of an extend step compute one token each (a mixed step puts its
    decodes first)."""
    wide = np.flatnonzero(np.asarray(extend_lens) != 1)
    return int(wide[0]) if len(wide) else len(extend_lens)


def split_plan_arrays(
    qo_indptr: np.ndarray, kv_indptr: np.ndarray, last_page_len: np.ndarray, d: int
) -> dict[str, np.ndarray]:
    """The plan arrays of an extend step's first `d` rows (decode kernels) and of the rest (prefill
    kernel), each indexed from its own start."""
    return {
        "decode_kv_indptr": kv_indptr[: d + 1].copy(),
        "decode_last_page_len": last_page_len[:d].copy(),
        "prefill_qo_indptr": qo_indptr[d:] - qo_indptr[d],
        "prefill_kv_indptr": kv_indptr[d:] - kv_indptr[d],
        "prefill_last_page_len": last_page_len[d:].copy(),
    }


@dataclass
class _SplitStep:
    """An extend step planned in two parts (FlashInferBackend._plan_split)."""

    decode_rows: int
    decode: object  # the planned decode wrapper, or the Triton kernel's _TritonDecode


@dataclass
class _TritonDecode:
    """A decode step's launch arguments for worker/triton_decode.py (fixed addresses: graphs replay them)."""

    indptr: torch.Tensor
    last_page_len: torch.Tensor
    splits: int
    scratch: object
    order: torch.Tensor | None = None  # paged_decode's, longest first (Kernels.decode_longest_first)
