"""Resident bytes measured from real allocations: tensor storages, each counted once."""

from __future__ import annotations


def storage_bytes(tensors, seen: set | None = None) -> int:
    """Bytes of the storages behind ``tensors``, each storage once (by data pointer) across
    calls that share ``seen``; None and empty tensors count nothing."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        st = t.untyped_storage()
        if st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        total += st.nbytes()
    return total
