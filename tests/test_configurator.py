"""The configurator: config files, --key=value overrides, type checks, clear errors with exit code
2."""
import json

import pytest

from configurator import configure, save_config
import warm


def defaults():
    return {'lr': 1e-5, 'steps': 10, 'name': 'run', 'compile': False, 'init_from': None,
            'rewards': [('correct', 1.0)], 'os': json}  # a module in globals is not a setting


def run(argv, g=None):
    g = defaults() if g is None else g
    return configure(g, argv), g


def test_overrides_parse_and_apply():
    cfg, g = run(['--lr=3e-4', '--steps=5', '--name=my run', '--compile=True',
                  "--rewards=[('format', 0.5)]"])
    assert cfg == {'lr': 3e-4, 'steps': 5, 'name': 'my run', 'compile': True, 'init_from': None,
                   'rewards': [('format', 0.5)]}
    assert g['lr'] == 3e-4, "the script's globals must change, nanoGPT style"


def test_constants_are_not_knobs(capsys):
    """An upper-case global (a module constant a script imports or defines) is no knob: --help does
    not list it, config.json does not hold it, and setting it is an unknown key."""
    g = {**defaults(), 'GRAPH_BUCKETS': 4}
    cfg, _ = run([], g)
    assert 'GRAPH_BUCKETS' not in cfg
    with pytest.raises(SystemExit) as e:
        run(['--GRAPH_BUCKETS=2'], g)
    assert e.value.code == 2 and 'unknown config key --GRAPH_BUCKETS' in capsys.readouterr().err
    assert g['GRAPH_BUCKETS'] == 4


def test_int_for_float_and_string_that_looks_like_a_number():
    cfg, _ = run(['--lr=1', '--name=2024'])
    assert cfg['lr'] == 1.0 and isinstance(cfg['lr'], float)
    assert cfg['name'] == '2024'


def test_none_default_accepts_anything():
    cfg, _ = run(['--init_from=Qwen/Qwen2.5-0.5B-Instruct'])
    assert cfg['init_from'] == 'Qwen/Qwen2.5-0.5B-Instruct'
    assert run(['--init_from=3'])[0]['init_from'] == 3


def test_auto_default_also_takes_true_or_false(tmp_path):
    """share_prompt = 'auto' also takes True/False, on the command line and in a config file (a
    choice, not a change of type); other words stay strings, for safety.bad_knob to refuse with the
    allowed values."""

    def g():
        return {**defaults(), 'share_prompt': 'auto'}

    assert run(['--share_prompt=False'], g())[0]['share_prompt'] is False
    assert run(['--share_prompt=True'], g())[0]['share_prompt'] is True
    assert run(['--share_prompt=auto'], g())[0]['share_prompt'] == 'auto'
    assert run(['--share_prompt=3'], g())[0]['share_prompt'] == '3'
    cfg = tmp_path / 'c.py'
    cfg.write_text('share_prompt = False\n')
    assert run([str(cfg)], g())[0]['share_prompt'] is False


def test_value_containing_equals():
    assert run(['--name=a=b=c'])[0]['name'] == 'a=b=c'


def test_config_file_then_override(tmp_path):
    f = tmp_path / 'c.py'
    f.write_text("import math\nlr = 2e-5  # a comment\nsteps = 100\ndef util(): pass\n")
    cfg, _ = run([str(f), '--steps=7'])
    assert cfg['lr'] == 2e-5 and cfg['steps'] == 7


