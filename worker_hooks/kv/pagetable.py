"""Content-addressed, refcounted KV pages: the storage under `CheckpointStore`.

A page is immutable once held (only full pages are checkpointed) and is stored once however many
request chains reference it. Each page remembers its parent key (the page before it, or the chain's
prior for page 0), so a held prefix can be walked back from its last key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


class IntegrityError(AssertionError):
    """The store's bookkeeping disagrees with its contents (a bug, never bad input)."""


@dataclass(slots=True, eq=False)
class _Page:
    data: memoryview
    parent: str | None
    refs: int = 1


class PageTable:
    def __init__(self) -> None:
        self._pages: dict[str, _Page] = {}
        self.bytes_used = 0

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, key: str) -> bool:
        return key in self._pages

    def data(self, key: str) -> memoryview | None:
        page = self._pages.get(key)
        return page.data if page else None

    def nbytes(self, key: str) -> int:
        return self._pages[key].data.nbytes

    def parent(self, key: str) -> str | None:
        return self._pages[key].parent

    def add(self, key: str, data: memoryview, parent: str | None) -> None:
        """Hold a new page with one reference; the caller has made room for it."""
        if key in self._pages:
            raise KeyError(f"page {key[:12]} is already held; incref it instead")
        self._pages[key] = _Page(data, parent)
        self.bytes_used += data.nbytes

    def incref(self, key: str) -> None:
        self._pages[key].refs += 1

    def decref(self, key: str) -> bool:
        """Drop one reference; frees the page and returns True when it was the last."""
        page = self._pages[key]
        page.refs -= 1
        if page.refs:
            return False
        del self._pages[key]
        self.bytes_used -= page.data.nbytes
        return True

    def ancestry(self, key: str, n_pages: int) -> tuple[list[str], str | None] | None:
        """(keys of pages 0..n_pages-1 ending at `key`, the prior of page 0), or None when the pages
        held under `key` are not a chain of exactly that length from a root."""
        keys: list[str] = []
        cur: str | None = key
        while cur is not None and cur in self._pages and len(keys) < n_pages:
            keys.append(cur)
            cur = self._pages[cur].parent
        if len(keys) != n_pages or (cur is not None and cur in self._pages):
            return None
        keys.reverse()
        return keys, cur

    def check(self, refs: Mapping[str, int]) -> None:
        """Raise IntegrityError unless sizes add up and refcounts equal `refs` (key -> references)."""
        total = sum(p.data.nbytes for p in self._pages.values())
        if total != self.bytes_used:
            raise IntegrityError(f"pages hold {total} B but bytes_used is {self.bytes_used}")
        for key, page in self._pages.items():
            if page.refs != refs.get(key, 0):
                raise IntegrityError(f"page {key[:12]} refcount {page.refs} != {refs.get(key, 0)} references")
        missing = [k for k in refs if k not in self._pages]
        if missing:
            raise IntegrityError(f"{len(missing)} referenced pages are not held, e.g. {missing[0][:12]}")
