"""``report --tables``: names planted in a trace, a run directory and a snapshot are written as inert text (no
CSV cell a spreadsheet runs as a formula; numbers, negative ones too, stay numbers); integers beyond 64 bits are
unknown where rank.json is read and text / string columns where they are still left; tables.json grants only
what fsdpprof wrote in that very folder (an edited CSV, a copied index: the user's); a recorder's folder is
refused; every CSV fsdpprof writes goes through one function."""
from __future__ import annotations

import csv
import gzip
import io
import json
import pickle
import re
import shutil
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from conftest import ROOT, run_fsdpprof, shared_data
from fsdpprof import runfmt
from fsdpprof.analyze.load import files
from fsdpprof.analyze.memory import safe_pickle
from fsdpprof.report import tables

DLRM = ("gpu-traces", "param-dlrm-8rank-v100")
PAYLOADS = ['=HYPERLINK("http://example.invalid/x","click")', "=cmd|' /C calc'!A0", "+1+cmd|' /C calc'!A0",
            "-2+3+cmd|' /C calc'!A0", "@SUM(1+1)*cmd|' /C calc'!A0", "\t=1+1", "\r=1+1"]
_KEEP = re.compile(r"nccl|c10d|ProfilerStep|record_param_comms|all_gather|reduce_scatter|all_reduce", re.I)


def _cells(folder: Path) -> list[tuple[str, str]]:
    """(file, cell) of every cell, headers included, of every CSV in ``folder``."""
    out = []
    for p in sorted(folder.glob("*.csv")):
        with open(p, newline="", encoding="utf-8") as fh:
            out += [(p.name, c) for row in csv.reader(fh) for c in row]
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def formula_cells(folder: Path) -> list[tuple[str, str]]:
    """Cells a spreadsheet would run: text starting with = + - @, tab or CR that is not a number."""
    return [(f, c) for f, c in _cells(folder) if c[:1] in ("=", "+", "-", "@", "\t", "\r") and not _is_number(c)]


def planted(folder: Path) -> dict[str, int]:
    """file -> cells holding a payload, neutralised (a leading ')."""
    counts: dict[str, int] = {}
    for f, c in _cells(folder):
        if c.startswith("'") and any(c[1:].startswith(p) for p in PAYLOADS):
            counts[f] = counts.get(f, 0) + 1
    return counts


def _report_tables(inp: Path, tmp_path: Path, *extra: str) -> Path:
    out = tmp_path / "tables"
    proc = run_fsdpprof("report", str(inp), "-o", str(tmp_path / "r.html"), "--tables", str(out), *extra)
    assert proc.returncode == 0, proc.stderr
    return out


# ------------------------------------------------------------------------------------------ formulas
def test_csv_cells_formula_prefixed_numbers_stay_numbers():
    rows = [{"name": p, "delta_us": -3.5, "count": -2, "text_number": "-3.5", "flag": True} for p in PAYLOADS]
    rows.append({"name": "aten::mm", "delta_us": None, "count": 7, "text_number": "+4", "flag": False})
    data = tables.csv_bytes(pd.DataFrame.from_records(rows)).decode()
    got = list(csv.DictReader(io.StringIO(data, newline="")))
    assert [r["name"] for r in got] == ["'" + p for p in PAYLOADS] + ["aten::mm"]
    assert {r["delta_us"] for r in got[:-1]} == {"-3.5"} and {r["count"] for r in got} == {"-2", "7"}
    assert [r["text_number"] for r in got] == ["-3.5"] * len(PAYLOADS) + ["+4"]   # a number as text: a number
    back = pd.read_csv(io.StringIO(data))
    assert back["delta_us"].iloc[0] == -3.5 and back["count"].iloc[0] == -2


def test_a_header_from_an_input_is_neutralised_too():
    data = tables.csv_bytes(pd.DataFrame({"=1+1": [1], "ok": ["x"]})).decode()
    assert data.split("\r\n")[0] == "'=1+1,ok"


def test_a_carriage_return_inside_a_cell_is_quoted_not_a_row_end():
    data = tables.csv_bytes(pd.DataFrame({"a": ["x\ry", "p\nq", "plain"], "b": [1, 2, 3]}))
    assert data == b'a,b\r\n"x\ry",1\r\n"p\nq",2\r\nplain,3\r\n'
    assert list(csv.reader(io.StringIO(data.decode(), newline=""))) == [["a", "b"], ["x\ry", "1"], ["p\nq", "2"],
                                                                          ["plain", "3"]]


def _planted_trace(path: Path) -> Path:
    doc = json.loads(gzip.decompress(shared_data(*DLRM, "rank-0.json.gz").read_bytes()))
    k = 0
    for e in doc["traceEvents"]:
        if isinstance(e, dict) and e.get("cat") in ("cpu_op", "kernel") and not _KEEP.search(str(e.get("name"))):
            e["name"] = PAYLOADS[k % len(PAYLOADS)] + f" #{k % 3}"
            k += 1
    assert k > 50
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))
    return path


