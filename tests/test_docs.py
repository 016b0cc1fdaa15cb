"""The docs' pointers lead somewhere: a section named in a comment, docstring or doc (`README: "Math"`,
`docs/gpu.md, "Weight sync"`) is a heading of that file, and a markdown link to a file names one that exists."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# README: "Title", or README.md / docs/<name>.md then ", " or ": " and a quoted title, or a bare capitalised one and `)`
SECTION = re.compile(r'(README(?:\.md)?|docs/[\w-]+\.md)[:,] (?:"([^"]+)"|([A-Z][\w -]+?)\))')
LINK = re.compile(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)")


def tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z", *patterns], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / p for p in out.stdout.split("\0") if p and (ROOT / p).is_file()]


def headings(doc: Path) -> list[str]:
    return [line.lstrip("#").strip().lower() for line in doc.read_text().splitlines() if line.startswith("#")]


def section_references(text: str) -> list[tuple[str, str]]:
    """(file, section title) of every section reference in `text`."""
    found = [(m[1] if m[1].endswith(".md") else "README.md", m[2] or m[3]) for m in SECTION.finditer(text)]
    return [(doc, re.sub(r"\s+(#\s*)?", " ", title)) for doc, title in found]  # a title wrapped over lines


def test_section_references_are_found_as_written():
    text = 'see README: "Math"; (docs/gpu.md, "Weight\n  # sync") and (README: LoRA) but not README: `make run`'
    assert section_references(text) == [("README.md", "Math"), ("docs/gpu.md", "Weight sync"), ("README.md", "LoRA")]


def test_every_section_a_file_points_to_is_a_heading_there():
    files = [p for p in tracked("*.py", "*.md", "*.yaml", "Makefile", "*.toml", "*.cfg") if p.name != "test_docs.py"]
    found, missing = 0, []
    for path in files:
        for doc, title in section_references(path.read_text(errors="replace")):
            found += 1
            if not (ROOT / doc).is_file() or not any(title.lower() in h for h in headings(ROOT / doc)):
                missing.append(f"{path.relative_to(ROOT)}: {doc}, {title!r}")
    assert found >= 5  # the pattern still finds the references the code has
    assert missing == [], "sections named but not headings of their file:\n" + "\n".join(missing)


def test_every_markdown_link_to_a_file_resolves():
    broken = [
        f"{md.relative_to(ROOT)}: {target}"
        for md in tracked("*.md")
        for target in LINK.findall(md.read_text())
        if not (md.parent / target).exists()
    ]
    assert broken == []
