"""The configurator: config files, --key=value overrides, type checks, clear errors with exit code
2."""
import json

import pytest

from configurator import configure, save_config


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
