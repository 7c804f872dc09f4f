"""Where the per-rank map runs: this process, a bounded pool of local processes, or a Dask cluster.

:func:`map_unordered` runs one picklable function over a list of jobs and yields each result as it arrives.
``local``: in this process (``workers`` 1), else at most ``workers`` forked processes; a pool that breaks (a
worker killed, e.g. for memory) loses only the jobs in flight, which run again each alone.  ``dask``: a running
``dask.distributed`` scheduler (``scheduler``), else a LocalCluster of ``workers`` processes here; jobs carry file
paths, not data (workers read the run where they see it), and Dask reschedules a job whose worker dies.
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import importlib
import importlib.util
import logging
import multiprocessing
import os
import socket
import struct
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures.process import BrokenProcessPool

from fsdpprof.analyze.load import memory_budget
from fsdpprof.errors import UserError
from fsdpprof.version import __version__

ENGINES = ("local", "dask")
DASK_WAIT_FOR_WORKERS_S = 60.0     # how long a job waits for the first worker of an external scheduler
POOL_MIN_BYTES = 64 << 20   # the local engine starts processes (--workers not given) only for this much trace JSON
_SCHEMES = ("tcp", "tls", "ws", "wss", "ucx", "inproc")
HANDSHAKE_MAX_BYTES = 1 << 16    # a Dask handshake is ~100 bytes: a peer announcing more is not Dask
HANDSHAKE_MAX_FRAMES = 64
_FIX = "check the address (tcp://HOST:8786) or leave --scheduler out to start a LocalCluster here"
_ANSWERED: set[str] = set()      # addresses where a Dask scheduler answered check_scheduler: each probed once


def _status_kib(name: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            return next((int(line.split()[1]) for line in fh if line.startswith(name + ":")), None)
    except (OSError, ValueError, IndexError):
        return None


def measured_call(fn, args: tuple = (), kwargs: dict | None = None, preload: tuple = ()):
    """(fn(*args, **kwargs), stats): host, pid, seconds, cpu_seconds, and this process's resident memory before
    and at its peak during the call (start_rss_bytes, peak_rss_bytes; None where Linux cannot say).  The modules
    in ``preload`` are imported first, outside the measurement."""
    for name in preload:
        importlib.import_module(name)
    try:        # reset this process's peak resident memory (VmHWM) to its current RSS (Linux >= 4.0)
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        reset = True
    except OSError:
        reset = False
    start = _status_kib("VmRSS")
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn(*args, **(kwargs or {}))
    peak = _status_kib("VmHWM") if reset else None
    if peak is not None and start is not None:
        # the kernel updates the high-water mark lazily: memory another thread took between the reset and the read
        # of VmRSS, then returned with madvise, can leave VmHWM under the start; the process held ``start`` anyway
        peak = max(peak, start)
    return out, {"host": socket.gethostname(), "pid": os.getpid(), "seconds": time.perf_counter() - t0,
                 "cpu_seconds": time.process_time() - c0,
                 "start_rss_bytes": start * 1024 if start is not None else None,
                 "peak_rss_bytes": peak * 1024 if peak is not None else None}


def check_engine(engine: str | None, scheduler: str | None, connect_timeout_s: float | None = None) -> str:
    """The engine to use (``dask`` when only a scheduler is given, else ``local``); UserError when the two
    disagree, dask is not installed, or no Dask scheduler answers at ``scheduler`` within ``connect_timeout_s``
    (which becomes Dask's connect timeout)."""
    if engine is None:
        engine = "dask" if scheduler else "local"
    if engine not in ENGINES:
        raise UserError(f"--engine {engine!r} is not known; use one of {', '.join(ENGINES)}")
    if scheduler is not None and engine != "dask":
        raise UserError(f"--scheduler {scheduler} is the address of a Dask scheduler: use it with --engine dask")
    if scheduler is not None and not str(scheduler).strip():
        raise UserError("--scheduler is empty; give the scheduler's address (tcp://HOST:8786), or leave it out "
                        "to start a Dask LocalCluster on this machine")
    if engine == "dask" and not _have_distributed():
        raise UserError("--engine dask needs dask.distributed: pip install 'fsdpprof[dask]'")
    if scheduler is not None:
        if connect_timeout_s is not None:
            import dask.config

            dask.config.set({"distributed.comm.timeouts.connect": f"{float(connect_timeout_s)}s"})
        check_scheduler(scheduler)
    return engine


def _have_distributed() -> bool:
    return _have("distributed")


def _have(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):     # a broken or blocked installation
        return False


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, else os.cpu_count()); collect has its own copy."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_workers(workers, what: str = "workers") -> None:
    """UserError unless ``workers`` is None or a whole number >= 1."""
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise UserError(f"{what} {workers!r} must be a whole number of at least 1 (it is capped at the number "
                        f"of ranks and of CPU cores, {usable_cores()} here)")


