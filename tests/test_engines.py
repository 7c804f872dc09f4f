"""The per-rank map on both engines: a local process pool and Dask (a LocalCluster of 2 worker processes,
started once for this module).  Same summary.json on both, on a real recorded run and on the real 8-rank
GPU traces; a Dask worker killed mid-run is retried; an unreadable rank is missing, not fatal."""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys

import cloudpickle
import pytest

from conftest import run_fsdpprof, shared_data

DLRM = ("gpu-traces", "param-dlrm-8rank-v100")
# summary.json keys that may differ between two analyses of the same input: none.  summary.json holds no
# timing of the analysis itself (where and how long each rank took stays in RankResult.worker); the times
# it holds (overview.started_at / ended_at) come from the input's run.json.  Kept as a list so that a key
# added later that does vary is named here, with its reason, instead of weakening the comparison.
EXCLUDED_KEYS: tuple = ()


@pytest.fixture(scope="module")
def scheduler():
    """Address of a LocalCluster of 2 worker processes (one thread each), for the whole module."""
    from distributed import LocalCluster

    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                           silence_logs=logging.CRITICAL)
    try:
        yield cluster.scheduler_address
    finally:
        cluster.close()


def _summary(path) -> dict:
    s = json.loads(path.read_text())
    for k in EXCLUDED_KEYS:
        s.pop(k, None)
    return s


