"""The documentation holds: the README is a short user's page linking every page of docs/, docs/design.md's module
table names every module, docs/configuration.md is the schema's, figures live on docs/benchmarks.md only (one dated
table per figure, each row with its commit, machine and command; no commit hash or timing in the README, the YAML
comments or the jobs' docstrings), every link to a section of it resolves, and no module docstring is an essay."""

from __future__ import annotations

import ast
import importlib.util
import re

import pytest

from conftest import REPO

DOCS = REPO / "docs"
README = REPO / "README.md"
MAX_README_LINES = 200
MAX_DOCSTRING_LINES = 15
# modules being rewritten by others, whose docstrings still hold their essays: empty this set as each is shortened
# (test_exempt_modules_still_need_it fails for a module that no longer needs its place here)
EXEMPT_UNTIL_REWRITTEN: set[str] = set()  # bench.py and bench_driver.py: now peftune/benchmarks/, short

# a commit named by its hash: 7 to 40 hex digits with at least one letter and one digit (so no plain number or word)
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
# a measured figure: a duration, a matmul rate, a throughput or a speed-up ("1.97x"; not "3 tasks x 400")
TIMING = re.compile(
    r"\b\d[\d,.]*\s*(?:ms|s|secs?|seconds?|mins?|minutes?|h|hrs?|hours?)\b"
    r"|\b\d+m\d+s\b"
    r"|\b(?:about|some|a few|several)\s+(?:seconds|minutes|hours)\b"
    r"|\b\d[\d,.]*\s*(?:[GT]FLOP|tokens/s)"
    r"|\b\d+(?:\.\d+)?x(?!\w)",
    re.IGNORECASE,
)


def figures(text: str) -> list[str]:
    return [m.group(0) for m in COMMIT.finditer(text)] + [m.group(0) for m in TIMING.finditer(text)]


def load_generator():
    spec = importlib.util.spec_from_file_location("docs_configuration", DOCS / "configuration.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------- the regexes themselves


@pytest.mark.parametrize(
    "text",
    ["at 4f48120", "commit eb5dc6b", "56.3 min", "took 146 s", "in 32s", "36.0 ms", "2 minutes", "about 20 min",
     "13m56s", "221 GFLOP/s", "51 TFLOP/s", "94,578 tokens/s", "1.97x", "at 0.73x the", "1,504 s", "in a few minutes"],
)  # fmt: skip
def test_a_figure_is_seen(text):
    assert figures(text), text


@pytest.mark.parametrize(
    "text",
    ["3 tasks x 400 = 1,200", "the embedded 6x384 BERT", "lr 1.0e-3", "1/9, 1/3", "deadbeef", "seed 4294967295",
     "trials_per_method: 5", "max_seconds: null", "after this many seconds", "an adapter's 1e-5", "10% trainable",
     "solo tokens/s", "the GFLOP/s peaks"],
)  # fmt: skip
def test_a_non_figure_is_not(text):
    assert not figures(text), figures(text)


# ----------------------------------------------------------------------------- the README


def test_the_readme_is_a_short_page_with_both_commands_first():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; the rest belongs in docs/"
    blocks = re.findall(r"```bash\n(.*?)```", "\n".join(lines), flags=re.S)
    assert "jobs/sst_tuning.py" in blocks[0], "the README's first code block must stay the main job's command"
    head = "\n".join(lines[:40])
    assert "jobs/sst_tuning.py" in head and 'pytest -q -m "not slow"' in head, "both commands in the first 40 lines"


def test_the_readme_holds_no_commit_hash_or_timing():
    found = figures(README.read_text(encoding="utf-8"))
    assert not found, f"README.md: {found}: measured figures go to docs/benchmarks.md"


def test_every_relative_link_of_the_readme_and_docs_resolves():
    for page in [README, *sorted(DOCS.glob("*.md")), REPO / "CONTRIBUTING.md"]:
        if not page.exists():
            continue
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.name}: link to {target}, which does not exist"


# ----------------------------------------------------------------------------- docs/


