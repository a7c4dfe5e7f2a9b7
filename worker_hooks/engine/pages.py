"""Paged KV accounting: which request owns which pages of the engine's KV pool.

A request is admitted with a reservation for the most pages it can ever need (prompt plus
max_new_tokens), takes real pages as its context grows, and gives all of them back when it finishes
or is aborted. Reservations make decode growth infallible, so the scheduler never has to preempt.
Invariant: every page id is either free or owned by exactly one request, and the outstanding
reservations never exceed the free pages.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class PagePoolError(RuntimeError):
    """An allocation the pool cannot honour, or a broken invariant (the message has the numbers)."""


@dataclass(slots=True)
class _Owner:
    pages: list[int] = field(default_factory=list)
    reserved: int = 0  # pages promised to this owner and not yet taken


class PagePool:
    def __init__(self, capacity_tokens: int, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if capacity_tokens < page_size:
            raise ValueError(f"KV capacity {capacity_tokens} tokens is less than one page ({page_size})")
        self.page_size = page_size
        self.total_pages = capacity_tokens // page_size
        # a stack: the most recently freed page is reused first
        self._free: list[int] = list(range(self.total_pages - 1, -1, -1))
        self._owners: dict[str, _Owner] = {}
        self._reserved = 0

    # -- queries --------------------------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        return self.total_pages * self.page_size

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def available_pages(self) -> int:
        """Free pages not promised to anyone."""
        return len(self._free) - self._reserved

    @property
    def used_pages(self) -> int:
        return self.total_pages - len(self._free)

    def owned(self, owner: str) -> int:
        o = self._owners.get(owner)
        return len(o.pages) if o else 0

    def pages_of(self, owner: str) -> list[int]:
        """The live list of `owner`'s pages in context order (page j holds tokens [j·ps, (j+1)·ps)).

        Read-only for callers. It grows with `grow_to`, and keeps its ids after `free` (so a finished
        request's last pages can still be read out before the next step reuses them).
        """
        o = self._owners.get(owner)
        if o is None:
            raise PagePoolError(f"{owner!r} holds no pages")
        return o.pages

    def can_allocate(self, n_pages: int) -> bool:
        return 0 <= n_pages <= self.available_pages

    # -- actions --------------------------------------------------------------------------------
    def allocate(self, owner: str, n_pages: int, *, reserve: int = 0) -> list[int]:
        """Give `owner` n_pages now and promise it `reserve` more for later `grow` calls."""
        if n_pages < 0 or reserve < 0:
            raise PagePoolError(f"negative allocation: {n_pages} pages, {reserve} reserved")
        if owner in self._owners:
            raise PagePoolError(f"{owner!r} already holds {self.owned(owner)} pages")
        if not self.can_allocate(n_pages + reserve):
            raise PagePoolError(
                f"cannot allocate {n_pages}+{reserve} pages: {self.available_pages} available "
                f"({self.free_pages} free, {self._reserved} reserved)"
            )
        pages = self._take(n_pages)
        self._owners[owner] = _Owner(pages=pages, reserved=reserve)
        self._reserved += reserve
        return list(pages)

    def grow_to(self, owner: str, n_pages: int) -> int:
        """Make `owner` hold at least n_pages, drawing on its reservation first. Returns pages added."""
        o = self._owners.get(owner)
        if o is None:
            raise PagePoolError(f"{owner!r} holds no pages")
        need = n_pages - len(o.pages)
        if need <= 0:
            return 0
        from_reserve = min(need, o.reserved)
        extra = need - from_reserve
        if extra > self.available_pages:
            raise PagePoolError(
                f"{owner!r} needs {need} more pages ({o.reserved} reserved), {self.available_pages} available"
            )
        o.reserved -= from_reserve
        self._reserved -= from_reserve
        o.pages.extend(self._take(need))
        return need

    def free(self, owner: str) -> int:
        """Return every page `owner` holds and drop its reservation. Unknown owners free nothing."""
        o = self._owners.pop(owner, None)
        if o is None:
            return 0
        self._reserved -= o.reserved
        self._free.extend(reversed(o.pages))
        return len(o.pages)

    def _take(self, n: int) -> list[int]:
        if n == 0:
            return []
        taken = self._free[-n:]
        del self._free[-n:]
        taken.reverse()
        return taken

    def check_integrity(self) -> None:
        owned = [p for o in self._owners.values() for p in o.pages]
        reserved = sum(o.reserved for o in self._owners.values())
        if len(owned) + len(self._free) != self.total_pages:
            raise PagePoolError(
                f"page leak: {len(owned)} owned + {len(self._free)} free != {self.total_pages} total"
            )
        seen = set(owned)
        seen.update(self._free)
        if (
            len(seen) != self.total_pages
            or min(seen, default=0) < 0
            or max(seen, default=0) >= self.total_pages
        ):
            raise PagePoolError(
                f"page ids corrupt: {len(seen)} distinct ids in [0, {self.total_pages}) expected, "
                f"{len(owned)} owned + {len(self._free)} free"
            )
        if reserved != self._reserved:
            raise PagePoolError(f"reservation drift: owners hold {reserved}, pool counts {self._reserved}")
        if self._reserved > len(self._free):
            raise PagePoolError(f"over-reserved: {self._reserved} reserved > {len(self._free)} free")
