"""GSM8K with the python tool (tasks/gsm8k_tools.py, config/gsm8k_tools.py): the task plugs in with
its tool and the hermes style and reuses gsm8k's data and grading; its prompts, rendered with the
tool's schema through Qwen2.5's real chat template on a tiny BPE with Qwen2.5's tool tokens, are
the ids of transformers' apply_chat_template, on real GSM8K problems when ../shared/gsm8k is there;
the config loads through the configurator, naming only train_grpo.py's knobs and the task's."""
import ast
import json
import re
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer as HFTokenizer

import lora
import safety
import tasks
import sandbox
import tool_calls
from configurator import configure
from tasks import gsm8k
from test_chat_template import hf_ids, snapshot, trained  # noqa: F401 (trained is a fixture)
from tokenizer import load_tokenizer

transformers = pytest.importorskip('transformers')

ROOT = Path(__file__).resolve().parents[1]
GSM8K = ROOT.parent / 'shared' / 'gsm8k'
CONFIG = ROOT / 'config' / 'gsm8k_tools.py'
TEMPLATE = ROOT / 'tests' / 'fixtures' / 'templates' / 'qwen2.5.jinja'
# added tokens of Qwen2.5's tokenizer.json that its tool template writes (special: false there)
TOOL_TOKENS = ['<tool_call>', '</tool_call>', '<tool_response>', '</tool_response>']
EXAMPLE = {'question': 'Janet’s ducks lay 16 eggs per day. She eats 3 and bakes muffins with 4. '
                       'She sells the rest for $2 each. How much does she make?',
           'answer': '18', 'solution': '16 - 3 - 4 = 9\n9 * 2 = 18\n#### 18'}


def task():
    return tasks.resolve('gsm8k_tools')


def schema():
    """The python tool as the chat template's `tools` lists it."""
    return [tool_calls.json_schema(sandbox.python)]


def examples():
    """A few real GSM8K problems (the first has a curly apostrophe), else a hand-written one."""
    if not (GSM8K / 'test.jsonl').exists():
        return [EXAMPLE]
    test, train = task().load('test', str(GSM8K)), task().load('train', str(GSM8K))
    return [test[0], test[1], test[40], train[0], train[-1]]


@pytest.fixture(scope='module')
def qwen25(request, tmp_path_factory):
    """(ours, transformers') tokenizers of a tiny snapshot with Qwen2.5's real chat template and
    its four tool tokens as added tokens: test_chat_template's tiny BPE, copied."""
    tok = HFTokenizer.from_str(request.getfixturevalue('trained').to_str())
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    path = snapshot(tok, tmp_path_factory.mktemp('snap') / 'qwen2.5-tools', TEMPLATE.read_text(),
                    False)
    return load_tokenizer(path), transformers.AutoTokenizer.from_pretrained(path)


def test_the_task_plugs_in_with_the_python_tool_and_gsm8k_grading(tmp_path):
    t = task()
    assert 'gsm8k_tools' in tasks.BUILTIN
    assert tasks.tools_of(t) == ({'python': sandbox.python}, 'hermes')
    assert t.grade is gsm8k.grade and t.solution is gsm8k.solution
    assert tasks.default_rewards(t) == gsm8k.rewards
    assert tasks.knobs(t) == {'skip_bad_rows': False}
    system, user = tasks.messages(t, EXAMPLE)
    assert system['role'] == 'system' and 'python tool' in system['content']
    assert 'print' in system['content']
    assert user['content'].startswith(EXAMPLE['question']) and user['content'].endswith('\\boxed{}.')
    # a rollout as Qwen2.5 writes it: a call that ends the turn, the program's output as a tool
    # message, the answer in \boxed{}; grade reads the box, not the numbers in the output
    turn = ('Let me compute.\n<tool_call>\n{"name": "python", "arguments": '
            '{"code": "eggs = 16 - 3 - 4\\nprint(eggs, eggs * 2)"}}\n</tool_call>')
    calls = tool_calls.parse_calls(turn, 'hermes')
    assert calls == [{'name': 'python',
                      'arguments': {'code': 'eggs = 16 - 3 - 4\nprint(eggs, eggs * 2)'}}]
    result = tool_calls.run_call(calls[0], tasks.tools_of(t)[0], 10.0)
    assert result['error'] is None and result['output'] == '9 18\n', result
    rollout = (f"{turn}<|im_end|>\n<|im_start|>user\n<tool_response>\n{result['output']}"
               "</tool_response><|im_end|>\n<|im_start|>assistant\nShe makes \\boxed{18} dollars.")
    assert t.grade(rollout, EXAMPLE) and t.grade(t.solution(EXAMPLE), EXAMPLE)
    assert not t.grade(rollout.replace('{18}', '{9}'), EXAMPLE)
    # skip_bad_rows is this task's knob, handed to gsm8k's loader and put back after
    (tmp_path / 'train.jsonl').write_text(
        json.dumps({'question': 'q?', 'answer': 'so #### 7'}) + '\n{not json\n')
    with pytest.raises(ValueError, match='train.jsonl'):
        t.load('train', str(tmp_path))
    tasks.set_knobs(t, {'skip_bad_rows': True})
    try:
        stats = {}
        assert [ex['answer'] for ex in t.load('train', str(tmp_path), stats=stats)] == ['7']
        assert stats['skipped'] == 1 and gsm8k.skip_bad_rows is False
    finally:
        tasks.set_knobs(t, {'skip_bad_rows': False})


