"""The plugin's staging ring: pinned host memory shared by the scheduler thread (which reserves and
copies pages into it) and the shipper thread (which sends and releases them)."""

from __future__ import annotations

import threading
from collections import deque


class Staging:
    """A ring of `capacity` bytes of host memory: contiguous reservations, taken by the scheduler thread
    and released by the shipper thread (in any order; space comes back oldest first). Thread-safe."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._lock = threading.Lock()
        self._live: deque[list[int]] = deque()  # [offset, size, released] in reservation order
        self._head = 0  # where the next reservation starts (when it fits)
        self._used = 0

    def reserve(self, nbytes: int) -> int | None:
        """The offset of `nbytes` contiguous bytes, or None when the ring has no such room now."""
        if nbytes < 1:
            raise ValueError(f"nbytes must be >= 1, got {nbytes}")
        with self._lock:
            if not self._live:
                offset: int | None = 0 if nbytes <= self.capacity else None
            else:
                tail, head = self._live[0][0], self._head
                if head > tail:
                    offset = head if head + nbytes <= self.capacity else (0 if nbytes <= tail else None)
                elif head < tail:
                    offset = head if head + nbytes <= tail else None
                else:  # head == tail with live reservations: full
                    offset = None
            if offset is None:
                return None
            self._live.append([offset, nbytes, 0])
            self._head = offset + nbytes
            self._used += nbytes
            return offset

    def release(self, offset: int) -> None:
        with self._lock:
            for entry in self._live:
                if entry[0] == offset and not entry[2]:
                    entry[2] = 1
                    self._used -= entry[1]
                    break
            else:
                raise RuntimeError(f"no staged reservation at offset {offset}")
            while self._live and self._live[0][2]:
                self._live.popleft()

    @property
    def used(self) -> int:
        """Bytes reserved and not released."""
        with self._lock:
            return self._used

    def regions(self) -> list[tuple[int, int]]:
        """(offset, size) of the live reservations (tests)."""
        with self._lock:
            return [(o, n) for o, n, released in self._live if not released]
