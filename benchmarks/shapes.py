"""The benchmark shapes: one registry, grouped by where each shape comes from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    """One benchmark problem: packed sequences of ``lengths`` tokens with ``heads`` heads."""

    lengths: tuple[int, ...]
    heads: int
    group: str

    @property
    def total_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def num_sequences(self) -> int:
        return len(self.lengths)

    @property
    def equal_lengths(self) -> bool:
        return len(set(self.lengths)) == 1

    @property
    def name(self) -> str:
        """``TxHxN``, with ``-ragged`` when the sequences differ in length."""
        base = f"{self.total_tokens}x{self.heads}x{self.num_sequences}"
        return base if self.equal_lengths else f"{base}-ragged"


def _equal(total_tokens: int, heads: int, num_sequences: int, group: str) -> Shape:
    return Shape((total_tokens // num_sequences,) * num_sequences, heads, group)


SPEC_SHAPES = tuple(
    _equal(t, h, n, "spec")
    for t, h, n in (
        (2048, 12, 1),
        (2048, 16, 1),
        (4096, 8, 1),
        (4096, 12, 1),
        (8192, 12, 4),
        (8192, 16, 1),
        (1024, 4, 1),
        (3072, 10, 1),
        (8192, 24, 1),
        (16384, 16, 8),
    )
)
"""SPEC's ten shapes (cuDNN FE's "ten shapes"): the geomeans are taken over these."""

FLASHKDA_MIXED_LENGTHS = (1300, 547, 2048, 963, 271, 3063)

FLASHKDA_SHAPES = tuple(
    shape
    for heads in (64, 96)
    for shape in (
        _equal(8192, heads, 1, "flashkda"),
        Shape(FLASHKDA_MIXED_LENGTHS, heads, "flashkda"),
        _equal(8192, heads, 8, "flashkda"),
    )
)
"""FlashKDA's benchmark: T = 8192 as one sequence, six mixed lengths and 8 x 1024; H = 64, 96."""

EDGE_SHAPES = (
    Shape((17, 0, 16), 2, "edge"),
    _equal(64 * 128, 32, 64, "edge"),
)
"""SPEC's known faults: a small packed batch (launch count), many short sequences (workspace)."""

ALL_SHAPES = SPEC_SHAPES + FLASHKDA_SHAPES + EDGE_SHAPES
GROUPS = ("spec", "flashkda", "edge")

QUICK_SHAPE_NAMES = ("1024x4x1", "33x2x3-ragged")
"""``--quick``: the smallest SPEC shape and the small ragged batch, enough to run every stage."""


def shape_by_name(name: str) -> Shape:
    for shape in ALL_SHAPES:
        if shape.name == name:
            return shape
    raise KeyError(f"unknown shape {name!r}; known: {', '.join(s.name for s in ALL_SHAPES)}")
