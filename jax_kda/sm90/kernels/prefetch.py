"""L2 prefetches for the per-chunk kernels: a CTA asks for global bytes it will read in a later
phase, with nothing to wait on (prefetch.global.L2, a 128-byte line a thread an instruction,
as coalesced as a load), so that the later phase's loads find them in L2 instead of waiting
on DRAM.

Where it pays (H100, 2026-12-07): once a CTA's first loads are in, the fused decayed and
tokens' backward asks for its tokens phase's rows (that phase 13.5k -> 10.9k cycles a CTA at
2048x12x1, results/2026-12-07-h100-f-*), the chunk core for its v rows and the dense backward
for kk (3.5% and 4.6% off those kernels there, -h-*). Asked for at a CTA's start, beside loads
that the CTA issues at once, prefetches cost more than they save, whatever they ask for
(2048x12x1, against 98.1, 58.9, 56.5 and 17.1 us for the kernels without them): those rows
with the inputs of the CTA a wave ahead (its launch index plus the CTAs resident at once) took
the decayed backward to 104.5 us (its first phase 12.7k -> 19.1k cycles), the chunk core with
its v rows and the next wave's rows to 61.9, the dense backward with all its inputs and the
next wave's to 62.2 (`-f-profile-train-prefetch-start.log`); the dense backward and the state
cotangent with only the arrays they load after the first one took 61.4 and 18.2 us (280-284 ->
315 us for the dense one at 8192x16x1, `-g-profile-train-prefetch-dense-cotangent.log`, every
result bit for bit as without). A prefetch changes no value a kernel computes, only when its
bytes arrive. (cp.async.bulk.prefetch takes a byte range an instruction, but a warp's lanes
issue it one after another.)
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
