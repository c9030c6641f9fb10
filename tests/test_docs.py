"""The README and docs/ say what the code does: their blocks run, their commands parse, their links
lead somewhere.

Every ```python block runs on the CPU, unless a `<!-- no-run: REASON -->` line precedes it (it
needs CUDA, or it is a fragment); those are compiled and every ``autofuse`` name they import or
use must resolve. Every ``autofuse ...`` line of a ```bash block is parsed by the CLI's own
parser, so a renamed flag fails here, and the problem it names must exist. The README's
laptop example (the two blocks tagged `<!-- cpu-example -->`) runs as written, with fewer trials.
"""

from __future__ import annotations

import ast
import importlib
import re
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PLUGIN_EXAMPLE = ROOT / "examples" / "autofuse-plugin-example" / "src"
PLUGIN_MODULES = "autofuse_plugin_example.matmul_sigmoid_sum,autofuse_plugin_example.row_chunked"
TAG = re.compile(r"^<!--\s*([\w-]+)(?::\s*(.*?))?\s*-->$")
# Backticked repository paths are checked too; these are the folders they may start with.
TOP_LEVEL = ("autofuse", "tests", "problems", "variants", "benchmarks", "examples", "docs", ".ci")


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    tag: str | None  # the name of a `<!-- name: ... -->` line right before the fence

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    found, lines, i = [], page.read_text().splitlines(), 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        tag = TAG.match(before)
        found.append(Block(page, i + 1, fence.group(1), "\n".join(lines[i + 1:end]) + "\n",
                           tag.group(1) if tag else None))
        i = end + 1
    return found


ALL = [b for page in PAGES for b in blocks(page)]
PYTHON = [b for b in ALL if b.lang == "python"]
BASH = [b for b in ALL if b.lang == "bash"]


def test_the_pages_exist():
    expected = ["autograd", "benchmarks", "cli", "contributing", "kernelbench", "kernels", "plugins", "precision",
                "table", "tuning"]
    assert [p for p in expected if not (ROOT / "docs" / f"{p}.md").exists()] == []


def test_the_readme_reads_in_ten_minutes():
    lines = (ROOT / "README.md").read_text().splitlines()
    long = [(n, len(line)) for n, line in enumerate(lines, 1) if len(line) > 100]
    assert len(lines) <= 250, f"README.md must have <= 250 lines, got {len(lines)}"
    assert long == [], f"README.md lines must be <= 100 characters, got (line, length) {long}"


def test_the_quick_start_is_what_ci_runs():
    """`.ci/run` runs the lines between the markers that are neither a comment nor a fence."""
    text = (ROOT / "README.md").read_text()
    section = re.search(r"<!-- quickstart:begin -->\n(.*?)<!-- quickstart:end -->", text, re.S)
    assert section, "README.md must keep the <!-- quickstart:begin/end --> markers .ci/run reads"
    commands = [line for line in section.group(1).splitlines() if not line.startswith(("<!--", "```"))]
    assert commands == ['python3 -m pip install "torch==2.13.0" -e ".[test]"', "python3 -m pytest -q"]


def test_no_lab_diary():
    """Reference pages cite tests, benchmarks and docs, not numbered runs or dated logs."""
    diary = re.compile(r"tests/device|NOTES\.md|\bsession\b|\blog \d{4}-\d\d-\d\d|logs/\d{4}-")
    hits = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in PAGES
            for n, line in enumerate(p.read_text().splitlines(), 1) if diary.search(line)]
    assert hits == []


def test_every_gpu_script_is_in_its_readme():
    """benchmarks/gpu/README.md is where a GPU check worth rerunning is found: each script has a row."""
    folder = ROOT / "benchmarks" / "gpu"
    listed = set(re.findall(r"^\| `([\w.-]+)` \|", (folder / "README.md").read_text(), re.M))
    scripts = {p.name for p in folder.iterdir() if p.suffix in (".py", ".sh")}
    assert sorted(scripts - listed) == [], "scripts without a row in benchmarks/gpu/README.md"
    assert sorted(listed - scripts) == [], "rows in benchmarks/gpu/README.md naming no script"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.*)$", text, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_somewhere(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file}")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.name}")
    assert broken == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_backticked_paths_exist(page):
    missing = []
    for path in re.findall(r"`([\w.-]+/[^`\s]*)`", page.read_text()):
        if path.split("/")[0] not in TOP_LEVEL or re.search(r"[<*{]", path):
            continue
        if not (ROOT / path.rstrip("/")).exists():
            missing.append(path)
    assert missing == []


def _unresolved(names) -> list[str]:
    """Each of ``names`` (dotted autofuse names) that does not resolve, with why."""
    unresolved = []
    for name in sorted(names):
        try:
            _resolve(name)
        except (ImportError, AttributeError) as exc:
            unresolved.append(f"{name}: {exc}")
    return unresolved


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_backticked_autofuse_names_exist(page):
    """`autofuse.serve.tune_on_miss.TuneOnMiss(...)` in prose must name something real."""
    prose = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    names = {name for span in re.findall(r"`([^`]+)`", prose)
             for name in re.findall(r"(?<![\w/.-])autofuse(?:\.\w+)+", span)}
    assert _unresolved(names) == []


