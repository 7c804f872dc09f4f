"""Where ``report``, ``compare``, ``whatif``, ``timeline`` and ``demo`` write, and how: nothing the user has is
lost. An existing file is replaced only when fsdpprof wrote it (or with ``--force``), never an input; the files of
one command are written all or none, under locks, their temporaries removed on errors and signals."""
from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import gzip
import json
import os
import re
import secrets
import signal
import stat
import threading
import time
import zlib

from fsdpprof import runfmt
from fsdpprof.analyze.load.files import OUTPUT_JSON_MARK, file_kind
from fsdpprof.analyze.trace.timeline_file import is_timeline
from fsdpprof.errors import UserError
from fsdpprof.report import plotly_bundle
from fsdpprof.version import __version__

GENERATOR = "fsdpprof"
_HEAD_BYTES = 4096
_HTML_MARK = re.compile(rb'<meta name="generator" content="fsdpprof[ "]')
_JS_MARK = re.compile(rb"/\* fsdpprof: plotly\.js ")          # the first line of the plotly.js file we write
_HTML_LEGACY_TAIL = re.compile(rb'>fsdpprof [0-9][^<]{0,40}</footer></body></html>\s*\Z')  # reports before the meta tag
_INPUT_SUFFIXES = (".pt.trace.json.gz", ".pt.trace.json", ".json.gz", ".json", ".pickle.gz", ".pickle",
                   ".pkl.gz", ".pkl")


def generator_meta() -> str:
    """The tag that marks an HTML page as written by fsdpprof (an existing page with it may be replaced)."""
    return f'<meta name="generator" content="{GENERATOR} {__version__}">'


def written_by_fsdpprof(path: str) -> bool:
    """True when ``path`` is a regular file (not a link) that fsdpprof wrote: JSON, HTML, plotly.js or a timeline."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return False
        with open(path, "rb") as fh:
            head = fh.read(_HEAD_BYTES)
            if OUTPUT_JSON_MARK.match(head) or _HTML_MARK.search(head) or _JS_MARK.match(head):
                return True
            if head[:2] == b"\x1f\x8b":       # a timeline (gzip): its first bytes of JSON
                fh.seek(0)
                try:
                    with gzip.GzipFile(fileobj=fh) as gz:
                        return is_timeline(gz.read(256))
                except (OSError, EOFError, zlib.error):
                    return False
            size = os.fstat(fh.fileno()).st_size
            fh.seek(max(size - 256, 0))
            return bool(_HTML_LEGACY_TAIL.search(fh.read(256)))
    except OSError:
        return False


def json_bytes(obj) -> bytes:
    """``obj`` as indented JSON (NaN and infinities as null, numpy/pandas values as numbers); a dict one key at
    a time (the same bytes as one ``json.dumps``), so that only that key's plain values are alive at once."""
    from fsdpprof.analyze.load.frames import json_safe

    if not isinstance(obj, dict) or not obj:
        return _indented(json_safe(obj)).encode()
    parts = []
    for key, value in obj.items():
        # one level deeper: every line break of the layout gains one space (a string's own are written \n)
        text = _indented(json_safe(value)).replace("\n", "\n ")
        parts.append(f" {json.dumps(str(key))}: {text}")
    return ("{\n" + ",\n".join(parts) + "\n}").encode()


def _indented(value) -> str:
    """``json.dumps(value, indent=1, allow_nan=False)``, the same text: compact by json's C encoder (much faster
    than its indenting Python one), then laid out by msgspec."""
    compact = json.dumps(value, separators=(",", ":"), allow_nan=False)
    try:
        import msgspec
        return msgspec.json.format(compact, indent=1)
    except (ImportError, AttributeError):          # pragma: no cover - msgspec is a dependency
        return json.dumps(value, indent=1, allow_nan=False)


# --- plotly.js beside the pages ------------------------------------------------------------------

