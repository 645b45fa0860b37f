"""``--only``: which shapes and implementations a run measures.

Each term names a shape (``2048x12x1``), a shape group (``spec``, ``flashkda``, ``edge``), an
implementation (``fla/chunk_kda``) or one part of an implementation's name (``xla``, ``cudnn``,
``kda_hopper``). Shape terms narrow the shapes, implementation terms the implementations; a side
with no term is not narrowed. A term that names nothing is an error.
"""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks.shapes import GROUPS, Shape


def parse_only(text: str | None) -> list[str]:
    """``"spec,fla xla"`` -> ``["spec", "fla", "xla"]`` (commas or spaces separate terms)."""
    if not text:
        return []
    return [term for term in text.replace(",", " ").split() if term]


def _names_implementation(term: str, name: str) -> bool:
    return term == name or term in name.split("/")


def _names_shape(term: str, shape: Shape) -> bool:
    return term in (shape.name, shape.group)


def select(
    terms: Sequence[str], shapes: Sequence[Shape], implementation_names: Sequence[str]
) -> tuple[list[Shape], list[str]]:
    """The shapes and implementation names that ``terms`` keep, in their registry order."""
    shape_terms = [t for t in terms if t in GROUPS or any(_names_shape(t, s) for s in shapes)]
    impl_terms = [
        t for t in terms if any(_names_implementation(t, n) for n in implementation_names)
    ]
    unknown = [t for t in terms if t not in shape_terms and t not in impl_terms]
    if unknown:
        raise ValueError(
            f"--only: {unknown} name no shape, group or implementation; shapes: "
            f"{[s.name for s in shapes]}, groups: {list(GROUPS)}, implementations: "
            f"{list(implementation_names)}"
        )
    kept_shapes = [
        s for s in shapes if not shape_terms or any(_names_shape(t, s) for t in shape_terms)
    ]
    kept_impls = [
        n
        for n in implementation_names
        if not impl_terms or any(_names_implementation(t, n) for t in impl_terms)
    ]
    return kept_shapes, kept_impls