@pytest.mark.skipif(not (GSM8K / 'test.jsonl').exists(), reason='../shared/gsm8k not present')
def test_it_loads_gsm8k_as_gsm8k_does():
    assert task().load('test', str(GSM8K)) == gsm8k.load('test', str(GSM8K))


def test_prompts_with_the_tool_schema_are_apply_chat_template_ids(qwen25):
    ours, hf = qwen25
    t, tools = task(), schema()
    assert all(ours.special[s] == hf.convert_tokens_to_ids(s) for s in TOOL_TOKENS)
    for ex in examples():
        # the task's prompt, and one without a system turn (the template's default takes its place)
        for msgs in (tasks.messages(t, ex, system_prompt=''), tasks.messages(t, ex)):
            want = hf_ids(hf, msgs, True, tools=tools)
            got = ours.render_chat(msgs, tools=tools)
            assert got == want, (f'{ex["question"][:40]!r}:\n ours {ours.decode(got)!r}\n'
                                 f'   hf {hf.decode(want)!r}')
        text = ours.decode(got)
        # the template's call format, "<tool_call></tool_call> XML tags:\n<tool_call>\n{...}"
        assert got.count(ours.special['<tool_call>']) == 2, text
        assert got.count(ours.special['</tool_call>']) == 2, text
        # the python tool's schema is in the system turn, after the task's system prompt
        head, _, tool_part = text.partition('\n\n# Tools\n')
        assert head == '<|im_start|>system\n' + t.SYSTEM_PROMPT, head
        assert json.dumps(tools[0], ensure_ascii=False) in tool_part
        assert '"name": "python"' in tool_part and '"code": {"type": "string"' in tool_part
        assert text.endswith(f'{ex["question"]}\n{t.INSTRUCTION}<|im_end|>\n'
                             '<|im_start|>assistant\n'), text[-300:]


def test_sample_encodes_the_prompts_with_the_tool_schema(qwen25):
    """SAMPLE.ENCODE_PROMPTS: what training and evaluation feed the model are the ids checked above
    (a hermes task's prompts rendered with its tools' schemas), not the prompt without them."""
    import sample
    ours, _ = qwen25
    t = task()
    want = [ours.render_chat(tasks.messages(t, ex), tools=schema()) for ex in examples()]
    assert sample.encode_prompts(ours, t, examples()) == want


def train_grpo_globals():
    """train_grpo.py's knobs with their defaults: its source up to the line that ends them."""
    source = (ROOT / 'train_grpo.py').read_text()
    knob_block = re.split(r'^# -{20,}$', source, maxsplit=1, flags=re.MULTILINE)[0]
    g = {}
    exec(compile(knob_block, 'train_grpo.py', 'exec'), g)
    return g


def load_config(path):
    """The resolved config of `train_grpo.py path`, as the script's configure call makes it."""
    def task_knobs(settings):
        return tasks.knobs(tasks.resolve(settings['task']))
    return configure(train_grpo_globals(), [str(path)], more_knobs=task_knobs)


def assigned(path):
    """{name: (first line, last line)} of the top-level assignments of a config file."""
    tree = ast.parse(Path(path).read_text())
    return {node.targets[0].id: (node.lineno, node.end_lineno) for node in tree.body
            if isinstance(node, ast.Assign)}


def test_the_config_loads_through_the_configurator(tmp_path, capsys):
    cfg = load_config(CONFIG)
    assert cfg['task'] == 'gsm8k_tools' and cfg['init_from'] == 'Qwen/Qwen2.5-0.5B-Instruct'
    assert safety.bad_knob(cfg) is None and lora.bad_knob(cfg) is None
    ours, base = assigned(CONFIG), assigned(ROOT / 'config' / 'gsm8k.py')
    assert set(base) <= set(ours), f'knobs of config/gsm8k.py left out: {set(base) - set(ours)}'
    assert {'max_tool_calls', 'tool_timeout'} <= set(ours)
    assert cfg['max_new_tokens'] > load_config(ROOT / 'config' / 'gsm8k.py')['max_new_tokens']
    lines = CONFIG.read_text().splitlines()
    for name, (first, last) in ours.items():
        assert any('#' in line for line in lines[max(first - 2, 0):last]), f'{name} has no comment'
    # a name that is no knob stops the run with exit code 2, naming it
    typo = tmp_path / 'typo.py'
    typo.write_text(CONFIG.read_text() + 'max_tool_call = 2\n')
    with pytest.raises(SystemExit) as e:
        load_config(typo)
    assert e.value.code == 2 and "unknown config key 'max_tool_call'" in capsys.readouterr().err
