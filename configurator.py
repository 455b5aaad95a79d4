"""
nanoGPT-style configuration, shared by train_grpo.py and sample.py.

A script keeps its defaults as plain module globals (each with a comment), then calls

    config = configure(globals())

which applies, in order, each bare argument as a Python config file (executed in the script's
globals) and each `--key=value` as an override. Values go through ast.literal_eval (falling back to
the raw string) and must match the type of the default; a default of None accepts anything. Any
mistake is one clear line and exit code 2; an unknown key names the closest known ones. `--help`
prints every knob with its default and the comments beside and above it in the script's source, in
the source's order and groups, and exits 0.
"""
import ast
import difflib
import io
import json
import os
import sys
import tokenize


def config_keys(g):
    """The configurable globals: plain values at module level with lowercase names (as a task's
    knobs, tasks.knobs); not modules, functions, private names or CONSTANTS (sample.py run as a
    script has its GRAPH_BUCKETS among its globals)."""
    plain = (int, float, bool, str, list, tuple, dict, type(None))
    return [k for k, v in g.items() if not k.startswith('_') and k == k.lower() and isinstance(v, plain)]


def fail(msg):
    print(f"config error: {msg}", file=sys.stderr)
    sys.exit(2)


def auto_bool(default, value):
    """A knob whose default is 'auto' (share_prompt) also takes True or False: a choice, not a
    change of type."""
    return default == 'auto' and isinstance(value, bool)


def check_type(key, value, default, where):
    """Return value coerced to the default's type (int -> float, list <-> tuple), or fail naming
    where it came from."""
    if default is None or value is None or auto_bool(default, value):
        return value
    if isinstance(default, bool) or isinstance(value, bool):
        # bool is an int subclass: compare exactly
        ok = type(value) is type(default)
    elif isinstance(default, float) and isinstance(value, int):
        return float(value)  # --lr=1 means 1.0
    elif isinstance(default, (list, tuple)) and isinstance(value, (list, tuple)):
        return type(default)(value)
    else:
        ok = isinstance(value, type(default))
    if not ok:
        fail(f"{where}: '{key}' expects {type(default).__name__} (default {default!r}), "
             f"got {type(value).__name__} {value!r}")
    return value


def unknown_key(key, known):
    """The words after 'unknown config key ...': the closest known names, or where to find them."""
    close = difflib.get_close_matches(key, known, n=3)
    if close:
        return "(did you mean " + ' or '.join(f'--{k}' for k in close) + "?)"
    return "(--help lists the known keys)"


def source_notes(path, keys):
    """[(line, text)] from the script at path: each knob's assignment as ('knob', name, comment on
    its line) and the comment lines directly above it as ('note', text), in source order. Knobs
    are assignments at module level or in a module-level `if` (sample.py's `__main__` block)."""
    try:
        with open(path) as f:
            src = f.read()
        tree = ast.parse(src)
    except (OSError, SyntaxError, ValueError):
        return []
    comments = {}  # line -> comment text
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip('#').strip()
    lines = src.splitlines()
    first = {}  # knob -> its first assignment
    for node in tree.body:
        for stmt in [node] + (node.body if isinstance(node, ast.If) else []):
            if isinstance(stmt, ast.Assign):
                for t in stmt.targets:
                    if isinstance(t, ast.Name) and t.id in keys and t.id not in first:
                        first[t.id] = stmt
    notes = []
    for name, stmt in sorted(first.items(), key=lambda kv: kv[1].lineno):
        above, n = [], stmt.lineno - 1
        while n >= 1 and lines[n - 1].strip().startswith('#') and n in comments:
            if not comments[n].strip('-= '):  # a separator line ends the block
                break
            above.insert(0, (n, ('note', comments[n])))
            n -= 1
        own = ' '.join(comments[i] for i in range(stmt.lineno, stmt.end_lineno + 1) if i in comments)
        notes += above + [(stmt.lineno, ('knob', name, own))]
    return [note for _, note in sorted(set(notes))]