def test_names_planted_in_a_trace_are_inert(tmp_path):
    out = _report_tables(_planted_trace(tmp_path / "rank-0.json.gz"), tmp_path)
    assert formula_cells(out) == []
    hits = planted(out)
    assert hits.get("top_ops.csv", 0) > 0 and hits.get("top_kernels.csv", 0) > 0, hits
    for name in ("top_ops", "top_kernels"):          # Parquet keeps the raw names
        df = pd.read_parquet(out / f"{name}.parquet")
        assert any(str(n).startswith(tuple(PAYLOADS)) for n in df["name"])


def test_frames_planted_in_a_snapshot_are_inert(tmp_path):
    snap = safe_pickle.load_sized(str(shared_data("cuda-snapshots", "flexgen-opt1.3b-legacy.pickle")),
                                  max_bytes=1 << 30)[0]
    k = 0

    def plant(obj):                 # every frame anywhere (blocks' history, trace entries): its name and file
        nonlocal k
        if isinstance(obj, dict):
            if isinstance(obj.get("filename"), str) and "name" in obj:
                obj["name"], obj["filename"] = PAYLOADS[k % len(PAYLOADS)], PAYLOADS[(k + 1) % len(PAYLOADS)]
                k += 1
            for v in obj.values():
                plant(v)
        elif isinstance(obj, list):
            for v in obj:
                plant(v)
    plant(snap)
    assert k > 0
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(snap, protocol=4))
    out = _report_tables(path, tmp_path)
    assert formula_cells(out) == []
    hits = planted(out)
    assert any(f.endswith("top_allocations.csv") for f in hits), hits


@pytest.mark.slow
def test_unit_names_planted_in_a_run_directory_are_inert(tmp_path, recorded_run):
    run = tmp_path / "run"
    shutil.copytree(recorded_run("fsdp2"), run)
    payload = "=cmd|' /C calc'!A0"               # the name of unit layers.0, everywhere the run names it
    changed = 0
    for p in list(run.glob("rank-*/trace.json.gz")) + list(run.glob("rank-*/inventory.json")):
        raw = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
        new = raw.replace(b"layers.0", payload.encode())
        changed += new != raw
        p.write_bytes(gzip.compress(new) if p.suffix == ".gz" else new)
    assert changed >= 4
    out = _report_tables(run, tmp_path)
    assert formula_cells(out) == []
    hits = planted(out)
    assert hits.get("comm_unit_step.csv", 0) > 0 and any(".by_unit" in f for f in hits), hits


# ------------------------------------------------------------------------------------------ beyond 64 bits
def test_integers_beyond_64_bits_are_text_in_csv_and_strings_in_parquet(tmp_path):
    doc = {"t": [{"name": "a", "bytes": 2**64 - 1, "small": 1}, {"name": "b", "bytes": None, "small": 2},
                 {"name": "c", "bytes": -(2**70), "small": -3}]}
    items = dict(tables.table_files(doc, str(tmp_path)))
    text = items[str(tmp_path / "t.csv")].decode()
    assert text.split("\r\n")[1:-1] == ["a,18446744073709551615,1", "b,,2", "c,-1180591620717411303424,-3"]
    table = pq.read_table(io.BytesIO(items[str(tmp_path / "t.parquet")]))     # (pyarrow: in the test extra)
    assert str(table.schema.field("bytes").type) in ("string", "large_string")
    assert str(table.schema.field("small").type) == "int64"
    assert table.column("bytes").to_pylist() == ["18446744073709551615", None, "-1180591620717411303424"]


def test_rank_json_integers_beyond_64_bits_are_read_as_unknown(tmp_path):
    p = tmp_path / "rank.json"
    p.write_text('{"rank": 0, "process_memory": {"samples": [{"used_bytes": 18446744073709551615, "step": 3}]}, '
                 '"big": -9223372036854775809, "edge": 9223372036854775807}')
    doc = files._read_json(str(p), "rank file")
    assert doc["process_memory"]["samples"][0] == {"used_bytes": None, "step": 3}
    assert doc["big"] is None and doc["edge"] == 2**63 - 1


@pytest.mark.slow
def test_nvml_not_available_in_rank_json_gives_a_report_and_tables(tmp_path, recorded_run):
    run = tmp_path / "run"
    shutil.copytree(recorded_run("fsdp2"), run)
    info_path = run / "rank-0" / "rank.json"
    info = json.loads(info_path.read_text())
    samples = info["process_memory"]["samples"]
    assert samples
    for key in ("used_bytes", "used_peak_bytes"):
        samples[0][key] = 2**64 - 1                       # NVML's "not available"
    info_path.write_text(json.dumps(info))
    out = _report_tables(run, tmp_path)
    summary = (tmp_path / "r.summary.json").read_text()
    assert "18446744073709551615" not in summary and "18446744073709551615" not in "".join(
        c for _, c in _cells(out))
    index = json.loads((out / "tables.json").read_text())
    assert not [t for t in index["tables"] if "parquet_error" in t and "too large" in t["parquet_error"]]


