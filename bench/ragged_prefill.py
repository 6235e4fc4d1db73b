"""Whether an extend step's attention would be faster over the chunk's own keys and values as they leave
the projection (FlashInfer's ragged prefill) than over the paged KV cache (what extend steps run now). One
layer of FA3 in bf16 at the prefill-heavy workload's chunk of 8,192 tokens, the pages of every request
scattered over the cache:

  paged    one causal kernel over each row's whole KV through its pages (the engine's extend step)
  ragged   one causal kernel over the chunk's tokens alone (contiguous, strided as the projection's
           output), then for the rows that continue a prompt begun in an earlier step one non-causal paged
           kernel over their earlier tokens, and FlashInfer's merge of the two results

  split    the rows that continue a prompt through one paged kernel over their whole KV, the fresh rows
           through one ragged kernel over their own tokens, each writing its rows of the output

Chunks: `continuing` (a prompt's last 2,100 tokens after 2,500 in the cache, then fresh prompts of 4,300 and
1,792 tokens) and `fresh` (prompts of 4,500 and 3,692). Median microseconds of 50 calls timed with CUDA
events, and the two outputs' largest difference.

    python bench/ragged_prefill.py [--heads 16:8 32:8] [--page-size 16] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

HEAD_DIM = 128
# (tokens already in the cache, tokens of this chunk) a row
CHUNKS = {"continuing": [(2500, 2100), (0, 4300), (0, 1792)], "fresh": [(0, 4500), (0, 3692)]}


def median_us(fn, reps: int = 50) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def paged_layout(lens: list[int], page_size: int, pages: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """kv_indptr, the page ids (each request's taken in turn from `pages`) and last_page_len for requests
    of `lens` tokens."""
    counts = [-(-n // page_size) for n in lens]
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(counts), 0)
    last = torch.tensor([n - (c - 1) * page_size for n, c in zip(lens, counts)], dtype=torch.int32)
    return indptr, pages[: int(indptr[-1])].to(torch.int32), last


def one_case(rows, heads: int, kv_heads: int, page_size: int, workspace: torch.Tensor) -> dict:
    import flashinfer

    dev, dt = torch.device("cuda"), torch.bfloat16
    prefix = [p for p, _ in rows]
    new = [n for _, n in rows]
    total = [p + n for p, n in rows]
    tokens = sum(new)
    num_pages = sum(-(-t // page_size) for t in total)
    # every request's pages scattered over a cache twice the size, as a long-running engine leaves them
    pages = torch.randperm(2 * num_pages)
    k_cache = torch.randn(2 * num_pages, page_size, kv_heads, HEAD_DIM, device=dev, dtype=dt)
    v_cache = torch.randn_like(k_cache)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * HEAD_DIM, device=dev, dtype=dt)
    q = torch.randn(tokens, heads, HEAD_DIM, device=dev, dtype=dt)
    k = qkv[:, heads * HEAD_DIM : (heads + kv_heads) * HEAD_DIM].view(tokens, kv_heads, HEAD_DIM)
    v = qkv[:, (heads + kv_heads) * HEAD_DIM :].view(tokens, kv_heads, HEAD_DIM)
    qo_indptr = torch.zeros(len(rows) + 1, dtype=torch.int32)
    qo_indptr[1:] = torch.cumsum(torch.tensor(new), 0)

    # the chunk's keys and values written into their pages, so that both ways attend the same values
    indptr, ids, last = paged_layout(total, page_size, pages)
    for i, (p, n) in enumerate(rows):
        own = ids[indptr[i] : indptr[i + 1]].to(dev).long()
        slots = (own[:, None] * page_size + torch.arange(page_size, device=dev)).flatten()[p : p + n]
        lo, hi = int(qo_indptr[i]), int(qo_indptr[i + 1])
        k_cache.view(-1, kv_heads, HEAD_DIM)[slots] = k[lo:hi]
        v_cache.view(-1, kv_heads, HEAD_DIM)[slots] = v[lo:hi]
    types = {"q_data_type": dt, "kv_data_type": dt}
    dims = (heads, kv_heads, HEAD_DIM, page_size)

    paged = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa3")
    paged.plan(qo_indptr, indptr, ids.to(dev), last, *dims, causal=True, **types)
    reference = paged.run(q, (k_cache, v_cache))
    paged_us = median_us(lambda: paged.run(q, (k_cache, v_cache), out=reference))

    ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend="fa3")
    ragged.plan(qo_indptr, qo_indptr, heads, kv_heads, HEAD_DIM, causal=True, **types)
    out, lse = ragged.run(q, k, v, return_lse=True)
    ragged_us = median_us(lambda: ragged.run(q, k, v, out=out, lse=lse, return_lse=True))
    result = {"tokens": tokens, "paged_us": paged_us, "ragged_us": ragged_us, "prefix_us": 0.0, "merge_us": 0.0}

    cont = [i for i, p in enumerate(prefix) if p]  # the continuing rows: the chunk's first ones
    if cont:
        n_cont = int(qo_indptr[len(cont)])
        head_indptr, head_ids, head_last = _prefix_pages(indptr, ids, prefix[: len(cont)], page_size)
        before = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa3")
        before.plan(qo_indptr[: len(cont) + 1], head_indptr, head_ids.to(dev), head_last, *dims, causal=False, **types)
        o2, s2 = before.run(q[:n_cont], (k_cache, v_cache), return_lse=True)
        result["prefix_us"] = median_us(
            lambda: before.run(q[:n_cont], (k_cache, v_cache), out=o2, lse=s2, return_lse=True)
        )
        merged = out.clone()
        flashinfer.merge_state_in_place(merged[:n_cont], lse[:n_cont].clone(), o2, s2)
        a, s = out[:n_cont].clone(), lse[:n_cont].clone()
        result["merge_us"] = median_us(lambda: flashinfer.merge_state_in_place(a, s, o2, s2))
        out = merged

        # split: the continuing rows paged, the fresh ones ragged, no merge
        cont_paged = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa3")
        n_pages = int(indptr[len(cont)])
        cont_paged.plan(
            qo_indptr[: len(cont) + 1],
            indptr[: len(cont) + 1],
            ids[:n_pages].to(dev),
            last[: len(cont)],
            *dims,
            causal=True,
            **types,
        )
        fresh_indptr = qo_indptr[len(cont) :] - qo_indptr[len(cont)]
        fresh = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend="fa3")
        fresh.plan(fresh_indptr, fresh_indptr, heads, kv_heads, HEAD_DIM, causal=True, **types)
        split = torch.empty_like(reference)

        def run_split():
            cont_paged.run(q[:n_cont], (k_cache, v_cache), out=split[:n_cont])
            fresh.run(q[n_cont:], k[n_cont:], v[n_cont:], out=split[n_cont:])

        run_split()
        result["split_us"] = median_us(run_split)
        result["split_over_paged"] = result["split_us"] / paged_us
        result["split_max_abs_diff"] = float((split.float() - reference.float()).abs().max())
    else:
        result["split_us"], result["split_over_paged"] = ragged_us, ragged_us / paged_us
        result["split_max_abs_diff"] = float((out.float() - reference.float()).abs().max())
    result["ragged_total_us"] = result["ragged_us"] + result["prefix_us"] + result["merge_us"]
    result["ragged_over_paged"] = result["ragged_total_us"] / paged_us
    result["max_abs_diff"] = float((out.float() - reference.float()).abs().max())
    return result


def _prefix_pages(indptr, ids, prefix: list[int], page_size: int) -> tuple[torch.Tensor, ...]:
    """The page layout of each continuing row's earlier tokens alone: its first pages, the last one cut."""
    counts = [-(-p // page_size) for p in prefix]
    head_ids = torch.cat([ids[int(indptr[i]) : int(indptr[i]) + c] for i, c in enumerate(counts)])
    head_indptr = torch.zeros(len(prefix) + 1, dtype=torch.int32)
    head_indptr[1:] = torch.cumsum(torch.tensor(counts), 0)
    last = torch.tensor([p - (c - 1) * page_size for p, c in zip(prefix, counts)], dtype=torch.int32)
    return head_indptr, head_ids, last


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", nargs="+", default=["16:8", "32:8"], help="query heads:kv heads (Qwen3-0.6B, -8B)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--out")
    args = p.parse_args()
    torch.manual_seed(0)
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    results = []
    print(
        f"page {args.page_size}\n{'heads':>6} {'chunk':>11} {'paged':>8} {'ragged':>8} {'prefix':>8} {'merge':>7} "
        f"{'ratio':>6} {'diff':>7} {'split':>8} {'ratio':>6}"
    )
    for pair in args.heads:
        heads, kv_heads = (int(x) for x in pair.split(":"))
        for name, rows in CHUNKS.items():
            r = {"heads": pair, "chunk": name, **one_case(rows, heads, kv_heads, args.page_size, workspace)}
            results.append(r)
            print(
                f"{pair:>6} {name:>11} {r['paged_us']:8.1f} {r['ragged_us']:8.1f} {r['prefix_us']:8.1f} "
                f"{r['merge_us']:7.1f} {r['ragged_over_paged']:6.3f} {r['max_abs_diff']:7.4f} "
                f"{r['split_us']:8.1f} {r['split_over_paged']:6.3f}"
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"benchmark": "ragged_prefill", "page_size": args.page_size, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
