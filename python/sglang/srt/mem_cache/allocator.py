"""Free-list allocators for fixed-size pages and token slots.

Both live on the host (the scheduler decides allocation before a forward), so no device sync is needed.
Id 0 is reserved as a dummy (padding rows and CUDA-graph dummy requests may point at it safely).
Every failure leaves the allocator untouched and raises `PoolExhaustedError` naming the pool.
"""

from __future__ import annotations


class PoolExhaustedError(RuntimeError):
    """A pool cannot satisfy an allocation; the state is unchanged."""

    def __init__(self, pool: str, requested: int, available: int) -> None:
        super().__init__(f"{pool} pool exhausted: requested {requested}, available {available}")
        self.pool, self.requested, self.available = pool, requested, available


class PageAllocator:
    """Hands out ids 1..size-1 (0 is the reserved dummy). LIFO reuse keeps recently freed ids warm."""

    def __init__(self, size: int, name: str) -> None:
        if size < 2:
            raise ValueError(f"{name} pool needs at least 2 entries (one is reserved), got {size}")
        self.size, self.name = size, name
        self._free = list(range(size - 1, 0, -1))
        self._is_free = bytearray([0]) + bytearray([1]) * (size - 1)

    def available(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list:
        if n > len(self._free):
            raise PoolExhaustedError(self.name, n, len(self._free))
        if n == 0:
            return []
        out = self._free[-n:][::-1]
        del self._free[-n:]
        for i in out:
            self._is_free[i] = 0
        return out

    def free(self, ids) -> None:
        # Pushed back in reverse, so freeing then allocating the same count returns the same ids in the same
        # order (identical runs see identical slots).
        for i in reversed(list(ids)):
            if not 0 < i < self.size or self._is_free[i]:
                raise RuntimeError(f"{self.name} pool: double free or invalid id {i}")
            self._is_free[i] = 1
            self._free.append(i)

    def is_full(self) -> bool:
        """True when every id (except the reserved one) is free."""
        return len(self._free) == self.size - 1
