"""Solutions to notebook 02's exercises (workbench exercises list 02)."""

from workbench.kv.block_manager import EvictionCandidate


def slot_mapping(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Physical slots of token positions [start, end) of a sequence with this block table."""
    out = []
    for p in range(start, end):
        block = block_table[p // block_size]      # the physical block holding position p
        offset = p % block_size                   # p's place inside that block
        out.append(block * block_size + offset)
    return out


def block_hashes(token_ids: list[int], block_size: int, hash_block) -> list[int]:
    """Chain hash of every full block: hash_block(previous block's hash or None, block tokens)."""
    hashes = []
    parent = None
    for i in range(len(token_ids) // block_size):   # full blocks only: a partial tail is never hashed
        block = tuple(token_ids[i * block_size:(i + 1) * block_size])
        parent = hash_block(parent, block)
        hashes.append(parent)
    return hashes


def choose_victim(candidates: list[EvictionCandidate]) -> int:
    """The block_id of the cached block to evict now (candidates: every cached block, ref_count 0).

    Leaves only (a tail is reached only through its head); among them the fewest prefix hits,
    so a block that prompts share outlives one-off prompts; the least recently used among equals."""
    leaves = [c for c in candidates if c.children == 0]
    return min(leaves, key=lambda c: (c.hits, c.last_used)).block_id
