"""A model's pages in groups: the layers that see every key share one table per
sequence, and each sliding window's layers another, whose pages behind the
window are freed as the sequence moves on.

Each group is a ``PagedKV`` of its own (its pages hold only its layers' rows),
so a window's pages go back to its pool while the full layers' stay. A window
layer of 1,024 keys in an 8,000-token sequence then holds about 1,100 tokens'
pages instead of 8,000 (Gemma 3: five layers of six; gpt-oss: half, with
windows of 128). A table keeps ``WINDOW_SLACK`` tokens more than the window of
its last pass's first token, so that the prompt cache may trim a kept state by
about as many (a prompt sent again runs its last token anew); a state is not
trimmed deeper than its ``floor``.
"""

from collections.abc import Sequence

from mlx_backend.caches.paged import (
    HOLE,
    PAGE_TOKENS,
    LayerShape,
    PagedKV,
    PagedLayer,
    PagedPrefix,
    Segment,
    StepLayout,
    Table,
    pages_for,
)

# Tokens a window's table holds past its window: how far back a kept state may
# be trimmed.
WINDOW_SLACK = 2 * PAGE_TOKENS


class PagedStore:
    """Every attention layer's pages, one ``PagedKV`` per group of layers: those
    that see every key, then each sliding window's. A sequence holds a
    ``Table`` per group."""

    def __init__(self, shapes: Sequence[LayerShape], arena_pages: int | None = None):
        self.shapes = tuple(shapes)
        self.windows = tuple(sorted({s.window for s in self.shapes}))
        self.groups = tuple(
            PagedKV([s for s in self.shapes if s.window == w], arena_pages)
            for w in self.windows
        )
        # Each layer's group, and its index there.
        self.places: list[tuple[int, int]] = []
        counts = [0] * len(self.groups)
        for s in self.shapes:
            g = self.windows.index(s.window)
            self.places.append((g, counts[g]))
            counts[g] += 1

    @property
    def closed(self) -> bool:
        return any(g.closed for g in self.groups)

    @closed.setter
    def closed(self, value: bool) -> None:
        for g in self.groups:
            g.closed = value

    @property
    def planes(self) -> list:
        """Every group's arenas (to evaluate with a step)."""
        return [g.planes for g in self.groups]

    @property
    def page_nbytes(self) -> int:
        """Bytes of a sequence's page of tokens across every layer."""
        return sum(g.page_nbytes for g in self.groups)

    @property
    def pages_held(self) -> int:
        return sum(g.pages_held for g in self.groups)

    def nbytes(self) -> int:
        """Bytes of the pages held."""
        return sum(g.nbytes() for g in self.groups)

    def free_nbytes(self) -> int:
        """Bytes of the arenas' pages nothing holds."""
        return sum((g.pages - g.pages_held) * g.page_nbytes for g in self.groups)

    def held_nbytes(self, tables: Sequence[Sequence[Table]]) -> int:
        """Bytes of the pages that any of ``tables`` (a sequence's, per group)
        holds, each page once."""
        total = 0
        for i, g in enumerate(self.groups):
            pages = {p for t in tables for p in t[i].pages if p != HOLE}
            total += len(pages) * g.page_nbytes
        return total

    def tables(self) -> list[Table]:
        """A new sequence's tables, empty."""
        return [Table() for _ in self.groups]

    def extend(self, tables: list[Table], context: int, first: int) -> tuple:
        """Pages for a sequence's ``tables`` to hold ``context`` tokens, for a
        pass whose first token is at ``first``: no later pass looks further
        back, so each window's pages before it (and its slack) are freed. Each
        group's pages, for the pass's ``Segment``."""
        out = []
        for g, w, table in zip(self.groups, self.windows, tables):
            more = pages_for(context) - len(table.pages)
            if more > 0:
                table.pages += g.allocate(more)
            if w:
                free_behind(g, table, first - w - WINDOW_SLACK)
            out.append(tuple(table.pages))
        return tuple(out)

    def release(self, tables: Sequence[Table]) -> None:
        for g, table in zip(self.groups, tables):
            g.release(table.pages)

    def prefix(self, tables: Sequence[Table], length: int) -> list[PagedPrefix]:
        """The first ``length`` tokens of a sequence's ``tables`` as a KV state
        of their own, per layer: it holds the pages, copying nothing."""
        kept = [g.prefix(t, length) for g, t in zip(self.groups, tables)]
        return [kept[g][i] for g, i in self.places]

    def take(self, cache: Sequence, length: int) -> list[Table]:
        """New tables holding the first ``length`` tokens of ``cache`` (per
        layer): ``PagedKV.take`` per group. Raises ``MissingKeys`` where a
        window's state lacks keys its next token sees."""
        tables = []
        try:
            for i, g in enumerate(self.groups):
                layers = [c for c, (at, _) in zip(cache, self.places) if at == i]
                tables.append(g.take(layers, length))
        except Exception:
            self.release(tables)
            raise
        return tables

    def layout(self, segments: Sequence[Segment]) -> tuple[StepLayout, ...]:
        """A pass's layout per group, for ``segments`` whose pages are given per
        group (``extend``); the groups share its positions and segment rows."""
        layouts: list[StepLayout] = []
        for i, g in enumerate(self.groups):
            own = [Segment(s.start, s.tokens, s.context, s.pages[i]) for s in segments]
            layouts.append(g.layout(own, layouts[0] if layouts else None))
        return tuple(layouts)

    def layer(self, index: int, layouts: Sequence[StepLayout]) -> PagedLayer:
        """The paged layer ``index``'s cache in a pass of ``layouts``."""
        g, i = self.places[index]
        return PagedLayer(self.groups[g], i, layouts[g])


def free_behind(kv: PagedKV, table: Table, position: int) -> None:
    """Frees ``table``'s pages wholly before ``position`` (holes left)."""
    end = max(position, 0) // PAGE_TOKENS
    if end * PAGE_TOKENS <= table.start:
        return
    # The pages from the one holding its first token on (those before are holes).
    first = table.start // PAGE_TOKENS
    kv.release(table.pages[first:end])
    table.pages[first:end] = [HOLE] * (end - first)
    table.start = end * PAGE_TOKENS
