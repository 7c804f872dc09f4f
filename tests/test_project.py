"""Project-level guarantees: README's commands, CI calling them, and the one-way data flow."""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

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


README_LINES_MAX = 200
DOC_PAGES = ("recording.md", "run-directory.md", "reading.md", "metrics.md", "whatif-model.md", "architecture.md")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _relative_links(path: Path) -> list[str]:
    """Targets of the Markdown links and images of ``path`` that are not URLs."""
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", path.read_text()) if not re.match(r"[a-z]+:", t)]


def test_readme_is_short_and_links_every_doc_page():
    text = (ROOT / "README.md").read_text()
    assert text.count("\n") <= README_LINES_MAX, "README is for users: the details go to docs/"
    links = _relative_links(ROOT / "README.md")
    assert [p for p in DOC_PAGES if f"docs/{p}" not in links] == []
    assert any(t.startswith("reports/screenshots/") and t.endswith(".png") for t in links), "a screenshot of the report"


def test_links_of_readme_and_docs_resolve():
    """Every relative link (and image) of README.md and docs/*.md names a file that exists, and an anchor
    (#section) a heading of that page."""
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in _relative_links(page):
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and dest.suffix == ".md":
                headings = {_anchor(h) for h in re.findall(r"^#+ (.*)$", dest.read_text(), re.M)}
                if anchor not in headings:
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []


def test_readme_python_api_imports():
    """The Python API README documents exists: every name its code blocks import, and every name it lists
    as exported by fsdpprof.analyze."""
    import importlib

    text = (ROOT / "README.md").read_text()
    missing = []
    for block in re.findall(r"```python\n(.*?)```", text, re.S):
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "fsdpprof":
                module = importlib.import_module(node.module)
                missing += [f"{node.module}.{a.name}" for a in node.names if not hasattr(module, a.name)]
            elif isinstance(node, ast.Import):
                for a in node.names:
                    importlib.import_module(a.name)
    exports = re.search(r"`fsdpprof\.analyze` also exports (.*?)\.\n", text, re.S)
    assert exports, "README lists the other names fsdpprof.analyze exports"
    analyze = importlib.import_module("fsdpprof.analyze")
    names = re.findall(r"`(\w+)`", exports.group(1))
    assert len(names) >= 5
    missing += [f"fsdpprof.analyze.{n}" for n in names if not hasattr(analyze, n)]
    assert missing == []


def _imported_modules(path: Path) -> set[str]:
    """Every name an import statement of ``path`` names, anywhere in it (in a function too): ``import a.b``
    -> a.b; ``from a import b`` -> a and a.b (b may be a module: ``from fsdpprof import analyze``); a relative
    import resolved against the file's package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(ROOT).parent.parts)
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
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


def test_the_layering_check_sees_every_form_of_import(tmp_path, monkeypatch):
    """The two checks above catch ``from fsdpprof import report``, a relative import and a lazy one."""
    fake = tmp_path / "fsdpprof" / "collect"
    fake.mkdir(parents=True)
    (fake / "a.py").write_text("from fsdpprof import report\n")
    (fake / "b.py").write_text("from ..analyze import run\n")
    (fake / "c.py").write_text("def f():\n    import pandas\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert sorted(_violations("collect", ("fsdpprof.analyze", "fsdpprof.report", "pandas"))) == [
        "fsdpprof/collect/a.py imports fsdpprof.report", "fsdpprof/collect/b.py imports fsdpprof.analyze",
        "fsdpprof/collect/b.py imports fsdpprof.analyze.run", "fsdpprof/collect/c.py imports pandas"]


def test_ci_builds_a_fresh_virtual_environment_before_the_tests():
    """Nothing installed by hand may make CI green: .ci/run creates a new venv, then runs README's command."""
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    test_at = lines.index(_readme_commands()[1])
    before = "\n".join(lines[:test_at])
    assert re.search(r"rm -rf \"?\$VENV\"?", before) and re.search(r"-m venv \"?\$VENV\"?", before)
    assert re.search(r"\. \"?\$VENV\"?/bin/activate", before)


