"""What the report says and how: column words with units, trace names shortened with the full name kept,
FSDP units in the model's order, lanes named from the trace's thread names, the headline's numbers."""
from __future__ import annotations

import re

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
