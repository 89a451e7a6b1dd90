"""The front door's links hold: every relative link in README.md, docs/, bench/README.md,
bench/RESULTS.md and bench/history/ names a file that exists and, with a #fragment, a heading
that file has (GitHub's anchors: lower case, punctuation dropped, spaces to dashes, -1, -2 for
repeats). Moving a page or renaming a heading breaks this test, not a reader."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md",
            ROOT / "bench" / "RESULTS.md", *sorted((ROOT / "bench" / "history").glob("*.md"))]


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    out: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        m = None if fenced else re.match(r"^#+\s+(.*)", line)
        if m:
            s = _slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def _broken(page: Path, root: Path = ROOT) -> list[str]:
    bad = []
    for m in LINK.finditer(page.read_text()):
        target = m.group(1)
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, frag = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(root)}: ({target})"
        if not dest.exists():
            bad.append(f"{where} names a file that does not exist")
        elif frag and dest.is_file() and dest.suffix == ".md" and frag not in _anchors(dest):
            bad.append(f"{where}: {dest.relative_to(root)} has no heading #{frag}")
    return bad


def test_every_relative_link_resolves():
    bad = [b for page in _pages() if page.exists() for b in _broken(page)]
    assert not bad, "broken links (fix the link or the heading it names):\n" + "\n".join(bad)


def test_the_checker_sees_a_broken_link(tmp_path):
    (tmp_path / "b.md").write_text("# Some heading\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md#some-heading) [ok](b.md#twice-1) [x](b.md#nope) [y](gone.md) [z](https://x.y/z)\n")
    assert [b.split(": ", 1)[1] for b in _broken(page, tmp_path)] == [
        "(b.md#nope): b.md has no heading #nope", "(gone.md) names a file that does not exist"]