SELF_CONTAINED_FIX = "or pass --self-contained to embed plotly.js in the page instead"


@functools.lru_cache(maxsize=1)
def plotly_file_bytes() -> bytes:
    """The plotly.js file written beside the pages: a first line that marks it as fsdpprof's, then the bundle."""
    head = (f"/* fsdpprof: plotly.js v{plotly_bundle.plotly_js_version()} for the fsdpprof pages in this folder "
            "(pages written with --self-contained embed it instead) */\n")
    return head.encode("utf-8") + plotly_bundle.plotly_js().encode("utf-8")


def plotly_path(html_path: str) -> str:
    """The plotly.js file a page written at ``html_path`` loads: ``plotly-<version>.min.js`` beside it."""
    return os.path.join(os.path.dirname(os.path.abspath(html_path)), plotly_bundle.plotly_js_name())


def plotly_output(html_path: str, self_contained: bool = False) -> list[tuple[str, str, str]]:
    """:func:`check_outputs`' entry for the plotly.js beside the page ([] when the page is self-contained)."""
    return [] if self_contained else [(plotly_path(html_path), "the page's plotly.js", SELF_CONTAINED_FIX)]


def _same_bytes(path: str, data: bytes) -> bool:
    """True when ``path`` is a regular file (not a link) holding exactly ``data``."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size != len(data):
            return False
        with open(path, "rb") as fh:
            return fh.read() == data
    except OSError:
        return False


def page_items(html_path: str, render, self_contained: bool = False) -> list[tuple[str, bytes]]:
    """:func:`write_files`' items for the page at ``html_path``: ``render(plotly_src)``'s HTML, and the plotly.js
    file it loads unless that is there already, intact (``self_contained``: plotly.js embedded, no file)."""
    src = None if self_contained else plotly_bundle.plotly_js_name()
    text = render(src)
    items = [(html_path, text.encode("utf-8"))]
    if src is not None and f'src="{src}"' in text:
        js_path, data = plotly_path(html_path), plotly_file_bytes()
        if not _same_bytes(js_path, data):
            items.append((js_path, data))
    return items


# --- names -----------------------------------------------------------------------------------

def input_stem(path: str) -> str:
    """``trace.json.gz`` -> ``trace``, ``rank0.pt.trace.json`` -> ``rank0``, ``snap.pickle`` -> ``snap``."""
    base = os.path.basename(os.path.normpath(os.path.abspath(path)))
    low = base.lower()
    for suffix in _INPUT_SUFFIXES:
        if low.endswith(suffix) and len(base) > len(suffix):
            return base[: -len(suffix)]
    return base or "report"


def writable_dir(directory: str) -> bool:
    """A folder we may write into by default: writable, and not marked read-only (no write bit at all) by its owner."""
    try:
        st = os.stat(directory)
    except OSError:
        return False
    return (stat.S_ISDIR(st.st_mode) and bool(st.st_mode & 0o222)
            and os.access(directory, os.W_OK | os.X_OK))


def summary_for(html_path: str) -> str:
    """Report's JSON beside ``html_path``: ``report.html`` -> ``summary.json``, ``X.report.html`` and
    ``X.html`` -> ``X.summary.json``."""
    d, base = os.path.split(os.path.abspath(html_path))
    if base == "report.html":
        return os.path.join(d, "summary.json")
    for suffix in (".report.html", ".html", ".htm"):
        if base.lower().endswith(suffix) and len(base) > len(suffix):
            base = base[: -len(suffix)]
            break
    return os.path.join(d, base + ".summary.json")


def _output_path(run_path: str, output: str | None, name: str) -> str:
    """-o (a folder: the default name in it); else ``name`` in a run directory or trace folder, ``X.name`` beside a
    file X.json.gz, in the current folder (``STEM.name``) when that folder is not writable."""
    run_path = os.path.abspath(run_path)
    is_dir = os.path.isdir(run_path)
    stem_name = f"{input_stem(run_path)}.{name}"
    if output:
        return os.path.abspath(os.path.join(output, name if is_dir else stem_name) if os.path.isdir(output) else output)
    where = run_path if is_dir else os.path.dirname(run_path)
    return os.path.join(where, name if is_dir else stem_name) if writable_dir(where) else os.path.abspath(stem_name)


def report_paths(run_path: str, output: str | None, summary: str | None) -> tuple[str, str]:
    """The report's (html, json) paths from the input path and the -o / --summary options."""
    html = _output_path(run_path, output, "report.html")
    return html, os.path.abspath(summary) if summary else summary_for(html)


