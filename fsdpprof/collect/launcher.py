"""``fsdpprof record [options] -- CMD ARGS...``: run a training command so that every Python process loads
fsdpprof's bootstrap, and write the run directory's ``run.json`` and launcher file.

The job's stdin/stdout/stderr and exit code pass through unchanged; bad use is refused with one line (exit 2)
before anything runs. Several launchers (one per node) may share one ``--out``: each writes
``launchers/<host>-<pid>.json``, the first creates ``run.json`` and its status is derived from all launchers and
ranks. A launcher joins a running run of the same command; any other run is refused unless ``--force``, which
removes only what fsdpprof wrote there.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import glob
import json
import os
import platform
import signal
import socket
import subprocess
import threading
from importlib import metadata

from fsdpprof import runfmt
from fsdpprof import options as opt
from fsdpprof.errors import UserError
from fsdpprof.version import __version__

BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bootstrap")
PKG_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", help="run directory (default: a new timestamped folder under ./fsdpprof-runs/)")
    p.add_argument("--skip-steps", default=str(runfmt.DEFAULT_SKIP_STEPS), metavar="N", type=opt.SKIP_STEPS,
                   help="optimizer steps to run before the profiler starts (default %(default)s)")
    p.add_argument("--warmup-steps", default=str(runfmt.DEFAULT_WARMUP_STEPS), metavar="N", type=opt.WINDOW_STEPS,
                   help="profiler warm-up steps, not recorded (default %(default)s)")
    p.add_argument("--active-steps", default=str(runfmt.DEFAULT_ACTIVE_STEPS), metavar="N", type=opt.WINDOW_STEPS,
                   help="optimizer steps recorded (default %(default)s)")
    p.add_argument("--ranks", default="all", type=opt.ranks_list,
                   help="comma-separated global ranks that record (default all)")
    p.add_argument("--no-memory", action="store_true", help="no memory profiling (profile_memory, CUDA history)")
    p.add_argument("--with-stack", action="store_true", help="record Python stacks in the trace (bigger, slower)")
    p.add_argument("--max-memory-entries", default=str(runfmt.DEFAULT_MAX_MEMORY_ENTRIES), metavar="N",
                   type=opt.MEMORY_ENTRIES,
                   help="CUDA memory history entries kept (default %(default)s)")
    p.add_argument("--force", action="store_true", help="replace an existing run in --out")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ARGS",
                   help="the training command, after --")


def window_options(skip_steps, warmup_steps, active_steps, max_memory_entries, ranks, prefix: str = "--") -> dict:
    """The recording window and limits, checked (UserError naming the range otherwise). ``prefix``: how the
    names are said ('--' on the command line, 'fsdpprof.record: ' in the Python API)."""
    def name(n: str) -> str:
        return prefix + (n.replace("_", "-") if prefix == "--" else n)

    return {"skip_steps": opt.SKIP_STEPS.parse(skip_steps, name("skip_steps")),
            "warmup_steps": opt.WINDOW_STEPS.parse(warmup_steps, name("warmup_steps")),
            "active_steps": opt.WINDOW_STEPS.parse(active_steps, name("active_steps")),
            "max_memory_entries": opt.MEMORY_ENTRIES.parse(max_memory_entries, name("max_memory_entries")),
            "ranks": opt.parse_ranks(ranks, name("ranks"))}


def validate(args) -> tuple[list[str], dict]:
    """Check the command line; returns (command, options). Raises UserError before anything runs."""
    cmd = list(args.cmd or [])
    if not cmd or cmd[0] != "--":
        raise UserError("no command: put the training command after --, e.g. "
                        "fsdpprof record -- torchrun --nproc-per-node=2 train.py")
    cmd = cmd[1:]
    if not cmd:
        raise UserError("no command after --: e.g. fsdpprof record -- torchrun --nproc-per-node=2 train.py")
    opts = window_options(args.skip_steps, args.warmup_steps, args.active_steps, args.max_memory_entries, args.ranks)
    opts.update(memory=not args.no_memory, with_stack=bool(args.with_stack))
    return cmd, opts


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat()


def _default_out() -> str:
    base = os.path.join(os.getcwd(), "fsdpprof-runs", _dt.datetime.now().strftime("%Y%m%d-%H%M%S"))
    out, n = base, 1
    while os.path.exists(out):
        n += 1
        out = f"{base}-{n}"
    return out


def run_meta(path: str):
    """run.json of ``path`` when it is fsdpprof's (an ``fsdpprof.run/*`` schema), else None."""
    try:
        doc = runfmt.read_json(os.path.join(path, runfmt.RUN_JSON))
    except (OSError, ValueError):
        return None
    return doc if runfmt.is_run_meta(doc) else None


