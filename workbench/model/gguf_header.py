"""The header of a llama.cpp GGUF file, walked and checked before the ``gguf`` package reads it
(:func:`check_gguf_header`; ``workbench import-gguf``, :mod:`workbench.model.gguf_import`, calls it
first).

Needs the optional ``gguf`` package (``pip install -e ".[gguf]"``), imported only when called.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

from workbench.errors import CheckpointError, WorkbenchError

GGUF_HINT = "reading GGUF files needs the `gguf` package: pip install -e \".[gguf]\" (or pip install gguf)"


def _import_gguf():
    try:
        import gguf  # lazy: optional (the [gguf] extra)
    except ImportError:
        raise WorkbenchError(GGUF_HINT) from None
    return gguf


# ---- the header, checked before the gguf package reads it ---------------------------------------------
# GGUFReader trusts every count and length in the header: an array declared with 2**60 numbers
# at the end of the file loops forever appending empty views (a hang that grows memory), a
# truncated tensor fails late.  The header is walked here first, every count and length checked
# against the bytes that are left, nothing allocated in proportion to a declared number.
GGUF_MAGIC = 0x46554747                     # b"GGUF", little-endian
GGUF_VERSIONS = (2, 3)                      # what the gguf package's reader reads
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}   # GGUFValueType -> bytes
_STRING, _ARRAY = 8, 9
_MAX_ARRAY_DEPTH = 3                        # an array of arrays of arrays (the format nests; nothing real does)
_MAX_DIMS = 4                               # GGML_MAX_DIMS
# The gguf package's reader makes one numpy view per array item, some 700 bytes of Python heap
# each (a 100,000-item array of bytes: 67 MiB), and transformers' tokenizer converter reads the
# file with it again: a header with more array items than this, in all, is refused (a vocabulary
# of 262,144 tokens has some 1.3 million: tokens, scores, token types and merges).
MAX_ARRAY_ITEMS = 2**22
_MAX_ELEMENTS = 2**50


class _Header:
    """A bounds-checked cursor over the file's bytes (memory-mapped: nothing is read ahead)."""

    def __init__(self, data, path: Path, order: str) -> None:
        self.data, self.path, self.order, self.pos, self.items = data, path, order, 0, 0

    def fail(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: GGUF header {what} (a corrupt or truncated file?)")

    def left(self) -> int:
        return len(self.data) - self.pos

    def take(self, n: int, what: str) -> int:
        if n > self.left():
            raise self.fail(f"{what}: needs {n:,} bytes at offset {self.pos:,}, the file has {self.left():,} left")
        at = self.pos
        self.pos += n
        return at

    def uint(self, size: int, what: str) -> int:
        at = self.take(size, what)
        return struct.unpack_from(self.order + {4: "I", 8: "Q"}[size], self.data, at)[0]

    def string(self, what: str) -> str:
        n = self.uint(8, f"{what} (its length)")
        at = self.take(n, f"{what} ({n:,} bytes long)")
        try:
            return bytes(self.data[at:at + n]).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what}: not UTF-8") from None

    def value(self, vtype: int, what: str, depth: int = 0):
        """Skip one value of type ``vtype``; returns it when it is a scalar or a string."""
        if vtype in _SCALAR_SIZES:
            size = _SCALAR_SIZES[vtype]
            at = self.take(size, what)
            code = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}[vtype]
            return struct.unpack_from(self.order + code, self.data, at)[0]
        if vtype == _STRING:
            return self.string(what)
        if vtype != _ARRAY:
            raise self.fail(f"{what}: unknown value type {vtype}")
        if depth >= _MAX_ARRAY_DEPTH:
            raise self.fail(f"{what}: arrays nested deeper than {_MAX_ARRAY_DEPTH}")
        itype = self.uint(4, f"{what} (its item type)")
        count = self.uint(8, f"{what} (its length)")
        smallest = _SCALAR_SIZES.get(itype, 8 if itype == _STRING else 12 if itype == _ARRAY else None)
        if smallest is None:
            raise self.fail(f"{what}: unknown array item type {itype}")
        if count * smallest > self.left():
            raise self.fail(f"{what}: an array of {count:,} items needs at least {count * smallest:,} bytes, the "
                            f"file has {self.left():,} left")
        self.items += count
        if self.items > MAX_ARRAY_ITEMS:
            raise self.fail(f"{what}: an array of {count:,} items takes the header's arrays past the "
                            f"{MAX_ARRAY_ITEMS:,} items read here")
        if itype in _SCALAR_SIZES:
            self.take(count * smallest, what)
        else:
            for i in range(count):
                self.value(itype, f"{what}[{i}]", depth + 1)
        return None


