"""The project's shape: no file imports another in a circle (imports inside functions count too: a
lazy import is still a dependency), so any file can be read, reused or lifted out with what it
imports and nothing else."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def project_files():
    """{module: path}: the top-level files and each package's (a folder with an __init__.py: tasks,
    doctor), the package itself named for its __init__.py."""
    files = {p.stem: p for p in ROOT.glob('*.py')}
    for init in ROOT.glob('*/__init__.py'):
        pkg = init.parent.name
        for p in init.parent.glob('*.py'):
            files[f'{pkg}.{p.stem}' if p.stem != '__init__' else pkg] = p
    return files


def project_imports():
    files = project_files()
    graph = {}
    for name, path in files.items():
        package = name if path.name == '__init__.py' else name.rpartition('.')[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods = [node.module]
            elif isinstance(node, ast.ImportFrom) and node.level == 1 and package:
                # from .read import x, from . import read: a module of the same package
                mods = ([f'{package}.{node.module}'] if node.module
                        else [f'{package}.{a.name}' for a in node.names])
            else:
                mods = []
            for m in mods:
                top = m if m in files else m.split('.')[0]
                if top in files and top != name:
                    deps.add(top)
        graph[name] = deps
    return graph


def test_no_import_circles():
    graph = project_imports()
    assert {'train_grpo', 'tasks', 'tasks.gsm8k', 'batch', 'safety', 'parallel', 'doctor',
            'doctor.read', 'doctor.detect', 'doctor.__main__'} <= set(graph)
    state = {}

    def visit(n, path):
        if state.get(n) == 'done':
            return
        assert state.get(n) != 'open', f"import circle: {' -> '.join(path + [n])}"
        state[n] = 'open'
        for d in sorted(graph[n]):
            visit(d, path + [n])
        state[n] = 'done'

    for n in sorted(graph):
        visit(n, [])


def test_the_circle_check_sees_a_circle(monkeypatch):
    """The check itself: a planted circle (parallel importing train_grpo) is found."""
    real = project_imports()

    def with_circle():
        return {**real, 'parallel': real['parallel'] | {'train_grpo'}}

    monkeypatch.setattr(__import__(__name__), 'project_imports', with_circle)
    try:
        test_no_import_circles()
    except AssertionError as e:
        assert 'import circle' in str(e)
    else:
        raise AssertionError("a planted circle went unnoticed")