@pytest.mark.parametrize('argv,needle', [
    (['--nope=1'], "unknown config key --nope"),
    (['--steps=1.5'], "'steps' expects int"),
    (['--compile=1'], "'compile' expects bool"),
    (['--steps=abc'], "'steps' expects int"),
    (['--steps'], "expected --key=value"),
    (['missing_file.py'], "config file not found: missing_file.py"),
])
def test_bad_input_exits_2_with_one_clear_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        run(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and err.count('\n') == 1, \
        f"expected one line containing {needle!r}, got {err!r}"


def test_config_file_errors_name_the_file(tmp_path, capsys):
    f = tmp_path / 'bad.py'
    f.write_text("stepz = 3\n")
    with pytest.raises(SystemExit) as e:
        run([str(f)])
    assert e.value.code == 2 and f"{f}: unknown config key 'stepz'" in capsys.readouterr().err
    f.write_text("steps = 'many'\n")
    with pytest.raises(SystemExit):
        run([str(f)])
    assert f"{f}: 'steps' expects int" in capsys.readouterr().err


def test_save_config(tmp_path, capsys):
    cfg, _ = run(['--steps=3'])
    save_config(cfg, str(tmp_path / 'out'))
    assert json.load(open(tmp_path / 'out' / 'config.json'))['steps'] == 3
    assert '"steps": 3' in capsys.readouterr().out


SCRIPT = '''"""a script with knobs"""
import json
# optimization
lr = 1e-5  # peak learning rate
steps = 10  # optimizer steps
# a knob whose comment sits above it,
# over two lines
rewards = [('correct', 1.0)]
# -----------------------------------------------------------------------------
# I/O
name = 'run'  # the run's name
'''


def script_globals(tmp_path):
    path = tmp_path / 'script.py'
    path.write_text(SCRIPT)
    g = {'__file__': str(path)}
    exec(compile(SCRIPT, str(path), 'exec'), g)
    del g['__builtins__']
    return g


def test_help_prints_every_knob_with_default_and_comment_in_source_groups(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        configure(script_globals(tmp_path), ['--help'])
    assert e.value.code == 0
    out = capsys.readouterr().out
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    order = ['optimization', '--lr=1e-05', '--steps=10', 'a knob whose comment sits above it,',
             'over two lines', "--rewards=[('correct', 1.0)]", 'I/O', "--name='run'"]
    found = [next(i for i, line in enumerate(lines) if line.startswith(o)) for o in order]
    assert found == sorted(found), out
    assert any(line.startswith('--lr=1e-05') and line.endswith('peak learning rate') for line in lines)
    assert not any('----' in line or 'import' in line for line in lines), "separators and code stay out"


def test_help_after_config_file_and_without_a_source(tmp_path, capsys):
    """-h works anywhere in argv; globals with no source file still list every knob and default."""
    with pytest.raises(SystemExit) as e:
        run(['--steps=3', '-h'])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for k, v in defaults().items():
        if k != 'os':
            assert f'--{k}={v!r}' in out


@pytest.mark.parametrize('argv,needle', [
    (['--step=1'], "unknown config key --step (did you mean --steps?)"),
    (['--nmae=x'], "did you mean --name?"),
    (['--zzzz=1'], "unknown config key --zzzz (--help lists the known keys)"),
])
def test_unknown_key_names_the_closest_known_ones(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        run(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle in err and 'init_from' not in err, err


def test_scripts_answer_help(tmp_path):
    """train_grpo.py and sample.py --help: exit 0, every knob with its default and comment."""
    import os
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for script, knobs in [('train_grpo.py', ["--group_size=8", "--beta=0.0", "--seed=1337"]),
                          ('sample.py', ["--split='test'", "--n_samples=1"])]:
        p = warm.run([sys.executable, script, '--help'], cwd=root, timeout=120)
        assert p.returncode == 0, p.stderr
        lines = p.stdout.splitlines()
        assert not [line for line in lines if line.startswith('  --') and not line[4].islower()], script
        for knob in knobs:
            line = next(line for line in lines if line.strip().startswith(knob + ' '))
            assert len(line.split(None, 1)) == 2, f"{script}: {knob} has no comment: {line!r}"


def test_every_training_config_passes_the_knob_checks_and_values_out_of_range_are_named():
    """safety.bad_knob on each config/ file as train_grpo.py resolves it: nothing to refuse. On the
    defaults, a value outside what a knob can take: one line that names it (checked before anything
    loads; these once ran silently, a negative beta rewarding divergence, or died in a traceback)."""
    import safety
    from test_gsm8k_tools import ROOT, load_config, train_grpo_globals
    for path in sorted((ROOT / 'config').glob('*.py')):
        if not path.name.startswith('eval_'):  # eval_*: sample.py's
            assert safety.bad_knob(load_config(path)) is None, path
    base = configure(train_grpo_globals(), [])
    bad = {'temperature': 0.0, 'top_p': 1.5, 'top_k': -1, 'beta': -0.1, 'lr': -1e-6,
           'adam_betas': (0.9,), 'weight_decay': -0.1, 'max_steps': -1, 'min_lr_ratio': 2.0,
           'dtype': 'fp8', 'device': 'gpu', 'deterministic': 'yes', 'eps_low': -0.1,
           'kl_max': -1.0, 'zero_reward_patience': 0, 'eval_batch_size': 0, 'loss_agg': 'mean',
           'share_prompt': 'maybe', 'min_p': 1.0, 'micro_batch_tokens': -1, 'export_best': 'pass@1',
           'lr_schedule': 'cos', 'export_best_mode': 'lowest', 'epochs': -1.0, 'stop_strings': [''],
           'teacher_coef': -1.0}
    for key, value in bad.items():
        error = safety.bad_knob({**base, key: value})
        assert error is not None and error.startswith(f"--{key}={value!r}:"), (key, error)
    error = safety.bad_knob({**base, 'export_best': 'eval/pass@1', 'eval_every': 0})
    assert error is not None and 'eval_every = 0' in error, error