def timeline_path(run_path: str, output: str | None) -> str:
    """timeline's file from the input path and -o."""
    return _output_path(run_path, output, "timeline.json.gz")


def compare_paths(output: str, summary: str | None) -> tuple[str, str]:
    """compare's (html, json): ``X.html`` -> ``X.json``; -o an existing folder -> compare.html inside it."""
    if os.path.isdir(output):
        output = os.path.join(output, "compare.html")
    html = os.path.abspath(output)
    return html, os.path.abspath(summary) if summary else os.path.splitext(html)[0] + ".json"


# --- checks ----------------------------------------------------------------------------------

def check_not_empty(**options) -> None:
    """UserError for an option given as an empty path (``-o ""`` would mean the current folder)."""
    for name, value in options.items():
        if value is not None and not str(value).strip():
            raise UserError(f"{name} is empty: give a file or folder path")


def _ids(paths) -> dict[tuple[int, int], str]:
    out = {}
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            continue
        out[(st.st_dev, st.st_ino)] = p
    return out


def check_outputs(outputs: list[tuple[str, ...]], *, force: bool = False, inputs=(), defer_under=(),
                  input_folders=(), fix: str = "") -> None:
    """Refuse, before anything is written, an output that would lose something. ``outputs``: (path, how the user
    named it[, its own fix]); ``inputs`` are never replaced, nor anything in ``input_folders`` (what record wrote);
    existing files under ``defer_under`` (inputs not loaded yet) are left to the check with ``inputs``."""
    default_fix = fix or "choose another path with -o / --summary"
    seen: dict[str, str] = {}
    input_ids = _ids(inputs)
    defer = [os.path.realpath(p) for p in defer_under]
    folders = [os.path.realpath(d) for d in input_folders]
    for path, how, *own_fix in outputs:
        fix = f"{default_fix}, {own_fix[0]}" if own_fix else default_fix
        real = os.path.realpath(path)
        if real in seen:
            raise UserError(f"{how} {path} is the same file as {seen[real]}: each output needs its own path")
        seen[real] = f"{how} {path}"
        try:
            lst = os.lstat(path)
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ENOTDIR):  # ENOTDIR: a parent is a file; the write says so
                raise UserError(f"{how} {path} cannot be used ({exc.strerror}); {fix}") from None
            lst = None
        try:
            target = os.stat(path) if lst is not None else None
        except OSError:
            target = None
        if target is not None and (target.st_dev, target.st_ino) in input_ids:
            raise UserError(f"{how} {path} is one of the input files ({input_ids[(target.st_dev, target.st_ino)]}); "
                            f"writing there would destroy it: {fix}")
        inside = [d for d in folders if real.startswith(d.rstrip(os.sep) + os.sep)]
        if inside:
            raise UserError(f"{how} {path} is inside the run's own {inside[0]} (what fsdpprof record wrote, "
                            f"replaced by the next recording); {fix}")
        if lst is None:
            continue
        if any(real == d or real.startswith(d.rstrip(os.sep) + os.sep) for d in defer):
            continue
        if stat.S_ISLNK(lst.st_mode):
            if not force:
                raise UserError(f"{how} {path} is a symbolic link that fsdpprof did not make; pass --force to replace "
                                f"the link (its target is left alone), or {fix}")
            continue
        if not stat.S_ISREG(lst.st_mode):
            raise UserError(f"{how} {path} is {file_kind(lst.st_mode)}, not a file; {fix}")
        if not force and not written_by_fsdpprof(path):
            raise UserError(f"{how} {path} exists and was not written by fsdpprof; pass --force to overwrite it, "
                            f"or {fix}")


