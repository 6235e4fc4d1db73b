"""FlashInfer's paged attention on a mixed step, checked against the torch reference backend: the
step's decode rows attend through the decode kernels and its prompt chunks through the prefill kernel,
and the two parts together are the step's attention."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker.attention.flashinfer_backend import (
    exact_decode_grid,
    leading_single_token_rows,
    prefill_backend,
    split_plan_arrays,
    whole_kv_decode,
)
from worker.batch import BatchDesc, ForwardBatch
from worker.kernels import Kernels

PAGE, ROWS, ROW_LEN, HEADS, KV_HEADS, HEAD_DIM = 16, 8, 2048, 16, 8, 128


def test_a_mixed_steps_leading_one_token_rows_are_split_off():
    assert leading_single_token_rows(np.array([1, 1, 1, 40, 1, 7])) == 3
    assert leading_single_token_rows(np.array([40, 1])) == 0
    assert leading_single_token_rows(np.array([1, 1])) == 2
    qo = np.array([0, 1, 2, 42, 49], dtype=np.int32)
    kv = np.array([0, 3, 10, 14, 20], dtype=np.int32)
    last = np.array([5, 16, 2, 9], dtype=np.int32)
    parts = split_plan_arrays(qo, kv, last, 2)
    assert parts["decode_kv_indptr"].tolist() == [0, 3, 10]
    assert parts["decode_last_page_len"].tolist() == [5, 16]
    assert parts["prefill_qo_indptr"].tolist() == [0, 40, 47]
    assert parts["prefill_kv_indptr"].tolist() == [0, 4, 10]
    assert parts["prefill_last_page_len"].tolist() == [2, 9]


def test_the_prefill_backend_follows_the_choice_and_refuses_fa3_where_it_does_not_build():
    cpu = torch.device("cpu")
    assert prefill_backend(cpu, 128) == "fa2"  # auto: FA3 only on Hopper
    assert prefill_backend(cpu, 128, torch.bfloat16, "fa2") == "fa2"
    with pytest.raises(ValueError, match="FA3 prefill needs a Hopper GPU"):
        prefill_backend(cpu, 128, torch.bfloat16, "fa3")
    with pytest.raises(ValueError, match="unknown prefill kernel 'fa4'"):
        Kernels(prefill="fa4")


def test_large_decode_batches_attend_each_requests_kv_whole():
    # FlashInfer splits KV only while (request, kv head) pairs fit in two CTAs a multiprocessor
    assert not whole_kv_decode(33, 8, 132) and whole_kv_decode(34, 8, 132)
    assert whole_kv_decode(256, 8, 132) and not whole_kv_decode(64, 4, 132) and whole_kv_decode(67, 4, 132)


class _Planned:
    def __init__(self, info: tuple[int, ...]):
        self._plan_info = info


def _plan_info(padded: int, cta_tile_q: int, graph: bool, split: bool) -> tuple[int, ...]:
    # PrefillPlanInfo::ToVector's 15 fields, the offsets made up
    return (padded, 256, 8, cta_tile_q, 16, 32, 48, 64, 80, 96, 0, 0, 0, int(graph), int(split))


def test_a_graph_plan_without_split_kv_launches_one_cta_a_request():
    w = _Planned(_plan_info(287, 16, graph=True, split=False))
    assert exact_decode_grid(w, 256, 2)
    assert w._plan_info == _plan_info(256, 16, graph=True, split=False) and isinstance(w._plan_info, tuple)
    # a group wider than one query tile takes two entries a request
    w = _Planned(_plan_info(300, 16, graph=True, split=False))
    exact_decode_grid(w, 100, 32)
    assert w._plan_info[0] == 200
    # split plans (the mask marks their padded CTAs) and eager plans (never padded) are left as they are
    for graph, split in ((True, True), (False, False)):
        w = _Planned(_plan_info(287, 16, graph, split))
        assert exact_decode_grid(w, 256, 2) and w._plan_info[0] == 287
    # a plan of another layout (another FlashInfer) is not touched, and the caller plans without the cut
    w = _Planned(_plan_info(287, 16, graph=True, split=False) + (0,))
    assert not exact_decode_grid(w, 256, 2) and w._plan_info[0] == 287


def _mixed_desc(extend: list[int], seq: list[int]) -> BatchDesc:
    b, t = len(extend), sum(extend)
    slots = np.arange(b, dtype=np.int32)
    out_loc = np.concatenate([s * ROW_LEN + np.arange(q - e, q) for s, e, q in zip(slots, extend, seq)]).astype(
        np.int32
    )
    return BatchDesc(
        is_prefill=True,
        slots=slots,
        seq_lens=np.array(seq, dtype=np.int32),
        extend_lens=np.array(extend, dtype=np.int32),
        out_loc=out_loc,
        input_ids=np.zeros(t, dtype=np.int32),
        temperature=np.zeros(b, dtype=np.float32),
        top_p=np.ones(b, dtype=np.float32),
        top_k=np.zeros(b, dtype=np.int32),
        seeds=np.zeros(b, dtype=np.int64),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_a_mixed_steps_decode_rows_and_prompt_chunks_agree_with_the_torch_reference(kv_dtype):
    from worker.attention.flashinfer_backend import FlashInferBackend
    from worker.attention.torch_backend import TorchBackend
    from worker.kv_cache import KVCachePool

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    kv = KVCachePool(1, ROWS * ROW_LEN // PAGE, PAGE, KV_HEADS, HEAD_DIM, kv_dtype, dev)
    kv.buffer.copy_((torch.randn(kv.buffer.shape, generator=gen, device=dev) * 0.5).to(kv_dtype))
    # every row's locations in order (row s holds s * ROW_LEN ..): whole pages, as the page allocator gives
    table = (torch.arange(ROWS, device=dev)[:, None] * ROW_LEN + torch.arange(ROW_LEN, device=dev)).to(torch.int32)
    # four decodes over long and short KV, then a chunk over a cached prefix, a fresh prompt, a one-token chunk
    extend, seq = [1, 1, 1, 1, 100, 64, 1], [1500, 700, 17, 16, 300, 64, 9]
    desc = _mixed_desc(extend, seq)
    batch = ForwardBatch(
        desc=desc,
        input_ids=torch.zeros(sum(extend), dtype=torch.int32, device=dev),
        positions=torch.from_numpy(np.concatenate([np.arange(q - e, q) for e, q in zip(extend, seq)])).to(dev),
        out_loc=torch.from_numpy(desc.out_loc.astype(np.int64)).to(dev),
        slots=torch.from_numpy(desc.slots.astype(np.int64)).to(dev),
        seq_lens=torch.from_numpy(desc.seq_lens).to(dev),
        last_idx=torch.from_numpy(np.cumsum(extend) - 1).to(dev),
    )
    q = torch.randn(sum(extend), HEADS, HEAD_DIM, generator=gen, device=dev).to(torch.bfloat16)
    fi = FlashInferBackend(kv, table, HEADS, q_dtype=torch.bfloat16)
    plan = fi.stage(desc, desc.batch_size)
    assert plan.decode_rows == 4
    fi.prepare(batch, plan)
    got = fi.forward(q, None, None, 0)
    ref_backend = TorchBackend(kv, table)
    ref_backend.prepare(batch)
    ref = ref_backend.forward(q, None, None, 0)
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)
    # a step that starts with a prompt chunk has nothing at its front to split off
    assert fi.stage(_mixed_desc(extend[4:], seq[4:]), 3).decode_rows == 0


@pytest.mark.gpu
def test_a_graph_decode_batch_past_the_split_bound_agrees_with_the_torch_reference():
    # a CUDA graph captured once over FlashInfer's tensor-core decode without split-KV (whole_kv_decode), and
    # replayed over two draws of lengths: every row's output against the torch reference
    from worker.attention.flashinfer_backend import FlashInferBackend
    from worker.attention.torch_backend import TorchBackend
    from worker.kv_cache import KVCachePool

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    bs, row_len = 48, 1024
    gen = torch.Generator(device=dev).manual_seed(1)
    pages = bs * row_len // PAGE
    kv = KVCachePool(1, pages + 1, PAGE, KV_HEADS, HEAD_DIM, torch.bfloat16, dev)  # the last page: scratch
    kv.buffer.copy_((torch.randn(kv.buffer.shape, generator=gen, device=dev) * 0.5).to(torch.bfloat16))
    table = (torch.arange(bs, device=dev)[:, None] * row_len + torch.arange(row_len, device=dev)).to(torch.int32)
    fi = FlashInferBackend(kv, table, HEADS, q_dtype=torch.bfloat16)
    assert whole_kv_decode(bs, KV_HEADS, fi.num_sms)
    out_loc = torch.zeros(bs, dtype=torch.int64, device=dev)
    q = torch.zeros(bs, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev)
    fi.prepare_graph(None, bs, out_loc, pages)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fi.forward(q, None, None, 0)  # FlashInfer's first run, outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = fi.forward(q, None, None, 0)
    rng = np.random.default_rng(1)
    for _ in range(2):
        seq = rng.integers(1, row_len + 1, bs).astype(np.int32)
        desc = BatchDesc(
            is_prefill=False,
            slots=np.arange(bs, dtype=np.int32),
            seq_lens=seq,
            extend_lens=np.ones(bs, dtype=np.int32),
            out_loc=(np.arange(bs) * row_len + seq - 1).astype(np.int32),
            input_ids=None,
            temperature=np.zeros(bs, dtype=np.float32),
            top_p=np.ones(bs, dtype=np.float32),
            top_k=np.zeros(bs, dtype=np.int32),
            seeds=np.zeros(bs, dtype=np.int64),
        )
        fi.prepare_graph(desc, bs, out_loc, pages)
        q.copy_(torch.randn(q.shape, generator=gen, device=dev).to(torch.bfloat16))
        graph.replay()
        batch = ForwardBatch(
            desc=desc,
            input_ids=torch.zeros(bs, dtype=torch.int32, device=dev),
            positions=torch.from_numpy(seq.astype(np.int64) - 1).to(dev),
            out_loc=torch.from_numpy(desc.out_loc.astype(np.int64)).to(dev),
            slots=torch.from_numpy(desc.slots.astype(np.int64)).to(dev),
            seq_lens=torch.from_numpy(seq).to(dev),
            last_idx=torch.arange(bs, device=dev),
        )
        ref_backend = TorchBackend(kv, table)
        ref_backend.prepare(batch)
        ref = ref_backend.forward(q, None, None, 0)
        torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)