def _pool_size(workers: int | None, n_jobs: int) -> int:
    cores = usable_cores()
    return max(1, min(int(workers or cores), n_jobs or 1, cores))


def local_workers(workers: int | None, json_sizes: list[int], max_memory: int | None = None) -> int:
    """Processes the local engine runs ranks in, whose unread traces hold ``json_sizes`` bytes of JSON each:
    ``workers`` when given, else one per rank from POOL_MIN_BYTES in all on and below it 1 (this process: small
    traces are read faster than processes start); never more than the ranks, the CPU cores or the ranks the memory
    budget (``max_memory``, else a share of the available memory: memory_budget.budget_bytes) holds at once
    (said on stderr when it sets the number)."""
    n_jobs = len(json_sizes)
    if workers is None:
        workers = n_jobs if sum(json_sizes) >= POOL_MIN_BYTES else 1
    n = _pool_size(workers, n_jobs)
    budget = memory_budget.budget_bytes(max_memory) if n > 1 else None
    fit = memory_budget.ranks_at_once(json_sizes, budget) if budget is not None else None
    if fit is not None and fit < n:
        need = memory_budget.need_bytes(max(json_sizes))
        whose = "--max-memory" if max_memory is not None else \
            f"{memory_budget.MEMORY_SHARE:.0%} of the available memory"
        print(f"fsdpprof: analysing {fit} rank{'s' if fit > 1 else ''} at a time, not {n}: the biggest trace may "
              f"need up to {need / 2**30:.1f} GiB of memory and the budget is {budget / 2**30:.1f} GiB ({whose})",
              file=sys.stderr, flush=True)
        n = fit
    return n


def map_unordered(fn, jobs: list[tuple[tuple, dict]], *, engine: str = "local", workers: int | None = None,
                  scheduler: str | None = None, preload: tuple = ()) -> Iterator[tuple[int, bool, object]]:
    """Run ``measured_call(fn, *job, preload)`` for every job ``(args, kwargs)``; yield ``(index, ok, value)`` as
    each finishes: value is ``(result, stats)`` when ok, else a one-line reason why the job has no result."""
    if not jobs:
        return
    jobs = [(args, kwargs, tuple(preload)) for args, kwargs in jobs]
    if engine == "dask":
        yield from _dask(fn, jobs, workers, scheduler)
    elif workers is not None and int(workers) <= 1 or len(jobs) == 1:
        for i, job in enumerate(jobs):
            yield i, True, measured_call(fn, *job)
    else:
        yield from _local_pool(fn, jobs, _pool_size(workers, len(jobs)))


def _failed(exc: BaseException) -> str:
    return f"worker failed ({type(exc).__name__}: {(str(exc).splitlines() or [''])[0]})"


def _pool(n: int) -> cf.ProcessPoolExecutor:
    return cf.ProcessPoolExecutor(max_workers=n, mp_context=multiprocessing.get_context("fork")
                                  if hasattr(os, "fork") else None)


def _local_pool(fn, jobs, n: int):
    """At most n + 1 jobs in flight (a worker that dies takes few with it); the jobs a broken pool lost run
    again, each alone in a fresh process, the rest go on in a fresh pool."""
    queue = list(range(len(jobs)))
    lost: list[int] = []
    while queue:
        with _pool(n) as pool:
            running: dict = {}
            broken = submitted = False
            while (queue or running) and not broken:
                while queue and len(running) <= n:
                    try:
                        running[pool.submit(measured_call, fn, *jobs[queue[0]])] = queue[0]
                    except BrokenProcessPool:   # a worker died since the last wait: the job stays queued
                        broken = True
                        break
                    queue.pop(0)
                    submitted = True
                if not running:
                    break
                done, _ = cf.wait(running, return_when=cf.FIRST_COMPLETED)
                for fut in done:
                    i = running.pop(fut)
                    try:
                        yield i, True, fut.result()
                    except BrokenProcessPool:   # a worker died (killed for memory?): the jobs in flight are lost
                        lost.append(i)
                        broken = True
                    except Exception as exc:
                        yield i, False, _failed(exc)
            lost += running.values()
            if broken and not submitted:    # a fresh pool that takes no job: the rest go one by one
                lost += queue
                queue = []
    for i in sorted(lost):         # once more, alone in a fresh process: a job that kills it spares the others
        with _pool(1) as pool:
            try:
                yield i, True, pool.submit(measured_call, fn, *jobs[i]).result()
            except BrokenProcessPool:
                yield i, False, ("its worker process died twice (killed, e.g. out of memory); analyse fewer ranks "
                                 "at once (--workers 1) or give the machine more memory")
            except Exception as exc:
                yield i, False, _failed(exc)


