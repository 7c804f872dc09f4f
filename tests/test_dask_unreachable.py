"""--scheduler at an address where no Dask scheduler answers: a local server on 127.0.0.1 that accepts and says
nothing, one that answers garbage (a length of exabytes, HTTP), one that stops in the middle of a message, one
that hangs up; and inproc://.  Each ends in one line naming the address, exit 2, bounded by
--connect-timeout (short here), before distributed.Client is made (nothing allocated from a peer's bytes)."""
from __future__ import annotations

import socket
import struct
import threading

import pytest

from conftest import run_fsdpprof, shared_data
from fsdpprof import cli

pytest.importorskip("distributed")

DLRM = ("gpu-traces", "param-dlrm-8rank-v100")
EXABYTES = struct.pack("<Q", 3 * 2**60) + b"\x00" * 64            # "3.07 EiB follow"
HTTP = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
HALF = struct.pack("<Q", 58) + struct.pack("<QQ", 1, 42)           # a plausible start, then nothing


class Peer:
    """A TCP server on 127.0.0.1 that treats each connection by ``mode``: silent (accept, keep it open, say
    nothing), hangup (close at once), or bytes to send before staying silent."""

    def __init__(self, mode):
        self.mode, self.accepted, self.conns = mode, 0, []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            if self.mode == "hangup":
                conn.close()
                continue
            if isinstance(self.mode, bytes):
                conn.sendall(self.mode)
            self.conns.append(conn)

    def close(self):
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.fixture
def restore_dask_timeout():
    """--connect-timeout sets Dask's connect timeout for the process: give the suite's back afterwards."""
    import dask.config

    before = dask.config.get("distributed.comm.timeouts.connect")
    yield
    dask.config.set({"distributed.comm.timeouts.connect": before})


@pytest.mark.parametrize("mode,words", [
    ("silent", ["accepted the connection but did not answer within 0.3 s", "--connect-timeout"]),
    (EXABYTES, ["not Dask's protocol", f"{3 * 2**60} bytes"]),
    (HTTP, ["not Dask's protocol"]),
    (HALF, ["did not answer within 0.3 s"]),
    ("hangup", ["closed the connection"]),
], ids=["silent", "exabytes", "http", "half-message", "hangup"])
@pytest.mark.parametrize("cmd", ["report", "compare"])
def test_a_peer_that_is_no_dask_scheduler_is_one_line_exit_2(tmp_path, capsys, restore_dask_timeout, cmd, mode,
                                                               words):
    peer = Peer(mode)
    trace = str(shared_data(*DLRM))
    runs = [trace] if cmd == "report" else [trace, trace]
    try:
        code = cli.main([cmd, *runs, "-o", str(tmp_path / "out.html"), "--scheduler", peer.address,
                         "--connect-timeout", "0.3"])
    finally:
        peer.close()
    err = capsys.readouterr().err
    assert code == 2 and peer.accepted >= 1, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"fsdpprof {cmd}: error: "), err
    assert peer.address in lines[0] and "Traceback" not in err, err
    for w in words:
        assert w in lines[0], lines[0]
    assert not list(tmp_path.iterdir())


def test_a_real_scheduler_passes_the_handshake_check():
    """The check reads what a real scheduler sends first (a LocalCluster with no worker, on 127.0.0.1)."""
    import logging

    from distributed import LocalCluster

    from fsdpprof.analyze.load.engines import check_scheduler

    with LocalCluster(n_workers=0, processes=False, protocol="tcp", host="127.0.0.1", dashboard_address=None,
                      silence_logs=logging.CRITICAL) as cluster:
        assert cluster.scheduler_address.startswith("tcp://127.0.0.1:")
        check_scheduler(cluster.scheduler_address, 10)      # no UserError


@pytest.mark.parametrize("address,words", [
    ("inproc://nothing", ["inproc://nothing", "only inside the Python process"]),
    ("tcp://127.0.0.1:1", ["cannot reach the Dask scheduler at tcp://127.0.0.1:1"]),
])
def test_inproc_and_closed_port_one_line_and_nothing_later(tmp_path, address, words):
    """A process of its own: nothing may follow the line at exit (distributed's Client.__del__ said a
    TimeoutError traceback 30 s later for inproc://)."""
    p = run_fsdpprof("report", str(shared_data(*DLRM)), "-o", str(tmp_path / "r.html"), "--scheduler", address,
                     "--connect-timeout", "1", timeout=120)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
    for w in words:
        assert w in p.stderr, p.stderr
