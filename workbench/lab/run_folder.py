"""A batch run's folder: which folder a run may write into, how each file lands there, and the
``summary.json`` that says at every moment what the folder holds.

::

    folder = open_run_folder("runs/mine", sources=[nb])          # new or empty: a fresh run
    folder = open_run_folder("runs/mine", resume=True)           # keep finished notebooks, run the rest
    kept = folder.begin(plan, info)                               # summary.json: "running", the plan
    folder.update(records)                                        # after each notebook: what finished
    folder.finish(records, "complete")                            # last, after results.csv and the report

Why each rule:

* A run writes into a folder of its own (default ``runs/<UTC time>``, else a new or empty
  ``--out``): a second run into the same folder would replace the first one's sidecars while its
  ``summary.json``, ``results.csv`` and report still describe them.  A non-empty folder needs
  ``resume`` (keep the finished notebooks of the run there, run the rest: the same notebooks,
  parameters and sweep, else an error) or ``overwrite`` (delete the files the run there wrote,
  then run).  Neither touches a folder without a run summary, and both delete only files a run
  names, by their file names inside the folder (never a path a summary points elsewhere).
* The source notebooks' folder (``notebooks/``, or the folder of a notebook given by path) is
  never a run folder: an executed copy has its source's file name.
* Every file lands whole: written to a temporary file in the same folder, then ``os.replace``
  (a reader, or a run killed with SIGKILL, sees the old file or the new one, never half of one).
* ``summary.json`` is written first (``"status": "running"``, the plan: every notebook and sweep
  point with its files), again as each notebook ends (its record, only once its files are in
  place) and last (``"complete"``, or ``"interrupted"`` after Ctrl-C / SIGTERM / an executor's
  error), after ``results.csv``, ``sweep.csv`` and ``report.html``.  So whenever the run stops, even
  by SIGKILL, the summary names only files that are there and whole; ``"running"`` with a
  process (``host``, ``pid``) that is gone means the run was killed.
* A lock (``flock`` on ``.workbench-run.lock``) keeps two runs out of one folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import tempfile
from datetime import UTC, datetime
from pathlib import Path

from workbench.errors import ConfigError

SUMMARY = "summary.json"
LOCK = ".workbench-run.lock"
FORMAT = "workbench-run/1"
DERIVED = ("results.csv", "sweep.csv", "report.html")     # rebuilt from the sidecars at the end of a run
OUT = "out_dir (--out)"


# ---- files that land whole ---------------------------------------------------------------------
def atomic_write(path, data: str | bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary file in the same folder and ``os.replace``:
    the file is the old one or the new one, whole, whenever the writer is killed."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def atomic_csv(frame, path) -> Path:
    """A DataFrame as CSV, landing whole (see :func:`atomic_write`)."""
    return atomic_write(path, frame.to_csv(index=False))


def is_temporary(name: str) -> bool:
    """A file a run writes on the way to another (removed when a run resumes or overwrites)."""
    return ((name.startswith(".") and (name.endswith(".tmp") or name.endswith(".partial.ipynb")
                                       or name.endswith(".stacks")))
            or name.endswith(".results.json.tmp"))


def partial_path(output: Path) -> Path:
    """Where papermill writes a notebook while it runs; renamed to ``output`` when it ends."""
    return Path(output).with_name(f".{Path(output).stem}.partial.ipynb")


def task_files(name: str) -> list[str]:
    """Every file name a run may write for one notebook / sweep point ``name``."""
    return [f"{name}.ipynb", f"{name}.results.json", f"{name}.results.json.tmp", f"{name}.stacks.txt",
            f".{name}.partial.ipynb", f".{name}.stacks"]


# ---- which folder ------------------------------------------------------------------------------
def check_out_dir(out_dir, sources=(), notebooks_dir: Path | None = None) -> Path:
    """The absolute folder ``out_dir`` names, or a ConfigError saying why a run cannot write there:
    empty, an existing file or device, the source notebooks' folder (or inside ``notebooks/``)."""
    text = os.fspath(out_dir) if isinstance(out_dir, (str, os.PathLike)) else None
    if text is None:
        raise ConfigError(f"{OUT} = {out_dir!r}: expected a folder path")
    if not text.strip():
        raise ConfigError(f"{OUT} is empty: give a folder for the run (new or empty), or leave --out out for "
                          "runs/<UTC time>")
    try:
        d = Path(text).expanduser().resolve()
    except (OSError, RuntimeError) as e:
        raise ConfigError(f"{OUT} {text!r}: cannot resolve the path ({e})") from None
    if d.exists() and not d.is_dir():
        raise ConfigError(f"{OUT} {d}: exists and is not a folder (a file or a device); give a folder for the run")
    forbidden = {Path(s).resolve().parent for s in sources}
    nb_dir = Path(notebooks_dir).resolve() if notebooks_dir is not None else None
    if d in forbidden or (nb_dir is not None and (d == nb_dir or nb_dir in d.parents)):
        raise ConfigError(f"{OUT} {d}: the source notebooks' folder; a run never writes there (an executed copy "
                          "has its notebook's name): give another folder, or leave --out out for runs/<UTC time>")
    return d


