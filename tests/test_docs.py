"""Every `docs/<page>.md#<anchor>` citation in the repository points to an existing page and heading.

Anchors follow GitHub's rules for headings: markup removed, lower case, punctuation other than `-` and `_`
dropped, each space turned into `-`, and repeated headings numbered `-1`, `-2`, ... Links between the pages
inside docs/ (`[text](training.md#muon)`, `[text](#router)`) are checked the same way.
"""

from __future__ import annotations

import os
import re
import subprocess

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
DOCS = "docs"
SCANNED = (".py", ".md", ".sh", ".sbatch", ".toml", ".ipynb", ".txt", ".cfg", ".yaml", ".yml")
SELF = "tests/test_docs.py"
SKIP_DIRS = {".git", ".venv", ".venv-hf", "__pycache__", ".pytest_cache", ".ruff_cache", "runs", "build"}

# docs/page.md or docs/page.md#anchor, not preceded by a path character (so "x/docs/..." is not one).
CITATION = re.compile(r"(?<![\w./-])docs/([\w./-]+?\.md)(?:#([\w-]+))?")
MD_LINK = re.compile(r"\]\(([^)\s#]*)(?:#([^)\s]*))?\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^ {0,3}(```|~~~)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)  # inline code: its text
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline html
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """The anchors of every ATX heading outside fenced code blocks, numbered like GitHub's duplicates."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    fenced = False
    for line in markdown.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def _files(root: str) -> list[str]:
    """Repository files to scan (relative paths): git's tracked and unignored files, else a walk."""
    try:
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=root,
                                capture_output=True, text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        listed = []
        for d, dirs, names in os.walk(root):
            dirs[:] = [x for x in dirs if x not in SKIP_DIRS and not x.endswith(".egg-info")]
            listed += [os.path.relpath(os.path.join(d, n), root) for n in names]
    return sorted(p for p in listed if (p.endswith(SCANNED) or os.path.basename(p) == "Makefile")
                  and os.path.isfile(os.path.join(root, p)))


def broken_citations(root: str = ROOT) -> list[str]:
    """`file:line: target (why)` for every citation or docs-internal link that does not resolve."""
    cache: dict[str, set[str] | None] = {}

    def page_anchors(rel: str) -> set[str] | None:
        if rel not in cache:
            path = os.path.join(root, rel)
            cache[rel] = anchors(open(path, encoding="utf-8").read()) if os.path.isfile(path) else None
        return cache[rel]

    def check(where: str, page: str, anchor: str | None, problems: list[str]):
        found = page_anchors(page)
        target = page + (f"#{anchor}" if anchor else "")
        if found is None:
            problems.append(f"{where}: {target} (no such page)")
        elif anchor and anchor not in found:
            problems.append(f"{where}: {target} (no heading with this anchor)")

    problems: list[str] = []
    for rel in _files(root):
        if rel == SELF:  # its examples and expected messages are not citations
            continue
        try:
            text = open(os.path.join(root, rel), encoding="utf-8").read()
        except UnicodeDecodeError:
            continue
        in_docs = rel.startswith(DOCS + "/") and rel.endswith(".md")
        for n, line in enumerate(text.splitlines(), 1):
            where = f"{rel}:{n}"
            for m in CITATION.finditer(line):
                check(where, os.path.normpath(f"{DOCS}/{m.group(1)}"), m.group(2), problems)
            if not in_docs:
                continue
            for m in MD_LINK.finditer(line):  # links between the docs pages
                target, anchor = m.group(1), m.group(2)
                if re.match(r"[a-z]+:", target) or (target and not target.endswith(".md")):
                    continue  # external, or not a markdown page
                page = os.path.normpath(os.path.join(os.path.dirname(rel), target)) if target else rel
                if page.startswith(DOCS + "/"):
                    check(where, page, anchor or None, problems)
    return problems


def test_every_docs_citation_resolves():
    problems = broken_citations()
    assert not problems, "citations to missing docs pages or headings:\n" + "\n".join(problems)


def test_the_pages_exist():
    for page in ("README.md", "architecture.md", "training.md", "sharding.md"):
        assert os.path.isfile(os.path.join(ROOT, DOCS, page)), page


def test_github_anchor_rules():
    assert slug("Config fields and released values") == "config-fields-and-released-values"
    assert slug("Muon and Explicit sharding") == "muon-and-explicit-sharding"
    assert slug("Group-limited top-k") == "group-limited-top-k"
    assert slug("The `head_dim` field (explicit!)") == "the-head_dim-field-explicit"
    assert slug("Muon + AdamW") == "muon--adamw"  # GitHub keeps both hyphens
    assert anchors("# A\n## A\n```\n# not a heading\n```\n### B ###\n") == {"a", "a-1", "b"}


def test_a_broken_citation_is_reported(tmp_path):
    """The checker fails on a citation to a missing heading, a missing page and a broken docs link."""
    (tmp_path / DOCS).mkdir()
    (tmp_path / DOCS / "page.md").write_text("# Title\n\n## Real heading\n\n[bad](#nope) [good](#title)\n")
    ok, bad_anchor, bad_page = ("docs/" + "page.md#real-heading", "docs/" + "page.md#missing-heading",
                                "docs/" + "absent.md#x")
    (tmp_path / "mod.py").write_text(f"# see {ok}\n# see {bad_anchor}\n# see {bad_page}\n")
    problems = broken_citations(str(tmp_path))
    assert problems == [
        "docs/page.md:5: docs/page.md#nope (no heading with this anchor)",
        "mod.py:2: docs/page.md#missing-heading (no heading with this anchor)",
        "mod.py:3: docs/absent.md#x (no such page)",
    ], problems