def test_the_configuration_reference_is_up_to_date():
    generator = load_generator()
    written = (DOCS / "configuration.md").read_text(encoding="utf-8")
    assert generator.render() == written, f"docs/configuration.md is out of date: run `{generator.COMMAND}`"


def test_the_configuration_reference_names_every_key_of_the_schema():
    generator = load_generator()
    schema = generator.schema()
    written = (DOCS / "configuration.md").read_text(encoding="utf-8")
    keys = set(schema["properties"])
    for section in schema.get("$defs", {}).values():
        keys |= set(section.get("properties", {}))
    assert not {key for key in keys if f"| `{key}` |" not in written}


BENCHMARKS = DOCS / "benchmarks.md"
ARCHIVE = DOCS / "benchmarks-archive.md"
MAX_BENCHMARKS_LINES = 200
DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


def markdown_tables(text: str) -> list[list[list[str]]]:
    """Each table of a Markdown page as its rows of cells (the header first, the separator row left out)."""
    tables, rows = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            if not re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", line.strip()):
                rows.append(re.split(r"\s*\|\s*", line.strip().strip("|").strip()))
        elif rows:
            tables.append(rows)
            rows = []
    return tables


def headings(text: str) -> list[str]:
    return re.findall(r"^#{1,6} (.+?)\s*$", text, flags=re.M)


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def test_the_benchmarks_page_is_a_short_reference_with_its_archive():
    text = BENCHMARKS.read_text(encoding="utf-8")
    assert len(text.splitlines()) < MAX_BENCHMARKS_LINES, "docs/benchmarks.md: the current figures only"
    assert "](benchmarks-archive.md)" in text and ARCHIVE.exists(), "superseded entries go to the archive, linked"


def test_every_figure_on_the_benchmarks_page_has_its_date_commit_machine_and_command():
    """Every table of docs/benchmarks.md gives, for each row, the date, the commit, the machine (one the page
    names, with its matmul peaks in brackets) and the command of the measurement."""
    text = BENCHMARKS.read_text(encoding="utf-8")
    machines = re.findall(r"\*\*([\w-]+)\*\*:", text)
    assert machines, "docs/benchmarks.md names its machines (**name**: what it is)"
    tables = markdown_tables(text)
    assert tables
    for header, *rows in tables:
        columns = {name: header.index(name) for name in ("date", "commit", "command")} | {
            "machine": next((i for i, name in enumerate(header) if name.startswith("machine")), None)
        }
        assert None not in columns.values(), f"a table without its date, commit, machine or command: {header}"
        assert rows, header
        for row in rows:
            cell = {name: row[i] if i < len(row) else "" for name, i in columns.items()}
            assert DATE.match(cell["date"]), f"{row[0]!r}: date {cell['date']!r}"
            assert re.search(r"\b[0-9a-f]{7,40}\b", cell["commit"]), f"{row[0]!r}: commit {cell['commit']!r}"
            assert re.match(rf"({'|'.join(machines)}\b).*\(.+\)", cell["machine"]), (
                f"{row[0]!r}: machine {cell['machine']!r} is none of {machines} with its peaks in brackets"
            )
            assert cell["command"], f"{row[0]!r}: no command"


LINKING = [
    README,
    REPO / "CONTRIBUTING.md",
    REPO / "pyproject.toml",
    *sorted(DOCS.glob("*.md")),
    *sorted((REPO / "jobs").glob("*.py")),
    *sorted((REPO / "platform" / "peftune").rglob("*.py")),
    *sorted((REPO / "analysis").rglob("*.py")),
    *sorted((REPO / "search_spaces").rglob("*.yaml")),
]


