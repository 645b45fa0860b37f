"""Decoding cu_seqlens into chunk slots: the one place every kernel does it.

Sequence s owns the slots cu[s] // C + s + c, c in [0, ceil(len_s / C)), for C-token chunks:
T // C + N slots hold any packing of T tokens in N sequences, slots of different sequences never
overlap, and the others (gap slots) belong to no sequence (xla.py maps tokens the same way).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32


@cute.jit
def sequence_slots(mCu: cute.Tensor, n, chunk: cutlass.Constexpr[int]):
    """Sequence n's first token, length, chunk count and first slot."""
    bos = mCu[n]
    seqlen = mCu[n + 1] - bos
    chunks = (seqlen + (chunk - 1)) // chunk
    return bos, seqlen, chunks, bos // chunk + n


@cute.jit
def slot_owner(mCu: cute.Tensor, slot, chunk: cutlass.Constexpr[int]):
    """The sequence whose chunk `slot` holds: (active, first token, length, the chunk's index
    in the sequence); active is False for a gap slot (and when there is no sequence)."""
    n_seq = mCu.shape[0] - 1
    lo = Int32(0)
    hi = n_seq
    while hi - lo > 1:  # largest s with cu[s] // C + s <= slot
        mid = (lo + hi) // 2
        if mCu[mid] // chunk + mid <= slot:
            lo = mid
        else:
            hi = mid
    active = n_seq > 0
    bos = Int32(0)
    seqlen = Int32(0)
    c = Int32(0)
    if active:
        bos = mCu[lo]
        seqlen = mCu[lo + 1] - bos
        c = slot - (bos // chunk + lo)
        nch = (seqlen + (chunk - 1)) // chunk
        active = c < nch
    return active, bos, seqlen, c


@cute.jit
def scan_slots(mCu: cute.Tensor, n, n_slots, chunk: cutlass.Constexpr[int]):
    """Sequence n's chunk slots for a serial pass over them: (first slot, chunk count, end of
    the gap slots after them (the next sequence's first slot)). Valid boundaries give
    0 <= slot0 <= slot0 + nch <= gap_end <= n_slots; bad ones (cu[0] != 0, decreasing,
    cu[N] != T) are clamped to that: garbage, but no access out of bounds."""
    n_seq = mCu.shape[0] - 1
    bos, seqlen, nch, slot0 = sequence_slots(mCu, n, chunk)
    gap_end = n_slots
    if n + 1 < n_seq:
        gap_end = (bos + seqlen) // chunk + n + 1
    slot0 = cutlass.min(cutlass.max(slot0, Int32(0)), n_slots)
    chunks_end = cutlass.min(cutlass.min(slot0 + cutlass.max(nch, Int32(0)), gap_end), n_slots)
    chunks_end = cutlass.max(chunks_end, slot0)
    gap_end = cutlass.min(cutlass.max(gap_end, chunks_end), n_slots)
    return slot0, chunks_end - slot0, gap_end


@cute.jit
def step_slot(slot0, nch, reverse: cutlass.Constexpr[bool], j):
    """The slot of step j of a serial pass over a sequence's chunk slots (scan_slots): in slot
    order, or from the last one in reverse."""
    slot = slot0 + j
    if cutlass.const_expr(reverse):
        slot = slot0 + nch - 1 - j
    return slot


@cute.jit
def slot_rows(mCu: cute.Tensor, slot, tokens, chunk: cutlass.Constexpr[int]):
    """The token rows chunk slot `slot` holds: (row0, count), its rows i < count being tokens
    row0 + i (count 0 for a gap slot). count keeps every such row inside [0, tokens) whatever
    cu_seqlens holds: bad boundaries give garbage, never an access out of bounds."""
    active, bos, seqlen, c = slot_owner(mCu, slot, chunk)
    row0 = bos + c * chunk
    count = cutlass.min(cutlass.min(seqlen - c * chunk, chunk), tokens - row0)
    if not active or row0 < 0:
        count = Int32(0)
    return row0, cutlass.max(count, Int32(0))
