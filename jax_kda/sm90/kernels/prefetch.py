"""L2 prefetches for the per-chunk kernels: a CTA asks for global bytes it will read in a later
phase, with nothing to wait on (prefetch.global.L2, a 128-byte line a thread an instruction),
so that the later phase's loads find them in L2 instead of waiting on DRAM. Every address a
caller passes lies inside its tensor (the rows as varlen.slot_rows bounds them): a prefetch is
a memory access like any other here.

Where it pays (H100, 2026-12-07): once a CTA's first loads are in, the fused decayed and
tokens' backward asks for its tokens phase's rows (that phase 13.5k -> 10.9k cycles a CTA at
2048x12x1, results/2026-12-07-h100-f-*; its v entry took the head's first rows in that run,
since then the chunk's own, row0 + i), and the dense backward for kk (56.4-56.5 -> 53.7-54.0
us there, -h-*). The chunk core asking for its v rows the same way took 59.3-59.6 -> 57.3-57.6
us on the H100 with its row count not yet bounded by the tensor; bounded by slot_rows, on an
H200 it is a wash (56.8-56.9 against 57.1-57.6 us at 2048x12x1, 234.3-234.8 against
232.6-233.2 at 8192x16x1; results/2026-12-07-h200-i-*, where the decayed backward with the
chunk's v rows took 91.6-91.9 and 429.1-429.8 us).
Asked for at a CTA's start, beside loads that the CTA issues at once, prefetches cost more
than they save: with the inputs of the CTA a wave ahead (its launch index plus the CTAs
resident at once), the decayed backward took 104.5 us against 98.1 (its first phase 12.7k
-> 19.1k cycles), the chunk core 61.9 against 58.9, the dense backward 62.2 against 56.5
(2048x12x1, `-f-profile-train-prefetch-start.log` against `-f-profile-train-base.log`); the
dense backward and the state cotangent with only the arrays they load after their first one
took 61.4 and 18.2 us against 56.3-57.0 and 17.0-17.3 in the same lease (280-284 -> 315 us
for the dense one at 8192x16x1, `-g-profile-train*.log`, every result bit for bit as
without). A prefetch changes no value a kernel computes, only when its bytes arrive.
Asked for once a CTA's own first loads are in (while its products run), the wave-ahead inputs
did not pay either (H100, 2026-12-07, branch exp-wave-prefetch against main in one lease,
results/2026-12-07-h100-j-*, every result bit for bit): the decayed backward 95.4-95.7 ->
96.5-96.7 us at 2048x12x1 and 437.4-437.9 -> 449.5-450.2 at 8192x16x1, the dense backward
266.2-268.0 -> 281.5-282.1 there, the chunk core 245.1-245.3 -> 248.2-248.3; the decayed
kernel's first phase, its rows then in L2, 13.4k -> 13.6k cycles a CTA (median): that phase
waits on something other than DRAM.
(cp.async.bulk.prefetch takes a byte range an instruction, but a warp's lanes issue it one
after another.)
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from jax_kda.constants import SCAN_CHUNK

LINE_BYTES = 128
"""Bytes one prefetch asks for: an L2 line."""


def prefetch_line(ptr):
    """The L2 line holding global address ptr."""
    cute.arch.prefetch(ptr.llvm_ptr, cache_level="L2")


@cute.jit
def prefetch_rows(rows, row0, count, tid, nthreads: cutlass.Constexpr[int]):
    """Rows row0 + i, i < count (<= SCAN_CHUNK), of each (m_x, col0, nbytes) of `rows` into L2:
    m_x a [rows, C] view (one head's of a token array, or a chunk's block), nbytes (a multiple
    of 128) from column col0 of each row; line j of row i by thread (SCAN_CHUNK j + i) %
    nthreads."""
    for m_x, col0, nbytes in rows:
        if cutlass.const_expr(nbytes % LINE_BYTES != 0):
            raise ValueError(
                f"prefetch_rows takes whole lines: nbytes {nbytes} is no multiple of 128"
            )
        per_line = LINE_BYTES * 8 // m_x.element_type.width  # elements a line
        tasks = SCAN_CHUNK * (nbytes // LINE_BYTES)
        for r in cutlass.range_constexpr((tasks + nthreads - 1) // nthreads):
            task = tid + r * nthreads
            i = task % SCAN_CHUNK
            if task < tasks and i < count:
                line = task // SCAN_CHUNK
                prefetch_line(m_x[row0 + i, None].iterator + col0 + line * per_line)