# -- --force: remove only what fsdpprof wrote ---------------------------------------------------
def _entries_text(names: list[str], limit: int = 4) -> str:
    """'a, b/, c and 5 more': a few entries of a folder, to say what is in the way."""
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _listing(out: str, names) -> list[str]:
    return [n + ("/" if os.path.isdir(os.path.join(out, n)) else "") for n in sorted(names)]


def _real_dir(path: str) -> bool:
    return os.path.isdir(path) and not os.path.islink(path)


def _remove_file(path: str) -> None:
    try:
        if os.path.isfile(path) or os.path.islink(path):
            os.unlink(path)
    except FileNotFoundError:
        pass


def _remove_with_temps(path: str) -> None:
    """Remove file ``path`` and the temporary files that writes of it left."""
    _remove_file(path)
    for tmp in runfmt.temp_siblings(os.path.dirname(path), os.path.basename(path)):
        _remove_file(tmp)


def _rmdir_if_empty(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass  # not empty: it holds something fsdpprof did not write


def _listed_paths(out: str, files, folders: tuple[str, ...]) -> list[str]:
    """Absolute paths of the entries ``files`` (relative to ``out``) that lie directly in one of ``folders``."""
    paths = []
    for rel in files if isinstance(files, list) else []:
        if isinstance(rel, str) and rel and not os.path.isabs(rel):
            path = os.path.normpath(os.path.join(out, rel))
            if os.path.dirname(path) in folders:
                paths.append(path)
    return paths


def _recorded_files(out: str, name: str) -> list[str] | None:
    """Files of rank folder ``out/name`` that fsdpprof can prove it wrote (what ``--force`` may remove): those its
    manifest lists and their temporaries; without a manifest, in a folder holding fsdpprof's rank.json, those of
    fsdpprof's own names. None: a folder of the user's. A damaged manifest proves nothing: UserError."""
    path = os.path.join(out, name)
    try:
        listed = runfmt.manifest_files(path)
    except ValueError as exc:
        raise UserError(f"--out {out} holds an old run whose {name}/{runfmt.MANIFEST_JSON} is damaged ({exc}): "
                        f"fsdpprof cannot tell the files it wrote in {name}/ from yours, so --force removed "
                        f"nothing; move {name}/ away or choose a new folder")
    present = sorted(os.listdir(path))
    if listed is not None:
        keep = set(listed) | {os.path.basename(t) for n in listed for t in runfmt.temp_siblings(path, n)}
        return [f for f in present if f in keep]
    try:
        doc = runfmt.read_json(os.path.join(path, runfmt.RANK_JSON))
    except (OSError, ValueError):
        doc = None
    if isinstance(doc, dict) and str(doc.get("schema", "")).startswith("fsdpprof.rank/"):   # recorded before manifests
        return [f for f in present if f in runfmt.RANK_FILES or runfmt.RANK_TEMP_RE.match(f)]
    return None


def remove_recorded(out: str) -> None:
    """Remove the run in ``out``, only what fsdpprof wrote: in rank-<R>/ the files it can prove it wrote, the files
    each launcher file or clash note lists, the launcher files, run.json. A folder goes only once empty."""
    ranks = {}
    for name in sorted(os.listdir(out)):   # (every rank folder judged before anything is removed)
        path = os.path.join(out, name)
        if runfmt.rank_of_dir(name) is not None and _real_dir(path):
            ranks[path] = _recorded_files(out, name)
    for path, files in ranks.items():
        for f in files or []:
            _remove_file(os.path.join(path, f))
        _rmdir_if_empty(path)   # (an empty folder too: a rank killed as it claimed it)
    launchers_dir = os.path.join(out, runfmt.LAUNCHERS_DIR)
    if _real_dir(launchers_dir):
        for doc_path, doc in runfmt.launcher_docs(out):
            for path in _listed_paths(out, doc.get("files"), (out, launchers_dir)):
                _remove_with_temps(path)
            _remove_file(doc_path)
        _rmdir_if_empty(launchers_dir)
    clashes_dir = os.path.join(out, runfmt.CLASHES_DIR)
    if _real_dir(clashes_dir):
        for doc in runfmt.read_clashes(out):
            for path in _listed_paths(out, doc.get("files"), (clashes_dir,)):
                _remove_file(path)
        _rmdir_if_empty(clashes_dir)
    _remove_with_temps(os.path.join(out, runfmt.RUN_JSON))


def _in_the_way(out: str, after_removal: bool = False) -> list[str]:
    """Entries of ``out`` that fsdpprof would have to overwrite or mix with, and may not remove (``after_removal``:
    as they will be once :func:`remove_recorded` has run; nothing is touched)."""
    names = []
    for name in sorted(os.listdir(out)):
        path = os.path.join(out, name)
        if name in (runfmt.LAUNCHERS_DIR, runfmt.CLASHES_DIR):
            names += [] if _real_dir(path) else [name]
        elif name == runfmt.RUN_JSON:
            names += [] if after_removal else [name]
        elif runfmt.rank_of_dir(name) is not None:
            if not after_removal or not _real_dir(path):
                names.append(name)
                continue
            recorded = _recorded_files(out, name)
            if recorded is None:
                names += [name] if os.listdir(path) else []
            else:
                names += [f"{name}/{f}" for f in sorted(os.listdir(path)) if f not in recorded]
    return _listing(out, names)


def prepare_out(out: str, cmd: list[str], force: bool) -> bool:
    """Make ``out`` ready; True when joining a running multi-launcher run. ``--force`` replaces a run (a run.json
    with fsdpprof's schema) removing only what fsdpprof wrote; it never removes anything that is not a run's, and
    refuses when something fsdpprof did not write sits where the new run must write."""
    out = os.path.abspath(out)
    if os.path.exists(out) and not os.path.isdir(out):
        raise UserError(f"--out {out} exists and is not a directory: choose another path")
    joining = False
    entries = os.listdir(out) if os.path.isdir(out) else []
    if entries:
        meta = run_meta(out)
        if meta is not None:
            live = meta.get("status") == runfmt.STATUS_RUNNING and any(
                runfmt.launcher_alive(doc, path) is not False for path, doc in runfmt.launcher_docs(out)
                if doc.get("exit_code") is None)
            if live and meta.get("command") == cmd:
                joining = True  # another node's launcher of the same job, still running
            elif live:
                raise UserError(f"--out {out} holds a run of another command that is still being recorded "
                                f"({runfmt.run_liveness(out)[1]}): choose a new folder")
            elif force:
                blocking = _in_the_way(out, after_removal=True)
                if blocking:
                    raise UserError(f"--out {out} holds an old run and also {_entries_text(blocking)}, which "
                                    "fsdpprof did not write: move them away (nothing was removed) or choose a "
                                    "new folder")
                try:
                    remove_recorded(out)
                except OSError as exc:
                    raise UserError(f"--force could not remove the old run in {out} ({exc.strerror or exc}): "
                                    "remove it by hand or choose a new folder")
            else:
                raise UserError(f"--out {out} already holds a run (status {meta.get('status', 'unknown')}): "
                                "choose a new folder or pass --force to replace it")
        elif not force:
            raise UserError(f"--out {out} exists and is not empty (it holds {_entries_text(_listing(out, entries))}) "
                            "and is not an fsdpprof run: choose a new folder, or pass --force to record beside "
                            "those files (nothing of them is removed)")
        blocking = [] if joining else _in_the_way(out)
        if blocking:
            raise UserError(f"--out {out} holds {_entries_text(blocking)}, which fsdpprof did not write and "
                            "would have to replace: move them away or choose a new folder")
    try:
        os.makedirs(out, exist_ok=True)
        probe = os.path.join(out, f".fsdpprof-write-test-{os.getpid()}")
        with open(probe, "w") as fh:
            fh.write("ok")
        os.unlink(probe)
    except OSError as exc:
        raise UserError(f"--out {out} is not writable ({exc.strerror or exc}): choose a writable folder")
    return joining


# -- run.json and the launcher files ----------------------------------------------------------
def _versions() -> dict:
    versions = {"fsdpprof": __version__, "python": platform.python_version(), "torch": None}
    try:
        versions["torch"] = metadata.version("torch")
    except Exception:
        pass
    return versions


def expected_ranks(cmd: list[str]):
    """World size from a torchrun-style command line (--nproc-per-node x --nnodes), else None."""
    def value(*names):
        for i, arg in enumerate(cmd):
            for name in names:
                if arg == name and i + 1 < len(cmd):
                    return cmd[i + 1]
                if arg.startswith(name + "="):
                    return arg.split("=", 1)[1]
        return None

    nproc = value("--nproc-per-node", "--nproc_per_node")
    try:
        return None if nproc is None else int(nproc) * int((value("--nnodes") or "1").split(":")[-1])
    except ValueError:
        return None


def begin_run(out: str, cmd: list[str], options: dict, ranks_expected, extra: dict,
              create: bool = True) -> tuple[str, str, dict]:
    """Create run.json (``create``: unless another launcher did) and this process's launcher file, which lists
    what it wrote (``--force`` removes only that). Returns (run.json path, launcher file path, its document).
    Raises ``OSError``, leaving nothing of this process behind."""
    host, pid, started = socket.gethostname(), os.getpid(), _now()
    meta = {"schema": runfmt.RUN_SCHEMA, "command": cmd, "cwd": os.getcwd(), "started_at": started,
            "ended_at": None, "exit_code": None, "status": runfmt.STATUS_RUNNING, "versions": _versions(),
            "host": host, "options": options, "ranks_expected": ranks_expected, "ranks_seen": []}
    run_json = os.path.join(out, runfmt.RUN_JSON)
    name = f"{host}-{pid}.json"
    launcher_path = os.path.join(out, runfmt.LAUNCHERS_DIR, name)
    created = False
    try:
        created = create and runfmt.exclusive_create_json(run_json, meta)
        launcher = {"host": host, "pid": pid, "pid_start": runfmt.process_start_ticks(pid), "command": cmd,
                    "started_at": started, "ended_at": None, "exit_code": None, **extra,
                    "files": ([runfmt.RUN_JSON] if created else []) + [f"{runfmt.LAUNCHERS_DIR}/{name}"]}
        runfmt.atomic_write_json(launcher_path, launcher)
    except OSError:
        if created:
            runfmt.remove_quietly(run_json)
        raise
    return run_json, launcher_path, launcher


def _rank_statuses(out: str) -> dict[int, dict]:
    ranks = {}
    for path in glob.glob(os.path.join(glob.escape(out), runfmt.RANK_DIR_PREFIX + "*", runfmt.RANK_JSON)):
        rank = runfmt.rank_of_dir(os.path.basename(os.path.dirname(path)))
        if rank is None:
            continue  # e.g. a folder rank-analysis/ of the user's
        try:
            doc = runfmt.read_json(path)
            ranks[int(doc["rank"])] = doc
        except Exception:
            ranks[rank] = {"status": "failed", "error": f"unreadable {path}"}
    return ranks


def derive_status(out: str, meta: dict, own: tuple[str, dict] | None = None) -> dict:
    """run.json fields derived from every launcher file, rank.json and clash note in ``out``. ``own``: (path,
    document) of the calling launcher's file as it is in memory (its last write may have failed on a full disk)."""
    docs = dict(runfmt.launcher_docs(out))
    if own is not None:
        docs[own[0]] = own[1]
    ranks = _rank_statuses(out)
    codes = [d.get("exit_code") for d in docs.values()]
    ended = [c for c in codes if c is not None]
    exit_code = next((c for c in ended if c != 0), 0 if ended else None)
    expected = meta.get("ranks_expected")
    selected = (meta.get("options") or {}).get("ranks")
    if expected and selected is not None:
        expected = len([r for r in selected if r < expected])
    statuses = [r.get("status") for r in ranks.values()]
    if None in codes:
        status = runfmt.STATUS_RUNNING
    elif statuses and all(s == runfmt.RANK_STEPPED_ASIDE for s in statuses):
        status = runfmt.STATUS_STEPPED_ASIDE  # the job profiled itself: fsdpprof recorded no trace
    elif exit_code == 0 and statuses and all(s in ("complete", "skipped") for s in statuses) \
            and (not expected or len(ranks) >= expected):
        status = runfmt.STATUS_COMPLETE
    elif any(s in ("complete", "partial", runfmt.RANK_NO_OPTIMIZER) for s in statuses):
        status = runfmt.STATUS_PARTIAL
    else:
        status = runfmt.STATUS_FAILED
    notes = [f"rank {r}: {ranks[r][key]}" for r in sorted(ranks) for key in ("write_error", "note")
             if ranks[r].get(key)]
    aside = [r for r in sorted(ranks) if ranks[r].get("status") == runfmt.RANK_STEPPED_ASIDE]
    if aside:
        notes.append(f"fsdpprof stepped aside on rank{'s' if len(aside) > 1 else ''} "
                     f"{', '.join(map(str, aside))}: the job ran its own torch.profiler there (no trace recorded)")
    clashes = runfmt.read_clashes(out)
    notes += [runfmt.clash_text(doc) for doc in clashes]
    return {"status": status, "exit_code": exit_code, "ranks_seen": sorted(ranks),
            "rank_status": {str(r): ranks[r].get("status") for r in sorted(ranks)}, "notes": notes,
            "clashes": [{k: doc.get(k) for k in ("rank", "host", "pid", "claimed_by")} for doc in clashes]}


def build_env(out: str, options: dict) -> dict:
    env = dict(os.environ)
    prev = env.get("PYTHONPATH", "")
    env[runfmt.ENV_PREV_PYTHONPATH] = prev
    env["PYTHONPATH"] = BOOTSTRAP_DIR + (os.pathsep + prev if prev else "")
    env[runfmt.ENV_RUN_DIR] = out
    env[runfmt.ENV_OPTIONS] = json.dumps(options)
    env["FSDPPROF_PKG_PARENT"] = PKG_PARENT
    return env


def run(args) -> int:
    cmd, options = validate(args)
    out = os.path.abspath(args.out or _default_out())
    try:
        joining = prepare_out(out, cmd, bool(args.force))
    except OSError as exc:  # a folder that cannot be listed or read: nothing has run yet
        raise UserError(f"--out {out} cannot be used ({runfmt.write_error_text(exc)}): choose another folder")
    window = [options["skip_steps"], options["warmup_steps"], options["active_steps"]]
    try:
        run_json, launcher_path, launcher = begin_run(out, cmd, {**options, "window": window}, expected_ranks(cmd),
                                                      {"heartbeat_s": runfmt.HEARTBEAT_S}, create=not joining)
    except OSError as exc:  # nothing has run yet: nothing is left behind
        raise UserError(f"--out {out} cannot be written ({runfmt.write_error_text(exc)}): nothing was run; "
                        "free some space or choose another folder")
    try:
        child = subprocess.Popen(cmd, env=build_env(out, options))
    except OSError as exc:  # as a shell: 127 for a command not found, 126 for one that cannot run
        code = 127 if isinstance(exc, FileNotFoundError) else 126
        launcher.update(exit_code=code, ended_at=_now(), error=f"could not start {cmd[0]}: {exc}")
        _end_run(out, run_json, launcher_path, launcher)
        raise UserError(f"could not start {cmd[0]!r}: {exc.strerror or exc}", exit_code=code)

    def forward(signum, frame):
        try:
            child.send_signal(signum)
        except Exception:
            pass

    handlers = dict.fromkeys((signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2), forward)
    handlers[signal.SIGINT] = lambda s, f: None  # the child gets it from the terminal
    previous = {}
    for sig, handler in handlers.items():
        try:
            previous[sig] = signal.signal(sig, handler)
        except (ValueError, OSError):
            pass
    done = threading.Event()

    def heartbeat():
        """Touch the launcher file while the job runs: another host tells a live launcher from a killed one by it."""
        while not done.wait(runfmt.HEARTBEAT_S):
            try:
                os.utime(launcher_path)
            except OSError:
                pass

    threading.Thread(target=heartbeat, name="fsdpprof-heartbeat", daemon=True).start()
    try:
        while True:
            try:
                code = child.wait()
                break
            except KeyboardInterrupt:
                continue
    finally:
        done.set()
        for sig, handler in previous.items():
            try:
                signal.signal(sig, handler)
            except (ValueError, OSError, TypeError):
                pass
    exit_code = code if code >= 0 else 128 - code
    try:  # from here on nothing may change the job's exit code: a failure is one line, at most
        launcher.update(exit_code=exit_code, ended_at=_now(), ranks=sorted(_rank_statuses(out)))
        meta, unwritten = _end_run(out, run_json, launcher_path, launcher)
        status = meta["status"].replace("_", " ")
        if meta["status"] == runfmt.STATUS_STEPPED_ASIDE:
            status += " (the job ran its own torch.profiler: fsdpprof recorded no trace)"
        elif meta.get("notes"):
            status += " (" + "; ".join(meta["notes"]) + ")"
        if unwritten:
            status += f"; not written: {'; '.join(unwritten)}"
        runfmt.say(f"fsdpprof: run {status} -> {out}  (next: fsdpprof report {out})")
    except Exception as exc:
        runfmt.say(f"fsdpprof: could not finish the run directory {out}: {runfmt.write_error_text(exc)}")
    return exit_code


def _end_run(out: str, run_json: str, launcher_path: str, launcher: dict) -> tuple[dict, list[str]]:
    """Write this launcher's final file, then run.json's final status; a write that fails (a full disk) is
    skipped and named. Returns (run.json as derived, what could not be written, in words)."""
    unwritten = []
    try:
        runfmt.write_status_json(launcher_path, launcher)
    except OSError as exc:
        unwritten.append(runfmt.write_error_text(exc, launcher_path))
    meta, error = _finalize(out, run_json, own=(launcher_path, launcher))
    return meta, unwritten + ([error] if error else [])


def _finalize(out: str, run_json: str, rounds: int = 10, own: tuple[str, dict] | None = None):
    """Write run.json's derived fields, deriving again after each write until what is on disk still holds
    (launchers ending together race; each writes its own file first, so the last writer sees every ended one).
    Returns (run.json as derived, None or why it could not be written)."""
    for _ in range(rounds):
        try:
            meta = runfmt.read_json(run_json)
        except Exception:
            meta = {"schema": runfmt.RUN_SCHEMA}
        derived = derive_status(out, meta, own)
        meta.update(derived, ended_at=_now())
        try:
            runfmt.write_status_json(run_json, meta)
        except OSError as exc:
            return meta, runfmt.write_error_text(exc, run_json)
        if derive_status(out, meta, own) == derived:
            break
    return meta, None
