"""``fsdpprof record [options] -- CMD ARGS...``: run a training command so that every Python process
loads fsdpprof's bootstrap, and write the run directory's ``run.json`` and launcher file.

The job's stdin/stdout/stderr and exit code pass through unchanged. Bad use is refused with one
line (exit 2) before anything runs. Several launchers (one per node) may share one ``--out``:
each writes ``launchers/<host>-<pid>.json``; ``run.json`` is created by the first (exclusive
create) and its status is derived from all launchers and ranks. A later launcher joins a run
whose run.json says ``running`` for the same command; any other existing run is refused unless
``--force``, which removes only what fsdpprof wrote there (see :func:`remove_recorded`).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import glob
import json
import os
import platform
import re
import signal
import socket
import subprocess
import threading

from fsdpprof import runfmt
from fsdpprof import options as opt
from fsdpprof.errors import UserError
from fsdpprof.version import __version__

BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bootstrap")
PKG_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULTS = {"skip_steps": 5, "warmup_steps": 1, "active_steps": 3, "max_memory_entries": 100_000}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", help="run directory (default: a new timestamped folder under ./fsdpprof-runs/)")
    p.add_argument("--skip-steps", default=str(DEFAULTS["skip_steps"]), metavar="N", type=opt.SKIP_STEPS,
                   help="optimizer steps to run before the profiler starts (default %(default)s)")
    p.add_argument("--warmup-steps", default=str(DEFAULTS["warmup_steps"]), metavar="N", type=opt.WINDOW_STEPS,
                   help="profiler warm-up steps, not recorded (default %(default)s)")
    p.add_argument("--active-steps", default=str(DEFAULTS["active_steps"]), metavar="N", type=opt.WINDOW_STEPS,
                   help="optimizer steps recorded (default %(default)s)")
    p.add_argument("--ranks", default="all", type=opt.ranks_list,
                   help="comma-separated global ranks that record (default all)")
    p.add_argument("--no-memory", action="store_true", help="no memory profiling (profile_memory, CUDA history)")
    p.add_argument("--with-stack", action="store_true", help="record Python stacks in the trace (bigger, slower)")
    p.add_argument("--max-memory-entries", default=str(DEFAULTS["max_memory_entries"]), metavar="N",
                   type=opt.MEMORY_ENTRIES,
                   help="CUDA memory history entries kept (default %(default)s)")
    p.add_argument("--force", action="store_true", help="replace an existing run in --out")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ARGS",
                   help="the training command, after --")


def window_options(skip_steps, warmup_steps, active_steps, max_memory_entries, ranks, prefix: str = "--") -> dict:
    """The recording window and limits, checked (options' ranges); UserError naming the range otherwise.
    ``prefix``: how the names are said ('--' on the command line, 'fsdpprof.record: ' in the Python API)."""
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


def _default_out() -> str:
    base = os.path.join(os.getcwd(), "fsdpprof-runs", _dt.datetime.now().strftime("%Y%m%d-%H%M%S"))
    out, n = base, 1
    while os.path.exists(out):
        n += 1
        out = f"{base}-{n}"
    return out


RANK_DIR_RE = re.compile(re.escape(runfmt.RANK_DIR_PREFIX) + r"\d+$")


def run_meta(path: str):
    """run.json of ``path`` when it is fsdpprof's (an ``fsdpprof.run/*`` schema), else None."""
    try:
        doc = runfmt.read_json(os.path.join(path, runfmt.RUN_JSON))
    except (OSError, ValueError):
        return None
    return doc if runfmt.is_run_meta(doc) else None


def _live_launcher(out: str) -> bool:
    """Is a launcher of this run still going? (a live pid here, or another host's that is not known dead)"""
    return any(runfmt.launcher_alive(doc, path) is not False for path, doc in runfmt.launcher_docs(out)
               if doc.get("exit_code") is None)


def _entries_text(names: list[str], limit: int = 4) -> str:
    """'a, b/, c and 5 more': a few entries of a folder, to say what is in the way."""
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _listing(out: str, names) -> list[str]:
    return [n + ("/" if os.path.isdir(os.path.join(out, n)) else "") for n in sorted(names)]


def _inside(out: str, rel: str):
    """Absolute path of ``rel`` when it names an entry inside ``out`` (no escape with .. or /), else None."""
    if not isinstance(rel, str) or not rel or os.path.isabs(rel):
        return None
    path = os.path.normpath(os.path.join(out, rel))
    return path if os.path.dirname(path) != path and path.startswith(out + os.sep) else None


def _remove_file(path: str) -> None:
    try:
        if os.path.isfile(path) or os.path.islink(path):
            os.unlink(path)
    except FileNotFoundError:
        pass


def _remove_listed(directory: str, names: list[str], rmdir: bool = True) -> None:
    """Remove files ``names`` of ``directory`` and the temporary files their writes left, then the folder if empty."""
    for name in names:
        _remove_file(os.path.join(directory, name))
        for tmp in runfmt.temp_siblings(directory, name):
            _remove_file(tmp)
    if rmdir:
        try:
            os.rmdir(directory)
        except OSError:
            pass  # not empty: it holds something fsdpprof did not write


def _is_legacy_rank_dir(path: str) -> bool:
    """A rank folder written before manifests existed: it holds fsdpprof's rank.json."""
    try:
        doc = runfmt.read_json(os.path.join(path, runfmt.RANK_JSON))
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and str(doc.get("schema", "")).startswith("fsdpprof.rank/")


def _recorded_files(out: str, name: str) -> list[str] | None:
    """Files of the rank folder ``out/name`` that fsdpprof can prove it wrote (what ``--force`` may remove):
    those its manifest lists, with the temporaries of their writes; in a folder recorded before manifests
    existed (it holds fsdpprof's rank.json), those of fsdpprof's own names.  None: none of them (a folder
    of the user's).  A manifest.json that is there but damaged (emptied, not JSON, not ours) proves
    nothing: UserError, before anything is removed."""
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
    if _is_legacy_rank_dir(path):
        return [f for f in present if f in runfmt.RANK_FILES or runfmt.RANK_TEMP_RE.match(f)]
    return None


def remove_recorded(out: str) -> None:
    """Remove the run in ``out`` (its run.json carries fsdpprof's schema): only what fsdpprof wrote.

    rank-<R>/ folders: the files fsdpprof can prove it wrote there (:func:`_recorded_files`), never a whole
    folder. launchers/ and clashes/: the files each launcher or clash note lists (the launcher files
    themselves for an old run without lists). run.json itself. A folder is removed only once empty:
    anything else in it stays.
    """
    ranks = {}
    for name in sorted(os.listdir(out)):   # (every rank folder judged before anything is removed)
        path = os.path.join(out, name)
        if RANK_DIR_RE.match(name) and os.path.isdir(path) and not os.path.islink(path):
            ranks[path] = _recorded_files(out, name)
    for path, files in ranks.items():
        for f in files or []:
            _remove_file(os.path.join(path, f))
        try:
            os.rmdir(path)  # once empty (or an empty folder: a rank killed as it claimed it): nothing to lose
        except OSError:
            pass  # not empty: it holds something fsdpprof did not write
    launchers_dir = os.path.join(out, runfmt.LAUNCHERS_DIR)
    docs = runfmt.launcher_docs(out)
    if os.path.isdir(launchers_dir) and not os.path.islink(launchers_dir):
        old_run = docs and not any("files" in doc for _, doc in docs)  # recorded before launchers listed files
        for doc_path, doc in docs:
            files = doc.get("files") if isinstance(doc.get("files"), list) and not old_run else []
            for rel in files:
                target = _inside(out, rel)
                if target is not None and os.path.dirname(target) in (out, launchers_dir):
                    _remove_listed(os.path.dirname(target), [os.path.basename(target)], rmdir=False)
            _remove_file(doc_path)
        _remove_listed(launchers_dir, [])
    clashes_dir = os.path.join(out, runfmt.CLASHES_DIR)
    if os.path.isdir(clashes_dir) and not os.path.islink(clashes_dir):
        for doc in runfmt.read_clashes(out):
            for rel in doc.get("files") or []:
                target = _inside(out, rel)
                if target is not None and os.path.dirname(target) == clashes_dir:
                    _remove_file(target)
        _remove_listed(clashes_dir, [])
    _remove_file(os.path.join(out, runfmt.RUN_JSON))
    for tmp in runfmt.temp_siblings(out, runfmt.RUN_JSON):
        _remove_file(tmp)


def _in_the_way(out: str, after_removal: bool = False) -> list[str]:
    """Entries of ``out`` that fsdpprof would have to overwrite or mix with, and may not remove.

    ``after_removal``: as they will be once :func:`remove_recorded` has run (predicted, nothing is touched).
    """
    names = []
    for name in sorted(os.listdir(out)):
        path = os.path.join(out, name)
        if name in (runfmt.LAUNCHERS_DIR, runfmt.CLASHES_DIR):
            if not os.path.isdir(path) or os.path.islink(path):
                names.append(name)
        elif name == runfmt.RUN_JSON:
            if not after_removal:
                names.append(name)
        elif RANK_DIR_RE.match(name):
            if not after_removal or not os.path.isdir(path) or os.path.islink(path):
                names.append(name)
                continue
            recorded = _recorded_files(out, name)
            if recorded is None:
                if os.listdir(path):
                    names.append(name)
                continue
            names += [f"{name}/{f}" for f in sorted(os.listdir(path)) if f not in recorded]
    return _listing(out, names)


def prepare_out(out: str, cmd: list[str], force: bool) -> bool:
    """Make ``out`` ready; returns True when joining a running multi-launcher run.

    A folder is a run only when its run.json carries fsdpprof's schema. ``--force`` replaces such a
    run by removing only what fsdpprof wrote; it never removes anything from a folder that is not a
    run, and refuses when something fsdpprof did not write sits where the new run must write.
    """
    out = os.path.abspath(out)
    if os.path.exists(out) and not os.path.isdir(out):
        raise UserError(f"--out {out} exists and is not a directory: choose another path")
    joining = False
    entries = os.listdir(out) if os.path.isdir(out) else []
    if entries:
        meta = run_meta(out)
        if meta is not None:
            status = meta.get("status", "unknown")
            live = meta.get("status") == runfmt.STATUS_RUNNING and _live_launcher(out)
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
                raise UserError(f"--out {out} already holds a run (status {status}): "
                                "choose a new folder or pass --force to replace it")
        elif not force:
            raise UserError(f"--out {out} exists and is not empty (it holds {_entries_text(_listing(out, entries))}) "
                            "and is not an fsdpprof run: choose a new folder, or pass --force to record beside "
                            "those files (nothing of them is removed)")
        if not joining:
            blocking = _in_the_way(out)
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


def _versions() -> dict:
    from importlib import metadata

    versions = {"fsdpprof": __version__, "python": platform.python_version()}
    try:
        versions["torch"] = metadata.version("torch")
    except Exception:
        versions["torch"] = None
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
    if nproc is None:
        return None
    try:
        nnodes_text = value("--nnodes") or "1"
        nnodes = int(nnodes_text.split(":")[-1])
        return int(nproc) * nnodes
    except ValueError:
        return None


def _rank_statuses(out: str) -> dict[int, dict]:
    ranks = {}
    for path in glob.glob(os.path.join(glob.escape(out), runfmt.RANK_DIR_PREFIX + "*", runfmt.RANK_JSON)):
        if not RANK_DIR_RE.match(os.path.basename(os.path.dirname(path))):
            continue  # e.g. a folder rank-analysis/ of the user's
        try:
            doc = runfmt.read_json(path)
            ranks[int(doc["rank"])] = doc
        except Exception:
            name = os.path.basename(os.path.dirname(path))[len(runfmt.RANK_DIR_PREFIX):]
            if name.isdigit():
                ranks[int(name)] = {"status": "failed", "error": f"unreadable {path}"}
    return ranks


def derive_status(out: str, meta: dict, own: tuple[str, dict] | None = None) -> dict:
    """run.json fields derived from every launcher file, rank.json and clash note in ``out``.

    ``own``: (path, document) of the calling launcher's file, taken as it is in memory (its last write
    may have failed on a full disk: a launcher that ended must not read as running)."""
    docs = dict(runfmt.launcher_docs(out))
    if own is not None:
        docs[own[0]] = own[1]
    launchers = list(docs.values())
    ranks = _rank_statuses(out)
    still_running = any(launch.get("exit_code") is None for launch in launchers)
    codes = [launch.get("exit_code") for launch in launchers if launch.get("exit_code") is not None]
    exit_code = next((c for c in codes if c != 0), 0 if codes else None)
    expected = meta.get("ranks_expected")
    selected = (meta.get("options") or {}).get("ranks")
    if expected and selected is not None:
        expected = len([r for r in selected if r < expected])
    statuses = [r.get("status") for r in ranks.values()]
    if still_running:
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
    host, pid = socket.gethostname(), os.getpid()
    started = _dt.datetime.now(_dt.timezone.utc).isoformat()
    meta = {"schema": runfmt.RUN_SCHEMA, "command": cmd, "cwd": os.getcwd(), "started_at": started,
            "ended_at": None, "exit_code": None, "status": runfmt.STATUS_RUNNING, "versions": _versions(),
            "host": host, "options": {**options, "window": [options["skip_steps"], options["warmup_steps"],
                                                          options["active_steps"]]},
            "ranks_expected": expected_ranks(cmd), "ranks_seen": []}
    run_json = os.path.join(out, runfmt.RUN_JSON)
    name = f"{host}-{pid}.json"
    launcher_path = os.path.join(out, runfmt.LAUNCHERS_DIR, name)
    created = False
    try:
        if not joining:
            created = runfmt.exclusive_create_json(run_json, meta)
        launcher = {"host": host, "pid": pid, "pid_start": runfmt.process_start_ticks(pid), "command": cmd,
                    "started_at": started, "ended_at": None, "exit_code": None, "heartbeat_s": runfmt.HEARTBEAT_S,
                    # what this launcher writes in the run directory (--force removes only that)
                    "files": ([runfmt.RUN_JSON] if created else []) + [f"{runfmt.LAUNCHERS_DIR}/{name}"]}
        runfmt.atomic_write_json(launcher_path, launcher)
    except OSError as exc:  # nothing has run yet: leave nothing behind and refuse in one line
        if created:
            runfmt.remove_quietly(run_json)
        raise UserError(f"--out {out} cannot be written ({runfmt.write_error_text(exc)}): nothing was run; "
                        "free some space or choose another folder")

    try:
        child = subprocess.Popen(cmd, env=build_env(out, options))
    except OSError as exc:
        launcher.update(exit_code=127, ended_at=_dt.datetime.now(_dt.timezone.utc).isoformat(),
                        error=f"could not start {cmd[0]}: {exc}")
        _end_run(out, run_json, launcher_path, launcher)
        raise UserError(f"could not start {cmd[0]!r}: {exc.strerror or exc}")

    def forward(signum, frame):
        try:
            child.send_signal(signum)
        except Exception:
            pass

    previous = {}
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        try:
            previous[sig] = signal.signal(sig, forward)
        except (ValueError, OSError):
            pass
    try:
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, lambda s, f: None)  # the child gets it from the tty
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
        launcher.update(exit_code=exit_code, ended_at=_dt.datetime.now(_dt.timezone.utc).isoformat(),
                        ranks=sorted(_rank_statuses(out)))
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
    """Write this launcher's final file, then run.json's final status (:func:`_finalize`); a write that fails
    (a full disk) is skipped and named.  Returns (run.json as derived, what could not be written, in words)."""
    unwritten = []
    try:
        runfmt.write_status_json(launcher_path, launcher)
    except OSError as exc:
        unwritten.append(runfmt.write_error_text(exc, launcher_path))
    meta, error = _finalize(out, run_json, own=(launcher_path, launcher))
    if error:
        unwritten.append(error)
    return meta, unwritten


def _finalize(out: str, run_json: str, rounds: int = 10, own: tuple[str, dict] | None = None):
    """Write run.json's derived fields; re-derive after writing until what is on disk still holds.
    Returns (run.json as derived, None or why it could not be written: "disk full: <path>").

    Launchers that end together race: one may derive "running" before the other's launcher file
    says it ended, yet write after the other's final status. Each launcher writes its own file
    before run.json, so whoever wrote last sees every ended launcher when it derives again.
    ``own``: this launcher's (path, file) as it is in memory (see :func:`derive_status`)."""
    for _ in range(rounds):
        try:
            meta = runfmt.read_json(run_json)
        except Exception:
            meta = {"schema": runfmt.RUN_SCHEMA}
        derived = derive_status(out, meta, own)
        meta.update(derived)
        meta["ended_at"] = _dt.datetime.now(_dt.timezone.utc).isoformat()
        try:
            runfmt.write_status_json(run_json, meta)
        except OSError as exc:
            return meta, runfmt.write_error_text(exc, run_json)
        if derive_status(out, meta, own) == derived:
            break
    return meta, None

