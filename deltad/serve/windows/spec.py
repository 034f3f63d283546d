"""A window's spec: everything that decides its bytes (the window cache's key)."""

from __future__ import annotations

from dataclasses import dataclass

from deltad.types import Form, WireDtype


@dataclass(frozen=True)
class WindowSpec:
    """Everything that decides a window's bytes (the cache key when no rows are owed)."""

    rank: int
    generation: int
    resync: bool
    from_seq: int  # cursor seq (-1 for a base window)
    to_seq: int
    form: Form
    dtype: WireDtype
    tables: tuple[str, ...]
    k: int
    fraction: float
    max_rows: int
    chunk_bytes: int
    row_alignment: int = 0  # packed dtypes (else 0)
    dense: bool = False  # with the newest dense state at or before the head, if newer
