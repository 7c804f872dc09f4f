"""Project-level guarantees: README's commands, CI calling them, and the one-way data flow."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```(?:bash|sh)?\n(.*?)```", text, re.S)
    assert block, "README.md must open with a code block of set-up commands"
    return [line.strip() for line in block.group(1).splitlines() if line.strip()]


def test_readme_opens_with_two_setup_commands():
    text = (ROOT / "README.md").read_text()
    first_block_at = text.index("```")
    assert text[:first_block_at].count("\n") <= 2, "the commands come first, before any prose"
    commands = _readme_commands()
    assert len(commands) == 2
    demo, tests = commands
    assert demo.startswith("pip install torch==2.13.0") and demo.endswith("fsdpprof demo")
    assert "pytest" in tests and tests.startswith("pip install torch==2.13.0")


def test_ci_runs_exactly_the_readme_test_command():
    test_command = _readme_commands()[1]
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_command in ci_lines


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _violations(package: str, forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    for path in sorted((ROOT / "fsdpprof" / package).rglob("*.py")):
        for module in _imported_modules(path):
            if module.startswith(forbidden):
                bad.append(f"{path.relative_to(ROOT)} imports {module}")
    return bad


def test_collect_imports_neither_analyze_nor_report_nor_pandas():
    assert _violations("collect", ("fsdpprof.analyze", "fsdpprof.report", "pandas", "plotly")) == []


def test_analyze_does_not_import_report():
    assert _violations("analyze", ("fsdpprof.report",)) == []
