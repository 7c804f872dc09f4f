"""``fsdpprof record [options] -- CMD ARGS...``: run a training command so that every Python process
loads fsdpprof's bootstrap, and write the run directory's ``run.json`` and launcher file.

The job's stdin/stdout/stderr and exit code pass through unchanged. Bad use is refused with one
line (exit 2) before anything runs. Several launchers (one per node) may share one ``--out``:
each writes ``launchers/<host>-<pid>.json``; ``run.json`` is created by the first (exclusive
create) and its status is derived from all launchers and ranks. A later launcher joins a run
whose run.json says ``running`` for the same command; any other existing run is refused unless
``--force``.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import glob
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys

from fsdpprof import __version__, runfmt
from fsdpprof.errors import UserError

BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bootstrap")
PKG_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULTS = {"skip_steps": 5, "warmup_steps": 1, "active_steps": 3, "max_memory_entries": 100_000}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", help="run directory (default: a new timestamped folder under ./fsdpprof-runs/)")
    p.add_argument("--skip-steps", default=str(DEFAULTS["skip_steps"]), metavar="N",
                   help="optimizer steps to run before the profiler starts (default %(default)s)")
    p.add_argument("--warmup-steps", default=str(DEFAULTS["warmup_steps"]), metavar="N",
                   help="profiler warm-up steps, not recorded (default %(default)s)")
    p.add_argument("--active-steps", default=str(DEFAULTS["active_steps"]), metavar="N",
                   help="optimizer steps recorded (default %(default)s)")
    p.add_argument("--ranks", default="all", help="comma-separated global ranks that record (default all)")
    p.add_argument("--no-memory", action="store_true", help="no memory profiling (profile_memory, CUDA history)")
    p.add_argument("--with-stack", action="store_true", help="record Python stacks in the trace (bigger, slower)")
    p.add_argument("--max-memory-entries", default=str(DEFAULTS["max_memory_entries"]), metavar="N",
                   help="CUDA memory history entries kept (default %(default)s)")
    p.add_argument("--force", action="store_true", help="replace an existing run in --out")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ARGS",
                   help="the training command, after --")


def _positive_int(value: str, option: str) -> int:
    try:
        number = int(str(value).strip())
    except ValueError:
        number = 0
    if number < 1:
        raise UserError(f"{option} must be a positive integer (got {value!r})")
    return number


def _parse_ranks(value: str):
    if value is None or value.strip().lower() in ("", "all"):
        return None
    try:
        ranks = sorted({int(v) for v in value.split(",") if v.strip()})
    except ValueError:
        ranks = []
    if not ranks or min(ranks) < 0:
        raise UserError(f"--ranks must be 'all' or comma-separated ranks >= 0, e.g. 0,1 (got {value!r})")
    return ranks


def validate(args) -> tuple[list[str], dict]:
    """Check the command line; returns (command, options). Raises UserError before anything runs."""
    cmd = list(args.cmd or [])
    if not cmd or cmd[0] != "--":
        raise UserError("no command: put the training command after --, e.g. "
                        "fsdpprof record -- torchrun --nproc-per-node=2 train.py")
    cmd = cmd[1:]
    if not cmd:
        raise UserError("no command after --: e.g. fsdpprof record -- torchrun --nproc-per-node=2 train.py")
    options = {
        "skip_steps": _positive_int(args.skip_steps, "--skip-steps"),
        "warmup_steps": _positive_int(args.warmup_steps, "--warmup-steps"),
        "active_steps": _positive_int(args.active_steps, "--active-steps"),
        "max_memory_entries": _positive_int(args.max_memory_entries, "--max-memory-entries"),
        "ranks": _parse_ranks(args.ranks),
        "memory": not args.no_memory,
        "with_stack": bool(args.with_stack),
    }
    return cmd, options


def _default_out() -> str:
    base = os.path.join(os.getcwd(), "fsdpprof-runs", _dt.datetime.now().strftime("%Y%m%d-%H%M%S"))
    out, n = base, 1
    while os.path.exists(out):
        n += 1
        out = f"{base}-{n}"
    return out


def _is_run_dir(path: str) -> bool:
    return (os.path.exists(os.path.join(path, runfmt.RUN_JSON))
            or os.path.isdir(os.path.join(path, runfmt.LAUNCHERS_DIR))
            or bool(glob.glob(os.path.join(path, runfmt.RANK_DIR_PREFIX + "*"))))


def _live_launcher(out: str) -> bool:
    """Is a launcher of this run still going? (another host's unfinished one, or a live pid here)"""
    host = socket.gethostname()
    for path in glob.glob(os.path.join(out, runfmt.LAUNCHERS_DIR, "*.json")):
        try:
            launch = runfmt.read_json(path)
        except Exception:
            continue
        if launch.get("exit_code") is not None:
            continue
        if launch.get("host") != host:
            return True
        try:
            os.kill(int(launch.get("pid")), 0)
            return True
        except (OSError, TypeError, ValueError):
            continue
    return False


def prepare_out(out: str, cmd: list[str], force: bool) -> bool:
    """Make ``out`` ready; returns True when joining a running multi-launcher run."""
    out = os.path.abspath(out)
    if os.path.exists(out) and not os.path.isdir(out):
        raise UserError(f"--out {out} exists and is not a directory: choose another path")
    joining = False
    if os.path.isdir(out) and os.listdir(out):
        if _is_run_dir(out):
            try:
                meta = runfmt.read_json(os.path.join(out, runfmt.RUN_JSON))
            except Exception:
                meta = {}
            if force:
                for name in [runfmt.RUN_JSON, runfmt.LAUNCHERS_DIR] + \
                        [os.path.basename(p) for p in glob.glob(os.path.join(out, runfmt.RANK_DIR_PREFIX + "*"))]:
                    path = os.path.join(out, name)
                    if os.path.isdir(path):
                        shutil.rmtree(path, ignore_errors=True)
                    elif os.path.exists(path):
                        os.unlink(path)
            elif meta.get("status") == runfmt.STATUS_RUNNING and meta.get("command") == cmd and _live_launcher(out):
                joining = True  # another node's launcher of the same job, still running
            else:
                raise UserError(f"--out {out} already holds a run (status {meta.get('status', 'unknown')}): "
                                "choose a new folder or pass --force to replace it")
        elif not force:
            raise UserError(f"--out {out} exists and is not empty: choose a new folder or pass --force")
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
    for path in glob.glob(os.path.join(out, runfmt.RANK_DIR_PREFIX + "*", runfmt.RANK_JSON)):
        try:
            doc = runfmt.read_json(path)
            ranks[int(doc["rank"])] = doc
        except Exception:
            name = os.path.basename(os.path.dirname(path))[len(runfmt.RANK_DIR_PREFIX):]
            if name.isdigit():
                ranks[int(name)] = {"status": "failed", "error": f"unreadable {path}"}
    return ranks


def derive_status(out: str, meta: dict) -> dict:
    """run.json fields derived from every launcher file and rank.json in ``out``."""
    launchers = []
    for path in sorted(glob.glob(os.path.join(out, runfmt.LAUNCHERS_DIR, "*.json"))):
        try:
            launchers.append(runfmt.read_json(path))
        except Exception:
            pass
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
    elif exit_code == 0 and statuses and all(s in ("complete", "skipped") for s in statuses) \
            and (not expected or len(ranks) >= expected):
        status = runfmt.STATUS_COMPLETE
    elif any(s in ("complete", "partial", "no_optimizer") for s in statuses):
        status = runfmt.STATUS_PARTIAL
    else:
        status = runfmt.STATUS_FAILED
    return {"status": status, "exit_code": exit_code, "ranks_seen": sorted(ranks),
            "rank_status": {str(r): ranks[r].get("status") for r in sorted(ranks)}}


def _exclusive_create_json(path: str, obj) -> bool:
    data = json.dumps(obj, indent=1, default=str).encode()
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    try:
        os.link(tmp, path)  # atomic and exclusive: fails if run.json exists
        return True
    except FileExistsError:
        return False
    except OSError:  # filesystems without hard links
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        return True
    finally:
        os.unlink(tmp)


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
    joining = prepare_out(out, cmd, bool(args.force))
    host, pid = socket.gethostname(), os.getpid()
    started = _dt.datetime.now(_dt.timezone.utc).isoformat()
    meta = {"schema": runfmt.RUN_SCHEMA, "command": cmd, "cwd": os.getcwd(), "started_at": started,
            "ended_at": None, "exit_code": None, "status": runfmt.STATUS_RUNNING, "versions": _versions(),
            "host": host, "options": {**options, "window": [options["skip_steps"], options["warmup_steps"],
                                                          options["active_steps"]]},
            "ranks_expected": expected_ranks(cmd), "ranks_seen": []}
    run_json = os.path.join(out, runfmt.RUN_JSON)
    if not joining:
        _exclusive_create_json(run_json, meta)
    launcher_path = os.path.join(out, runfmt.LAUNCHERS_DIR, f"{host}-{pid}.json")
    launcher = {"host": host, "pid": pid, "command": cmd, "started_at": started, "ended_at": None,
                "exit_code": None}
    runfmt.atomic_write_json(launcher_path, launcher)

    try:
        child = subprocess.Popen(cmd, env=build_env(out, options))
    except OSError as exc:
        launcher.update(exit_code=127, ended_at=_dt.datetime.now(_dt.timezone.utc).isoformat(),
                        error=f"could not start {cmd[0]}: {exc}")
        runfmt.atomic_write_json(launcher_path, launcher)
        _finalize(out, run_json)
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
    try:
        while True:
            try:
                code = child.wait()
                break
            except KeyboardInterrupt:
                continue
    finally:
        for sig, handler in previous.items():
            try:
                signal.signal(sig, handler)
            except (ValueError, OSError, TypeError):
                pass
    exit_code = code if code >= 0 else 128 - code
    launcher.update(exit_code=exit_code, ended_at=_dt.datetime.now(_dt.timezone.utc).isoformat(),
                    ranks=sorted(_rank_statuses(out)))
    runfmt.atomic_write_json(launcher_path, launcher)
    status = _finalize(out, run_json)
    sys.stderr.write(f"fsdpprof: run {status} -> {out}  (next: fsdpprof report {out})\n")
    sys.stderr.flush()
    return exit_code


def _finalize(out: str, run_json: str) -> str:
    try:
        meta = runfmt.read_json(run_json)
    except Exception:
        meta = {"schema": runfmt.RUN_SCHEMA}
    meta.update(derive_status(out, meta))
    meta["ended_at"] = _dt.datetime.now(_dt.timezone.utc).isoformat()
    runfmt.atomic_write_json(run_json, meta)
    return meta["status"]