def _report(run, out, *args):
    p = run_fsdpprof("report", str(run), "-o", str(out / "report.html"), *args, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return _summary(out / "summary.json"), (out / "report.html").read_text(), p


def _both(run, tmp_path, scheduler, *args):
    (tmp_path / "local").mkdir()
    (tmp_path / "dask").mkdir()
    local = _report(run, tmp_path / "local", "--engine", "local", "--workers", "2", *args)
    dask = _report(run, tmp_path / "dask", "--engine", "dask", "--scheduler", scheduler, *args)
    return local, dask


@pytest.mark.slow
def test_recorded_run_same_summary_on_both_engines(recorded_run, tmp_path, scheduler):
    run = recorded_run("fsdp2")
    (s_local, html_local, _), (s_dask, html_dask, _) = _both(run, tmp_path, scheduler)
    assert s_local["overview"]["ranks_analysed"] == 2 and not s_local["missing"]
    for key in ("comm_unit_step", "steps", "skew", "stragglers", "memory_peaks", "model_states", "traffic"):
        assert s_local[key], key                     # nothing vacuous is being compared
    assert s_dask == s_local
    assert html_dask == html_local


@pytest.mark.slow
def test_gpu_traces_same_summary_on_both_engines(tmp_path, scheduler):
    path = shared_data(*DLRM)
    (s_local, html_local, _), (s_dask, html_dask, _) = _both(path, tmp_path, scheduler)
    assert s_local["overview"]["ranks_analysed"] == 8 and s_local["overview"]["device_type"] == "cuda"
    for key in ("comm_phase", "skew", "stragglers", "temporal", "idle", "top_kernels", "rank_distributions"):
        assert s_local[key], key
    assert s_dask == s_local
    assert html_dask == html_local


@pytest.mark.slow
def test_dask_runs_each_rank_on_the_workers(scheduler):
    """The ranks run in the cluster's worker processes, and only the small results come back."""
    from distributed import Client

    from fsdpprof.analyze.pipeline import map_ranks
    from fsdpprof.analyze.load.run import load_run

    run = load_run(shared_data(*DLRM), lazy=True)
    assert all(rd.events is None for rd in run.ranks.values())     # paths travel, not events
    res = map_ranks(run, engine="dask", scheduler=scheduler)
    with Client(scheduler, set_as_default=False) as client:
        worker_pids = set(client.run(os.getpid).values())
    pids = {r.worker["pid"] for r in res}
    assert pids <= worker_pids and os.getpid() not in pids, (pids, worker_pids)
    assert [r.rank for r in res] == list(range(8)) and not any(r.error for r in res)
    assert all(r.worker["peak_rss_bytes"] >= r.worker["start_rss_bytes"] > 0 for r in res)


def _kill_once(marker: str, suffix: str):
    """A worker plugin (dask's, imported here: not to collect the tests)."""
    from distributed.diagnostics.plugin import WorkerPlugin

    class _KillOnce(WorkerPlugin):
        """Worker plugin: the first worker that starts the task whose key ends with ``suffix`` dies at once
        (os._exit: what the OOM killer or a lost node does to a worker), once per marker file."""

        name = "fsdpprof-test-kill-once"

        def __init__(self, marker: str, suffix: str):
            self.marker, self.suffix = marker, suffix

        def transition(self, key, start, finish, **kwargs):
            if finish == "executing" and str(key).startswith("fsdpprof-") and str(key).endswith(self.suffix):
                try:
                    fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                except FileExistsError:
                    return
                os.write(fd, str(os.getpid()).encode())
                os.close(fd)
                os._exit(17)

    return _KillOnce(marker, suffix)


@pytest.mark.slow
def test_a_worker_that_dies_mid_run_is_retried_by_dask(tmp_path, scheduler):
    from distributed import Client

    from fsdpprof.analyze.pipeline import map_ranks, reduce_run
    from fsdpprof.analyze.load.run import load_run
    from fsdpprof.report.summary import summary

    path = shared_data(*DLRM)
    run = load_run(path, lazy=True)
    expected = summary(reduce_run(run, map_ranks(run, workers=1)))
    marker = tmp_path / "killed"
    plugin = _kill_once(str(marker), "-3")        # the job of rank 3
    cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the workers need not import this file
    with Client(scheduler, set_as_default=False) as client:
        client.register_plugin(plugin, name=plugin.name)
        try:
            res = map_ranks(run, engine="dask", scheduler=scheduler)
        finally:
            client.unregister_worker_plugin(plugin.name)
        client.wait_for_workers(2, timeout=60)                     # the nanny restarted it
    assert marker.exists(), "no worker was killed: the test proved nothing"
    killed = int(marker.read_text())
    assert res[3].rank == 3 and not res[3].error and res[3].worker["pid"] != killed
    assert summary(reduce_run(run, res)) == expected


def _copy(path, dst):
    shutil.copytree(path, dst)
    for f in dst.iterdir():
        f.chmod(0o644)
    return dst


@pytest.mark.slow
def test_an_unreadable_rank_is_missing_not_fatal(tmp_path, scheduler):
    from fsdpprof.analyze.pipeline import map_ranks, reduce_run
    from fsdpprof.analyze.load.run import load_run
    from fsdpprof.report.summary import summary

    d = _copy(shared_data(*DLRM), tmp_path / "traces")
    (d / "rank-5.json.gz").write_bytes(b"\x1f\x8b\x08\x00" + os.urandom(4000))   # a gzip header, then noise
    run = load_run(d, lazy=True)
    s_local = summary(reduce_run(run, map_ranks(run, engine="local", workers=2)))
    s_dask = summary(reduce_run(run, map_ranks(run, engine="dask", scheduler=scheduler)))
    assert s_local["overview"]["ranks_analysed"] == 7 and 5 not in s_local["overview"]["ranks_present"]
    assert list(s_local["missing"]) == ["rank-5.json.gz"] and "gzip" in s_local["missing"]["rank-5.json.gz"]
    assert s_dask == s_local


@pytest.mark.slow
def test_a_file_the_workers_cannot_see_is_missing(tmp_path, scheduler):
    """Discovered here, gone where the rank runs (not on the workers' storage): that rank is missing, with
    the reason; the other ranks are analysed."""
    from fsdpprof.analyze.pipeline import map_ranks, reduce_run
    from fsdpprof.analyze.load.run import load_run

    d = _copy(shared_data(*DLRM), tmp_path / "traces")
    run = load_run(d, lazy=True)
    (d / "rank-6.json.gz").unlink()
    a = reduce_run(run, map_ranks(run, engine="dask", scheduler=scheduler))
    assert a.overview["ranks_analysed"] == 7
    assert "is not there on" in a.missing["rank-6.json.gz"] and "same path" in a.missing["rank-6.json.gz"]


@pytest.mark.slow
def test_mode_000_trace_is_missing_on_a_local_cluster_started_by_the_cli(tmp_path):
    """`--engine dask` without --scheduler: a LocalCluster here.  A trace nobody may read (mode 000, root
    without DAC override) is missing, not fatal."""
    setpriv = shutil.which("setpriv")
    if os.geteuid() == 0 and not setpriv:
        pytest.skip("running as root without setpriv: mode 000 cannot be made unreadable here")
    prefix = [setpriv, "--bounding-set=-dac_override,-dac_read_search", "--"] if os.geteuid() == 0 else []
    d = _copy(shared_data(*DLRM), tmp_path / "traces")
    (d / "rank-2.json.gz").chmod(0)
    out = tmp_path / "out"
    out.mkdir()
    p = subprocess.run([*prefix, sys.executable, "-m", "fsdpprof", "report", str(d), "-o", str(out / "r.html"),
                        "--engine", "dask", "--workers", "2"], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    s = json.loads((out / "r.summary.json").read_text())
    assert s["overview"]["ranks_analysed"] == 7 and "permission denied" in s["missing"]["rank-2.json.gz"]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["local", "dask"])
def test_one_progress_line_per_rank(engine, scheduler, capsys):
    from fsdpprof.analyze.pipeline import map_ranks
    from fsdpprof.analyze.load.run import load_run

    run = load_run(shared_data(*DLRM), lazy=True)
    kw = {"scheduler": scheduler} if engine == "dask" else {"workers": 2}
    map_ranks(run, engine=engine, progress=True, **kw)
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("fsdpprof: rank ")]
    ranks = sorted(int(re.match(r"fsdpprof: rank (\d+) analysed \(", x).group(1)) for x in lines)
    assert ranks == list(range(8)), lines
    assert sorted(int(re.search(r"(\d+)/8\)$", x).group(1)) for x in lines) == list(range(1, 9))


