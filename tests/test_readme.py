"""The README is a front door a newcomer reads in two minutes, and the docs stay inside the repository.

What is checked (issue 35):

- README.md says what tlt does and for whom in its first paragraph, which ends within the first 10
  lines and names the training it speeds up (GRPO), how (speculative decoding) and its users
  ("for people who ...").
- The first code block of README.md is the two commands, each under a one-line comment: command 1
  installs with the tested set (`-c tlt_cli/constraints.txt`) and runs the bundled default recipe;
  command 2 is, byte for byte, the line `.ci/run` runs after "# README command 2:". Both lie within
  the first 12 lines.
- The Status table has the columns part / built / ran on / headline figure and no cell over 160
  characters.
- The Layout section names every package directory under tlt_cli/ (a directory with __init__.py) as
  `tlt_cli/<name>/`. It may name a package another branch is adding; it may not leave one out.
- No link leaves the repository. In README.md, BENCHMARKS.md and docs/*.md every markdown link
  (inline `[text](target)` and reference `[id]: target`) points at a file of this repository, and
  an anchor at a heading of that file; a link to http(s) or an absolute path is refused, and so is
  a path written in backticks that climbs out of the repository (`../shared/DESIGN.md`). tlt's own
  documentation lives here; external work (the TLT paper, SGLang, TRL) is cited by name in plain
  text, never as a link.
- BENCHMARKS.md opens with a headline table (claim, figure, machine, commit, section) before any
  measured section, and a section that says it measured the previous built-in model is marked
  **Superseded** right under its heading.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BENCHMARKS = ROOT / "BENCHMARKS.md"
DOCUMENTS = [README, BENCHMARKS, *sorted((ROOT / "docs").glob("*.md"))]
STATUS_COLUMNS = ["part", "built", "ran on", "headline figure"]
HEADLINE_COLUMNS = ["claim", "figure", "machine", "commit", "section"]
LONGEST_STATUS_CELL = 160

INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
REFERENCE_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(\S+)", re.MULTILINE)
BACKTICKED_PATH = re.compile(r"`(\.\./[^`\s]+)`")


def without_code_blocks(text: str) -> str:
    """The text with every fenced code block blanked (its lines kept empty, so line numbers hold)."""
    lines, inside = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            inside = not inside
            lines.append("")
        else:
            lines.append("" if inside else line)
    return "\n".join(lines)


def code_blocks(text: str) -> list[tuple[int, list[str]]]:
    """Each fenced code block as (line number of its first content line, its lines)."""
    blocks, current, start = [], None, 0
    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith("```"):
            if current is None:
                current, start = [], number + 1
            else:
                blocks.append((start, current))
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def section(text: str, heading: str) -> str:
    """The body of the level-2 section `## heading`, up to the next level-2 heading."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert match, f"no section '## {heading}'"
    return match.group(1)


def table_rows(text: str) -> list[list[str]]:
    """The first markdown table in `text`: header and body rows as lists of cells (separator left out)."""
    table_lines = []
    for line in text.splitlines():
        if line.startswith("|"):
            table_lines.append(line)
        elif table_lines:
            break
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in table_lines]
    return [row for row in rows if not all(set(cell) <= set("-: ") for cell in row)]


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", lambda match: match.group(1) or "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, seen = set(), {}
    for line in without_code_blocks(path.read_text()).splitlines():
        match = re.match(r"#{1,6} (.+)", line)
        if match:
            anchor = github_anchor(match.group(1))
            count = seen.get(anchor, 0)
            found.add(anchor if count == 0 else f"{anchor}-{count}")
            seen[anchor] = count + 1
    return found


def link_problem(document: Path, target: str) -> str | None:
    """Why `target`, linked from `document`, does not stay inside the repository (None when it does)."""
    if re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("/"):
        return "points outside the repository"
    path_part, _, anchor = target.partition("#")
    linked = (document.parent / path_part).resolve() if path_part else document
    if not linked.is_relative_to(ROOT):
        return "climbs out of the repository"
    if not linked.exists():
        return "names a file the repository does not have"
    if anchor and linked.suffix == ".md" and anchor not in anchors(linked):
        return f"names an anchor {linked.name} has no heading for"
    return None


