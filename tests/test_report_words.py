"""What the report says and how: column words with units, trace names shortened with the full name kept,
FSDP units in the model's order, lanes named from the trace's thread names, the headline's numbers."""
from __future__ import annotations

import re
from html.parser import HTMLParser

import pandas as pd
import pytest

from conftest import shared_data
from fsdpprof.analyze.model import unit_order
from fsdpprof.analyze.trace.labels import lane_names
from fsdpprof.report.glance import _fill_rows
from fsdpprof.report.page import column_label, fmt_fixed, fmt_us, short_name, table, value_label

KERNEL = ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
          "at::detail::Array<char*, 1> >(int, at::native::FillFunctor<float>, at::detail::Array<char*, 1>)")


def test_long_kernel_names_are_shortened_and_short_ones_kept():
    assert short_name(KERNEL) == "at::native::vectorized_elementwise_kernel<…>"
    assert short_name("aten::mm") == "aten::mm"
    assert short_name("<script>alert(1)</script>") == "<script>alert(1)</script>"   # not a C++ name: as is
    long_plain = "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad" * 2
    s = short_name(long_plain)
    assert len(s) <= 64 and s.endswith("…") and long_plain.startswith(s[:-1])
    stack = "torch::cuda::gather_with_cpp() (memory_snapshot.cpp:0) < c10::StorageImpl::StorageImpl(" + "x" * 80 + ")"
    assert short_name(stack) == "torch::cuda::gather_with_cpp() (memory_snapshot.cpp:0) < …"   # the first frame


def test_table_headers_are_words_with_units_and_cells_use_the_column_unit():
    df = pd.DataFrame({"rank": [0, 1], "peak_allocated_bytes": [41_479_844.0, 3 * 2**20],
                       "exposed_comm_us": [122_396.7, 0.0], "overlap_pct": [12.345, 0.0],
                       "collective": ["all_gather", "reduce_scatter"], "name": [KERNEL, "aten::mm"]})
    html = table(df)
    heads = re.findall(r"<th[^>]*>(.*?)</th>", html)
    assert heads == ["rank", "peak allocated (MiB)", "exposed communication (ms)", "hidden behind compute (%)",
                     "collective", "name"]
    assert not any("_" in h for h in heads)
    cells = re.findall(r"<td[^>]*>(.*?)</td>", html)
    assert cells[1:4] == ["39.6", "122", "12.3"] and cells[7:10] == ["3.00", "0", "0.0"]
    assert "all-gather" in cells and "reduce-scatter" in cells
    # the full kernel name on hover, the short one shown
    assert 'title="void at::native::vectorized_elementwise_kernel&lt;4' in html
    assert ">at::native::vectorized_elementwise_kernel&lt;…&gt;</td>" in html


def test_words_and_numbers():
    assert column_label("model_step_us", "ms") == "T_comp + T_comm - T_overlap (ms)"
    assert column_label("some_new_metric_bytes", "MiB") == "some new metric (MiB)"   # no mapping: still words
    assert value_label("category", "unsharded_grad") == "unsharded grads"
    assert [fmt_fixed(x) for x in (1234.5, 12.34, 1.234, 0.1234, 0.0, 2e-6)] == ["1,234", "12.3", "1.23", "0.123",
                                                                                  "0", "<0.001"]
    assert fmt_us(0.0) == "0 ms" and fmt_us(1500.0) == "1.50 ms" and fmt_us(12.0) == "12.0 µs"


def test_units_in_the_models_order():
    units = ["layers.10", "layers.2", "(root)", "layers.0", "layers.1", "encoder.layers.3"]
    assert unit_order(units) == ["(root)", "encoder.layers.3", "layers.0", "layers.1", "layers.2", "layers.10"]


def test_headline_rows_are_filled():
    tile = '<div class="tile "></div>'
    wide = '<div class="tile wide"></div>'
    assert _fill_rows([tile, tile, tile, wide, tile]) == [tile, tile, tile, wide, tile]   # 3 + 3: as is
    out = _fill_rows([tile, wide, tile])                   # 1 + 2, then a tile alone: it spans the row
    assert out[:2] == [tile, wide] and "grid-column:span 3" in out[2]


