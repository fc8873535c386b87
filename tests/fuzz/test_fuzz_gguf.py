"""Fuzzing GGUF files (``workbench import-gguf``, :func:`workbench.model.gguf_import.import_gguf`).
A valid tiny GGUF - a one-layer Llama with a 300-token byte-level BPE vocabulary, its matrices
Q8_0, written by the project's own exporter - is taken apart into its header's pieces (magic,
version, the two counts, each key-value pair, each tensor info, the data) and put back together
with one change:

* a key-value pair's value replaced (any type: the same type with an odd value - 0, 2**63, NaN,
  a 100,000-item array -, another type, a string, an array of arrays), removed, repeated, added;
* a tensor info's dimensions, type, offset or name changed, the info removed or repeated;
* the tensor or key-value count, a string's or an array's length set to odd values (2**64 - 1 ...);
* the file truncated anywhere, its header's bytes flipped / overwritten / inserted / deleted.

The outcome is a correct import (the folder loads as a model: its weights finite) or a
one-line CheckpointError / ConfigError naming the file - never another exception, never a hang,
never an allocation the file's size does not justify (huge declared counts and lengths are
refused before anything is allocated: the Python heap and the resident set may grow by at most
64 MiB, 16 bytes per byte of the file, and the gguf package reader's ~700 bytes per header array
item - twice: the import and transformers' tokenizer converter each read the file with it).
"""

from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fuzzkit import MiB, Shown, check_refusal, fuzz, mutated_bytes, note, outcome

gguf = pytest.importorskip("gguf", reason="the optional `gguf` package (pip install -e \".[gguf]\")")

from workbench.errors import CheckpointError, ConfigError  # noqa: E402
from workbench.model.gguf_import import check_gguf_header, import_gguf  # noqa: E402

SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
U64 = [0, 1, 2, 3, 12, 25, 300, 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1]
ITEM_BYTES = 700         # the gguf package's reader: heap per header array item (one numpy view each)


# ---- the file in pieces -------------------------------------------------------------------------------

def _skip_value(data: bytes, pos: int, vtype: int) -> int:
    if vtype in SCALARS:
        return pos + struct.calcsize("<" + SCALARS[vtype])
    if vtype == STRING:
        (n,) = struct.unpack_from("<Q", data, pos)
        return pos + 8 + n
    itype, count = struct.unpack_from("<IQ", data, pos)
    pos += 12
    for _ in range(count):
        pos = _skip_value(data, pos, itype)
    return pos


def split_gguf(data: bytes) -> dict:
    """``{"prefix": magic + version, "kv": [(key, type, value bytes)], "tensors": [(name, dims,
    type, offset)], "data": the data section, "alignment"}`` of a valid little-endian file."""
    _, _, n_t, n_kv = struct.unpack_from("<IIQQ", data, 0)
    pos, kv = 24, []
    for _ in range(n_kv):
        (klen,) = struct.unpack_from("<Q", data, pos)
        key = data[pos + 8:pos + 8 + klen].decode()
        (vtype,) = struct.unpack_from("<I", data, pos + 8 + klen)
        start = pos + 12 + klen
        pos = _skip_value(data, start, vtype)
        kv.append((key, vtype, data[start:pos]))
    tensors = []
    for _ in range(n_t):
        (nlen,) = struct.unpack_from("<Q", data, pos)
        name = data[pos + 8:pos + 8 + nlen].decode()
        pos += 8 + nlen
        (nd,) = struct.unpack_from("<I", data, pos)
        dims = list(struct.unpack_from(f"<{nd}Q", data, pos + 4))
        ttype, offset = struct.unpack_from("<IQ", data, pos + 4 + 8 * nd)
        pos += 4 + 8 * nd + 12
        tensors.append([name, dims, ttype, offset])
    start = pos + (-pos % 32)
    return {"prefix": data[:8], "kv": kv, "tensors": tensors, "data": data[start:], "alignment": 32}