def check_gguf_header(path: Path) -> dict:
    """Walk the GGUF header of ``path`` (key-value metadata, tensor infos) with every count,
    length, type and offset checked against the file's size; a CheckpointError naming the file
    and the field otherwise.  Returns ``{"version", "tensors", "kv", "data_offset", "array_items"}``."""
    gguf = _import_gguf()
    sizes = {int(k): v for k, v in gguf.constants.GGML_QUANT_SIZES.items()}
    size = path.stat().st_size
    if size < 24:
        raise CheckpointError(f"{path}: not a readable GGUF file ({size} bytes, too short for its header; "
                              "truncated download?)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        h = _Header(data, path, "<")
        if h.uint(4, "magic") != GGUF_MAGIC:
            raise CheckpointError(f"{path}: not a readable GGUF file (it does not start with the GGUF magic number)")
        version = h.uint(4, "version")
        if version & 0xFFFF == 0:                   # written on a machine of the other byte order
            h.order, h.pos = ">", 4
            version = h.uint(4, "version")
        if version not in GGUF_VERSIONS:
            raise CheckpointError(f"{path}: GGUF version {version} is not read here (versions "
                                  f"{', '.join(map(str, GGUF_VERSIONS))})")
        n_tensors, n_kv = h.uint(8, "tensor count"), h.uint(8, "key-value count")
        if n_kv * 13 > h.left():                    # a key of length 0, a type, a 1-byte value
            raise h.fail(f"declares {n_kv:,} key-value pairs, more than its {h.left():,} remaining bytes can hold")
        if n_tensors * 24 > h.left():               # a name of length 0, no dims, a type, an offset
            raise h.fail(f"declares {n_tensors:,} tensors, more than its {h.left():,} remaining bytes can hold")
        alignment = gguf.GGUF_DEFAULT_ALIGNMENT
        keys = set()
        for i in range(n_kv):
            key = h.string(f"key #{i}")
            if key in keys:
                raise h.fail(f"key {key!r:.80} appears twice")
            keys.add(key)
            vtype = h.uint(4, f"{key!r:.80} (its type)")
            value = h.value(vtype, f"{key!r:.80}")
            if key == "general.alignment":
                if vtype != 4 or not value or value & (value - 1):
                    raise h.fail(f"'general.alignment' is {value!r}: expected a power of two (uint32)")
                alignment = value
        infos = []
        for i in range(n_tensors):
            name = h.string(f"tensor #{i}'s name")
            what = f"tensor {name!r:.80}"
            n_dims = h.uint(4, f"{what} (its number of dimensions)")
            if n_dims > _MAX_DIMS:
                raise h.fail(f"{what} has {n_dims:,} dimensions; GGUF tensors have at most {_MAX_DIMS}")
            dims = [h.uint(8, f"{what} (dimension {d})") for d in range(n_dims)]
            kind = h.uint(4, f"{what} (its type)")
            offset = h.uint(8, f"{what} (its offset)")
            if kind not in sizes:
                raise h.fail(f"{what} has unknown type {kind}")
            n = 1
            for d in dims:
                n *= d
            if n > _MAX_ELEMENTS:
                raise h.fail(f"{what} declares {n:,} elements (dimensions {dims})")
            block, type_size = sizes[kind]
            if dims and dims[0] % block:
                raise h.fail(f"{what}: rows of {dims[0]} values do not fill whole blocks of {block} "
                             f"({gguf.GGMLQuantizationType(kind).name})")
            infos.append((what, n * type_size // block, offset))
        start = h.pos + (-h.pos % alignment)
        for what, nbytes, offset in infos:
            if start + offset + nbytes > size:
                raise CheckpointError(f"{path}: GGUF {what} ends at byte {start + offset + nbytes:,} but the file "
                                      f"has {size:,} bytes (truncated download?)")
            if offset % alignment:
                raise h.fail(f"{what}: its offset {offset:,} is not a multiple of the alignment {alignment} "
                             "(llama.cpp refuses it too)")
        end, last = 0, None
        for what, nbytes, offset in sorted(infos, key=lambda x: x[2]):
            if offset < end:
                raise h.fail(f"{what} (offset {offset:,}) overlaps {last}'s data (which ends at {end:,})")
            end, last = offset + nbytes, what
    return {"version": version, "tensors": n_tensors, "kv": n_kv, "data_offset": start, "array_items": h.items}
