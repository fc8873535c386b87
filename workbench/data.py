"""Bundled data: the held-out split of the training corpus.

``data/corpus/heldout.jsonl`` holds whole documents (``{"path", "text"}``) that the bundled
model never saw in training: for perplexity, benchmark prompts and long-context studies.
"""

from __future__ import annotations

import hashlib
import json
import random
from functools import lru_cache
from pathlib import Path

from workbench.errors import ConfigError, DataError, WorkbenchError

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
HELDOUT = DATA_DIR / "corpus" / "heldout.jsonl"


@lru_cache(maxsize=1)
def heldout_documents(path: str | Path = HELDOUT) -> tuple[dict, ...]:
    p = Path(path)
    if not p.is_file():
        raise WorkbenchError(f"{p}: held-out corpus not found (rebuild it with scripts/train_reference_model.py)")
    docs = []
    for lineno, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        try:
            d = json.loads(line)
            docs.append({"path": d["path"], "text": d["text"]})
        except (json.JSONDecodeError, KeyError) as e:
            raise WorkbenchError(f"{p}, line {lineno}: expected a JSON object with 'path' and 'text' ({e})") from None
    return tuple(docs)


def heldout_token_windows(tokenizer, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """``n`` windows of exactly ``length`` tokens from held-out documents (seeded choice)."""
    try:
        docs = heldout_documents()
    except WorkbenchError:
        return []
    rng = random.Random(seed)
    long_docs = [ids for ids in (tokenizer.encode(d["text"]) for d in docs) if len(ids) > length]
    if not long_docs:
        return []
    out = []
    for _ in range(n):
        ids = rng.choice(long_docs)
        start = rng.randrange(0, len(ids) - length)
        out.append(ids[start:start + length])
    return out


def heldout_prompts(n: int, chars: int = 200, seed: int = 0) -> list[str]:
    """``n`` text prompts: the start of a paragraph from held-out documents, cut at a word."""
    rng = random.Random(seed)
    paras = [p.strip() for d in heldout_documents() for p in d["text"].split("\n\n")
             if len(p.strip()) > chars and p.strip()[0].isalpha()]
    picks = rng.sample(paras, min(n, len(paras)))
    return [p[:chars].rsplit(" ", 1)[0] for p in picks]


def heldout_split(tokenizer, context: int = 1024) -> dict:
    """Split the held-out corpus by whole documents: of the documents with at least ``context``
    tokens (in file order), even-numbered ones are for evaluation and odd-numbered ones for
    calibration; each contributes its first ``context`` tokens.  Shorter documents are unused.
    No calibration token is ever an evaluation token."""
    long_docs = [(d["path"], ids) for d in heldout_documents()
                 if len(ids := tokenizer.encode(d["text"])) >= context]
    ev, cal = long_docs[0::2], long_docs[1::2]
    return {"evaluation": [ids[:context] for _, ids in ev], "evaluation_docs": [p for p, _ in ev],
            "calibration": [ids[:context] for _, ids in cal], "calibration_docs": [p for p, _ in cal]}


# ---- a user's JSONL text file (calibration / evaluation sets) --------------------------------

CALIBRATION_DIR = DATA_DIR / "calibration"


# A calibration reads a few dozen windows of a few hundred tokens: these bound what a dataset may
# hold before anything is tokenized (a 400 MB JSONL of 4 rows took 7 GB in 22 s when it was read
# whole).  A row is read at most ``max_row_bytes + 1`` bytes at a time, so an oversized one is
# refused at its line having read no more than that.
ROW_BYTES_LIMIT = 4 << 20              # bytes of one JSONL line
DATASET_BYTES_LIMIT = 64 << 20         # bytes of the whole file
DATASET_TOKENS_LIMIT = 2_000_000       # tokens of the rows a calibration tokenizes


def _mib(n: int) -> str:
    return f"{n / 2**20:g} MiB" if n >= 1 << 20 else f"{n:,} bytes"


def read_jsonl(path: str | Path, text_field: str = "text", max_row_bytes: int = ROW_BYTES_LIMIT,
               max_bytes: int = DATASET_BYTES_LIMIT) -> list[dict]:
    """The rows of a JSONL file, one JSON object per line, each with a non-empty string under
    ``text_field``: ``[{"line": n, "text": str, **the row's other fields}]``.  Blank lines are
    skipped.  Anything else is a :class:`~workbench.errors.DataError` naming the file and the
    line: a missing file, an empty file, bytes that are not UTF-8, bad JSON, a line that is
    not an object, a missing / non-string / empty text field, a line longer than
    ``max_row_bytes`` or a file past ``max_bytes`` (read line by line: neither is read whole)."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: {'not a file' if p.exists() else 'file not found'} (expected a JSONL file: "
                        f"one JSON object per line with a {text_field!r} field)")
    rows: list[dict] = []
    total = 0
    with open(p, "rb") as f:
        for lineno, bline in enumerate(iter(lambda: f.readline(max_row_bytes + 1), b""), 1):
            if len(bline) > max_row_bytes and not bline.endswith(b"\n"):
                raise DataError(f"{p}, line {lineno}: a row of more than {_mib(max_row_bytes)} (the limit of one "
                                "row, max_row_bytes); a calibration reads windows of a few hundred tokens: split "
                                "long documents into rows of a paragraph or a section")
            total += len(bline)
            if total > max_bytes:
                raise DataError(f"{p}, line {lineno}: the file passes {_mib(max_bytes)} here (the limit of a "
                                "dataset, max_bytes); a calibration reads a few dozen windows of a few hundred "
                                "tokens: give a sample of the file")
            rows_line = _jsonl_row(p, lineno, bline.rstrip(b"\n"), text_field)
            if rows_line is not None:
                rows.append(rows_line)
    if not rows:
        raise DataError(f"{p}: the file is empty (expected one JSON object per line with a {text_field!r} field)")
    return rows


def _jsonl_row(p: Path, lineno: int, bline: bytes, text_field: str) -> dict | None:
    """One line of :func:`read_jsonl` as its row, None for a blank line, or a DataError."""
    try:
        line = bline.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{p}, line {lineno}: not UTF-8 (byte 0x{bline[e.start]:02x} at column {e.start + 1}); "
                        "save the file as UTF-8") from None
    if not line.strip():
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{p}, line {lineno}: bad JSON ({e.msg}: column {e.colno})") from None
    except RecursionError:
        raise DataError(f"{p}, line {lineno}: bad JSON (nested too deeply)") from None
    except ValueError as e:          # an integer of more than 4,300 digits
        raise DataError(f"{p}, line {lineno}: bad JSON ({e})") from None
    if not isinstance(obj, dict):
        raise DataError(f"{p}, line {lineno}: expected a JSON object with a {text_field!r} field, "
                        f"got {type(obj).__name__}")
    if text_field not in obj:
        fields = ", ".join(repr(k) for k in list(obj)[:6]) or "none"
        raise DataError(f"{p}, line {lineno}: no {text_field!r} field (fields: {fields}); name the text field "
                        "with --text-field")
    text = obj[text_field]
    if not isinstance(text, str):
        raise DataError(f"{p}, line {lineno}: field {text_field!r} must be a string, got {type(text).__name__}")
    if not text.strip():
        raise DataError(f"{p}, line {lineno}: field {text_field!r} is empty")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:      # JSON's "\ud800" escape: Python reads a lone surrogate
        raise DataError(f"{p}, line {lineno}: field {text_field!r} holds a lone surrogate "
                        f"(a \\u{ord(text[e.start]):04x} escape without its pair): not Unicode text") from None
    return {**{k: v for k, v in obj.items() if k != text_field}, "line": lineno, "text": text}


def encode_rows(rows: list, tokenizer, max_tokens: int = DATASET_TOKENS_LIMIT, path=None) -> list[list[int]]:
    """Each row's token ids, row by row: a DataError at the row where the total passes
    ``max_tokens`` (naming ``path`` and the line), so a file far larger than a calibration uses is
    refused before the rest of it is tokenized (and before its ids and n-gram sets fill memory)."""
    out, total = [], 0
    for r in rows:
        ids = tokenizer.encode(r["text"])
        total += len(ids)
        if total > max_tokens:
            where = f"{path}, " if path is not None else ""
            raise DataError(f"{where}line {r.get('line', '?')}: the dataset passes {max_tokens:,} tokens here (the "
                            "limit, max_tokens / --max-dataset-tokens); a calibration reads a few dozen windows of a "
                            "few hundred tokens: give a sample of the file, or raise the limit")
        out.append(ids)
    return out


def split_rows(rows: list, evaluation_fraction: float = 0.5, group_field: str | None = None) -> tuple[list, list]:
    """``(calibration, evaluation)``: row ``i`` (file order) is an evaluation row when
    ``floor((i + 1) f) > floor(i f)`` - every other row at ``f = 0.5``, interleaved so both
    halves see the whole file.  With ``group_field`` (e.g. ``"source"``: the document a row
    was cut from) the rule applies to the groups in order of first appearance and every row
    follows its group, so no document is in both parts.  No row is in both."""
    if not 0 < evaluation_fraction < 1:
        raise ConfigError(f"evaluation_fraction must be in (0, 1), got {evaluation_fraction!r}")
    is_ev = lambda i: int((i + 1) * evaluation_fraction) > int(i * evaluation_fraction)  # noqa: E731
    if group_field is None:
        ev = [is_ev(i) for i in range(len(rows))]
    else:
        order: dict = {}
        for r in rows:
            order.setdefault(r[group_field], len(order))
        ev = [is_ev(order[r[group_field]]) for r in rows]
    return [r for r, e in zip(rows, ev) if not e], [r for r, e in zip(rows, ev) if e]


GROUP_TYPES = (str, int, float, bool, type(None))


def group_field_of(rows: list, group_field: str | None = "auto", path: str | Path | None = None) -> str | None:
    """``"auto"``: ``"source"`` when every row has one (the shipped sets do), else None (split by
    row); a named field must be in every row.  The field's values name groups: strings, numbers,
    true / false or null (a list or an object in it is a DataError naming ``path`` and the line)."""
    where = f"{path}, " if path is not None else ""
    if group_field == "auto":
        group_field = "source" if rows and all(isinstance(r, dict) and "source" in r for r in rows) else None
    elif group_field is not None:
        if not isinstance(group_field, str):
            raise DataError(f"{where}the group field must be a field name, got {group_field!r:.80}")
        missing = next((r for r in rows if group_field not in r), None)
        if missing is not None:
            raise DataError(f"{where}line {missing.get('line', '?')}: no {group_field!r:.80} field to group rows by")
    if group_field is not None:
        odd = next((r for r in rows if not isinstance(r[group_field], GROUP_TYPES)), None)
        if odd is not None:
            raise DataError(f"{where}line {odd.get('line', '?')}: field {group_field!r:.80} groups rows by document "
                            f"and must be a string or a number, got {type(odd[group_field]).__name__}")
    return group_field


SPLITS = ("all", "calibration", "evaluation", "search", "confirmation")


def dataset_split(rows: list, split: str, evaluation_fraction: float = 0.5, group_field: str | None = None) -> list:
    """The rows of one part of a dataset: ``all``; ``calibration`` / ``evaluation``
    (:func:`split_rows` with ``evaluation_fraction``); ``search`` / ``confirmation``, the two
    halves of the evaluation rows (every other row, or group): a search chooses on the first and
    is confirmed on the second, text it never chose with."""
    if split not in SPLITS:
        raise ConfigError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    if split == "all":
        return list(rows)
    cal, ev = split_rows(rows, evaluation_fraction, group_field)
    if split in ("calibration", "evaluation"):
        return cal if split == "calibration" else ev
    search, confirm = split_rows(ev, 0.5, group_field)
    return search if split == "search" else confirm


def pack_windows(token_rows: list[list[int]], length: int, max_windows: int | None = None,
                 with_rows: bool = False):
    """Rows of token ids (each starting with its BOS, as ``Tokenizer.encode`` gives them) joined
    into one stream and cut into windows of exactly ``length`` tokens; with more windows than
    ``max_windows``, that many spread evenly over the stream (window ``floor(i n / max)``), so
    they sample every part of the text, not only its start.  The tail shorter than a window is
    dropped unless no whole window exists, when the one window is the whole stream.
    ``with_rows``: also return the number of rows the chosen windows touch."""
    stream = [t for ids in token_rows for t in ids]
    n = len(stream) // length
    if n == 0:
        spans = [(0, len(stream))] if len(stream) >= 2 else []
    else:
        k = n if max_windows is None else min(n, max_windows)
        spans = [((i * n // k) * length, (i * n // k) * length + length) for i in range(k)]
    windows = [stream[a:b] for a, b in spans]
    if not with_rows:
        return windows
    ends, pos = [], 0
    for ids in token_rows:
        pos += len(ids)
        ends.append(pos)
    starts = [e - len(ids) for e, ids in zip(ends, token_rows)]
    used = sum(any(s < b and e > a for a, b in spans) for s, e in zip(starts, ends))
    return windows, used


def file_sha256(path: str | Path) -> str:
    """SHA-256 of a file, read 1 MiB at a time (never whole)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def ngram_overlap(ids: list[list[int]], reference: list[list[int]], n: int = 8) -> float:
    """Share of the distinct ``n``-token sequences of ``ids`` that also occur in ``reference``
    (0: nothing shared; 1: every n-gram is there) - how much of a set repeats another."""
    grams = lambda rows: {tuple(r[i:i + n]) for r in rows for i in range(len(r) - n + 1)}  # noqa: E731
    mine = grams(ids)
    return len(mine & grams(reference)) / len(mine) if mine else 0.0


def calibration_set(name: str) -> Path:
    """The path of a shipped calibration set (``data/calibration/<name>.jsonl``)."""
    p = CALIBRATION_DIR / f"{name}.jsonl"
    if not p.is_file():
        have = sorted(q.stem for q in CALIBRATION_DIR.glob("*.jsonl")) if CALIBRATION_DIR.is_dir() else []
        raise DataError(f"no shipped calibration set {name!r} (have: {', '.join(have) or 'none'}; see data/README.md)")
    return p


def jsonl_windows(path: str | Path, tokenizer, context: int, max_windows: int | None = None, split: str = "all",
                  evaluation_fraction: float = 0.5, text_field: str = "text",
                  group_field: str | None = "auto",
                  max_tokens: int = DATASET_TOKENS_LIMIT) -> tuple[list[list[int]], dict]:
    """Token windows of one part of a JSONL text file (:func:`read_jsonl`,
    :func:`dataset_split` by :func:`group_field_of`, :func:`pack_windows`) and the *spec* that
    rebuilds them.  The spec (path - also relative to ``data/`` for a shipped file - SHA-256,
    fields, split, sizes, rows used) is what a recipe file records as its calibration and
    evaluation source (:func:`windows_from_spec`).  The file is read line by line within
    :func:`read_jsonl`'s limits, and the part tokenized within ``max_tokens`` (:func:`encode_rows`)."""
    rows = read_jsonl(path, text_field)
    group = group_field_of(rows, group_field, path)
    part = dataset_split(rows, split, evaluation_fraction, group)
    windows, used = pack_windows(encode_rows(part, tokenizer, max_tokens, path), context, max_windows, with_rows=True)
    resolved = Path(path).resolve()
    try:
        in_data = resolved.relative_to(DATA_DIR.resolve()).as_posix()
    except ValueError:
        in_data = None
    spec = {"dataset": str(resolved), "data_relative": in_data, "sha256": file_sha256(path), "text_field": text_field,
            "group_field": group, "split": split, "evaluation_fraction": evaluation_fraction, "context": context,
            "max_windows": max_windows, "windows": len(windows), "rows": len(part), "rows_used": used,
            "groups": len({r[group] for r in part}) if group else None}
    if max_tokens != DATASET_TOKENS_LIMIT:       # recorded when raised, so the recipe rebuilds within it
        spec["max_tokens"] = max_tokens
    return windows, spec


SPEC_KEYS = ("dataset", "context", "split")


def check_spec(spec, where: str = "") -> None:
    """A DataError naming ``where`` (a file and its field) and the spec's field unless ``spec`` is
    what :func:`jsonl_windows` writes: the fields :data:`SPEC_KEYS`, each optional one of its type
    and range."""
    at = f"{where}: " if where else ""
    if not isinstance(spec, dict) or any(k not in spec for k in SPEC_KEYS):
        raise DataError(f"{at}a data spec needs the fields {', '.join(SPEC_KEYS)}; got "
                        f"{sorted(map(str, spec))[:8] if isinstance(spec, dict) else type(spec).__name__}")

    def bad(key: str, want: str):
        return DataError(f"{at}data spec field {key!r} must be {want}, got {spec.get(key)!r:.80}")

    def count(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 1

    if not isinstance(spec["dataset"], str) or not spec["dataset"].strip() or "\0" in spec["dataset"]:
        raise bad("dataset", "the path of the JSONL file")
    for key in ("data_relative", "sha256", "group_field"):
        v = spec.get(key)
        if v is not None and (not isinstance(v, str) or "\0" in v):
            raise bad(key, "a string or null")
    if not isinstance(spec.get("text_field", "text"), str):
        raise bad("text_field", "a field name")
    if not isinstance(spec["split"], str) or spec["split"] not in SPLITS:
        raise bad("split", f"one of {', '.join(SPLITS)}")
    if not count(spec["context"]):
        raise bad("context", "an integer >= 1 (tokens per window)")
    if spec.get("max_windows") is not None and not count(spec["max_windows"]):
        raise bad("max_windows", "an integer >= 1 or null")
    if spec.get("max_tokens") is not None and not count(spec["max_tokens"]):
        raise bad("max_tokens", "an integer >= 1 or null")
    f = spec.get("evaluation_fraction", 0.5)
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f < 1:
        raise bad("evaluation_fraction", "a number between 0 and 1")


def windows_from_spec(spec: dict, tokenizer) -> list[list[int]]:
    """The windows :func:`jsonl_windows` built for ``spec``, from the same file (found at its
    recorded path, or for a shipped set under this checkout's ``data/``): a
    :class:`~workbench.errors.DataError` when the file is gone or its bytes changed (its
    SHA-256 differs), so a recipe is never recalibrated on other text without saying so."""
    check_spec(spec)
    path = Path(spec["dataset"])
    if not path.is_file() and spec.get("data_relative"):
        path = DATA_DIR / spec["data_relative"]            # a shipped set, in another checkout
    if not path.is_file():
        shown = spec["dataset"] if spec["dataset"].isprintable() else repr(spec["dataset"])
        raise DataError(f"{shown}: the text file this recipe was made with is not there")
    if spec.get("sha256") and file_sha256(path) != spec["sha256"]:
        raise DataError(f"{path}: the file changed since the recipe was made (SHA-256 differs); "
                        "calibrate again or restore the file")
    windows, _ = jsonl_windows(path, tokenizer, spec["context"], spec.get("max_windows"), spec["split"],
                               spec.get("evaluation_fraction", 0.5), spec.get("text_field", "text"),
                               spec.get("group_field"), spec.get("max_tokens") or DATASET_TOKENS_LIMIT)
    return windows