def connect_timeout_s() -> float:
    """Seconds to wait for a scheduler to connect and answer: Dask's ``distributed.comm.timeouts.connect``."""
    import dask.config
    from dask.utils import parse_timedelta

    return float(parse_timedelta(dask.config.get("distributed.comm.timeouts.connect"), default="s"))


def check_scheduler(scheduler: str, timeout_s: float | None = None) -> None:
    """UserError, in one line naming the address and within about ``timeout_s`` (default: Dask's connect
    timeout), unless a Dask scheduler answers there: tcp:// must send a Dask handshake first (read bounded, before
    distributed.Client could wait on it without a bound); tls://, ws://, wss://, ucx:// (UCX installed): the
    connection only; inproc:// is refused.
    An address that answered once in this process is not probed again (a command checks, then its maps)."""
    addr = str(scheduler).strip()
    if addr in _ANSWERED:
        return
    timeout_s = connect_timeout_s() if timeout_s is None else float(timeout_s)
    scheme, _, rest = addr.rpartition("://")
    if scheme and scheme not in _SCHEMES:
        raise UserError(f"--scheduler {addr}: {scheme}:// is not a Dask address scheme (one of "
                        f"{', '.join(_SCHEMES)}); {_FIX}")
    if scheme == "inproc":
        raise UserError(f"--scheduler {addr}: an inproc:// scheduler exists only inside the Python process that "
                        f"started it; give its tcp:// address, or leave --scheduler out to start a LocalCluster here")
    if scheme == "ucx" and not any(_have(m) for m in ("distributed_ucxx", "ucp")):
        raise UserError(f"--scheduler {addr}: ucx:// needs UCX for Dask (pip install distributed-ucxx, or ucx-py), "
                        f"which is not installed here; give the scheduler's tcp:// address instead")
    host, sep, port = rest.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"--scheduler {addr} is not HOST:PORT; {_FIX}")
    deadline = time.monotonic() + timeout_s
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    except TimeoutError:
        raise UserError(f"cannot reach the Dask scheduler at {addr}: no connection within {timeout_s:g} s "
                        f"(--connect-timeout); {_FIX}") from None
    except OSError as exc:
        raise UserError(f"cannot reach the Dask scheduler at {addr} ({exc.strerror or type(exc).__name__}); "
                        f"{_FIX}") from None
    with sock:
        why = _dask_handshake_problem(sock, deadline, timeout_s) if scheme in ("", "tcp") else None
    if why:
        raise UserError(f"the Dask scheduler at {addr} {why}; {_FIX}")
    _ANSWERED.add(addr)


def _recv_exactly(sock: socket.socket, n: int, deadline: float) -> bytes | None:
    """``n`` bytes from ``sock`` before ``deadline``; None when the peer closes first; TimeoutError after it."""
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        sock.settimeout(left)
        chunk = sock.recv(min(n - len(buf), 1 << 16))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _dask_handshake_problem(sock: socket.socket, deadline: float, timeout_s: float) -> str | None:
    """None when the peer's first message is a Dask handshake (distributed.comm.tcp's framing: a uint64 total,
    a uint64 frame count, the frame lengths, msgpack naming the handshake's keys); else what is wrong, in a few
    words.  Never reads more than HANDSHAKE_MAX_BYTES."""
    try:
        head = _recv_exactly(sock, 8, deadline)
        if head is None:
            return "closed the connection without a word (a Dask scheduler sends a handshake first)"
        (total,) = struct.unpack("<Q", head)
        if not 16 <= total <= HANDSHAKE_MAX_BYTES:
            return (f"answered bytes that are not Dask's protocol (a first message of {total} bytes: is this "
                    f"a Dask scheduler's port?)")
        body = _recv_exactly(sock, total, deadline)
    except TimeoutError:
        return (f"accepted the connection but did not answer within {timeout_s:g} s (a Dask scheduler sends a "
                f"handshake first; a slow one: raise --connect-timeout)")
    except OSError as exc:
        return f"broke the connection ({exc.strerror or type(exc).__name__})"
    if body is None:
        return "closed the connection in the middle of its first message"
    (n_frames,) = struct.unpack_from("<Q", body)
    if 1 <= n_frames <= HANDSHAKE_MAX_FRAMES and 8 * (1 + n_frames) <= total:
        lengths = struct.unpack_from(f"<{n_frames}Q", body, 8)
        if 8 * (1 + n_frames) + sum(lengths) == total and (b"compression" in body or b"pickle-protocol" in body):
            return None
    return "answered bytes that are not Dask's protocol (no Dask handshake: is this a Dask scheduler's port?)"