def test_the_purpose_comes_first():
    lines = README.read_text().splitlines()
    assert lines[0].startswith("# ")
    paragraph_end = lines.index("", 2)
    paragraph = " ".join(lines[2:paragraph_end])
    assert paragraph_end <= 10, "the first paragraph must end within the first 10 lines"
    for needed in ("GRPO", "specul", "for people who"):
        assert needed in paragraph, f"the first paragraph does not say {needed!r}"


def test_the_first_code_block_is_the_two_commands_ci_runs():
    readme = README.read_text()
    start, block = code_blocks(readme)[0]
    assert [line.startswith("# ") for line in block] == [True, False, True, False], block
    command_1, command_2 = block[1], block[3]
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert command_2 == ci_lines[ci_lines.index("# README command 2:") + 1]
    assert "pip install -c tlt_cli/constraints.txt" in command_1
    assert command_1.endswith("tlt train recipes/tiny-cpu.yaml")
    assert start + len(block) - 1 <= 12, "both commands must lie within the first 12 lines"


def test_the_status_table_is_short():
    rows = table_rows(section(README.read_text(), "Status"))
    assert rows[0] == STATUS_COLUMNS
    assert len(rows) > 5
    for row in rows[1:]:
        assert len(row) == len(STATUS_COLUMNS), row
        for cell in row:
            assert len(cell) <= LONGEST_STATUS_CELL, f"a Status cell of {len(cell)} characters: {cell}"


def test_the_layout_names_every_package():
    layout = section(README.read_text(), "Layout")
    packages = sorted(folder.name for folder in (ROOT / "tlt_cli").iterdir() if (folder / "__init__.py").is_file())
    assert "engine" in packages and "speculative" in packages
    missing = [name for name in packages if f"tlt_cli/{name}/" not in layout]
    assert not missing, f"the README's Layout does not name {missing}"


def test_no_link_leaves_the_repository():
    problems = []
    for document in DOCUMENTS:
        text = without_code_blocks(document.read_text())
        targets = INLINE_LINK.findall(text) + REFERENCE_DEFINITION.findall(text)
        for target in targets:
            problem = link_problem(document, target)
            if problem:
                problems.append(f"{document.relative_to(ROOT)}: {target} {problem}")
        for path in BACKTICKED_PATH.findall(text):
            if not (document.parent / path).resolve().is_relative_to(ROOT):
                problems.append(f"{document.relative_to(ROOT)}: `{path}` climbs out of the repository")
    assert not problems, "\n".join(problems)


def test_the_link_check_can_fail(tmp_path):
    assert link_problem(README, "https://example.org/tlt") == "points outside the repository"
    assert link_problem(README, "../shared/DESIGN.md") == "climbs out of the repository"
    assert link_problem(README, "docs/missing.md") == "names a file the repository does not have"
    assert link_problem(README, "BENCHMARKS.md#no-such-heading") == "names an anchor BENCHMARKS.md has no heading for"
    assert link_problem(README, "BENCHMARKS.md#headline-figures") is None
    assert github_anchor("T=0.7 on a quiet machine, B=1 (issue 20)") == "t07-on-a-quiet-machine-b1-issue-20"


def test_benchmarks_open_with_a_headline_table():
    text = BENCHMARKS.read_text()
    first_section = re.search(r"^## (.+)$", text, re.MULTILINE).group(1)
    assert first_section == "Headline figures"
    rows = table_rows(section(text, "Headline figures"))
    assert rows[0] == HEADLINE_COLUMNS
    assert len(rows) > 5
    for row in rows[1:]:
        assert len(row) == len(HEADLINE_COLUMNS), row
        assert re.fullmatch(r"[0-9a-f]{7,40}", row[3]), f"not a commit: {row[3]}"
        assert INLINE_LINK.search(row[4]), f"no link to a section: {row[4]}"


def test_sections_measuring_the_previous_model_are_marked_superseded():
    parts = re.split(r"^(#{2,3} .+)$", without_code_blocks(BENCHMARKS.read_text()), flags=re.MULTILINE)
    unmarked = [
        heading
        for heading, body in zip(parts[1::2], parts[2::2])
        if "Measured on the previous built-in model" in body and not body.lstrip().startswith("> **Superseded**")
    ]
    assert not unmarked, f"not marked superseded: {unmarked}"