def _string(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def encode(vtype: int, value) -> bytes:
    if vtype in SCALARS:
        code = SCALARS[vtype]
        if code in "fd":
            return struct.pack("<" + code, float(value))
        if code == "?":
            return struct.pack("<B", int(value) & 0xFF)
        bits = 8 * struct.calcsize(code)
        return struct.pack("<" + code.upper(), int(value) % 2**bits) if code.islower() else \
            struct.pack("<" + code, int(value) % 2**bits)
    if vtype == STRING:
        return _string(value)
    itype, items = value
    return struct.pack("<IQ", itype, len(items)) + b"".join(encode(itype, v) for v in items)


def join_gguf(parts: dict, n_kv=None, n_tensors=None, pad: bool = True) -> bytes:
    head = bytearray(parts["prefix"])
    head += struct.pack("<QQ", len(parts["tensors"]) if n_tensors is None else n_tensors,
                        len(parts["kv"]) if n_kv is None else n_kv)
    for key, vtype, raw in parts["kv"]:
        head += _string(key) + struct.pack("<I", vtype) + raw
    for name, dims, ttype, offset in parts["tensors"]:
        head += _string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims) + \
            struct.pack("<IQ", ttype, offset)
    if pad:
        head += b"\0" * (-len(head) % parts["alignment"])
    return bytes(head) + parts["data"]


# ---- the valid file -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def valid(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from workbench.bench.gguf_export import export_gguf
    from workbench.model.config import ModelConfig
    from workbench.model.decoder import CausalLM, init_weights
    from workbench.model.loader import save_model

    root = tmp_path_factory.mktemp("gguf")
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(["The list type has some more methods. Here are all of the methods of list objects."] * 20,
                           trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    cfg = ModelConfig(vocab_size=tk.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    hf = root / "hf"
    save_model(init_weights(CausalLM(cfg), seed=0).eval(), hf)
    tk.save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
        "chat_template": "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"}))
    path = export_gguf(hf, root / "tiny.gguf", "q8_0")
    data = path.read_bytes()
    parts = split_gguf(data)
    assert join_gguf(parts) == data, "the pieces put back together are the file"
    import_gguf(path, root / "warm")          # transformers' GGUF tokenizer converter imported before any bound
    return Shown({"data": data, "parts": parts}, "<the valid GGUF>")


# ---- the mutations ------------------------------------------------------------------------------------

ODD_INTS = st.sampled_from([0, 1, 2, 7, 16, 31, 33, 64, 255, 300, 65535, 2**31 - 1, 2**31, 2**32 - 1, 2**40, 2**63, -1])
ODD_FLOATS = st.sampled_from([0.0, -1.0, 1e-30, 1e30, math.inf, -math.inf, math.nan, 10000.0])
ODD_STRINGS = st.sampled_from(["", "llama", "qwen2", "gpt2", "llama3", "none", "linear", "yarn", "x" * 1000, "é",
                               "\x00", "{{ x }"])


@st.composite
def new_value(draw, vtype, raw):
    """(type, encoded value): the same type with an odd value, or another type."""
    choice = draw(st.sampled_from(["same", "same", "other"]))
    if choice == "other":
        vtype = draw(st.sampled_from(list(SCALARS) + [STRING, ARRAY]))
    if vtype in SCALARS:
        value = draw(ODD_FLOATS if SCALARS[vtype] in "fd" else ODD_INTS)
        return vtype, encode(vtype, value)
    if vtype == STRING:
        return vtype, encode(STRING, draw(ODD_STRINGS))
    itype = draw(st.sampled_from([4, 5, 6, STRING, ARRAY, 0]))
    if itype == ARRAY:
        inner = draw(st.lists(st.lists(ODD_INTS, max_size=3), max_size=3))
        return ARRAY, struct.pack("<IQ", ARRAY, len(inner)) + b"".join(encode(ARRAY, (5, x)) for x in inner)
    n = draw(st.sampled_from([0, 1, 2, 299, 300, 301, 5000]))      # (transformers parses each item: seconds for 20,000)
    item = draw(ODD_STRINGS) if itype == STRING else draw(ODD_FLOATS if itype == 6 else ODD_INTS)
    return ARRAY, encode(ARRAY, (itype, [item] * n))


@st.composite
def kv_mutation(draw, parts):
    kv = list(parts["kv"])
    i = draw(st.integers(0, len(kv) - 1))
    key, vtype, raw = kv[i]
    op = draw(st.sampled_from(["value", "value", "value", "remove", "repeat", "add", "count"]))
    n_kv = None
    if op == "value":
        kv[i] = (key, *draw(new_value(vtype, raw)))
    elif op == "remove":
        del kv[i]
    elif op == "repeat":
        kv.insert(i, kv[i])
    elif op == "add":
        key = draw(st.sampled_from(["general.alignment", "llama.rope.scaling.type", "llama.rope.scaling.factor",
                                    "tokenizer.ggml.padding_token_id", "qwen2.block_count", "x"]))
        kv.append((key, *draw(new_value(4, b""))))
    else:
        n_kv = draw(st.sampled_from(U64))
    what = f"key-value {op}: {key} -> {kv[i] if op == 'value' else n_kv}"
    return Shown(join_gguf(dict(parts, kv=kv), n_kv=n_kv), what, area="kv")