def test_lane_names_from_thread_names():
    threads = [[100, 100, "thread 100 (python)"], [100, 101, "thread 101 (pt_gloo_runloop)"],
               [100, 102, "thread 102 (python)"], [100, 103, "thread 103 (pt_autograd_0)"], [0, 7, "stream 7 "],
               [0, 40, "stream 40 "]]
    names = lane_names(["thread:100", "thread:101", "thread:102", "thread:103", "stream:7", "stream:40", "thread:9"],
                       comm_lanes={"thread:102", "stream:40"}, nccl_lanes={"stream:40"}, thread_names=threads,
                       device_type="cuda")
    assert names == {"thread:100": "main thread", "thread:101": "gloo worker 1", "thread:102": "gloo worker 2",
                     "thread:103": "autograd thread 0", "stream:7": "CUDA stream 7",
                     "stream:40": "CUDA stream 40 (NCCL)", "thread:9": "thread 9"}


def test_gpu_trace_lanes_are_named_streams():
    from fsdpprof.commands.report import analyse_path

    a = analyse_path(str(shared_data("gpu-traces", "hta-nccl-2rank-a100")))
    names = dict(zip(a.lanes["lane"], a.lanes["lane_name"]))
    assert names["stream:40"] == "CUDA stream 40 (NCCL)" and names["stream:7"] == "CUDA stream 7", names


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp2"])
def test_cpu_run_headline_and_lanes(recorded_run, strategy):
    from fsdpprof.analyze.summary.headline import headline
    from fsdpprof.commands.report import analyse_path

    a = analyse_path(str(recorded_run(strategy)))
    h = headline(a)
    mp = a.memory_peaks
    assert h["peak_bytes"] == mp["peak_allocated_bytes"].max() and h["peak_rank"] in set(mp["rank"])
    assert h["model_states_theory_bytes"] == a.theory["model_states"]["total_bytes"]
    # the step's split adds up to the step (compute + exposed + host time + copies)
    parts = h["compute_pct"] + h["exposed_comm_pct"] + h["idle_pct"] + h["residual_pct"]
    assert parts == pytest.approx(100.0, abs=0.01) and h["idle_is_host"]
    assert h["first_finding"] == a.findings[0].title
    lanes = set(a.lanes["lane_name"])
    assert "main thread" in lanes and any(x.startswith("gloo worker") for x in lanes), lanes
    assert not any(x.startswith("thread:") for x in lanes)


def test_per_unit_memory_tables_in_the_models_order():
    """FSDP's buffers by role and A_l per unit read root first, then layers.2 before layers.10 (the analysis
    keeps them largest first; the page reads like the model)."""
    import types

    from fsdpprof.report.oom import render_fsdp_memory

    act = pd.DataFrame({"unit": ["layers.10", "", "layers.2"], "activation_bytes": [3 << 20, 1 << 20, 2 << 20],
                        "at_peak_bytes": [0, 0, 0]})
    roles = pd.DataFrame({"unit": ["layers.2", "layers.10", ""], "fsdp_role": ["all_gather_output"] * 3,
                          "bytes": [1, 2, 3]})
    html = render_fsdp_memory(types.SimpleNamespace(activation_by_unit=act, by_role_at_peak=roles))
    for part in html.split("<h3>")[1:]:
        pos = [part.index(f">{u}<") for u in ("(root)", "layers.2", "layers.10")]
        assert pos == sorted(pos), part[:300]


def test_one_byte_formatter():
    """Bytes are written by one function everywhere (pages, text, messages, the overlap table): binary units at three
    significant digits, decimal ones on request, a placeholder for what is missing."""
    from fsdpprof.analyze import model
    from fsdpprof.analyze.summary import theory
    from fsdpprof.analyze.memory import oom
    from fsdpprof.commands import overlap as overlap_cmd
    from fsdpprof.report import page

    f = model.fmt_bytes
    assert page.fmt_bytes is f and theory.fmt_bytes is f
    assert [f(x) for x in (0, 1023, 1024, 1536, 10 * 2**20, 123.4 * 2**20, 1023 * 2**20, 1.5 * 2**30, 1234 * 2**30,
                           -3 * 2**20)] == ["0 B", "1023 B", "1.00 KiB", "1.50 KiB", "10.0 MiB", "123 MiB", "1,023 MiB",
                                            "1.50 GiB", "1,234 GiB", "-3.00 MiB"]
    assert [f(x) for x in (None, float("nan"), "x")] == ["-", "-", "-"] and f(None, missing="?") == "?"
    assert f(1.5e9, decimal=True) == "1.50 GB" and f(999, decimal=True) == "999 B" and f(12_345, decimal=True) == "12.3 kB"
    assert oom.fmt_bytes(None) == "unknown" and oom.fmt_bytes(2**20) == f(2**20)
    assert overlap_cmd.fmt_bytes is f       # (its table writes sizes in decimal units, beside bandwidths in GB/s)