# --- writing ---------------------------------------------------------------------------------

def _make_parents(directory: str) -> list[str]:
    """Create missing folders up to ``directory``; returns those created (deepest last)."""
    missing = []
    d = directory
    while d and not os.path.lexists(d):
        missing.append(d)
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    created = []
    for d in reversed(missing):
        os.mkdir(d)
        created.append(d)
    return created


def _remove(paths) -> None:
    for p in paths:
        try:
            os.unlink(p)
        except OSError:
            pass


# --- locks, interrupts, stale temporaries ------------------------------------------------------

STALE_TEMP_S = 600.0       # a temporary of ours this old, for an output we hold the lock of, is a dead write's


def lock_path(path: str) -> str:
    """The lock file of output ``path``: ``.<name>.lock`` beside it (removed by the writer that holds it)."""
    d, base = os.path.split(os.path.abspath(path))
    return os.path.join(d, f".{base}.lock")


def _lock(path: str):
    """Hold the flock of ``path``'s lock file (waiting for another writer); its descriptor, None without locks."""
    name = lock_path(path)
    while True:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                _remove([name])
                return None
            raise
        except BaseException:
            os.close(fd)
            raise
        try:
            here = os.stat(name, follow_symlinks=False)
            mine = os.fstat(fd)
            if (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)        # the writer we waited for removed that lock file: lock the one there now


def _unlock(path: str, fd) -> None:
    if fd is None:
        return
    _remove([lock_path(path)])   # (before the close: a writer waiting on it sees it gone and locks anew)
    os.close(fd)


@contextlib.contextmanager
def output_locks(paths):
    """The outputs' locks, taken in one order: two commands writing the same files write one after the other."""
    held: list = []
    try:
        for path in sorted({os.path.abspath(p) for p in paths}):
            try:
                held.append((path, _lock(path)))
            except OSError as exc:
                exc.output_path = path      # (the output it was for, to say in the error)
                raise
        yield
    finally:
        for path, fd in reversed(held):
            _unlock(path, fd)


def _temp_re(name: str) -> re.Pattern:
    """fsdpprof's temporaries of ``name``: ``.<name>.<pid>.<8 hex>.tmp`` (runfmt.temp_name) and tempfile's."""
    n = re.escape(name)
    return re.compile(rf"\.{n}\.(?:(?P<pid>[0-9]+)\.[0-9a-f]{{8}}|[a-z0-9_]{{8}})\.tmp\Z")


def _pid_dead(pid: int) -> bool:
    """No process ``pid`` runs on this host (a writer killed by SIGKILL left its temporaries)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (OSError, OverflowError, ValueError):
        return False
    return False


def remove_stale_temps(path: str, now: float | None = None) -> list[str]:
    """Remove (and return) the temporaries that a killed write of ``path`` left: those of a pid that no longer
    runs here, and any older than STALE_TEMP_S (a pid reused since, or a writer on another host); the caller
    holds ``path``'s lock, so no live writer of ours owns them."""
    d, base = os.path.split(os.path.abspath(path))
    pattern, now = _temp_re(base), time.time() if now is None else now
    removed = []
    try:
        names = [(n, m) for n in os.listdir(d) if (m := pattern.match(n))]
    except OSError:
        return removed
    for n, m in names:
        p = os.path.join(d, n)
        try:
            st = os.lstat(p)
            dead = m.group("pid") is not None and m.group("pid") != str(os.getpid()) and _pid_dead(int(m.group("pid")))
            if stat.S_ISREG(st.st_mode) and (dead or now - st.st_mtime > STALE_TEMP_S):
                os.unlink(p)
                removed.append(p)
        except OSError:
            pass
    return removed


