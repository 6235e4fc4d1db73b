"""Programmatic dependent launch (compute capability 9.0+) inside the Triton kernels of a step. A
kernel launched with it (`launch_pdl`) may start while the kernel before it in the stream still runs: it
may first prefetch into L2 what no kernel of the step writes (its weights; triton_ops.prefetch_programs
says which GEMV programs do), then waits until the kernel
before it has finished and its writes are visible (`await_previous`), and only then reads anything else
or writes. Waiting there also lets the next kernel launch, so each kernel's prefetch overlaps the one
before it. Every program of such a kernel must wait before it returns: a kernel whose programs all left
without waiting could finish before the one it follows, and the kernel after it would wait on nothing.
Launched without it, the wait and the prefetch are a no-op and a hint."""

import triton
import triton.language as tl

# what a row's prefetch covers a step: 64 sectors of 32 bytes, one a thread of a program of 4 warps over two
# rows. One a sector, not one a 128-byte line: a prefetch may fill only the sector it names (not measured)
PREFETCH_SECTORS = tl.constexpr(64)


@triton.jit
def l2_prefetch(ptrs):
    # a prefetch of each pointer's sector into L2: no register waits on it, and an address past what the
    # kernel reads later only costs the fetch (the callers keep theirs inside the tensor)
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def prefetch_rows(w_ptr, rows, row_stride, K):
    # the first K elements of each of `rows` (indices that exist) of a row-major matrix, sector by sector
    SECTOR: tl.constexpr = 256 // w_ptr.dtype.element_ty.primitive_bitwidth
    sectors = tl.arange(0, PREFETCH_SECTORS) * SECTOR
    base = w_ptr + rows[:, None].to(tl.int64) * row_stride
    for k0 in range(0, K, PREFETCH_SECTORS * SECTOR):
        l2_prefetch(base + tl.minimum(k0 + sectors, K - 1)[None, :])


@triton.jit
def gemv_rows(w_ptr, N, K, w_stride, prefetch_programs, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    # a GEMV program's BLOCK_N output rows of w [N, K]; launched with PDL, the kernel before awaited first,
    # and the weights of the first `prefetch_programs` programs prefetched before that (a program that
    # starts later, once earlier ones of its own kernel have left, finds the kernel before long finished;
    # a gated GEMV's up rows, N further on, are not prefetched)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    if PDL:
        if tl.program_id(0) < prefetch_programs:
            prefetch_rows(w_ptr, tl.minimum(rn, N - 1), w_stride, K)
    await_previous(PDL)
    return rn


@triton.jit
def await_previous(PDL: tl.constexpr):
    # the kernel before has finished (its writes, and every earlier kernel's, are visible), and the next
    # kernel may launch now and prefetch while this one works
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