# --- one statistic per number, human words everywhere (issue 30) --------------------------------------------
class _Visible(HTMLParser):
    """The text a person sees: no <script>, <style> or <code> (summary.json keys), cells kept apart."""

    def __init__(self):
        super().__init__()
        self.parts, self.cells, self._skip, self._cell = [], [], 0, None

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style", "code"):
            self._skip += 1
        elif tag in ("td", "th"):
            self._cell = []
        self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag in ("script", "style", "code"):
            self._skip -= 1
        elif tag in ("td", "th") and self._cell is not None:
            self.cells.append("".join(self._cell).strip())
            self._cell = None

    def handle_data(self, data):
        if not self._skip:
            self.parts.append(data)
            if self._cell is not None:
                self._cell.append(data)


def visible(html: str) -> tuple[str, list[str]]:
    p = _Visible()
    p.feed(html)
    return "".join(p.parts), p.cells


def raw_words(text: str, cells: list[str] = ()) -> list[str]:
    """Vocabulary names and placeholders a person should not read: snake_case category / stage / phase /
    collective names as words, None, nan, a lone "-" or "?" standing for a value."""
    from fsdpprof.analyze import model

    names = {n for n in (list(model.MEMORY_CATEGORIES) + list(model.REPLICATED_CATEGORIES) + list(model.STAGES)
                         + list(model.FSDP_PHASES) + list(model.COLLECTIVES)) if "_" in n}
    found = [m.group(0) for n in sorted(names) for m in re.finditer(rf"(?<![\w.:=/\[])({re.escape(n)})(?![\w=(\[])", text)]
    found += re.findall(r"\b(?:None|nan|NaN)\b", text)
    found += [m.group(0) for m in re.finditer(r"(?:^|[\s(:])[-?](?=[,;)]|\s*$)", text, re.M)]
    found += [c for c in cells if c in ("-", "?", "None", "nan", "(none)")]
    return found


def _numbers(html: str) -> dict:
    """The numbers a report shows twice, each where it stands: At a glance, the findings, Overview, Memory."""
    sec = {m.group(1): m.group(0) for m in re.finditer(r'<section id="(\w+)">.*?</section>', html, re.S)}
    glance, fnd, over = sec.get("headline", ""), sec.get("findings", ""), sec.get("overview", "")
    where = {  # key: (the text it is read from, the pattern whose first group is the number)
        "glance_exposed": (glance, r'<div class="big">([^<]+)</div><div class="what">of the step is exposed communication'),
        "glance_step": (glance, r"of a ([^<]+?) step \("),
        "glance_idle": (glance, r"device idle ([\d.]+%)"),
        "glance_peak": (glance, r'<div class="big">([^<]+)</div><div class="what">peak memory'),
        "finding_exposed": (fnd, r"Communication not hidden behind compute is ([\d.]+%)"),
        "finding_idle": (fnd, r"The device is idle ([\d.]+%)"),
        "overview_step": (over, r"<th[^>]*>step time</th><td[^>]*>([^<(]+?) \("),
        "memory_peak": (html, r"measured peak \(rank \d+\) = ([^;]+);"),
    }
    return {key: m.group(1) for key, (text, pattern) in where.items() if (m := re.search(pattern, text))}


def _same_numbers_shown(html: str) -> dict:
    n = _numbers(html)
    if "glance_exposed" in n and "finding_exposed" in n:
        assert n["glance_exposed"] == n["finding_exposed"], n
    if "glance_idle" in n and "finding_idle" in n:
        assert n["glance_idle"] == n["finding_idle"], n
    if "glance_step" in n and "overview_step" in n:
        assert n["glance_step"].split(" (")[0] == n["overview_step"], n
    if "glance_peak" in n and "memory_peak" in n:
        assert n["glance_peak"] == n["memory_peak"], n
    return n


