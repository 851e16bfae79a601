"""The documentation holds: the README is a short user's page, docs/configuration.md is the schema's, figures live
on docs/benchmarks.md only (no commit hash or timing in the README, the YAML comments or the jobs' docstrings), and
no module docstring is an essay (at most 15 lines)."""

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


def test_the_benchmarks_page_dates_its_entries():
    text = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    recorded = re.findall(r"\*\*Recorded:\*\* (\d{4}-\d{2}-\d{2}), ([0-9a-f]{7,40})", text)
    assert len(recorded) >= 20, "every entry gives the date and commit that recorded it"


# ----------------------------------------------------------------------------- YAML comments and job docstrings


def yaml_comments(path) -> list[tuple[int, str]]:
    """The comments of a YAML file but those inside its top-level ``confirm:`` block (the decision procedure's
    own notes, being rewritten with it)."""
    out, in_confirm = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line and not line[0].isspace() and not line.startswith("#"):
            in_confirm = line.startswith("confirm:")
        if in_confirm or "#" not in line:
            continue
        out.append((number, line[line.index("#") :]))
    return out


SEARCH_SPACES = sorted((REPO / "search_spaces").rglob("*.yaml"))


@pytest.mark.parametrize("path", SEARCH_SPACES, ids=lambda p: str(p.relative_to(REPO)))
def test_yaml_comments_hold_no_commit_hash_or_timing(path):
    found = [(n, figures(c)) for n, c in yaml_comments(path) if figures(c)]
    assert not found, f"{path.name}: {found}: measured figures go to docs/benchmarks.md"


def test_the_yaml_comment_reader_skips_the_confirm_block_only():
    comments = dict(yaml_comments(REPO / "search_spaces" / "sst_tuning.yaml"))
    text = "\n".join(comments.values())
    assert "the embedded" in text and "margin" not in text


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


def test_the_generator_reads_a_fields_comment():
    from peftune import spaces

    assert load_generator().field_comments(spaces.SchedulerSettings).get("min_steps")