# import name -> distribution name, where the two differ and the package may not be installed here
_IMPORT_TO_DIST = {"hta": {"holistictraceanalysis", "traceinsight"}, "yaml": {"pyyaml"}, "PIL": {"pillow"},
                   "sklearn": {"scikit-learn"}, "dask": {"dask"}, "distributed": {"distributed", "dask"},
                   "pynvml": {"nvidia-ml-py", "pynvml"}}


def _declared_distributions() -> set[str]:
    import tomllib

    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(proj.get("dependencies", []))
    for extra in (proj.get("optional-dependencies") or {}).values():
        reqs += extra
    names = set()
    for r in reqs:
        name = re.split(r"[ <>=!~\[;]", r.strip(), maxsplit=1)[0]
        names.add(re.sub(r"[-_.]+", "-", name).lower())
    return names


def _third_party_imports() -> dict[str, set[str]]:
    """top-level module -> files importing it, over fsdpprof/, tests/ and benchmarks/ (absolute imports)."""
    import sys

    own = {"fsdpprof", "conftest"} | {p.stem for p in (ROOT / "tests").glob("*.py")} | \
        {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    found: dict[str, set[str]] = {}
    for folder in ("fsdpprof", "tests", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for module in _imported_modules(path):
                top = module.split(".")[0]
                if top in sys.stdlib_module_names or top in own or top == "__future__":
                    continue
                found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_third_party_import_is_declared_in_pyproject():
    """A package installed by hand makes a local run green and a fresh machine red (it happened with orjson)."""
    from importlib import metadata

    declared = _declared_distributions()
    dist_of = metadata.packages_distributions()
    undeclared = []
    for top, files in sorted(_third_party_imports().items()):
        dists = {re.sub(r"[-_.]+", "-", d).lower() for d in dist_of.get(top, [])} | _IMPORT_TO_DIST.get(top, set())
        if not dists:
            dists = {top.lower().replace("_", "-")}   # not installed here: its import name is our best guess
        if not dists & declared:
            undeclared.append(f"{top} (imported by {', '.join(sorted(files)[:3])})")
    assert not undeclared, "imported but not declared in pyproject.toml: " + "; ".join(undeclared)


def test_the_core_works_without_hta(tmp_path):
    """HTA is an extra (fsdpprof[hta]): a report on a real GPU trace needs none of it, --hta says what to install."""
    import subprocess
    import sys

    from conftest import shared_data

    trace = shared_data("gpu-traces", "hta-nccl-2rank-a100", "rank-0.json.gz")
    code = ("import sys; sys.modules['hta'] = None\n"          # any `import hta` now fails
            "from fsdpprof.cli import main\n"
            f"sys.exit(main(['report', {str(trace)!r}, '-o', {str(tmp_path / 'r.html')!r}]))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert (tmp_path / "r.html").exists() and "Temporal breakdown of device time" in (tmp_path / "r.html").read_text()
    code = code.replace("'-o'", "'--hta', '-o'").replace("r.html", "r2.html")
    code = code.replace("sys.modules['hta'] = None", "import importlib.util as u; u.find_spec = lambda n, *a: None")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "pip install 'fsdpprof[hta]'" in p.stderr and p.stderr.count("\n") == 1, p.stderr


def test_the_public_api_imports():
    """Every name of the public API (``from fsdpprof.analyze import ...``) resolves to where it is defined; the
    flat module names of fsdpprof 0.1 (``fsdpprof.analyze.overlap`` ...) are gone, with no alias left."""
    import importlib

    import fsdpprof.analyze as api

    for name in api.__all__:
        assert getattr(api, name) is getattr(importlib.import_module(api._API[name]), name)
    for old in ("overlap", "schema", "analysis", "rundata", "msgspec_import", "comm.quick", "trace.rules"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"fsdpprof.analyze.{old}")
