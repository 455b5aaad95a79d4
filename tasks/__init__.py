"""
Tasks: one file per task, each a plain module exposing the same few names, so that training, its
evaluation and sample.py render the same prompts and grade the same way.

    load(split, data_dir='', seed=0) -> [example dict]
        split 'train' or 'test'; accept **_ if you need neither
    messages(example, system_prompt=None, instruction=None) -> chat messages [{'role', 'content'}]
        or a str (a raw prompt, no chat template). None: the task's default; '' leaves it out.
    grade(completion, example) -> bool
        what eval/pass@1 counts and the built-in 'correct' reward pays
Optional:
    rewards = [...]                 the task's default reward config (reward.py's format);
                                    else [correct]
    solution(example) -> str        the supervised warm start's target (sft_steps > 0)
    answer(completion) -> str|None  what maj@k votes on (default: reward.extract_answer)
    metrics(completions, examples) -> {name: float}
        the task's own eval numbers beside pass@1, on the greedy completions (tasks/chess.py:
        legal_rate, ...): in evaluate()'s summary and train_grpo's eval/<name> (names other than
        n, pass@1, truncated, seconds)
    tools = [...]                   tools its rollouts may call (sandbox.py): built-in names
                                    ('calculator', 'python') or functions with type hints and a
                                    docstring; its completions then run through
                                    sample.generate_with_tools (docs/tools.md)
    tool_style = 'fenced'           how a call is written: 'fenced' (a ```name block, answered by
                                    an ```output block), 'hermes' (<tool_call>{json}</tool_call>)
                                    or 'json' (a turn that is one {"name", "parameters"} object,
                                    Llama 3.1+); hermes and json answers are the chat template's
    max_tool_calls = 4              calls per completion, unless the config sets max_tool_calls
The task's lowercase module-level values of plain types (int, float, bool, str, list, tuple, dict,
None) are its knobs: config files and --key=value set them as they set train_grpo.py's own
(tasks/arith.py: arith_difficulty, ...).

--task=gsm8k picks tasks/gsm8k.py; --task=mymodule:my_task imports my_task from mymodule (a
module, or any object with those names; mymodule must be importable); --task=path/to/task.py runs
that file as a module.
"""
import importlib
import importlib.util
import inspect
import os

REQUIRED = ('load', 'messages', 'grade')
INTERFACE = REQUIRED + ('rewards', 'solution', 'answer', 'metrics', 'tools', 'tool_style',
                        'max_tool_calls')
BUILTIN = ('gsm8k', 'gsm8k_tools', 'math', 'arith', 'arith_tools', 'chess')
KNOB_TYPES = (int, float, bool, str, list, tuple, dict, type(None))


# path -> module: a task file runs once per process, however often it is resolved
_from_files = {}


def resolve(spec):
    """The task object for a --task value. Raises ValueError with one line naming the task and what
    is wrong."""
    if spec.endswith('.py') and os.path.abspath(spec) in _from_files:
        task = _from_files[os.path.abspath(spec)]
    elif spec.endswith('.py'):
        if not os.path.isfile(spec):
            raise ValueError(f"task {spec!r}: no such file")
        name = f"task_{os.path.basename(spec)[:-3]}"
        mod_spec = importlib.util.spec_from_file_location(name, spec)
        task = importlib.util.module_from_spec(mod_spec)
        try:
            mod_spec.loader.exec_module(task)
        except Exception as e:
            raise ValueError(f"task {spec!r}: {type(e).__name__}: {e}") from e
        _from_files[os.path.abspath(spec)] = task
    elif ':' in spec:
        mod, _, attr = spec.partition(':')
        try:
            task = getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"task {spec!r}: cannot import {attr} from {mod} ({e})") from e
    elif spec in BUILTIN:
        task = importlib.import_module(f'tasks.{spec}')
    else:
        raise ValueError(f"unknown task {spec!r}: expected one of {BUILTIN}, 'module:attr' or a "
                         "path/to/task.py")
    for name in REQUIRED:
        if not callable(getattr(task, name, None)):
            raise ValueError(f"task {spec!r} has no {name}(): a task defines "
                             f"{', '.join(REQUIRED)} (tasks/__init__.py)")
    return task


def knobs(task):
    """{name: default} of the task's knobs: its public lowercase attributes of plain config
    types."""
    def is_knob(k):
        if k.startswith('_') or k != k.lower() or k in INTERFACE:
            return False
        value = getattr(task, k)
        return isinstance(value, KNOB_TYPES) and not inspect.ismodule(value)
    return {k: getattr(task, k) for k in dir(task) if is_knob(k)}


def eval_entry(entry):
    """An eval_tasks entry, 'task' (its own data source) or ('task', data_dir), as (task spec,
    data_dir, the name its metrics go under: eval/<name>/...). Raises ValueError naming it."""
    if isinstance(entry, str):
        spec, data_dir = entry, ''
    elif isinstance(entry, (tuple, list)) and len(entry) == 2 and all(isinstance(x, str)
                                                                      for x in entry):
        spec, data_dir = entry
    else:
        raise ValueError(f"eval_tasks: {entry!r}: expected 'task' or ('task', data_dir)")
    name = os.path.basename(spec)[:-3] if spec.endswith('.py') else spec.rpartition(':')[2]
    return spec, data_dir, name


def set_knobs(task, config):
    """Give the task the configured values of its knobs (its module globals, as nanoGPT's config
    sets globals)."""
    for k in knobs(task):
        if k in config:
            setattr(task, k, config[k])


def messages(task, example, system_prompt=None, instruction=None):
    """The task's messages for example; only the prompt parts the config overrides (not None) are
    passed."""
    parts = (('system_prompt', system_prompt), ('instruction', instruction))
    given = {k: v for k, v in parts if v is not None}
    return task.messages(example, **given)


def check_prompt_overrides(task, spec, system_prompt, instruction):
    """A task whose messages() takes no system_prompt/instruction cannot honour an override: say so
    at start-up."""
    params = inspect.signature(task.messages).parameters
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
    for k, v in (('system_prompt', system_prompt), ('instruction', instruction)):
        if v is not None and not takes_all and k not in params:
            raise ValueError(f"--{k}: task {spec!r}'s messages() takes no {k}")


def default_rewards(task):
    return getattr(task, 'rewards', None) or [{'name': 'correct', 'weight': 1.0}]


def answer_fn(task):
    from reward import extract_answer
    return getattr(task, 'answer', None) or extract_answer


def eval_metrics(task, completions, examples):
    """The task's metrics() hook on the completions ({} without one), its values as floats."""
    hook = getattr(task, 'metrics', None)
    if not callable(hook):
        return {}
    return {k: float(v) for k, v in hook(completions, examples).items()}


def tools_of(task):
    """({name: function}, style) of the tools the task's rollouts may call, or (None, None)."""
    listed = getattr(task, 'tools', None)
    if not listed:
        return None, None
    from sandbox import DEFAULT_TOOLS
    tools = {}
    for t in listed:
        if isinstance(t, str):
            if t not in DEFAULT_TOOLS:
                raise ValueError(f"task tool {t!r}: not a built-in tool "
                                 f"({', '.join(DEFAULT_TOOLS)}); give the function")
            tools[t] = DEFAULT_TOOLS[t]
        else:
            tools[t.__name__] = t
    return tools, getattr(task, 'tool_style', 'fenced')


def tool_call_limit(task, limit=None):
    """Calls per completion: limit (the config's max_tool_calls) unless None, else the task's
    max_tool_calls, else 4."""
    return limit if limit is not None else getattr(task, 'max_tool_calls', 4)