def test_every_link_to_a_section_of_the_benchmarks_pages_resolves():
    """``docs/benchmarks.md, "Name"`` (in a comment or docstring) names the start of a heading of that page, and
    ``benchmarks.md#anchor`` (in a page) one of its anchors: a figure moved to the archive takes its link along."""
    sections = {page.name: headings(page.read_text(encoding="utf-8")) for page in (BENCHMARKS, ARCHIVE)}
    broken = []
    for path in LINKING:
        if not path.exists() or path in (BENCHMARKS, ARCHIVE):
            continue
        text = re.sub(r"\s*\n\s*#?\s*", " ", path.read_text(encoding="utf-8"))  # a link may wrap a comment
        for page, name in re.findall(r"(benchmarks(?:-archive)?\.md),? \"([^\"]+)\"", text):
            if not any(heading.startswith(name) for heading in sections[page]):
                broken.append(f"{path.relative_to(REPO)}: {page}, {name!r}")
        for page, anchor in re.findall(r"(benchmarks(?:-archive)?\.md)#([\w-]+)", text):
            if anchor not in {slug(heading) for heading in sections[page]}:
                broken.append(f"{path.relative_to(REPO)}: {page}#{anchor}")
    assert not broken, f"links to sections of the benchmarks pages that do not exist: {broken}"


def test_a_section_link_is_read_as_the_test_reads_it():
    assert slug("The core against the HF Trainer (`peftune bench`)") == "the-core-against-the-hf-trainer-peftune-bench"
    assert slug("Exactness on a CPU at MiniLM's shapes") == "exactness-on-a-cpu-at-minilms-shapes"
    assert markdown_tables("a\n\n| x | y |\n|---|---|\n| 1 | 2 |\n\nb") == [[["x", "y"], ["1", "2"]]]


# ----------------------------------------------------------------------------- the module and page tables


PACKAGE = REPO / "platform" / "peftune"


def module_table() -> set[str]:
    """The names of docs/design.md's module table: the backticked words of the first column of the first table
    after its heading "Modules and layers" (``cli/commands.py``, ``benchmarks/driver.py``, ``methods/`` for a whole
    subpackage)."""
    text = (DOCS / "design.md").read_text(encoding="utf-8")
    section = text[text.index("## Modules and layers") :]
    header, *rows = markdown_tables(section)[0]
    assert header[0] == "module", header
    return {name for row in rows for name in re.findall(r"`([^`]+)`", row[0])}


def package_modules() -> list[str]:
    """Every module of the package, as a path relative to it (``cli/commands.py``, ``methods/lora.py``), but its own
    ``__init__.py``."""
    return sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py") if path != PACKAGE / "__init__.py")


def test_the_design_pages_module_table_names_every_module_of_the_package():
    """A module is named by its path in the package (``sweep/orchestrator.py``, ``benchmarks/driver.py``), or a
    subpackage's modules all at once by its directory (``methods/``); a subpackage's ``__init__.py`` by any row of its
    directory. A row naming no module is stale."""
    names = module_table()
    missing = []
    for module in package_modules():
        folder = module.rsplit("/", 1)[0] + "/" if "/" in module else ""
        covered = module in names or (folder and folder in names)
        if module.endswith("/__init__.py"):
            covered = any(name.startswith(folder) for name in names)
        if not covered:
            missing.append(module)
    assert not missing, f"docs/design.md's module table lacks {missing}: add a row saying what each does"
    stale = [name for name in names if not (PACKAGE / name).exists()]
    assert not stale, f"docs/design.md's module table names {stale}, which are not modules of peftune"


