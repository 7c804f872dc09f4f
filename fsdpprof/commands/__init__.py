"""The sub-commands (each module: ``add_arguments(parser)`` and ``run(args) -> int``) and what they share."""
from __future__ import annotations

import sys

from fsdpprof import options

SHARED = {  # option -> add_argument keywords
    "--force": dict(action="store_true",
                    help="overwrite output files that fsdpprof did not write (never one of the inputs)"),
    "--json": dict(action="store_true", help="print the numbers as JSON"),
    "--self-contained": dict(action="store_true",
                             help="embed plotly.js (4.8 MB) in the HTML page; by default the page loads it from "
                                  "plotly-<version>.min.js, written once beside the pages of its folder (keep the "
                                  "two together); either way the page works offline"),
    "--device": dict(type=options.device_choice, metavar="N|all",
                     help="the CUDA device of a snapshot to analyse: N for cuda:N, 'all' for every device of one "
                          "snapshot file, each on its own (default: the rank's device, else the device with the "
                          "largest peak; the report names it)"),
    "--max-trace-bytes": dict(type=options.TRACE_BYTES, metavar="BYTES",
                              help="largest trace accepted, in bytes of JSON once decompressed, e.g. 16GiB "
                                   "(default: what this machine's available memory can analyse, at least 8 GiB)"),
    "--max-memory": dict(type=options.MEMORY_BYTES, metavar="BYTES",
                         help="memory the ranks analysed at once may need together, e.g. 16GiB: no more run at once "
                              "than it holds (default: 80%% of the available memory, or of what this process's "
                              "memory cgroup leaves)"),
    # where the per-rank work runs (fsdpprof.analyze.load.engines)
    "--workers": dict(type=options.WORKERS, help="processes for loading ranks (at most one per rank and per CPU core, "
                                                  "and as many as the available memory holds)"),
    "--engine": dict(choices=("local", "dask"),
                     help="where each rank is analysed: local (default; this machine, a pool of --workers processes "
                          "for big traces) or dask (a Dask cluster: --scheduler, else a LocalCluster of --workers "
                          "processes here; pip install 'fsdpprof[dask]')"),
    "--scheduler": dict(metavar="ADDRESS",
                        help="address of a running dask.distributed scheduler (tcp://HOST:8786; implies --engine "
                             "dask): its workers read each rank's files at the same path (shared storage), only "
                             "small results come back"),
    "--connect-timeout": dict(type=options.CONNECT_TIMEOUT_S, default=None, metavar="SECONDS",
                              help=f"--scheduler: seconds to wait for the scheduler to connect and answer (default "
                                   f"{options.DEFAULT_CONNECT_TIMEOUT_S:g}; {options.CONNECT_TIMEOUT_S.describe()})"),
}
ENGINE = ("--workers", "--engine", "--scheduler", "--connect-timeout")


def add(p, *names: str, **helps: str) -> None:
    """Add the shared options ``names`` to parser ``p``; ``helps``: a help text of its own, by option dest."""
    for name in names:
        dest = name.lstrip("-").replace("-", "_")
        p.add_argument(name, **{**SHARED[name], "help": helps.get(dest, SHARED[name]["help"])})


def engine_of(args) -> str:
    """The engine of --engine / --scheduler / --connect-timeout; UserError when they do not work together; a
    warning for a --connect-timeout that nothing uses (no --scheduler)."""
    from fsdpprof.analyze.load.engines import check_engine

    timeout_s = args.connect_timeout
    if timeout_s is not None and args.scheduler is None:
        print(f"fsdpprof {args.command}: warning: --connect-timeout {timeout_s:g} has no effect without --scheduler "
              f"(it bounds the wait for a running Dask scheduler); ignored", file=sys.stderr)
    elif timeout_s is None:
        timeout_s = options.DEFAULT_CONNECT_TIMEOUT_S
    return check_engine(args.engine, args.scheduler, timeout_s)


def checked_run(args, path: str, outputs: list, fix: str = "", defer_under=None, load=None, **kw):
    """``load(path, **kw)`` (default find_run: traces not read yet), with ``outputs`` checked before (the input
    not read yet: ``defer_under``) and after (never one of the input's files), and its --device chosen."""
    from fsdpprof.analyze.load.files import find_run
    from fsdpprof.report.outputs import check_outputs

    check_outputs(outputs, force=args.force, defer_under=defer_under or [path], fix=fix)
    run = (load or find_run)(path, **kw)
    check_outputs(outputs, force=args.force, inputs=run.inputs, input_folders=run.record_folders(), fix=fix)
    if getattr(args, "device", None) is None:
        return run
    from fsdpprof.analyze.memory.attribution import choose_device

    return choose_device(run, args.device)