@st.composite
def tensor_mutation(draw, parts):
    tensors = [[name, list(dims), ttype, offset] for name, dims, ttype, offset in parts["tensors"]]
    i = draw(st.integers(0, len(tensors) - 1))
    op = draw(st.sampled_from(["dims", "ndims", "type", "offset", "name", "remove", "repeat", "count"]))
    n_t = None
    t = tensors[i]
    if op == "dims":
        j = draw(st.integers(0, len(t[1]) - 1))
        t[1][j] = draw(st.sampled_from(U64) | st.sampled_from([t[1][j] * 2, t[1][j] // 2, t[1][j] + 32]))
    elif op == "ndims":
        t[1] = draw(st.lists(st.sampled_from([1, 2, 32, 64, 300]), max_size=6))
    elif op == "type":
        t[2] = draw(st.sampled_from([0, 1, 2, 8, 10, 12, 14, 24, 30, 5, 4, 99, 2**31]))
    elif op == "offset":
        t[3] = draw(st.sampled_from(U64) | st.integers(0, len(parts["data"]) + 64))
    elif op == "name":
        t[0] = draw(st.sampled_from(["blk.1.attn_q.weight", "blk.0.attn_q.bias", "rope_freqs.weight", "",
                                     "token_embd.weight", "output.weight", "x" * 300]))
    elif op == "remove":
        del tensors[i]
    elif op == "repeat":
        tensors.insert(i, list(t))
    else:
        n_t = draw(st.sampled_from(U64))
    return Shown(join_gguf(dict(parts, tensors=tensors), n_tensors=n_t),
                 f"tensor {op}: {parts['tensors'][i][0]} -> {t if op != 'count' else n_t}", area="tensor info")


@st.composite
def byte_mutation(draw, valid):
    data, parts = valid["data"], valid["parts"]
    header_end = len(data) - len(parts["data"])
    if draw(st.booleans()):
        cut = draw(st.integers(0, len(data) - 1) | st.sampled_from([0, 3, 4, 8, 16, 24, header_end - 1, header_end]))
        return Shown(data[:cut], f"truncated to {cut} bytes", area="truncated")
    new, what = draw(mutated_bytes(data, (0, header_end)))
    return Shown(new, f"header bytes: {what}", area="header bytes")


@st.composite
def mutation(draw, valid):
    v = valid.value
    kind = draw(st.sampled_from(["kv"] * 4 + ["tensor"] * 3 + ["bytes"] * 3))
    if kind == "kv":
        return draw(kv_mutation(v["parts"]))
    if kind == "tensor":
        return draw(tensor_mutation(v["parts"]))
    return draw(byte_mutation(v))


# ---- the check ----------------------------------------------------------------------------------------

def run_case(tmp_path: Path, data: bytes, area: str):
    src, out = tmp_path / "model.gguf", tmp_path / "out"
    src.write_bytes(data)
    shutil.rmtree(out, ignore_errors=True)
    try:                 # the gguf package's reader: some 700 bytes of heap per header array item
        items = check_gguf_header(src)["array_items"]
    except CheckpointError:
        items = 0
    kind, got = outcome(lambda: import_gguf(src, out, overwrite=True), (CheckpointError, ConfigError),
                        max_bytes=64 * MiB + 16 * len(data) + 2 * ITEM_BYTES * items)
    if kind == "error":
        check_refusal(got, [src])
        note(f"{area}: refused")
        return got
    from workbench.model.loader import load_model

    model = load_model(out, device="cpu")           # what was written is a model that loads (its weights are
    with torch.inference_mode():                    # what the file holds: finite, not necessarily sensible)
        assert model(torch.tensor([[0, 1, 2]])).shape == (1, 3, model.config.vocab_size)
    assert (out / "tokenizer.json").is_file()
    note(f"{area}: imported")
    return None


@fuzz(ci=150, deadline_ms=20_000)
@given(data=st.data())
def test_fuzz_gguf_import(valid, tmp_path, data):
    case = data.draw(mutation(valid), label="mutation")
    run_case(tmp_path, case.value, case.area)


def test_the_valid_file_imports(valid, tmp_path):
    assert run_case(tmp_path, valid.value["data"], "valid") is None


# ---- what the fuzzing found, kept as regular tests ----------------------------------------------------

def _with_kv(valid, key, vtype, raw, replace=True):
    parts = valid.value["parts"]
    kv = list(parts["kv"])
    keys = [k for k, *_ in kv]
    if replace and key in keys:
        kv[keys.index(key)] = (key, vtype, raw)
    else:
        kv.append((key, vtype, raw))
    return join_gguf(dict(parts, kv=kv))


def _with_tensor(valid, which, **change):
    parts = valid.value["parts"]
    tensors = [[n, list(d), ty, off] for n, d, ty, off in parts["tensors"]]
    t = next(t for t in tensors if t[0] == which)
    for field, value in change.items():
        t[["name", "dims", "type", "offset"].index(field)] = value
    return join_gguf(dict(parts, tensors=tensors))


def _with_nan(valid, which):
    parts = valid.value["parts"]
    name, dims, ttype, offset = next(t for t in parts["tensors"] if t[0] == which)
    assert ttype == 0                                                   # F32
    data = bytearray(parts["data"])
    data[offset:offset + 4] = struct.pack("<f", math.nan)
    return join_gguf(dict(parts, data=bytes(data)))


@pytest.mark.parametrize("case, needles", [
    # an array declaring 2**60 bytes at the end of the metadata: the gguf reader appended empty views forever
    (lambda v: _with_kv(v, "x.huge", ARRAY, struct.pack("<IQ", 0, 2**60), replace=False),
     ["'x.huge'", "1,152,921,504,606,846,976 items"]),
    (lambda v: join_gguf(v.value["parts"], n_kv=2**64 - 1), ["key-value pairs"]),
    (lambda v: join_gguf(v.value["parts"], n_tensors=2**40), ["tensors, more than"]),
    (lambda v: _with_kv(v, "general.name", STRING, struct.pack("<Q", 2**63)), ["'general.name'", "bytes"]),
    (lambda v: _with_tensor(v, "output.weight", dims=[32, 300, 1, 1, 1, 1, 1]), ["7 dimensions"]),
    (lambda v: _with_tensor(v, "output.weight", offset=32), ["overlaps"]),
    (lambda v: _with_tensor(v, "output.weight", offset=7), ["not a multiple of the alignment"]),
    # 2**31 layers: the importer listed the names of 2**31 layers (a hang growing memory)
    (lambda v: _with_kv(v, "llama.block_count", 4, struct.pack("<I", 2**31)), ["num_hidden_layers", "2147483648"]),
    # 0 heads: ZeroDivisionError
    (lambda v: _with_kv(v, "llama.attention.head_count", 4, struct.pack("<I", 0)), ["head_count", "positive"]),
    # a string where a number belongs: ValueError from int()
    (lambda v: _with_kv(v, "llama.vocab_size", STRING, encode(STRING, "300")),
     ["'llama.vocab_size'", "not an integer"]),
    (lambda v: _with_kv(v, "llama.attention.layer_norm_rms_epsilon", 6, struct.pack("<f", math.nan)),
     ["layer_norm_rms_epsilon", "not a finite number"]),
    # NaN in a tensor's data: the folder was written, and then refused by the loader
    (lambda v: _with_nan(v, "blk.0.attn_norm.weight"), ["'blk.0.attn_norm.weight'", "non-finite"]),
    # a tensor's type changed to F16 over Q8_0 bytes: its data now runs into the next tensor's
    (lambda v: _with_tensor(v, "output.weight", type=1), ["'output.weight'", "overlaps"]),
    # a tensor with no name: the name check's error did not name the file
    (lambda v: _with_tensor(v, "output.weight", name=""), ["expected a name ending in .weight"]),
    # a shape that disagrees with the metadata (the same bytes): written as [16, 64], a folder the loader refuses
    (lambda v: _with_tensor(v, "blk.0.attn_q.weight", dims=[64, 16]), ["attn_q.weight", "has shape [16, 64]"]),
    # transformers' converter error spanned two lines
    (lambda v: _with_kv(v, "llama.attention.layer_norm_rms_epsilon", 0, b"\x01"), ["tokenizer could not be converted"]),
])
def test_files_found_by_fuzzing_are_refused_by_name(valid, tmp_path, case, needles):
    err = run_case(tmp_path, case(valid), "regression")
    assert err is not None and all(n in str(err) for n in needles), err


def test_a_key_with_control_characters_is_named_on_one_line(valid, tmp_path):
    """A corrupted key ('llama.embedding_le\\x00\\x00\\x00\\n') was printed as it is: a newline in the message."""
    parts = valid.value["parts"]
    kv = list(parts["kv"])
    kv[0] = ("general.arch\x00\n", 13, b"")                    # and an unknown value type
    err = run_case(tmp_path, join_gguf(dict(parts, kv=kv)), "regression")
    assert "'general.arch\\x00\\n'" in str(err) and "unknown value type 13" in str(err)
