"""README.md and docs/: README is a user's reference of at most 300 lines that links every docs/
page; every relative link resolves (files, and #anchors to headings); no page speaks of how the
project was developed."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / 'README.md'
DOCS = ROOT / 'docs'
MAX_README_LINES = 300
# built from parts so that this file does not match tests/test_style.py's pattern
DEV_WORDS = re.compile(r'\bsession\b|\bissue \d|closing ' + r'note|\bhelper\b', re.IGNORECASE)
# [text](target "title"), images left out
LINK = re.compile(r'(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+"[^"]*")?\)')


def pages():
    return [README] + sorted(DOCS.glob('*.md'))


def prose(text):
    """The text with fenced code blocks blanked (a link-like string in code is code, not a link),
    lines kept."""
    return re.sub(r'^```.*?^```', lambda m: '\n' * m.group(0).count('\n'), text,
                  flags=re.DOTALL | re.MULTILINE)


def links(path):
    """Relative link targets of a markdown file: (target, line number)."""
    out = []
    for n, line in enumerate(prose(path.read_text(encoding='utf-8')).splitlines(), 1):
        for target in LINK.findall(line):
            # http:, https:, mailto: ...
            if not re.match(r'[a-z][a-z0-9+.-]*:', target, re.IGNORECASE):
                out.append((target, n))
    return out


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped,
    spaces to '-'."""
    text = re.sub(r'[`*]', '', heading.strip().lower())
    return re.sub(r'[^\w\- ]', '', text).replace(' ', '-')


def anchors(path):
    seen, out = {}, set()
    for line in prose(path.read_text(encoding='utf-8')).splitlines():
        if m := re.match(r'#{1,6}\s+(.*)', line):
            s = slug(m.group(1))
            out.add(s if s not in seen else f'{s}-{seen[s]}')
            seen[s] = seen.get(s, 0) + 1
    return out


def test_readme_links_every_docs_page():
    files = [t.split('#')[0] for t, _ in links(README)]
    linked = {(README.parent / f).resolve() for f in files if f}
    missing = [p.name for p in sorted(DOCS.iterdir()) if p.is_file() and p.resolve() not in linked]
    assert not missing, f"docs/ pages not linked from README.md: {missing}"


@pytest.mark.parametrize('path', pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    bad = []
    for target, n in links(path):
        file, _, anchor = target.partition('#')
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{path.name}:{n}: {target} (no such file)")
        elif anchor and dest.suffix == '.md' and anchor not in anchors(dest):
            bad.append(f"{path.name}:{n}: {target} (no heading #{anchor} in {dest.name})")
    assert not bad, '\n'.join(bad)


def test_readme_is_at_most_300_lines():
    n = len(README.read_text(encoding='utf-8').splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines; move reference material to docs/"


@pytest.mark.parametrize('path', pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_words_about_how_the_project_was_developed(path):
    lines = path.read_text(encoding='utf-8').splitlines()
    hits = [f"{path.name}:{n}: {line.strip()}" for n, line in enumerate(lines, 1)
            if DEV_WORDS.search(line)]
    assert not hits, "lines about the project's development, not its use:\n" + '\n'.join(hits)