def test_local_pool_retries_the_ranks_of_a_killed_worker(tmp_path, monkeypatch):
    """A pool worker killed mid-run (SIGKILL: here rank 3's first attempt kills its own process, so the kill
    falls inside a job whatever the machine's load) breaks the pool: the ranks it lost run again, each alone
    in a fresh process, and the results equal an in-process run."""
    import signal

    from fsdpprof.analyze import pipeline
    from fsdpprof.analyze.pipeline import map_ranks, reduce_run
    from fsdpprof.analyze.load.run import load_run
    from fsdpprof.report.summary import summary

    run = load_run(shared_data(*DLRM), lazy=True)
    expected = summary(reduce_run(run, map_ranks(run, workers=1)))
    marker = tmp_path / "killed"
    real_job = pipeline.rank_job

    def dying_job(rd, **kw):
        if rd.rank == 3 and not marker.exists():
            marker.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        return real_job(rd, **kw)

    # (the pool's workers are forked after this: they find the patched job where pickle looks for it)
    dying_job.__module__, dying_job.__qualname__ = real_job.__module__, real_job.__qualname__
    monkeypatch.setattr(pipeline, "rank_job", dying_job)
    res = map_ranks(run, workers=2, engine="local")
    assert marker.exists(), "no worker was killed: the test proved nothing"
    killed = int(marker.read_text())
    assert killed != os.getpid() and sorted(r.rank for r in res) == list(range(8))
    assert not any(r.error for r in res)
    pids = [r.worker["pid"] for r in res]
    rerun = next(r for r in res if r.rank == 3).worker["pid"]
    assert rerun != killed and pids.count(rerun) == 1       # (the killed worker's earlier ranks keep its pid)
    assert summary(reduce_run(run, res)) == expected


def test_local_pool_survives_a_pool_broken_before_a_submit(monkeypatch):
    """The pool can break between a wait and the next submit (a worker died meanwhile): submit itself then
    raises BrokenProcessPool.  The job not yet submitted stays queued for a fresh pool, the jobs in flight are
    retried alone, and every job yields its result exactly once."""
    from concurrent.futures.process import BrokenProcessPool

    from fsdpprof.analyze.load import engines

    real = engines.cf.ProcessPoolExecutor
    pools: list = []

    class BreaksOnThirdSubmit(real):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.submits = 0
            pools.append(self)

        def submit(self, fn, /, *args, **kwargs):
            self.submits += 1
            if len(pools) == 1 and self.submits == 3:
                raise BrokenProcessPool("a child process terminated abruptly")
            return super().submit(fn, *args, **kwargs)

    monkeypatch.setattr(engines.cf, "ProcessPoolExecutor", BreaksOnThirdSubmit)
    jobs = [((-k,), {}) for k in range(7)]
    out = list(engines.map_unordered(abs, jobs, workers=2))
    assert sorted(i for i, _, _ in out) == list(range(7))
    assert all(ok for _, ok, _ in out) and {i: v[0] for i, _, v in out} == {k: k for k in range(7)}
    assert len(pools) >= 2, "the broken pool was not replaced"


