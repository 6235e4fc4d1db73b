"""The Triton split-KV paged decode kernel (worker/triton_decode.py) against a float32 torch reference over
fp8 and half-precision caches, its CUDA-graph property (the same launch over lengths changed in place),
and on a GPU against FlashInfer's tensor-core decode. On the CPU it runs under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from worker.kv_cache import to_fp8

pytest.importorskip("triton")

from worker import triton_decode  # noqa: E402
from worker.triton_decode import (  # noqa: E402
    decode_num_splits,
    decode_scratch,
    paged_decode,
    paged_decode_reference,
)

if not (triton_decode.INTERPRETED or torch.cuda.is_available()):
    pytest.skip("needs CUDA or Triton's interpreter (TRITON_INTERPRET=1)", allow_module_level=True)
DEVICE = "cpu" if triton_decode.INTERPRETED else "cuda"

KV_DTYPES = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp16": torch.float16}
UNIT_ROUNDOFF = 2.0**-8  # bfloat16's (8 significant bits); float16's is 2**-11


def page_lists(lens: list[int], page_size: int, num_pages: int, generator: torch.Generator):
    """CSR page lists of requests with these lengths over shuffled, non-contiguous page ids."""
    pages = [-(-n // page_size) for n in lens]
    ids = torch.randperm(num_pages, generator=generator)[: sum(pages)].to(torch.int32)
    indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * page_size for n, p in zip(lens, pages)], dtype=torch.int32)
    return indptr, ids, last


def make_decode(
    lens: list[int],
    page_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    kv: str,
    q_dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> tuple[torch.Tensor, ...]:
    """(q, k_cache, v_cache, kv_indptr, kv_indices, last_page_len) on DEVICE, with a few spare pages."""
    g = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-n // page_size) for n in lens) + 3
    indptr, ids, last = page_lists(lens, page_size, num_pages, g)
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    k, v = (to_fp8(x) if kv == "fp8" else x.to(KV_DTYPES[kv]) for x in (k, v))
    q = (2 * torch.randn(len(lens), num_kv_heads * group, head_dim, generator=g)).to(q_dtype)  # peaked softmax
    return tuple(x.to(DEVICE) for x in (q, k, v, indptr, ids, last))


def assert_close_to_reference(got: torch.Tensor, args: tuple[torch.Tensor, ...]) -> None:
    # Past float32 (q and K/V exact in the dot's dtype, float32 accumulation), the kernel rounds the
    # probabilities to 16 bits before P.V and the output to q's dtype, each to a relative u <= 2^-8:
    # |error| <= u * (sum p|v| / sum p + |o|) <= 2u * max|v|
    want = paged_decode_reference(*args).float()
    bound = 2 * UNIT_ROUNDOFF * args[2].float().abs().max().item()
    torch.testing.assert_close(got.float(), want, atol=bound, rtol=0)


def lens_around(page_size: int) -> list[int]:
    # one token, a page but one, a page, a page and one, a few pages
    return [n for n in (1, page_size - 1, page_size, page_size + 1, 3 * page_size + 5) if n >= 1]


CASES = {  # page_size, num_kv_heads, group, head_dim, num_splits, block_n
    "page16-group2-d64-one-split-blocks-across-pages": (16, 2, 2, 64, 1, None),
    "page16-group4-d128-three-splits": (16, 1, 4, 128, 3, None),
    "page1-group1-d64-four-splits": (1, 2, 1, 64, 4, 32),
    "page64-group2-d64-two-splits-blocks-inside-pages": (64, 1, 2, 64, 2, 32),
    "page16-group2-d64-more-splits-than-tokens": (16, 1, 2, 64, 12, 32),
}


@pytest.mark.parametrize("kv", ["fp8", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_decode_equals_float32_attention_over_the_pages(kv, case):
    page_size, num_kv_heads, group, head_dim, num_splits, block_n = CASES[case]
    args = make_decode(lens_around(page_size), page_size, num_kv_heads, group, head_dim, kv)
    got = paged_decode(*args, num_splits=num_splits, block_n=block_n)
    assert got.dtype == torch.bfloat16 and got.shape == args[0].shape
    assert_close_to_reference(got, args)


@pytest.mark.parametrize("kv", ["fp8", "fp16"])
def test_float16_queries_over_fp8_and_float16_caches(kv):
    args = make_decode([1, 30, 70], 16, 2, 2, 64, kv, q_dtype=torch.float16, seed=1)
    got = paged_decode(*args, num_splits=2)
    assert got.dtype == torch.float16
    assert_close_to_reference(got, args)


def test_fp8_cache_with_bfloat16_tensor_core_operands():
    args = make_decode([5, 40], 16, 2, 2, 64, "fp8", seed=2)
    assert_close_to_reference(paged_decode(*args, num_splits=2, f16_dot=False), args)


def test_sm_scale_is_applied():
    args = make_decode([9, 33], 16, 1, 2, 64, "bf16", seed=3)
    got = paged_decode(*args, num_splits=2, sm_scale=0.3)
    want = paged_decode_reference(*args, sm_scale=0.3).float()
    torch.testing.assert_close(got.float(), want, atol=2 * UNIT_ROUNDOFF * args[2].float().abs().max().item(), rtol=0)


@pytest.mark.parametrize("kv", ["fp8", "bf16"])
@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][4] > 1])
def test_split_results_merged_by_the_last_split_equal_those_merged_by_a_launch(kv, case):
    page_size, num_kv_heads, group, head_dim, num_splits, block_n = CASES[case]
    args = make_decode(lens_around(page_size), page_size, num_kv_heads, group, head_dim, kv)
    scratch = decode_scratch(len(args[0]), num_kv_heads * group, head_dim, num_splits, DEVICE)
    launched = paged_decode(*args, num_splits=num_splits, block_n=block_n, merge_in_last=False)
    for _ in range(2):  # the arrivals are counted from zero again at each launch
        got = paged_decode(*args, num_splits=num_splits, block_n=block_n, scratch=scratch, merge_in_last=True)
        assert torch.equal(got, launched)
        assert not scratch.arrivals.any()


def test_the_merge_in_the_last_split_needs_arrivals_for_every_kv_head():
    args = make_decode([3, 4], 16, 2, 2, 64, "bf16")
    scratch = decode_scratch(2, 4, 64, 4, DEVICE)
    with pytest.raises(ValueError, match="arrivals"):
        paged_decode(
            *args,
            num_splits=4,
            scratch=triton_decode.DecodeScratch(scratch.part_out, scratch.part_lse),
            merge_in_last=True,
        )
    short = triton_decode.DecodeScratch(scratch.part_out, scratch.part_lse, scratch.arrivals[:3])
    with pytest.raises(ValueError, match="arrivals"):
        paged_decode(*args, num_splits=4, scratch=short, merge_in_last=True)


@pytest.mark.parametrize("merge_in_last", [False, True])
def test_one_launch_follows_lengths_changed_in_place_on_the_device(merge_in_last):
    # a CUDA graph replays the same grid and arguments: only the page lists' contents change
    page_size, num_kv_heads, group, head_dim, max_batch, capacity = 16, 2, 2, 64, 6, 24
    g = torch.Generator().manual_seed(4)
    shape = (capacity, page_size, num_kv_heads, head_dim)
    k, v = (to_fp8(torch.randn(shape, generator=g)).to(DEVICE) for _ in range(2))
    q = torch.randn(4, num_kv_heads * group, head_dim, generator=g).bfloat16().to(DEVICE)
    kv_indptr = torch.zeros(5, dtype=torch.int32, device=DEVICE)
    kv_indices = torch.zeros(capacity, dtype=torch.int32, device=DEVICE)
    last_page_len = torch.ones(4, dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(q)
    scratch = decode_scratch(max_batch, num_kv_heads * group, head_dim, 8, DEVICE)

    def launch() -> torch.Tensor:
        return paged_decode(
            q, k, v, kv_indptr, kv_indices, last_page_len, num_splits=4, out=out, scratch=scratch,
            merge_in_last=merge_in_last,
        )  # fmt: skip

    def set_lengths(lens: list[int]) -> tuple[torch.Tensor, ...]:
        indptr, ids, last = page_lists(lens, page_size, capacity, g)
        kv_indptr.copy_(indptr)
        kv_indices[: len(ids)].copy_(ids)
        last_page_len.copy_(last)
        return q, k, v, kv_indptr, kv_indices[: len(ids)], last_page_len

    args = set_lengths([3, 20, 33, 1])
    assert launch() is out
    replay = launch
    if DEVICE == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            launch()
        replay = graph.replay
    replay()
    assert_close_to_reference(out, args)
    before = out.clone()

    args = set_lengths([40, 2, 17, 64])
    replay()
    assert_close_to_reference(out, args)
    assert not torch.equal(out, before)
    assert not scratch.arrivals.any()


def test_scratch_must_hold_the_batch_and_the_splits():
    args = make_decode([3, 4, 5], 16, 1, 2, 64, "bf16")
    with pytest.raises(ValueError, match="too small"):
        paged_decode(*args, num_splits=4, scratch=decode_scratch(2, 2, 64, 4, DEVICE))
    with pytest.raises(ValueError, match="too small"):
        paged_decode(*args, num_splits=4, scratch=decode_scratch(3, 2, 64, 2, DEVICE))


@pytest.mark.parametrize("kv", ["fp8", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("merge_in_last", [False, True])
def test_programs_started_longest_first_give_the_same_attention_bit_for_bit(kv, case, merge_in_last):
    page_size, num_kv_heads, group, head_dim, num_splits, block_n = CASES[case]
    lens = lens_around(page_size)
    args = make_decode(lens, page_size, num_kv_heads, group, head_dim, kv)
    order = torch.from_numpy(triton_decode.longest_first(lens)).to(DEVICE)
    assert sorted(order.tolist()) == list(range(len(lens))) and lens[order[0]] == max(lens)
    scratch = decode_scratch(len(lens), num_kv_heads * group, head_dim, num_splits, DEVICE)
    choices = dict(num_splits=num_splits, block_n=block_n, scratch=scratch)
    if num_splits > 1:
        choices["merge_in_last"] = merge_in_last
    elif merge_in_last:
        pytest.skip("one split merges nothing")
    in_rows = paged_decode(*args, **choices).clone()
    assert torch.equal(paged_decode(*args, **choices, order=order), in_rows)
    assert not scratch.arrivals.any()  # the merge in the last counted each (request, kv head) from zero again


def test_longest_first_orders_by_length_then_row():
    assert triton_decode.longest_first([5, 9, 1, 9, 7]).tolist() == [1, 3, 4, 0, 2]
    assert triton_decode.longest_first([]).dtype.name == "int32"


def test_an_order_must_be_one_int32_rank_a_request():
    args = make_decode([3, 4], 16, 2, 2, 64, "bf16")
    for bad in (torch.tensor([1, 0], dtype=torch.int64), torch.tensor([0], dtype=torch.int32)):  # dtype, length
        with pytest.raises(ValueError, match="order"):
            paged_decode(*args, num_splits=1, order=bad.to(DEVICE))


def test_splits_fill_the_gpu_at_small_batches_and_stay_bounded():
    splits = [decode_num_splits(bs, 8) for bs in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)]
    assert splits[0] == 32 and splits[-2] == splits[-1] == 1
    assert splits == sorted(splits, reverse=True)
    assert decode_num_splits(1, 1, max_splits=16) == 16


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["fp8", "bf16"])
def test_decode_agrees_with_flashinfer_tensor_core_decode(kv):
    flashinfer = pytest.importorskip("flashinfer")
    # Qwen3-0.6B's attention: 16 query heads, 8 kv heads, head_dim 128
    num_heads, num_kv_heads, head_dim, page_size, batch = 16, 8, 128, 16, 64
    g = torch.Generator().manual_seed(5)
    lens = torch.randint(1, 1001, (batch,), generator=g).tolist()
    args = make_decode(lens, page_size, num_kv_heads, num_heads // num_kv_heads, head_dim, kv, seed=5)
    q, k, v, kv_indptr, kv_indices, last_page_len = args
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        torch.zeros(128 << 20, dtype=torch.uint8, device="cuda"), "NHD", use_tensor_cores=True
    )
    wrapper.plan(
        kv_indptr.cpu(),
        kv_indices,
        last_page_len.cpu(),
        num_heads,
        num_kv_heads,
        head_dim,
        page_size,
        q_data_type=q.dtype,
        kv_data_type=k.dtype,
    )
    want = wrapper.run(q, (k, v)).float()
    got = paged_decode(*args, num_splits=decode_num_splits(batch, num_kv_heads)).float()
    bound = 2 * UNIT_ROUNDOFF * v.float().abs().max().item()
    ref = paged_decode_reference(*args).float()
    torch.testing.assert_close(got, ref, atol=bound, rtol=0)
    torch.testing.assert_close(got, want, atol=bound, rtol=0)
    assert (got - want).abs().mean() < 1e-3  # typical errors far inside the bound


def test_which_decode_steps_the_kernel_takes(monkeypatch):
    # by default every step over an fp8 cache, and over a half-precision one every pure decode step on
    # Hopper and a mixed step's decode rows up to TENSOR_CORE_ABOVE_BATCH (FlashInfer's tensor cores above;
    # every step so before Hopper); every step when asked for, or every pure decode step on any GPU
    # (triton_steps); none when FlashInfer's kernels are forced, off CUDA, without Triton, or over fp8 on a
    # GPU that cannot convert it
    from worker import triton_ops
    from worker.attention import flashinfer_backend as fb

    monkeypatch.setattr(triton_ops, "triton_installed", lambda: True)
    monkeypatch.setattr(triton_ops, "_capability", lambda index: (9, 0))
    cuda, fp8, bf16 = torch.device("cuda"), torch.float8_e4m3fn, torch.bfloat16
    small, large = fb.TENSOR_CORE_ABOVE_BATCH, fb.TENSOR_CORE_ABOVE_BATCH + 1
    for choice, kv, at_small, at_large, mixed_at_large in [
        ("auto", bf16, True, True, False),
        ("auto", torch.float16, True, True, False),
        ("auto", fp8, True, True, True),
        ("triton", bf16, True, True, True),
        ("triton_steps", bf16, True, True, False),
        ("triton_steps", fp8, True, True, True),
        ("tensor_cores", fp8, False, False, False),
        ("cuda_cores", bf16, False, False, False),
    ]:
        assert fb.decodes_with_triton(kv, cuda, choice, small) is at_small, (choice, kv)
        assert fb.decodes_with_triton(kv, cuda, choice, large) is at_large, (choice, kv)
        assert fb.decodes_with_triton(kv, cuda, choice, small, mixed=True) is at_small, (choice, kv)
        assert fb.decodes_with_triton(kv, cuda, choice, large, mixed=True) is mixed_at_large, (choice, kv)
    assert fb.decodes_with_triton(fp8, cuda, batch_size=256) is True  # auto, by default
    assert fb.decodes_with_triton(fp8, torch.device("cpu")) is False
    monkeypatch.setattr(triton_ops, "_capability", lambda index: (8, 0))
    assert fb.decodes_with_triton(fp8, cuda) is False and fb.decodes_with_triton(bf16, cuda, "triton") is True
    assert fb.decodes_with_triton(bf16, cuda) is True
    # before Hopper auto leaves the steps past TENSOR_CORE_ABOVE_BATCH on FlashInfer; triton_steps does not
    assert fb.decodes_with_triton(bf16, cuda, batch_size=large) is False
    assert fb.decodes_with_triton(bf16, cuda, "triton_steps", large) is True
    monkeypatch.setattr(triton_ops, "triton_installed", lambda: False)
    assert fb.decodes_with_triton(bf16, cuda, "triton") is False
    # a mixed step's rows that stay on FlashInfer take its tensor cores, as by default
    assert fb.use_tensor_cores(16, "triton_steps") and not fb.use_tensor_cores(16, "cuda_cores")


def test_small_batches_split_a_requests_kv_alike():
    # at and below TENSOR_CORE_ABOVE_BATCH rows every batch splits a request's KV as batch 1 does, so its
    # result does not depend on the rows beside it; above, the split count shrinks to fill the GPU
    from worker.attention.flashinfer_backend import TENSOR_CORE_ABOVE_BATCH, triton_decode_splits

    small = {triton_decode_splits(bs, 8, 132) for bs in range(1, TENSOR_CORE_ABOVE_BATCH + 1)}
    assert small == {decode_num_splits(1, 8, 132)}
    assert triton_decode_splits(256, 8, 132) == decode_num_splits(256, 8, 132) < decode_num_splits(1, 8, 132)


def test_flashinfers_decode_path_follows_the_choice_it_is_given():
    from worker.attention.flashinfer_backend import TENSOR_CORE_ABOVE_BATCH, use_tensor_cores

    small, large = TENSOR_CORE_ABOVE_BATCH, TENSOR_CORE_ABOVE_BATCH + 1
    assert not use_tensor_cores(small) and use_tensor_cores(large)  # auto
    assert use_tensor_cores(small, "tensor_cores") and not use_tensor_cores(large, "cuda_cores")


@pytest.mark.parametrize("kv", ["fp8", "bf16"])
@pytest.mark.parametrize(
    "case",
    [
        "page16-group2-d64-one-split-blocks-across-pages",
        "page16-group4-d128-three-splits",
        "page1-group1-d64-four-splits",
        "page16-group2-d64-more-splits-than-tokens",
    ],
)
@pytest.mark.parametrize("variant", [{"cuda_cores": True}, {"prefetch": True}, {"cuda_cores": True, "prefetch": True}])
def test_the_kernels_variants_equal_float32_attention_over_the_pages(kv, case, variant):
    page_size, num_kv_heads, group, head_dim, num_splits, block_n = CASES[case]
    args = make_decode(lens_around(page_size), page_size, num_kv_heads, group, head_dim, kv, seed=4)
    assert_close_to_reference(paged_decode(*args, num_splits=num_splits, block_n=block_n, **variant), args)


def assert_same_as_plain_conversion(got: torch.Tensor, plain: torch.Tensor) -> None:
    # the tensor cores multiply the same float16 values either way; within one bfloat16 rounding of the output
    torch.testing.assert_close(got, plain, rtol=2 * UNIT_ROUNDOFF, atol=2 * UNIT_ROUNDOFF * plain.abs().max().item())


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("prefetch", [False, True])
def test_an_fp8_caches_v_converted_before_staging_gives_the_same_attention(case, prefetch):
    """convert_v at every page size, split count and tile: float32 attention's output, and the plain
    conversion's. Under the interpreter both run the plain conversion (the PTX runs on CUDA only: the GPU
    test below)."""
    page_size, num_kv_heads, group, head_dim, num_splits, block_n = CASES[case]
    args = make_decode(lens_around(page_size), page_size, num_kv_heads, group, head_dim, "fp8", seed=6)
    tiles = dict(num_splits=num_splits, block_n=block_n, prefetch=prefetch)
    got = paged_decode(*args, convert_v=True, **tiles)
    assert_close_to_reference(got, args)
    assert_same_as_plain_conversion(got, paged_decode(*args, convert_v=False, **tiles))


@pytest.mark.gpu
@pytest.mark.parametrize("case", [*CASES, "qwen3-0.6b-heads-batch-64-one-split"])
@pytest.mark.parametrize("prefetch", [False, True])
def test_v_converted_before_staging_by_ptx_gives_the_same_attention(case, prefetch):
    """The same on CUDA, where V's conversion is PTX: every case's tile, and Qwen3-0.6B's heads over a batch
    of 64 at one split (the engine's full-batch decode)."""
    if case in CASES:
        page_size, num_kv_heads, group, head_dim, num_splits, block_n = CASES[case]
        args = make_decode(lens_around(page_size), page_size, num_kv_heads, group, head_dim, "fp8", seed=6)
    else:
        lens = torch.randint(1, 1001, (64,), generator=torch.Generator().manual_seed(6)).tolist()
        args, num_splits, block_n = make_decode(lens, 16, 8, 2, 128, "fp8", seed=6), 1, None
    tiles = dict(num_splits=num_splits, block_n=block_n, prefetch=prefetch)
    got = paged_decode(*args, convert_v=True, **tiles)
    assert_close_to_reference(got, args)
    assert_same_as_plain_conversion(got, paged_decode(*args, convert_v=False, **tiles))


def test_convert_v_is_for_an_fp8_cache_on_float16_operands():
    """convert_v asked of a bf16 cache, of the CUDA-core variant or of bfloat16 operands is an error; float16
    queries without f16_dot multiply float16 operands and take it."""
    args = make_decode([5, 40], 16, 2, 2, 64, "bf16", seed=2)
    with pytest.raises(ValueError, match="convert_v"):
        paged_decode(*args, num_splits=2, convert_v=True)
    fp8_args = make_decode([5, 40], 16, 2, 2, 64, "fp8", seed=2)
    with pytest.raises(ValueError, match="convert_v"):
        paged_decode(*fp8_args, num_splits=2, convert_v=True, cuda_cores=True)
    with pytest.raises(ValueError, match="convert_v"):
        paged_decode(*fp8_args, num_splits=2, convert_v=True, f16_dot=False)
    half = make_decode([5, 40], 16, 2, 2, 64, "fp8", q_dtype=torch.float16, seed=2)
    assert_close_to_reference(paged_decode(*half, num_splits=2, convert_v=True, f16_dot=False), half)


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["fp8", "bf16"])
@pytest.mark.parametrize("batch", [1, 8])
def test_the_merge_in_the_last_split_at_qwen3_8b_heads_in_a_graph(kv, batch):
    # 32 query heads over 8 kv heads, 32 splits a request (batch 1's count, which the engine keeps up to 8
    # rows): every replay's output as the merge launch gives it, the arrivals back at zero after each
    num_heads, num_kv_heads, head_dim, page_size, splits = 32, 8, 128, 16, decode_num_splits(1, 8)
    g = torch.Generator().manual_seed(6)
    lens = torch.randint(1, 600, (batch,), generator=g).tolist()
    args = make_decode(lens, page_size, num_kv_heads, num_heads // num_kv_heads, head_dim, kv, seed=6)
    launched = paged_decode(*args, num_splits=splits, merge_in_last=False)
    scratch = decode_scratch(batch, num_heads, head_dim, splits, DEVICE)
    out = torch.empty_like(args[0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode(*args, num_splits=splits, out=out, scratch=scratch, merge_in_last=True, pdl=True)
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.testing.assert_close(out, launched, atol=0, rtol=2.0**-7)  # at most the last bit apart
        assert not scratch.arrivals.any()
    assert_close_to_reference(out, args)