def test_gpu_trace_report_shows_each_number_once_and_in_words():
    """param-dlrm-8rank-v100 (8 ranks, ranks differ 2x): At a glance and the first findings state the same
    statistic (they said 40 % / 48 % beside 59.9 % (rank 1) / 75.8 % (rank 7)); no raw vocabulary on the page or
    in the terminal."""
    from fsdpprof.commands.report import analyse_path
    from fsdpprof.report.run_page import render_report
    from fsdpprof.report.text import summary_text

    a = analyse_path(str(shared_data("gpu-traces", "param-dlrm-8rank-v100")))
    html = render_report(a)
    n = _same_numbers_shown(html)
    assert {"glance_exposed", "finding_exposed", "glance_idle", "finding_idle", "glance_step", "overview_step"} <= set(n), n
    # the worst rank is named beside the median, labelled as such
    f = next(x for x in a.findings if x.id == "exposed_comm_total")
    assert f.worst > f.value and f"worst rank {f.rank}" in f.title and "median over 8 ranks" in f.title
    text, cells = visible(html)
    assert raw_words(text, cells) == []
    term = summary_text(a)
    assert raw_words(term) == [], term
    assert f"exposed {n['glance_step'].split(' (')[0]}" not in term        # (sanity: step and exposed differ)
    assert f"step {n['glance_step'].replace('–', '-')}" in term             # the terminal's step with its spread


def test_snapshot_and_gpu_compare_pages_in_words():
    """A CUDA snapshot's report and terminal, and the compare page of two GPU trace folders: words, no
    placeholders (it said "source cuda_snapshot", "Psi -", "median step -")."""
    from fsdpprof.analyze.compare.runs import compare_analyses
    from fsdpprof.commands.report import analyse_path
    from fsdpprof.report.compare_page import render_compare
    from fsdpprof.report.run_page import render_report
    from fsdpprof.report.text import compare_text, summary_text

    s = analyse_path(str(shared_data("cuda-snapshots", "lm-step-user-metadata.pickle")))
    text, cells = visible(render_report(s))
    assert raw_words(text, cells) == []
    term = summary_text(s)
    assert raw_words(term) == [] and "CUDA memory snapshot" in term and "unknown (no inventory)" in term, term
    a = analyse_path(str(shared_data("gpu-traces", "param-dlrm-8rank-v100")))
    b = analyse_path(str(shared_data("gpu-traces", "hta-nccl-2rank-a100")))
    c = compare_analyses([a, b], allow_different_models=True)
    text, cells = visible(render_compare(c))
    assert raw_words(text, cells) == []
    term = compare_text(c)
    assert raw_words(term) == [], term
    assert all(str(lab) in term for lab in c.labels)          # run names whole (it cut "param-dlrm-8rank-v100 (ddp")


def test_the_word_scan_finds_raw_words():
    """The scan flags what the issue saw, and leaves words and trace names alone."""
    assert len(raw_words("strategy - (-), Psi -, world size ?;")) == 3
    bad = raw_words("the legend says unsharded_grad, stage None, nan", ["-"])
    assert "unsharded_grad" in bad and "None" in bad and "nan" in bad and "-" in bad
    assert raw_words("gloo:all_gather, FSDP::post_backward_reduce (layers.1), measured - formula, 3.66 M") == []


@pytest.mark.slow
def test_recorded_runs_pages_agree_and_speak_words(recorded_run, tmp_path):
    """The demo-like pages of recorded runs (FULL_SHARD and DDP on 2 ranks): every number shown twice is shown
    equal (exposed communication in At a glance and the finding, step time in At a glance and Overview, the peak
    in At a glance and the peak formula), and the report, compare and what-if pages and texts are in words."""
    from fsdpprof.analyze.compare.runs import compare_analyses
    from fsdpprof.commands.report import analyse_path
    from fsdpprof.commands.whatif import text as whatif_text
    from fsdpprof.report.compare_page import render_compare
    from fsdpprof.report.run_page import render_report
    from fsdpprof.report.text import compare_text, summary_text
    from fsdpprof.report.whatif import render_whatif

    runs = [analyse_path(str(recorded_run(s))) for s in ("ddp", "fsdp2")]
    for a in runs:
        html = render_report(a)
        n = _same_numbers_shown(html)
        assert {"glance_step", "overview_step", "glance_peak", "memory_peak"} <= set(n), n
        text, cells = visible(html)
        assert raw_words(text, cells) == [], a.path
        assert raw_words(summary_text(a)) == []
        if getattr(a, "whatif", None):
            text, cells = visible(render_whatif(a.whatif))
            assert raw_words(text, cells) == []
            assert raw_words(whatif_text(a.whatif, "run")) == []
    c = compare_analyses(runs)
    text, cells = visible(render_compare(c))
    assert raw_words(text, cells) == []
    assert raw_words(compare_text(c)) == []
