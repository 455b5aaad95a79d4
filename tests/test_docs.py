"""README.md and docs/: README is a user's reference of at most 300 lines that links every docs/
page; every relative link resolves (files, and #anchors to headings); no page speaks of how the
project was developed."""
import ast
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


def reading_table():
    """The rows of README's "Reading the code" table: (stage, where) cells."""
    text = README.read_text(encoding='utf-8').split('## Reading the code', 1)[1].split('\n## ', 1)[0]
    rows = [line.strip().strip('|').split('|') for line in text.splitlines() if line.startswith('| ')]
    return [(stage.strip(), where.strip()) for stage, where in rows[1:]]  # the header row left out


def defined_names(path):
    """Names a file defines at module level (functions, classes, assignments) and in an
    `if __name__ == '__main__':` block."""
    names = set()
    for node in ast.parse(path.read_text(encoding='utf-8')).body:
        for stmt in [node] + (node.body if isinstance(node, ast.If) else []):
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(stmt.name)
            elif isinstance(stmt, ast.Assign):
                names |= {t.id for t in stmt.targets if isinstance(t, ast.Name)}
    return names


def test_reading_table_names_what_exists():
    """Every `file.py:name` and `file.name` the table names is defined there (by ast), every
    `file.py` and `folder/` it names exists, and `name` in `file.py` is defined in that file."""
    rows = reading_table()
    assert len(rows) >= 8, rows
    missing, checked = [], 0
    for _, where in rows:
        spans = re.findall(r'`([^`]+)`', where)
        for m in re.finditer(r'`(\w+)` in `([\w/]+\.py)`', where):
            spans.append(f'{m.group(2)}:{m.group(1)}')
        for span in spans:
            m = re.fullmatch(r'([\w/]+)(?:\.py:|\.)(\w+)', span)
            if span.endswith(('.py', '.jsonl', '.json', '.png', '.md')) or '<' in span:
                m = None  # a file's name, or a placeholder such as tasks/<name>.py
            if m and (ROOT / f'{m.group(1)}.py').is_file():
                checked += 1
                if m.group(2) not in defined_names(ROOT / f'{m.group(1)}.py'):
                    missing.append(span)
            elif (span.endswith('.py') or span.endswith('/')) and '<' not in span:
                if not (ROOT / span).exists():
                    missing.append(span)
    assert checked >= 10 and not missing, f"README's reading table names what is not there: {missing}"


def test_reading_table_names_the_advantages_the_loop_trains_on():
    """Stage 3 names the function whose advantages the loop trains on (loss.advantages: every
    advantage estimator, scaling and KL-in-reward), as train_grpo.py calls it."""
    src = (ROOT / 'train_grpo.py').read_text(encoding='utf-8')
    assert re.search(r'\badvantages\(', src), "train_grpo.py no longer calls loss.advantages"
    stage3 = next(where for stage, where in reading_table() if stage.startswith('3 '))
    assert '`loss.py:advantages`' in stage3, stage3
