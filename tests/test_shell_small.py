"""The smaller holes of the shell (issue 39): a hand-edited merged timeline names the field it breaks, a newer
timeline schema is said as a number, ``ucx://`` without UCX is one line and nothing after it, ``--connect-timeout``
without ``--scheduler`` warns."""
from __future__ import annotations

import copy
import gzip
import json

import pytest

from conftest import run_fsdpprof, shared_data
from fsdpprof.analyze.trace import timeline_file
from fsdpprof.errors import BUG_MARK, UserError

DLRM = shared_data("gpu-traces", "param-dlrm-8rank-v100")
TRACE = DLRM / "rank-0.json.gz"


@pytest.fixture(scope="module")
def timeline_doc(tmp_path_factory):
    d = tmp_path_factory.mktemp("timeline")
    proc = run_fsdpprof("timeline", str(DLRM), "-o", str(d / "t.json.gz"))
    assert proc.returncode == 0, proc.stderr
    return json.loads(gzip.decompress((d / "t.json.gz").read_bytes()))


def _rank1(**kw):
    def edit(doc):
        doc["otherData"]["ranks"][1].update(kw)
    return edit


EDITS = [  # (what, edit, words in the one line)
    ("duplicate pid", _rank1(pid=0), ["otherData.ranks[1].pid 0", "own process id"]),
    ("duplicate rank", _rank1(rank=0), ["otherData.ranks[1].rank 0"]),
    ("rank as text", _rank1(rank="1"), ["otherData.ranks[1].rank", "whole number"]),
    ("negative rank", _rank1(rank=-1), ["otherData.ranks[1].rank is -1"]),
    ("pid true", _rank1(pid=True), ["otherData.ranks[1].pid is true"]),
    ("offset as text", _rank1(offset_us="abc"), ["otherData.ranks[1].offset_us", "not a number"]),
    ("trace a list", _rank1(trace=[1]), ["otherData.ranks[1].trace", "not an object"]),
    ("info a list", _rank1(info=[1]), ["otherData.ranks[1].info", "not an object"]),
    ("label a number", _rank1(label=5), ["otherData.ranks[1].label is 5", "not text"]),
    ("a rank not an object", lambda doc: doc["otherData"]["ranks"].__setitem__(1, 7), ["otherData.ranks[1] is int"]),
    ("ranks an object", lambda doc: doc["otherData"].__setitem__("ranks", {"a": 1}), ["otherData.ranks is dict"]),
]


@pytest.mark.parametrize("what,edit,words", EDITS, ids=[e[0] for e in EDITS])
def test_a_hand_edited_timeline_names_the_bad_field(tmp_path, timeline_doc, what, edit, words):
    doc = copy.deepcopy(timeline_doc)
    edit(doc)
    path = tmp_path / "edited.json.gz"
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))
    for cmd in (["report", str(path), "-o", str(tmp_path / "r.html")], ["overlap", str(path)]):
        proc = run_fsdpprof(*cmd)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert str(path) in lines[0] and BUG_MARK not in lines[0] and "unexpected" not in lines[0], lines
        assert all(w in lines[0] for w in words), lines


def test_the_unedited_timeline_reads_back(tmp_path, timeline_doc):
    parts = timeline_file.rank_parts(timeline_doc["otherData"], "t")
    assert [p["rank"] for p in parts] == list(range(8)) and len({p["pid"] for p in parts}) == 8


def test_a_newer_timeline_schema_is_said_as_a_number(tmp_path, timeline_doc):
    doc = copy.deepcopy(timeline_doc)
    doc["otherData"]["schema"] = "fsdpprof.timeline/12"
    path = tmp_path / "newer.json.gz"
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))
    with pytest.raises(UserError) as err:
        timeline_file.timeline_meta(str(path))
    assert "fsdpprof.timeline/12)" in str(err.value) and "b'" not in str(err.value)


def test_ucx_scheduler_is_one_line_and_nothing_after_it(tmp_path):
    pytest.importorskip("distributed")
    proc = run_fsdpprof("overlap", str(TRACE), "--scheduler", "ucx://127.0.0.1:9", "--connect-timeout", "1",
                        fresh_process=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "ucx://127.0.0.1:9" in lines[0], proc.stderr
    assert "Exception ignored" not in proc.stderr and "Traceback" not in proc.stderr


def test_connect_timeout_without_scheduler_warns(tmp_path):
    proc = run_fsdpprof("overlap", str(TRACE), "--connect-timeout", "3")
    assert proc.returncode == 0
    assert "--connect-timeout 3 has no effect without --scheduler" in proc.stderr
    quiet = run_fsdpprof("overlap", str(TRACE))
    assert "--connect-timeout" not in quiet.stderr