@pytest.mark.slow
def test_compare_same_json_on_both_engines(tmp_path, scheduler):
    a = _copy(shared_data(*DLRM), tmp_path / "a")
    b = _copy(shared_data(*DLRM), tmp_path / "b")
    out = {}
    for engine, extra in (("local", ["--workers", "2"]), ("dask", ["--scheduler", scheduler])):
        p = run_fsdpprof("compare", str(a), str(b), "-o", str(tmp_path / f"{engine}.html"), "--force", "--engine", engine,
                         *extra, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        out[engine] = json.loads((tmp_path / f"{engine}.json").read_text())
    assert out["local"]["table"] and out["dask"] == out["local"]


@pytest.mark.slow
def test_whatif_same_predictions_on_both_engines(recorded_run, tmp_path, scheduler):
    """whatif maps its ranks like report does: each rank loaded and predicted in a local pool or on Dask
    workers gives the predictions of this process, rank by rank (fits) and for the run."""
    run = recorded_run("fsdp2")
    out = {}
    for engine, extra in (("here", ["--workers", "1"]), ("local", ["--engine", "local", "--workers", "2"]),
                          ("dask", ["--scheduler", scheduler])):
        p = run_fsdpprof("whatif", str(run), "--json", *extra, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        out[engine] = json.loads(p.stdout)
    assert out["here"]["ranks_predicted"] == [0, 1] and out["here"]["predictions"]
    assert out["local"] == out["here"] and out["dask"] == out["here"]


@pytest.mark.parametrize("args, needles", [
    (["--engine", "local", "--scheduler", "tcp://127.0.0.1:8786"], ["use it with --engine dask"]),
    (["--scheduler", "tcp://127.0.0.1:1"], ["cannot reach the Dask scheduler", "127.0.0.1:1"]),
    (["--scheduler", "nonsense://x"], ["not a Dask address scheme"]),
    (["--scheduler", "127.0.0.1"], ["is not HOST:PORT"]),
    (["--engine", "spark"], ["invalid choice"]),
])
@pytest.mark.parametrize("command", ["report", "whatif"])
def test_engine_options_bad_input_one_line(tmp_path, args, needles, command):
    p = run_fsdpprof(command, str(shared_data(*DLRM)), "-o", str(tmp_path / "r.html"), *args, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    last = p.stderr.strip().splitlines()[-1]
    for n in needles:
        assert n in last, last
    assert not (tmp_path / "r.html").exists()


def test_engine_dask_without_dask_installed_says_what_to_install(tmp_path):
    trace = shared_data(*DLRM)
    code = ("import sys, importlib.util as u\n"
            "u.find_spec = lambda n, *a: None if n.split('.')[0] in ('distributed', 'dask') else _f(n, *a)\n"
            "from fsdpprof.cli import main\n"
            f"sys.exit(main(['report', {str(trace)!r}, '-o', {str(tmp_path / 'r.html')!r}, '--engine', 'dask']))")
    code = "import importlib.util as _u\n_f = _u.find_spec\n" + code
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "pip install 'fsdpprof[dask]'" in p.stderr and p.stderr.count("\n") == 1, p.stderr


@pytest.mark.slow
def test_a_command_probes_its_scheduler_once(scheduler, monkeypatch, capsys):
    """The command checks --scheduler before reading the run, its map connects without a second probe."""
    import dask.config

    from fsdpprof import cli
    from fsdpprof.analyze.load import engines

    probes = []
    real = engines._dask_handshake_problem
    monkeypatch.setattr(engines, "_ANSWERED", set())
    monkeypatch.setattr(engines, "_dask_handshake_problem", lambda *a: probes.append(a) or real(*a))
    before = dask.config.get("distributed.comm.timeouts.connect")
    try:
        assert cli.main(["overlap", str(shared_data(*DLRM)), "--json", "--scheduler", scheduler]) == 0
    finally:
        dask.config.set({"distributed.comm.timeouts.connect": before})
    assert len(json.loads(capsys.readouterr().out)["overlap"]) == 8
    assert len(probes) == 1
