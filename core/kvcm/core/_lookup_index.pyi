"""Typing stub of the compiled key index (``_lookup_index.c``); see ``kvcm.core._key_index``."""

from collections.abc import Callable, Iterable
from typing import Any, Final

MAX_SLOT: Final[int]

class KeyIndex:
    """Cache key -> set of pool slots, walked per prompt (compiled)."""

    def __init__(self) -> None: ...
    def __len__(self) -> int: ...
    def add(self, keys: Iterable[bytes], slot: int, /) -> None: ...
    def discard(self, keys: Iterable[bytes], slot: int, /) -> None: ...
    def get(self, key: bytes, /) -> int: ...
    def walk(
        self, raw: bytes, hash_size: int, suffix: bytes, max_blocks: int, scope: int, /
    ) -> list[tuple[int, int]]: ...

def answer_all(
    kinds: list[tuple[list[tuple[int, int]], int, int, tuple[list[Any], ...]]],
    rows: list[Any],
    weight: float,
    parts: dict[int, Any],
    hit_parts: Callable[[dict[int, Any], int, str], Any],
    pool_hit: type[Any],
    pool_load: type[Any],
    /,
) -> tuple[Any, ...]: ...