@contextlib.contextmanager
def shared_scheduler(engine: str, scheduler: str | None, workers: int | None, n_jobs: int):
    """The scheduler address for one or several maps: ``scheduler`` itself, or for ``dask`` without one a
    LocalCluster of ``workers`` processes (one thread each) started here and closed on exit; None for local."""
    if engine != "dask" or scheduler:
        yield scheduler
        return
    from distributed import LocalCluster

    cluster = LocalCluster(n_workers=_pool_size(workers, n_jobs), threads_per_worker=1, processes=True,
                           dashboard_address=None, silence_logs=logging.CRITICAL)
    try:
        yield cluster.scheduler_address
    finally:
        cluster.close()


def _drop_failed_client(exc: BaseException) -> None:
    """Collect the half-made Client that ``exc`` (its constructor's error) still holds, now and quietly: its
    ``__del__`` would otherwise print "Exception ignored in Client.__del__ ... TimeoutError" after our one line."""
    import gc
    import sys
    import traceback

    hook = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: None
    try:
        traceback.clear_frames(exc.__traceback__)
        exc.__traceback__ = None
        exc.__context__ = exc.__cause__ = None
        gc.collect()
    finally:
        sys.unraisablehook = hook


def _check_workers_import_fsdpprof(client) -> None:
    """UserError unless every worker of the cluster can import this fsdpprof (the same version)."""
    try:
        client.wait_for_workers(1, timeout=DASK_WAIT_FOR_WORKERS_S)
    except (TimeoutError, OSError):
        raise UserError(f"the Dask scheduler has no worker after {DASK_WAIT_FOR_WORKERS_S:.0f} s; start workers "
                        f"(dask worker SCHEDULER_ADDRESS) with fsdpprof installed") from None
    try:
        versions = client.run(_fsdpprof_version)
    except Exception as exc:
        raise UserError(f"the Dask workers cannot run fsdpprof ({type(exc).__name__}: {exc}); install fsdpprof "
                        f"{__version__} on every worker") from None
    other = {str(v) for v in versions.values()} - {__version__}
    if other:
        raise UserError(f"the Dask workers run fsdpprof {', '.join(sorted(other))}, this is "
                        f"{__version__}; install the same version on every worker")


def _fsdpprof_version() -> str:
    return __version__


def _dask(fn, jobs, workers, scheduler):
    """The jobs on the scheduler at ``scheduler`` (probed by check_engine first), else on a LocalCluster here."""
    from distributed import Client, as_completed

    with shared_scheduler("dask", scheduler, workers, len(jobs)) as address:
        try:
            client = Client(address, timeout=connect_timeout_s(), set_as_default=False)
        except (OSError, TimeoutError, ValueError, TypeError) as exc:
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no answer'}"
            _drop_failed_client(exc)
            raise UserError(f"cannot reach the Dask scheduler at {address} ({why}); {_FIX}") from None
        with client:
            if scheduler:
                _check_workers_import_fsdpprof(client)
            tag = uuid.uuid4().hex[:8]
            futs = [client.submit(measured_call, fn, *job, key=f"fsdpprof-{tag}-{i}", pure=False, retries=0)
                    for i, job in enumerate(jobs)]
            index = {f.key: i for i, f in enumerate(futs)}
            try:
                for fut in as_completed(futs, loop=client.loop):
                    try:
                        value = fut.result()
                    except Exception as exc:  # KilledWorker: its worker died allowed-failures times; or fn raised
                        yield index[fut.key], False, _failed(exc)
                    else:
                        yield index[fut.key], True, value
                    fut.release()           # the cluster forgets the result: it is here now
            finally:
                client.cancel([f for f in futs if not f.done()])