def help_text(g, keys, extra=None):
    """Every knob of g (keys) with its default and its source comments, then the chosen task's
    knobs (extra: {name: default}), if any."""
    script = g.get('__file__') or 'script'
    out = [f"usage: python {os.path.basename(script)} [config.py ...] [--key=value ...]",
           "  a bare argument is a config file of assignments; --key=value overrides one knob; "
           "values are Python literals", '']

    def knob(name, default, comment):
        line = f"  --{name}={default!r}"
        return line + ' ' * max(2, 40 - len(line)) + comment if comment else line

    listed = set()
    notes = source_notes(g['__file__'], set(keys)) if g.get('__file__') else []
    for note in notes:
        if note[0] == 'note':
            if out[-1].startswith('  --'):
                out.append('')
            out.append(note[1])
        else:
            out.append(knob(note[1], g[note[1]], note[2]))
            listed.add(note[1])
    rest = [k for k in keys if k not in listed]
    if rest:
        out += ['', 'other knobs']
        out += [knob(k, g[k], '') for k in rest]
    if extra:
        out += ['', "the chosen task's own knobs (--task; their comments are in the task's file)"]
        out += [knob(k, v, '') for k, v in extra.items()]
    return '\n'.join(out)


def parse_value(raw):
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw  # a bare word such as --init_from=Qwen/Qwen2.5-0.5B-Instruct is a string


def configure(g, argv=None, more_knobs=None):
    """Apply config files and --key=value overrides from argv (default sys.argv[1:]) to the globals
    dict g. more_knobs(settings) -> {name: default}: knobs that exist only given other settings (the
    chosen task's, see tasks/), found after a first quiet pass over argv that skips unknown keys;
    they are added to g, then argv is applied for real, so they take files and overrides like any
    knob. A ValueError from it is a config error."""
    argv = sys.argv[1:] if argv is None else argv
    keys = config_keys(g)
    if '--help' in argv or '-h' in argv:
        show_help(g, keys, [a for a in argv if a not in ('--help', '-h')], more_knobs)
    if more_knobs is not None:
        extra = _more_knobs(g, keys, argv, more_knobs)
        clash = sorted(set(extra) & set(keys))
        if clash:
            fail(f"knob(s) {clash} of the chosen task clash with the script's own; "
                 "rename them in the task")
        g.update(extra)
        keys += list(extra)
    _apply(g, argv, {k: g[k] for k in keys}, strict=True)
    return {k: g[k] for k in keys}


def show_help(g, keys, argv, more_knobs):
    """Print the knobs (with the task's that argv chooses) and exit 0."""
    extra = {} if more_knobs is None else _more_knobs(g, keys, argv, more_knobs)
    print(help_text(g, keys, extra))
    sys.exit(0)


def _more_knobs(g, keys, argv, more_knobs):
    """The knobs more_knobs finds given the settings of a first quiet pass over argv (unknown keys
    skipped); a ValueError from it is a config error."""
    first = dict(g)
    _apply(first, argv, {k: g[k] for k in keys}, strict=False)
    try:
        return more_knobs(first)
    except ValueError as e:
        fail(str(e))


def _apply(g, argv, defaults, strict):
    """strict=False: a quiet first pass, unknown keys skipped."""
    for arg in argv:
        if not arg.startswith('--'):
            if not os.path.isfile(arg):
                fail(f"config file not found: {arg}")
            if strict:
                print(f"config: executing {arg}")
            file_globals = {'__file__': os.path.abspath(arg)}  # lets a config exec a sibling config
            try:
                with open(arg) as f:
                    exec(compile(f.read(), arg, 'exec'), file_globals)
            except Exception as e:
                fail(f"{arg}: {type(e).__name__}: {e}")
            for k, v in file_globals.items():
                if k.startswith('_') or callable(v) or type(v).__name__ == 'module':
                    continue  # imports and functions in a config file are not settings
                if k not in defaults:
                    if not strict:
                        continue
                    fail(f"{arg}: unknown config key '{k}' {unknown_key(k, defaults)}")
                g[k] = check_type(k, v, defaults[k], arg)
        else:
            key, sep, raw = arg[2:].partition('=')  # partition: values may themselves contain '='
            if not sep:
                fail(f"expected --key=value, got {arg}")
            if key not in defaults:
                if not strict:
                    continue
                fail(f"unknown config key --{key} {unknown_key(key, defaults)}")
            value = parse_value(raw)
            default = defaults[key]
            if isinstance(default, str):
                if not isinstance(value, str) and not auto_bool(default, value):
                    value = raw  # --out_dir=2024 is the string '2024'
            g[key] = check_type(key, value, default, arg)


def save_config(config, out_dir):
    """Print the resolved config and keep a copy beside the run's outputs."""
    os.makedirs(out_dir, exist_ok=True)
    print("config: " + json.dumps(config, sort_keys=True, default=str))
    with open(os.path.join(out_dir, 'config.json'), 'w') as f:
        json.dump(config, f, indent=2, sort_keys=True, default=str)
