"""The documentation's links point at things that exist.

Every intra-repository link of every tracked Markdown file must name an existing file or folder,
and a ``#anchor`` into a Markdown file must match one of its headings (GitHub's slugs). Paths of
Markdown documents named in the Python and Rust sources (``docs/X.md``, ``ARCHITECTURE.md``) must
exist too. ARCHITECTURE.md must stay a short map (under 40,000 bytes).

Needs a source checkout (the repository beside this file), not the built extension.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

if not (ROOT / "README.md").is_file() or not (ROOT / "ARCHITECTURE.md").is_file():
    pytest.skip("not a source checkout of pstore", allow_module_level=True)

ARCHITECTURE_MAX_BYTES = 40_000

# Directories never searched when git cannot list the tracked files.
_SKIP_DIRS = {".git", "target", "node_modules", "bench-results", "build", "dist"}

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_INLINE_CODE = re.compile(r"(`+)(.+?)\1")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_HTML_ID = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
# A Markdown document named in source: docs/<path>.md, or an upper-case name like FORMAT.md.
_SOURCE_REF = re.compile(r"(?<![\w/.-])((?:docs/[A-Za-z0-9_/.-]+|[A-Z][A-Z0-9_]*)\.md)(?![\w])")


def tracked(*patterns: str) -> list[Path]:
    """The repository's tracked files matching the glob patterns (a walk if git is missing)."""
    git = shutil.which("git")
    if git is not None and (ROOT / ".git").exists():
        out = subprocess.run(
            [git, "-C", str(ROOT), "ls-files", "-z", "--", *patterns],
            capture_output=True,
            check=False,
        )
        if out.returncode == 0:
            names = [n for n in out.stdout.decode().split("\0") if n]
            return sorted(ROOT / n for n in names if (ROOT / n).is_file())
    found: set[Path] = set()
    for pattern in patterns:
        for p in ROOT.rglob(pattern.lstrip("*/") if pattern.startswith("*") else pattern):
            rel = p.relative_to(ROOT)
            if p.is_file() and not _SKIP_DIRS.intersection(rel.parts[:-1]):
                found.add(p)
    return sorted(found)


def prose_lines(text: str) -> list[tuple[int, str]]:
    """The lines of a Markdown text outside fenced code blocks, numbered from 1."""
    out = []
    fence = ""
    for no, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if fence:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
                fence = ""
            continue
        if m:
            fence = m.group(1)
            continue
        out.append((no, line))
    return out


def _plain(text: str) -> str:
    """Markdown outside code as GitHub renders it to text: links become their text, HTML tags
    vanish."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"</?[A-Za-z][^>]*>", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (before duplicate suffixes)."""
    parts = []
    last = 0
    for m in _INLINE_CODE.finditer(heading):
        parts.append(_plain(heading[last : m.start()]))
        parts.append(m.group(2).strip())  # code is literal text, tags and all
        last = m.end()
    parts.append(_plain(heading[last:]))
    text = "".join(parts).strip().lower()
    kept = []
    for ch in text:
        if ch in "-_ " or unicodedata.category(ch)[0] in "LNM":
            kept.append("-" if ch == " " else ch)
    return "".join(kept)


def anchors(path: Path, cache: dict[Path, set[str]] = {}) -> set[str]:  # noqa: B006
    """Every anchor a Markdown file offers: heading slugs (with GitHub's -1, -2 suffixes for
    repeats) and explicit HTML ids."""
    if path not in cache:
        seen: dict[str, int] = {}
        found: set[str] = set()
        for _, line in prose_lines(path.read_text(encoding="utf-8")):
            found.update(_HTML_ID.findall(line))
            m = _HEADING.match(line)
            if not m:
                continue
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
        cache[path] = found
    return cache[path]


def link_targets(text: str) -> list[tuple[int, str]]:
    """(line, target) of every inline link, image and link definition outside code."""
    out = []
    for no, line in prose_lines(text):
        m = _REF_DEF.match(line)
        if m:
            out.append((no, m.group(1)))
            continue
        bare = _INLINE_CODE.sub(lambda c: "code", line)
        out.extend((no, t) for t in _LINK.findall(bare))
    return out


def check_link(md: Path, target: str) -> str | None:
    """Why a link of ``md`` is broken, or None if it is fine (or leaves the repository)."""
    if _SCHEME.match(target) or target.startswith("//"):
        return None
    path_part, _, anchor = target.partition("#")
    path_part = path_part.split("?", 1)[0]
    if path_part:
        base = ROOT if path_part.startswith("/") else md.parent
        dest = (base / path_part.lstrip("/")).resolve()
        if not dest.is_relative_to(ROOT):
            return f"{target}: leaves the repository"
        if not dest.exists():
            return f"{target}: no such file or folder"
    else:
        dest = md
    if anchor and dest.is_file() and dest.suffix == ".md":
        if anchor.lower() not in anchors(dest):
            return f"{target}: no heading with the anchor #{anchor} in {dest.relative_to(ROOT)}"
    return None


def test_slug_follows_github() -> None:
    assert slug("Serving artifacts (format `pstore-serving`, version 1)") == (
        "serving-artifacts-format-pstore-serving-version-1"
    )
    assert slug("Sparse rows (`rows/<name>`)") == "sparse-rows-rowsname"
    assert slug("W1, W2 and W4: full runs") == "w1-w2-and-w4-full-runs"
    assert slug("The [link](x.md) and **bold**") == "the-link-and-bold"


def test_markdown_links_resolve() -> None:
    files = tracked("*.md")
    assert ROOT / "README.md" in files
    broken = []
    for md in files:
        for no, target in link_targets(md.read_text(encoding="utf-8")):
            why = check_link(md, target)
            if why:
                broken.append(f"{md.relative_to(ROOT)}:{no}: {why}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_docs_named_in_source_exist() -> None:
    sources = [
        p for p in tracked("*.py", "*.pyi", "*.rs", "*.proto") if p != Path(__file__).resolve()
    ]
    assert sources
    missing = []
    for src in sources:
        for no, line in enumerate(src.read_text(encoding="utf-8").splitlines(), 1):
            for name in _SOURCE_REF.findall(line):
                if name.startswith("docs/"):
                    candidates = [ROOT / name]
                else:
                    # A bare name: at the root, in docs/, or beside the file or a parent of it.
                    dirs = [ROOT, ROOT / "docs", *src.parent.relative_to(ROOT).parents]
                    candidates = [ROOT / d / name for d in dirs]
                    candidates.append(src.parent / name)
                if not any(c.is_file() for c in candidates):
                    missing.append(f"{src.relative_to(ROOT)}:{no}: {name}")
    assert not missing, "documents named in source that do not exist:\n" + "\n".join(missing)


def test_architecture_is_a_short_map() -> None:
    size = (ROOT / "ARCHITECTURE.md").stat().st_size
    assert size < ARCHITECTURE_MAX_BYTES, (
        f"ARCHITECTURE.md is {size} bytes; keep it under {ARCHITECTURE_MAX_BYTES} "
        "(measurements go to benches/RESULTS.md, reasoning to docs/decisions/)"
    )