def _lock(d: Path):
    """An exclusive ``flock`` on the folder's lock file, held while the run writes (released by
    the kernel when the process dies, also by SIGKILL); None where there is no ``fcntl``."""
    try:
        import fcntl
    except ImportError:                       # Windows: no lock
        return None
    try:
        fd = os.open(d / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise ConfigError(f"{OUT} {d}: cannot write into the folder ({e.strerror}); give a folder you can "
                          "write to") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise ConfigError(f"{OUT} {d}: another workbench run is writing into this folder now (it holds {LOCK}); "
                          "wait for it to end, or give another folder") from None
    return fd


def _entries(d: Path) -> list[str]:
    """What the folder holds, besides the lock and a run's temporary files."""
    return sorted(p.name for p in d.iterdir() if p.name != LOCK and not is_temporary(p.name))


def read_summary(d: Path) -> dict:
    """The run summary of folder ``d`` (an older workbench's list of records is read as one
    without a plan); a ConfigError when there is none or it is not one."""
    p = d / SUMMARY
    how = "give a new or empty folder (a run deletes or keeps only files a run wrote and named)"
    if not p.is_file():
        raise ConfigError(f"{OUT} {d}: not empty and holds no {SUMMARY}: not a run folder; {how}")
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{p}: unreadable ({e}); {how}") from None
    if isinstance(doc, list) and all(isinstance(r, dict) for r in doc):
        return {"format": None, "status": "unknown", "plan": None, "notebooks": doc}
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ConfigError(f"{p}: not a workbench run summary (expected \"format\": \"{FORMAT}\"); {how}")
    return doc


class RunFolder:
    """The folder one run writes into, locked for it; see the module docstring."""

    def __init__(self, path: Path, lock_fd, mode: str | None, previous: dict | None, created: bool = False):
        self.path, self._lock_fd, self.mode, self.previous = path, lock_fd, mode, previous
        self.created = created                   # made by this run (a refused run removes it again)
        self.info: dict = {}
        self.plan: list[dict] = []
        self._leftover: list[str] = []

    # -- the summary --
    def _doc(self, status: str, records, **extra) -> dict:
        done = [r for r in records if r is not None]
        doc = {"format": FORMAT, "status": status, **self.info,
               "updated": datetime.now(UTC).isoformat(timespec="seconds"),
               "planned": len(self.plan), "finished": len(done),
               "ok": sum(r.get("status") == "ok" for r in done), **extra,
               "plan": self.plan, "notebooks": done}
        if self._leftover:
            doc["leftover"] = self._leftover          # files of the run before, not yet deleted
        return doc

    def write_summary(self, status: str, records, **extra) -> None:
        atomic_write(self.path / SUMMARY, json.dumps(self._doc(status, records, **extra), indent=2, default=str))

    def begin(self, plan: list[dict], info: dict) -> dict[str, dict]:
        """Write the first summary (``"running"``, the plan, the kept records) after clearing what
        ``overwrite`` clears; returns the records ``resume`` keeps, by task name."""
        self.plan = plan
        self.info = {"started": datetime.now(UTC).isoformat(timespec="seconds"),
                     "host": socket.gethostname(), "pid": os.getpid(), **info}
        kept: dict[str, dict] = {}
        stale: list[str] = []
        if self.mode == "resume" and self.previous is not None:
            kept = self._kept(plan)
            stale = [f for t in plan if t["name"] not in kept for f in task_files(t["name"])]
        elif self.mode == "overwrite" and self.previous is not None:
            stale = self._previous_files() + [f for t in plan for f in task_files(t["name"])]
        self._leftover = sorted(set(stale))
        records = [kept.get(t["name"]) for t in plan]
        self.write_summary("running", records)          # first: from now on it names only what is there
        for name in DERIVED:                            # rebuilt at the end of this run
            self._remove(name)
        for name in self._leftover:
            self._remove(name)
        for p in self.path.iterdir():                   # temporary files of a run that was killed
            if is_temporary(p.name) and p.name not in self._leftover:
                self._remove(p.name)
        if self._leftover:
            self._leftover = []
            self.write_summary("running", records)
        return kept

    def update(self, records) -> None:
        """After a notebook ended: the summary names it (its files are in place by now)."""
        self.write_summary("running", records)

    def finish(self, records, status: str, **extra) -> None:
        """The last write of a run: ``status`` "complete" or "interrupted"."""
        self.write_summary(status, records,
                           finished_at=datetime.now(UTC).isoformat(timespec="seconds"), **extra)

    def close(self) -> None:
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
            self._lock_fd = None

    # -- resume and overwrite --
    def _remove(self, name: str) -> None:
        """Delete one file by its name inside the run folder only (a summary's ``..`` or a path
        elsewhere is never followed); the only folder removed is a kernel's stack-dump folder."""
        name = Path(name).name
        if name in ("", ".", "..", SUMMARY, LOCK):
            return
        p = self.path / name
        with contextlib.suppress(FileNotFoundError):
            if p.is_dir() and not p.is_symlink():
                if name.startswith(".") and name.endswith(".stacks"):
                    shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink()

    def _previous_files(self) -> list[str]:
        """Every file name the run before named: its plan (or, from an older workbench, its
        records) and its leftovers."""
        prev, names = self.previous or {}, []
        for t in prev.get("plan") or prev.get("notebooks") or []:
            if isinstance(t, dict) and isinstance(t.get("name"), str):
                names += task_files(Path(t["name"]).name)
            for key in ("output", "results", "stacks"):
                if isinstance(t, dict) and isinstance(t.get(key), str):
                    names.append(Path(t[key]).name)
        names += [Path(n).name for n in prev.get("leftover") or [] if isinstance(n, str)]
        return [n for n in names if n not in (SUMMARY, LOCK)]

    def _kept(self, plan: list[dict]) -> dict[str, dict]:
        """The records of the run before that ``resume`` keeps: status ok, and its executed
        notebook and sidecar still in the folder and whole.  The run before must have had this
        plan (the same notebooks, parameters and sweep points), else a ConfigError."""
        prev = self.previous or {}
        before = prev.get("plan")
        if before is None:
            raise ConfigError(f"{OUT} {self.path}: its {SUMMARY} was written by an older workbench and names no "
                              "plan to resume; use --overwrite (clears that run first) or another folder")
        old = {t.get("name"): t for t in before if isinstance(t, dict)}
        new = {t["name"]: t for t in plan}
        if set(old) != set(new):
            extra, missing = sorted(set(old) - set(new)), sorted(set(new) - set(old))
            raise ConfigError(f"--resume {self.path}: that run had other notebooks or sweep points (there only: "
                              f"{extra[:3] or 'none'}; here only: {missing[:3] or 'none'}); resume it with the same "
                              "notebooks, parameters and sweep, or use --overwrite or another --out")
        for name, t in new.items():
            for key in ("notebook", "parameters"):
                if _plain(old[name].get(key)) != _plain(t[key]):
                    raise ConfigError(f"--resume {self.path}: {name} ran with {key} {_plain(old[name].get(key))!r} "
                                      f"there, {_plain(t[key])!r} now; resume with the same notebooks, parameters "
                                      "and sweep, or use --overwrite or another --out")
        kept = {}
        for rec in prev.get("notebooks") or []:
            name = rec.get("name") if isinstance(rec, dict) else None
            if name not in new or rec.get("status") != "ok":
                continue
            output, results = self.path / f"{name}.ipynb", self.path / f"{name}.results.json"
            if not _whole_json(output) or (rec.get("results") and not _whole_json(results)):
                continue
            kept[name] = {**rec, "output": str(output), "results": str(results) if rec.get("results") else None,
                          "resumed": True}
        return kept


def _plain(value):
    """``value`` as it reads back from JSON (tuples as lists, paths as text)."""
    return json.loads(json.dumps(value, default=str))


def _whole_json(p: Path) -> bool:
    try:
        json.loads(p.read_text(encoding="utf-8"))
        return True
    except (OSError, ValueError):
        return False


def open_run_folder(out_dir=None, resume: bool = False, overwrite: bool = False, sources=(),
                    notebooks_dir: Path | None = None, runs_dir: Path | None = None) -> RunFolder:
    """The folder a run writes into, locked: a fresh ``runs_dir/<UTC time>`` when ``out_dir`` is
    None, else ``out_dir`` if it is new or empty, or holds a run and ``resume`` / ``overwrite`` is
    given.  Every refusal is a one-line ConfigError naming the folder and what to do."""
    if resume and overwrite:
        raise ConfigError("resume and overwrite (--resume, --overwrite): give one (resume keeps the finished "
                          "notebooks of the run in --out and runs the rest; overwrite clears that run first)")
    mode = "resume" if resume else "overwrite" if overwrite else None
    if out_dir is None:
        if mode:
            raise ConfigError(f"--{mode} needs --out (out_dir): the folder of the run to {mode}")
        return RunFolder(*_fresh(Path(runs_dir or "runs")), None, None, created=True)
    d = check_out_dir(out_dir, sources, notebooks_dir)
    created = not d.exists()
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{OUT} {d}: cannot create the folder ({e.strerror or e}); give a folder you can "
                          "write to") from None
    lock_was_there = (d / LOCK).exists()
    fd = _lock(d)
    try:
        previous = None
        entries = _entries(d)
        if entries:
            if mode is None:
                raise ConfigError(f"{OUT} {d}: not empty ({len(entries)} entries, e.g. {entries[0]!r}); a run writes "
                                  "into a new or empty folder: give another --out, or --resume (keep the finished "
                                  "notebooks of the run there, run the rest) or --overwrite (delete that run's "
                                  "files first)")
            previous = read_summary(d)
        return RunFolder(d, fd, mode, previous, created=created)
    except BaseException:
        if fd is not None:
            if not lock_was_there:                 # a refused folder is left as it was
                with contextlib.suppress(OSError):
                    (d / LOCK).unlink()
            os.close(fd)
        raise


def _fresh(runs: Path) -> tuple[Path, object]:
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    for k in range(1, 1000):
        d = runs / (stamp if k == 1 else f"{stamp}-{k}")
        try:
            d.mkdir(parents=True)
        except FileExistsError:
            continue
        except OSError as e:
            raise ConfigError(f"{runs}: cannot create a run folder there ({e.strerror or e}); give --out") from None
        return d, _lock(d)
    raise ConfigError(f"{runs}: 1000 run folders named {stamp}*: give --out")
