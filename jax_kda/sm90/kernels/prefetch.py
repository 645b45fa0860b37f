"""L2 prefetches for the per-chunk kernels: a CTA asks for global bytes it will read in a later
phase, with nothing to wait on (prefetch.global.L2, a 128-byte line a thread an instruction,
as coalesced as a load), so that the later phase's loads find them in L2 instead of waiting
on DRAM.

Where it pays (H100, 2026-12-07, results/2026-12-07-h100-f-*): the fused decayed and tokens'
backward asks for its tokens phase's rows once its first phase's loads are in, and that phase
went from 13.5k to 10.9k cycles a CTA at 2048x12x1. Where it did not (same day, -f-profile-
train-prefetch-start.log): the same rows asked for at the CTA's start, beside the first
phase's own loads, slowed those by 6.4k cycles; asking for the next wave's CTA's inputs (its
launch index plus the CTAs resident at once) in the dense backward, the decayed backward and
the chunk core made all three slower (3 to 9%). A prefetch changes no value a kernel computes
(every result bit for bit as before), only when its bytes arrive. (cp.async.bulk.prefetch
takes a byte range an instruction, but a warp's lanes issue it one after another.)
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

LINE_BYTES = 128
"""Bytes one prefetch asks for: an L2 line."""


def prefetch_line(ptr):
    """The L2 line holding global address ptr."""
    cute.arch.prefetch(ptr.llvm_ptr, cache_level="L2")


@cute.jit
def prefetch_rows(rows, row0, count, tid, nthreads: cutlass.Constexpr[int]):
    """Rows row0 + i, i < count (<= 64), of each (m_x, col0, nbytes) of `rows` into L2: m_x a
    [rows, C] view (one head's of a token array, or a chunk's block), nbytes (a multiple of
    128) from column col0 of each row; line j of row i by thread (64 j + i) % nthreads."""
    for m_x, col0, nbytes in rows:
        per_line = LINE_BYTES * 8 // m_x.element_type.width  # elements a line
        tasks = 64 * (nbytes // LINE_BYTES)
        for r in cutlass.range_constexpr((tasks + nthreads - 1) // nthreads):
            task = tid + r * nthreads
            i = task % 64
            if task < tasks and i < count:
                prefetch_line(m_x[row0 + i, None].iterator + col0 + (task // 64) * per_line)