class Terminated(KeyboardInterrupt):
    """SIGTERM / SIGHUP while outputs are written: unwinds like Ctrl-C; the command ends with 128 + ``signum``."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _signals_unwind():
    """While outputs are written, SIGTERM and SIGHUP raise :class:`Terminated`, as SIGINT raises KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    def raise_terminated(signum, frame):
        raise Terminated(signum)
    previous = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_DFL:
            previous[sig] = signal.signal(sig, raise_terminated)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _new_temp(path: str, temps: list[tuple[str, str]]) -> int:
    """A new temporary beside ``path``, open for writing; it is listed in ``temps`` (tmp, path) before it exists,
    so that a signal landing as it is created still has it removed."""
    directory, base = os.path.split(os.path.abspath(path))
    while True:
        tmp = os.path.join(directory, runfmt.temp_name(base))
        temps.append((tmp, path))
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except FileExistsError:     # another writer's: not ours to remove
            temps.pop()


def write_files(items: list[tuple[str, bytes]], fix: str = "choose a writable path with -o / --summary") -> None:
    """Write every (path, bytes or a function writing into a binary file) or none, mode 0644: under the locks,
    each to a temporary beside it, then all renamed into place. A failure or a signal undoes the renames done and
    removes the temporaries and the folders made; the error names the path that failed."""
    temps: list[tuple[str, str]] = []
    made: list[str] = []
    done: list[tuple[str, str | None]] = []   # (path, backup of the file it replaced)
    failed = None

    def undo() -> None:
        for path, backup in reversed(done):
            try:
                if backup is None:
                    os.unlink(path)
                else:
                    os.replace(backup, path)
            except OSError:
                pass
        _remove(t for t, _ in temps)

    try:
        with _signals_unwind():
            for path, _ in items:
                failed = path
                made += _make_parents(os.path.dirname(os.path.abspath(path)))
            failed = None
            with output_locks([p for p, _ in items]):
                for path, data in items:
                    failed = path
                    remove_stale_temps(path)
                    fd = _new_temp(path, temps)
                    tmp = temps[-1][0]
                    with os.fdopen(fd, "wb") as fh:
                        if callable(data):      # written as it is made (a big file: never all in memory)
                            data(fh)
                        else:
                            fh.write(data)
                        fh.flush()
                        os.fsync(fh.fileno())
                    os.chmod(tmp, 0o644)
                for tmp, path in temps:
                    failed = path
                    backup = None
                    if os.path.lexists(path) and not stat.S_ISDIR(os.lstat(path).st_mode):  # a folder: replace fails
                        backup = os.path.join(os.path.dirname(os.path.abspath(path)),
                                              f".{os.path.basename(path)}.{secrets.token_hex(6)}.old")
                        try:
                            os.link(path, backup, follow_symlinks=False)
                        except OSError:
                            os.rename(path, backup)
                    try:
                        os.replace(tmp, path)
                    except BaseException:
                        if backup is not None and not os.path.lexists(path):
                            os.rename(backup, path)
                        elif backup is not None:
                            os.unlink(backup)
                        raise
                    done.append((path, backup))
    except BaseException as exc:
        undo()
        for d in reversed(made):
            try:
                os.rmdir(d)
            except OSError:
                pass
        if isinstance(exc, OSError):
            locked = getattr(exc, "output_path", None)
            if locked is not None:   # a lock not made: its folder is at fault; named by the first output in it
                folder = os.path.dirname(locked)
                failed = next(p for p in [p for p, _ in items] + [locked]
                              if os.path.dirname(os.path.abspath(p)) == folder)
            raise UserError(f"cannot write {failed}: {exc.strerror or exc}; {fix}") from None
        raise
    _remove(b for _, b in done if b)