# ------------------------------------------------------------------------------------------ ownership
def _first_csv(out: Path) -> Path:
    return out / json.loads((out / "tables.json").read_text())["tables"][0]["csv"]


def test_tables_json_records_sizes_hashes_and_its_folder(tmp_path):
    out = _report_tables(shared_data(*DLRM, "rank-0.json.gz"), tmp_path)
    index = json.loads((out / "tables.json").read_text())
    st = out.stat()
    assert index["schema"] == tables.TABLES_SCHEMA
    assert index["folder"] == {"path": str(out.resolve()), "device": st.st_dev, "inode": st.st_ino}
    for t in index["tables"]:
        assert t["csv_bytes"] == (out / t["csv"]).stat().st_size and len(t["csv_sha256"]) == 64
    assert tables.listed_files(str(out)) == {str(out / n) for t in index["tables"]
                                              for n in (t.get("csv"), t.get("parquet")) if n}


def test_an_edited_csv_is_the_users_replaced_only_with_force(tmp_path):
    trace = shared_data(*DLRM, "rank-0.json.gz")
    out = _report_tables(trace, tmp_path)
    mine = _first_csv(out)
    mine.write_text(mine.read_text() + "my,own,row\n")
    edited = mine.read_bytes()
    proc = run_fsdpprof("report", str(trace), "-o", str(tmp_path / "r.html"), "--tables", str(out))
    assert proc.returncode == 2 and str(mine) in proc.stderr and "--force" in proc.stderr, proc.stderr
    assert mine.read_bytes() == edited
    _report_tables(trace, tmp_path, "--force")
    assert mine.read_bytes() != edited and "my,own,row" not in mine.read_text()
    _report_tables(trace, tmp_path)                   # as fsdpprof wrote it again: replaced without --force


def test_a_copied_tables_json_grants_nothing(tmp_path):
    trace = shared_data(*DLRM, "rank-0.json.gz")
    out = _report_tables(trace, tmp_path)
    other = tmp_path / "copy"
    shutil.copytree(out, other)                        # the index and files exactly as fsdpprof wrote them
    assert tables.listed_files(str(other)) == set()
    mine = _first_csv(other)
    before = {p.name: p.read_bytes() for p in other.iterdir()}
    proc = run_fsdpprof("report", str(trace), "-o", str(tmp_path / "r.html"), "--tables", str(other))
    assert proc.returncode == 2 and "not written by fsdpprof" in proc.stderr, proc.stderr
    assert {p.name: p.read_bytes() for p in other.iterdir()} == before and mine.exists()
    # only the index alone, beside a user's file of a listed name
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(out / "tables.json", lone / "tables.json")
    (lone / mine.name).write_text("my numbers\n")
    proc = run_fsdpprof("report", str(trace), "-o", str(tmp_path / "r.html"), "--tables", str(lone))
    assert proc.returncode == 2 and (lone / mine.name).read_text() == "my numbers\n", proc.stderr


def test_a_recorders_folder_is_refused(tmp_path):
    run = tmp_path / "run"
    (run / "rank-0").mkdir(parents=True)
    (run / "launchers").mkdir()
    (run / "run.json").write_text(json.dumps({"schema": runfmt.RUN_SCHEMA}))
    alone = tmp_path / "alone"                        # a rank folder moved out of its run: its manifest says so
    alone.mkdir()
    (alone / runfmt.MANIFEST_JSON).write_text(json.dumps({"schema": runfmt.MANIFEST_SCHEMA, "files": []}))
    assert runfmt.recorder_folder(str(run / "rank-0" / "deeper")) == str((run / "rank-0").resolve())
    assert runfmt.recorder_folder(str(run / "launchers")) == str((run / "launchers").resolve())
    assert runfmt.recorder_folder(str(alone)) == str(alone.resolve())
    assert runfmt.recorder_folder(str(run)) is None and runfmt.recorder_folder(str(tmp_path / "rank-3")) is None
    trace = shared_data(*DLRM, "rank-0.json.gz")
    for target in (run / "rank-0", run / "rank-0" / "tables", run / "launchers", alone):
        proc = run_fsdpprof("report", str(trace), "-o", str(tmp_path / "r.html"), "--tables", str(target))
        assert proc.returncode == 2 and "fsdpprof record writes" in proc.stderr, proc.stderr
        assert proc.stderr.count("\n") == 1 and not (tmp_path / "r.html").exists()
    assert sorted(p.name for p in (run / "rank-0").iterdir()) == []


def test_every_csv_is_written_by_one_function():
    """to_csv / csv.writer appear in fsdpprof only in report/tables.py's csv_bytes."""
    hits = []
    for p in (ROOT / "fsdpprof").rglob("*.py"):
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if re.search(r"\.to_csv\(|csv\.writer|csv\.DictWriter|import csv", line):
                hits.append((str(p.relative_to(ROOT)), i))
    assert [f for f, _ in hits] == ["fsdpprof/report/tables.py"], hits
