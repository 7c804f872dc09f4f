"""Every numeric option of every command has a range (fsdpprof.options): a value too small, too large or not a
number is refused by the parser in one line, exit 2, naming the range; both ends of the range are accepted."""
from __future__ import annotations

import argparse

import pytest

from fsdpprof import cli, options

# the numeric options of each command (a new one must be added here, with a range in fsdpprof.options)
NUMERIC = {
    "record": {"--skip-steps", "--warmup-steps", "--active-steps", "--max-memory-entries", "--ranks"},
    "report": {"--workers", "--max-trace-bytes", "--max-memory", "--connect-timeout"},
    "compare": {"--rank", "--workers", "--connect-timeout"},
    "overlap": {"--workers", "--max-trace-bytes", "--max-memory", "--connect-timeout"},
    "plan": {"--params", "--world", "--shard-group", "--compression", "--gpu-mem"},
    "whatif": {"--world", "--shard-group", "--ranks-per-host", "--batch-scale", "--reshard-after-forward", "--workers",
               "--connect-timeout"},
    "demo": {"--nproc"},
    "timeline": {"--workers", "--max-trace-bytes", "--max-memory", "--ranks", "--steps"},
}
BASE = {  # a command line that parses, before the option under test
    "record": [], "report": ["RUN"], "compare": ["A", "B"], "overlap": ["RUN"],
    "plan": ["--params", "7B", "--world", "8"], "whatif": ["RUN"], "demo": [],
    "timeline": ["RUN"],
}
TAIL = {"record": ["--", "true"]}
SPECIAL_TYPES = (options.ranks_list, options.reshard_after_forward, options.steps_list)


def _numeric_actions():
    parser = cli.build_parser()
    for cmd, sub in parser.commands.items():
        for action in sub._actions:
            if action.option_strings and (isinstance(action.type, options.Number) or action.type in SPECIAL_TYPES):
                yield cmd, action.option_strings[-1], action


def _number_cases():
    for cmd, opt, action in _numeric_actions():
        n = action.type
        if not isinstance(n, options.Number):
            continue
        small = n.lo - 1 if n.whole or n.lo == 0 else n.lo / 2
        large = n.hi * 10 if n.whole else n.hi * 1.5
        for kind, value in (("small", small), ("large", large), ("nan", "abc")):
            yield pytest.param(cmd, opt, n, kind, str(value), id=f"{cmd}{opt}-{kind}")


def _refused(capsys, argv) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_every_numeric_option_has_a_range():
    found: dict[str, set] = {}
    for cmd, opt, _ in _numeric_actions():
        found.setdefault(cmd, set()).add(opt)
    assert found == NUMERIC
    for cmd, sub in cli.build_parser().commands.items():   # no bare int/float: each number goes through options
        assert not [a.dest for a in sub._actions if a.type in (int, float)], cmd


@pytest.mark.parametrize("cmd,opt,number,kind,value", list(_number_cases()))
def test_out_of_range_is_one_line_exit_2_naming_the_range(capsys, cmd, opt, number, kind, value):
    line = _refused(capsys, [cmd, *BASE[cmd], opt, value, *TAIL.get(cmd, [])])
    assert line.startswith(f"fsdpprof {cmd}: error: argument {opt}: "), line
    assert number.describe() in line, line
    assert {"small": "is too small", "large": "is too large", "nan": "is not a number"}[kind] in line, line


@pytest.mark.parametrize("cmd,opt,number", [(c, o, a.type) for c, o, a in _numeric_actions()
                                             if isinstance(a.type, options.Number)])
def test_both_ends_of_each_range_are_accepted(cmd, opt, number):
    sub = cli.build_parser([cmd]).commands[cmd]
    dest = next(a.dest for a in sub._actions if opt in a.option_strings)
    for value in (number.lo, number.hi):
        args, _ = sub.parse_known_args([*BASE[cmd], opt, str(value), *TAIL.get(cmd, [])])
        assert getattr(args, dest) == value


@pytest.mark.parametrize("cmd,argv,words", [
    ("record", ["--ranks", ""], ["--ranks", "'all' or comma-separated ranks", "from 0 to 9999999"]),
    ("record", ["--ranks", "0,,1"], ["--ranks", "not a list of ranks"]),
    ("record", ["--ranks", "-1"], ["--ranks", "from 0 to 9999999"]),
    ("record", ["--ranks", "10000000"], ["--ranks", "from 0 to 9999999"]),
    ("whatif", ["--reshard-after-forward", "maybe"], ["is not a number", "true, false or a whole number from 1"]),
    ("whatif", ["--reshard-after-forward", "1e8"], ["is too large", "true, false or a whole number from 1"]),
    ("whatif", ["--reshard-after-forward", "2.5"], ["is not a whole number"]),
])
def test_list_and_word_options(capsys, cmd, argv, words):
    line = _refused(capsys, [cmd, *BASE[cmd], *argv, *TAIL.get(cmd, [])])
    for w in words:
        assert w in line, line


@pytest.mark.parametrize("value,words", [("-1", ["too small"]), ("1e13", ["too large"]), ("last", ["not first"]),
                                         ("2.5", ["not a whole number"])])
def test_compare_iteration_step_range(capsys, value, words):
    """--iteration N is checked by compare before any run is read (the runs here do not exist)."""
    assert cli.main(["compare", "A", "B", "--iteration", value]) == 2
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and options.STEP_NUMBER.describe() in line, line
    for w in words:
        assert w in line, line


def test_record_values_reach_the_run_options():
    sub = cli.build_parser(["record"]).commands["record"]
    args, _ = sub.parse_known_args(["--ranks", "3, 1", "--warmup-steps", "1e3", "--", "true"])
    assert args.ranks == [1, 3] and args.warmup_steps == 1000
    assert sub.parse_known_args(["--ranks", "ALL"])[0].ranks is None


def test_sizes_take_units():
    assert options.TRACE_BYTES("8GiB") == 8 * 2**30 and options.TRACE_BYTES("1_000") == 1000
    with pytest.raises(argparse.ArgumentTypeError, match="unknown unit"):
        options.TRACE_BYTES("8 parsecs")
