"""The shape the code keeps as features land: ruff.toml's rules hold (no line over 120, pyflakes,
at most 6 positional parameters), the core (top-level *.py, tasks/ and doctor/) has at most 5% of
its lines over 100 characters and no function longer than a reader can hold (MAX_FUNCTION_LINES,
docstring aside; train_grpo.py's step loop MAX_LOOP_LINES), and nothing in the code or the
requirement files speaks of how the project was developed instead of what it does."""
import ast
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_SHARE_OVER_100 = 0.05
MAX_FUNCTION_LINES = 120  # the longest today: sample.generate_with_tools, its decode loop
MAX_LOOP_LINES = 40  # train_grpo.py's `while step < max_steps:` loop, the algorithm in stages
# built from parts so that this file does not match itself
DEV_WORDS = re.compile('|'.join([r'\bsess' + r'ions?\b', r'\biss' + r'ues? \d', 'closing ' + 'note',
                                 r'\bhel' + r'pers?\b']), re.IGNORECASE)


def core_files():
    return sorted(ROOT.glob('*.py')) + [p for folder in ('tasks', 'doctor')
                                        for p in sorted((ROOT / folder).glob('*.py'))]


def share_over_100(files):
    lines = [line for f in files for line in f.read_text(encoding='utf-8').splitlines()]
    long = [line for line in lines if len(line) > 100]
    return len(long) / max(len(lines), 1), len(long), len(lines)


def development_words(files):
    hits = []
    for f in files:
        for n, line in enumerate(f.read_text(encoding='utf-8').splitlines(), 1):
            if DEV_WORDS.search(line):
                hits.append(f"{f}:{n}: {line.strip()}")
    return hits


def test_ruff_is_clean():
    r = subprocess.run([sys.executable, '-m', 'ruff', 'check', '--no-cache', '.'], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_ruff_sees_a_breach(tmp_path):
    """The check itself: a function of 7 positional parameters and an unused import are refused."""
    (tmp_path / 'ruff.toml').write_text((ROOT / 'ruff.toml').read_text())
    (tmp_path / 'bad.py').write_text("import os\n\n\ndef f(a, b, c, d, e, g, h):\n    return a\n")
    r = subprocess.run([sys.executable, '-m', 'ruff', 'check', '--no-cache', '.'], cwd=tmp_path,
                       capture_output=True, text=True)
    assert r.returncode != 0, r.stdout
    assert 'PLR0917' in r.stdout, r.stdout
    assert 'F401' in r.stdout, r.stdout


def test_core_lines_over_100_are_few():
    share, n, total = share_over_100(core_files())
    msg = f"{n} of {total} core lines ({share:.1%}) are over 100 characters"
    assert share <= MAX_SHARE_OVER_100, msg


def function_lengths(files):
    """(lines, 'file:function') of every function, its docstring left out, longest first."""
    out = []
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(encoding='utf-8'))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body
                doc = ast.get_docstring(node) is not None and len(body) > 1
                out.append((node.end_lineno - body[doc].lineno + 1, f"{f.name}:{node.name}"))
    return sorted(out, reverse=True)


def test_no_core_function_is_too_long():
    lengths = function_lengths(core_files())
    too_long = [(n, name) for n, name in lengths if n > MAX_FUNCTION_LINES]
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines: {too_long}"
    tree = ast.parse((ROOT / 'train_grpo.py').read_text(encoding='utf-8'))
    loop = [n for n in tree.body if isinstance(n, ast.While)]
    assert len(loop) == 1, "train_grpo.py has one top-level loop: the steps"
    n = loop[0].end_lineno - loop[0].lineno + 1
    assert n <= MAX_LOOP_LINES, f"train_grpo.py's step loop is {n} lines"


def test_function_lengths_leave_the_docstring_out(tmp_path):
    f = tmp_path / 'x.py'
    f.write_text('def f():\n    """doc\n    more"""\n' + '    x = 1\n' * 130 + '\n\ndef g():\n    pass\n')
    assert function_lengths([f]) == [(130, 'x.py:f'), (1, 'x.py:g')]
    assert [n for n, _ in function_lengths([f]) if n > MAX_FUNCTION_LINES] == [130]


def test_the_share_counts_long_lines(tmp_path):
    f = tmp_path / 'x.py'
    f.write_text('x = 1\n' * 18 + '#' * 101 + '\n' + '#' * 100 + '\n')
    assert share_over_100([f]) == (1 / 20, 1, 20)


def test_nothing_speaks_of_how_the_project_was_developed():
    files = [f for f in sorted(ROOT.rglob('*.py'))
             if '.venv' not in f.parts and 'venv' not in f.parts]
    files += sorted(ROOT.glob('requirements*.txt')) + [ROOT / 'ruff.toml', ROOT / 'pytest.ini']
    hits = development_words(files)
    assert not hits, '\n'.join(hits[:20])


def test_the_development_words_are_found(tmp_path):
    f = tmp_path / 'x.py'
    f.write_text('# fixed in ' + 'iss' + 'ue 24\nok = 1\n'
                 + '# the closing ' + 'note said\n'
                 + '# GPU sess' + 'ion\n')
    assert len(development_words([f])) == 3


def kernel_signatures(files):
    """(file, name, is a @triton.jit function, positional parameters, keyword-only parameters) of
    every function in files."""
    out = []
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(encoding='utf-8'))):
            if isinstance(node, ast.FunctionDef):
                jit = any('jit' in ast.unparse(d) for d in node.decorator_list)
                a = node.args
                out.append((f.name, node.name, jit, len(a.posonlyargs) + len(a.args),
                            len(a.kwonlyargs)))
    return out


def test_triton_kernels_take_no_keyword_only_parameters():
    """ruff.toml exempts logprob_kernels.py and sample_kernels.py from the positional-parameter limit
    because Triton before 3.9 cannot bind a @triton.jit function's keyword-only parameters: so no
    jit function may have any, and every other function there keeps the limit of 6."""
    sigs = kernel_signatures([ROOT / 'logprob_kernels.py', ROOT / 'sample_kernels.py'])
    assert sum(jit for _, _, jit, _, _ in sigs) >= 8, 'expected the Triton kernels in these files'
    kw_only = [f'{f}:{name}' for f, name, jit, _, kw in sigs if jit and kw]
    assert not kw_only, f'keyword-only parameters in Triton kernels (fail on Triton < 3.9): {kw_only}'
    too_many = [f'{f}:{name} ({n})' for f, name, jit, n, _ in sigs if not jit and n > 6]
    assert not too_many, f'more than 6 positional parameters outside Triton kernels: {too_many}'


def our_import_names():
    """What `import X` finds in this folder first: the top-level modules and packages."""
    return {p.stem for p in ROOT.glob('*.py')} | {p.parent.name for p in ROOT.glob('*/__init__.py')}


def shadowed(names):
    """Those of names that the standard library or an installed distribution also provides: run
    from here, ours would be imported in its place (transformers 5.25 imports the package `kernels`
    at import time, so a top-level kernels.py broke every transformers import)."""
    taken = set(sys.stdlib_module_names) | set(importlib.metadata.packages_distributions())
    return sorted(set(names) & taken)


def test_no_top_level_module_shadows_an_installed_or_standard_one():
    assert shadowed(our_import_names()) == []


def test_a_shadowing_name_is_found():
    assert shadowed({'json', 'torch', 'logprob_kernels'}) == ['json', 'torch']