def test_the_readmes_documentation_table_links_every_page_of_docs():
    """The README's table under "## Documentation": its first column's links."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Documentation") :]
    header, *rows = markdown_tables(section)[0]
    linked = {target for row in rows for target in re.findall(r"\]\(([^)#\s]+)\)", row[0])}
    pages = {f"docs/{page.name}" for page in DOCS.glob("*.md")}
    assert not pages - linked, f"the README's documentation table lacks {sorted(pages - linked)}"


# ----------------------------------------------------------------------------- YAML comments and job docstrings


def yaml_comments(path) -> list[tuple[int, str]]:
    """Every comment of a YAML file, with its line number (a ``#`` inside a quoted value is taken as one too:
    a figure there is as wrong)."""
    out = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if "#" in line:
            out.append((number, line[line.index("#") :]))
    return out


SEARCH_SPACES = sorted((REPO / "search_spaces").rglob("*.yaml"))


@pytest.mark.parametrize("path", SEARCH_SPACES, ids=lambda p: str(p.relative_to(REPO)))
def test_yaml_comments_hold_no_commit_hash_or_timing(path):
    found = [(n, figures(c)) for n, c in yaml_comments(path) if figures(c)]
    assert not found, f"{path.name}: {found}: measured figures go to docs/benchmarks.md"


def test_the_yaml_comment_reader_reads_every_block(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text("name: x  # top\nconfirm:  # after the search\n  seeds: 3  # 10 min on 2 cores\nbudgets:  # b\n")
    comments = dict(yaml_comments(path))
    assert sorted(comments) == [1, 2, 3, 4] and figures(comments[3]), "the confirm: block's comments are read too"


JOBS = sorted((REPO / "jobs").glob("*.py"))


@pytest.mark.parametrize("path", JOBS, ids=lambda p: p.name)
def test_job_docstrings_hold_no_commit_hash_or_timing(path):
    found = figures(ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or "")
    assert not found, f"{path.name}: {found}: measured figures go to docs/benchmarks.md"


# ----------------------------------------------------------------------------- module docstrings


def modules():
    return sorted([*(REPO / "platform" / "peftune").rglob("*.py"), *(REPO / "analysis").rglob("*.py")])


def docstring_lines(path) -> int:
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False)
    return len(doc.strip().splitlines()) if doc else 0


def test_no_module_docstring_is_over_15_lines():
    long = {
        str(p.relative_to(REPO)): n
        for p in modules()
        if (n := docstring_lines(p)) > MAX_DOCSTRING_LINES and str(p.relative_to(REPO)) not in EXEMPT_UNTIL_REWRITTEN
    }
    assert not long, f"module docstrings over {MAX_DOCSTRING_LINES} lines: {long}; what they explain goes to docs/"


def test_exempt_modules_still_need_it():
    shortened = {name for name in EXEMPT_UNTIL_REWRITTEN if docstring_lines(REPO / name) <= MAX_DOCSTRING_LINES}
    assert not shortened, f"{shortened}: now short enough; remove them from EXEMPT_UNTIL_REWRITTEN"


# ----------------------------------------------------------------------------- the schema's descriptions


def described(schema, where: str = "") -> dict[str, str]:
    """Every property of a JSON Schema, nested ones and $defs' included: its path -> its description ("": none)."""
    found = {}
    for key, value in schema.items() if isinstance(schema, dict) else enumerate(schema):
        if key == "properties" and isinstance(value, dict):
            found.update({f"{where}{name}": prop.get("description", "") for name, prop in value.items()})
        if isinstance(value, (dict, list)):
            found.update(described(value, where if key == "properties" else f"{where}{key}."))
    return found


@pytest.mark.parametrize("task", [False, True], ids=["sweep", "task"])
def test_every_key_of_the_printed_schema_has_a_meaning_the_reference_shares(task, capsys):
    import json

    from peftune.cli import commands

    assert commands.main(["schema", *(["--task"] if task else [])]) == 0
    printed = capsys.readouterr().out
    meanings = described(json.loads(printed))
    assert len(meanings) >= (19 if task else 60), sorted(meanings)
    assert not [key for key, meaning in meanings.items() if not meaning.strip()], "keys without a description"
    # a key's meaning, word for word, in what `peftune schema` prints and in the generated reference
    meaning = meanings["kind" if task else "$defs.SchedulerSettings.min_steps"]
    assert json.dumps(meaning) in printed
    assert f"| {meaning} |" in (DOCS / "configuration.md").read_text(encoding="utf-8")


def test_a_key_without_a_description_stops_the_generator():
    with pytest.raises(SystemExit) as stop:
        load_generator().table({"surprise": {"type": "integer"}}, [], {}, "search")
    assert str(stop.value) == "search.surprise: no description in the schema; write a docstring under its field"