@pytest.fixture
def example_plugin(monkeypatch):
    """The plugin example registered (docs/plugins.md tunes its problem), `compiled` not blocked."""
    from autofuse.core import plugins

    monkeypatch.syspath_prepend(str(PLUGIN_EXAMPLE))
    monkeypatch.setenv("AUTOFUSE_PLUGINS", PLUGIN_MODULES)
    monkeypatch.setenv("AUTOFUSE_BLOCK_PLUGINS", "")
    plugins.reset_plugin_manager()
    yield
    plugins.reset_plugin_manager()


def _resolve(dotted: str):
    """The object a dotted ``autofuse...`` name stands for, importing submodules on the way."""
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 2):
        if hasattr(obj, part):
            obj = getattr(obj, part)
        else:
            obj = importlib.import_module(".".join(parts[:i]))
    return obj


def _autofuse_names(tree: ast.AST) -> list[str]:
    """Every autofuse name the code imports or reaches through ``autofuse.a.b``."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names if a.name.split(".")[0] == "autofuse"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "autofuse":
            names += [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute):
            chain, inner = [node.attr], node.value
            while isinstance(inner, ast.Attribute):
                chain.insert(0, inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id == "autofuse":
                names.append(".".join(["autofuse", *chain]))
    return sorted(set(names))


@pytest.mark.parametrize("block", [b for b in PYTHON if b.tag == "no-run"], ids=lambda b: b.id)
def test_python_blocks_that_need_a_gpu_name_real_things(block, example_plugin):
    tree = compile(block.text, block.id, "exec", ast.PyCF_ONLY_AST)
    assert _unresolved(_autofuse_names(tree)) == []


@pytest.mark.parametrize("block", [b for b in PYTHON if b.tag is None], ids=lambda b: b.id)
def test_python_blocks_run_on_the_cpu(block, monkeypatch, no_file_problems):
    """From the repository root, as the pages say (docs/kernelbench.md names a file by its path)."""
    monkeypatch.chdir(ROOT)
    exec(compile(block.text, block.id, "exec"), {"__name__": "__docs__"})


def _commands(block: Block) -> list[list[str]]:
    """The simple commands of a bash block: continuations joined, split at && ; | and comments."""
    commands = []
    for line in block.text.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        current = []
        for token in lexer:
            if set(token) <= set(";&|()<>"):
                commands.append(current)
                current = []
            else:
                current.append(token)
        commands.append(current)
    # Leading VAR=value assignments belong to the environment, not the command.
    return [c[next((i for i, t in enumerate(c) if not re.match(r"^\w+=", t)), len(c)):] for c in commands if c]


def _autofuse_lines(block: Block) -> list[list[str]]:
    return [c[1:] for c in _commands(block) if c and c[0] == "autofuse"]


def test_bash_blocks_name_autofuse_commands():
    """The parser checks below are not vacuous: the pages do show autofuse commands."""
    assert sum(len(_autofuse_lines(b)) for b in BASH) >= 10


@pytest.mark.parametrize("block", [b for b in BASH if _autofuse_lines(b)], ids=lambda b: b.id)
def test_bash_blocks_parse_with_the_cli(block, example_plugin, capsys):
    from autofuse.cli import _parser
    from autofuse.core.listing import list_variants
    from autofuse.core.registry import get_problem

    wrong = []
    for argv in _autofuse_lines(block):
        try:
            args = _parser().parse_args(argv)
        except SystemExit:
            wrong.append(f"autofuse {shlex.join(argv)}: {capsys.readouterr().err.strip().splitlines()[-1]}")
            continue
        problem = getattr(args, "problem", None)
        if problem and problem.endswith(".py"):
            if not (ROOT / problem).exists():
                wrong.append(f"autofuse {shlex.join(argv)}: no file {problem} in the repository")
        elif problem:
            try:
                name = get_problem(problem).name
            except Exception as exc:
                wrong.append(f"autofuse {shlex.join(argv)}: {exc}")
                continue
            known = {v["name"] for v in list_variants(name)}
            for variant in set(getattr(args, "variants", None) or []) - known:
                wrong.append(f"autofuse {shlex.join(argv)}: {name} has no variant {variant}")
    assert wrong == []


def _cpu_example() -> tuple[Block, Block]:
    tagged = [b for b in ALL if b.page.name == "README.md" and b.tag == "cpu-example"]
    assert [b.lang for b in tagged] == ["bash", "python"], \
        "README.md must tag its laptop example's bash block, then its python block, <!-- cpu-example -->"
    return tagged[0], tagged[1]


@pytest.mark.slow
def test_the_readme_cpu_example_runs(tmp_path, monkeypatch):
    """The laptop example as written, at 2 trials instead of 6 and without torch.compile (the
    suite blocks `compiled`, tests/conftest.py), its table in tmp_path."""
    from autofuse.cli import main

    bash, python = _cpu_example()
    tunes = _autofuse_lines(bash)
    assert [argv[:1] for argv in tunes] == [["tune"]]
    table = re.search(r"--table (\S+)", bash.text).group(1)
    argv = [str(tmp_path / "t.json") if a == table else a for a in tunes[0]]
    argv[argv.index("--trials") + 1] = "2"
    monkeypatch.chdir(tmp_path)
    start = time.perf_counter()
    assert main([*argv, "--no-progress"]) == 0
    namespace = {"__name__": "__docs__"}
    exec(compile(python.text.replace(table, str(tmp_path / "t.json")), python.id, "exec"), namespace)
    assert namespace["info"]["source"] == "tuned", namespace["info"]
    print(f"the laptop example took {time.perf_counter() - start:.1f} s", file=sys.stderr)
