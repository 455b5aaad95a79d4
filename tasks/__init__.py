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
                                    ('calculator', 'python', 'python_repl') or functions
                                    with type hints and a docstring; its completions then run
                                    through sample.generate_with_tools (docs/tools.md)
    tool_style = 'fenced'           how a call is written: 'fenced' (a ```name block, answered by
                                    an ```output block), 'hermes' (<tool_call>{json}</tool_call>)
                                    or 'json' (a turn that is one {"name", "parameters"} object,
                                    Llama 3.1+); hermes and json answers are the chat template's
    max_tool_calls = 4              calls per completion, unless the config sets max_tool_calls
    rollout_state(example) -> object
        a fresh state for each completion (TRL's environment_factory, verifiers' StatefulToolEnv):
        tools with a keyword-only `state` parameter get their rollout's (hidden from the model;
        without rollout_state, a new {}), and grade(completion, example, state) and rewards
        declaring `state` get it at the end
    respond(turn, state) -> str | None
        the environment's answer when a turn of the model ends without a call (verifiers'
        env_response): a str goes in as a user turn and the model goes on, None ends the rollout
    max_turns = 4                   user turns respond may add to a rollout (a task knob)
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
import random
import types

REQUIRED = ('load', 'messages', 'grade')
INTERFACE = REQUIRED + ('rewards', 'solution', 'answer', 'metrics', 'tools', 'tool_style',
                        'max_tool_calls', 'rollout_state', 'respond')
BUILTIN = ('gsm8k', 'gsm8k_tools', 'math', 'arith', 'arith_tools', 'chess', 'qa', 'countdown')
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
    check_state(task, spec)
    return task


def check_state(task, spec):
    """rollout_state without respond or a tool that takes `state` is refused (a tool that takes it
    without rollout_state gets a new {} per rollout)."""
    make = getattr(task, 'rollout_state', None)
    if make is not None and not callable(make):
        raise ValueError(f"task {spec!r}: rollout_state must be a function of an example")
    respond = getattr(task, 'respond', None)
    if respond is not None and not callable(respond):
        raise ValueError(f"task {spec!r}: respond must be a function of (turn, state)")
    if make is not None and respond is None and not stateful_tools(task):
        raise ValueError(f"task {spec!r} defines rollout_state(), but neither respond() nor any of its "
                         "tools takes `state` (a keyword-only parameter) to be given it")


def stateful_tools(task):
    """The names of the task's tools that take their rollout's state (tool_calls.takes_state)."""
    if not getattr(task, 'tools', None):
        return []
    import tool_calls
    return [name for name, fn in tools_of(task)[0].items() if tool_calls.takes_state(fn)]


def rollout_states(task, examples, group_size):
    """A new state for each of the group_size completions of each example, in the order the
    sampler lays rows out: the task's rollout_state(example), or {} where only its respond or
    tools take a state; None for a task with neither."""
    make = getattr(task, 'rollout_state', None)
    if make is None and getattr(task, 'respond', None) is None and not stateful_tools(task):
        return None
    return [make(ex) if make else {} for ex in examples for _ in range(group_size)]


def grade(task, completion, example, state=None):
    """task.grade(completion, example), with its rollout's state when its grade takes one."""
    from reward import graded
    return graded(task.grade, completion, example, state)


def knobs(task):
    """{name: default} of the task's knobs: its public lowercase attributes of plain config
    types."""
    def is_knob(k):
        if k.startswith('_') or k != k.lower() or k in INTERFACE:
            return False
        value = getattr(task, k)
        return isinstance(value, KNOB_TYPES) and not inspect.ismodule(value)
    return {k: getattr(task, k) for k in dir(task) if is_knob(k)}


def name_of(spec):
    """The name a task's metrics go under: 'math', a file's stem, module:attr's attr."""
    return os.path.basename(spec)[:-3] if spec.endswith('.py') else spec.rpartition(':')[2]


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
    return spec, data_dir, name_of(spec)


def mix_entry(entry):
    """A mix_tasks entry, 'task', ('task', data_dir) or ('task', data_dir, times), as (task spec,
    data_dir, times, name). Raises ValueError naming it."""
    parts = (entry,) if isinstance(entry, str) else entry
    ok = isinstance(parts, (tuple, list)) and 1 <= len(parts) <= 3
    ok = ok and all(isinstance(x, str) for x in parts[:2])
    times = parts[2] if ok and len(parts) == 3 else 1.0
    if not ok or isinstance(times, bool) or not isinstance(times, (int, float)) or not times > 0:
        raise ValueError(f"mix_tasks: {entry!r}: expected 'task', ('task', data_dir) or ('task', "
                         "data_dir, times) with times > 0")
    spec, data_dir = (*parts[:2], '')[:2]
    return spec, data_dir, float(times), name_of(spec)


def eval_entries(eval_tasks, mix_tasks):
    """(task spec, data_dir, name) of each held-out set evaluated beside the run's task's:
    eval_tasks', then each mixed-in task's test split (mix_tasks) not among them already."""
    out = [eval_entry(e) for e in eval_tasks]
    for spec, data_dir, _, name in map(mix_entry, mix_tasks):
        if (spec, data_dir, name) not in out:
            out.append((spec, data_dir, name))
    return out


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


# --------------------------------------------------------------------------- mixtures (mix_tasks)
MIX_KEY = 'mix_task'  # what a mixed-in training problem carries: the name of its task


def mixture(main, main_name, parts):
    """The run's task with parts [(name, task, data_dir, times)] mixed into its training problems
    (train_grpo's mix_tasks), as one task. Each part's train split joins the run's task's `times`
    times (0.5: a seeded half of it, 2: all of it twice), each problem tagged with its task's name
    under MIX_KEY; a tagged problem is prompted (its task's own system prompt and instruction),
    graded and warm-started by its task, the rest by the run's task (the prompt overrides
    system_prompt/instruction apply to these only). The test split is the run's task's: each part's
    is evaluated apart, as eval_tasks'. Default rewards: each problem its own task's (see
    mixed_rewards). Raises ValueError naming a task that calls tools, or two with one name."""
    of = {name: task for name, task, _, _ in parts}
    names = [main_name] + [name for name, *_ in parts]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"mix_tasks: two tasks named {name!r} (their problems and metrics "
                             "would mix)")
    for name, task in [(main_name, main), *of.items()]:
        if getattr(task, 'tools', None) or getattr(task, 'respond', None):
            raise ValueError(f"mix_tasks: task {name!r} calls tools or answers turns; a mixture "
                             "trains tasks without either")

    def task_name(example):  # the name of a problem's task
        return example.get(MIX_KEY, main_name)

    def task_of(example):
        return of.get(task_name(example), main)

    def load(split, data_dir='', seed=0):
        out = list(main.load(split, data_dir=data_dir, seed=seed))
        for name, task, ddir, times in (parts if split == 'train' else ()):
            try:
                got = task.load('train', data_dir=ddir, seed=seed)
            except (ValueError, RuntimeError, FileNotFoundError) as e:
                raise type(e)(f"mix_tasks: task {name!r}: {e}") from e
            out += [{**ex, MIX_KEY: name} for ex in times_over(got, times, f'{name} {seed}')]
        return out

    def mixed_messages(example, system_prompt=None, instruction=None):
        if MIX_KEY in example:
            return task_of(example).messages(example)
        return messages(main, example, system_prompt, instruction)

    def grade(completion, example):
        return task_of(example).grade(completion, example)

    mixed = {'load': load, 'messages': mixed_messages, 'grade': grade, 'task_of': task_of,
             'task_name': task_name,
             'rewards': mixed_rewards([(main_name, main), *of.items()], task_name)}
    if all(callable(getattr(t, 'solution', None)) for t in [main, *of.values()]):
        mixed['solution'] = lambda example: task_of(example).solution(example)
    for name in ('answer', 'metrics'):  # the evaluation of the run's task's test split
        if hasattr(main, name):
            mixed[name] = getattr(main, name)
    return types.SimpleNamespace(**mixed)


def times_over(examples, times, seed):
    """round(times x len(examples)) of them: every one floor(times) times, then a seeded share."""
    n = len(examples)
    order = random.Random(seed).sample(range(n), n)
    return [examples[order[i % n]] for i in range(round(times * n))] if n else []


def mixed_rewards(named, task_name):
    """The default rewards of a mixture of the tasks in named [(name, task)], task_name(example) the
    name of a problem's task: each problem gets its own task's. An entry every task lists alike
    stays as it is ('correct' then pays each problem's own grade); one only some list, or listed
    alike with another function ('correct': each task's grade), calls the problem's task's function
    and gives None (does not apply) for the others'. Raises ValueError when tasks give one name
    another weight or kwargs, or such an entry scores batches (a reward model)."""
    from reward import _accepts, _builtin, resolve_rewards
    seen = {}  # name -> (weight, kwargs, {task name: (fn, entry)})
    for owner, task in named:
        for entry in default_rewards(task):
            got = resolve_rewards([entry], grade=task.grade)[0]
            fn = got['name'] if callable(got['name']) else _builtin(got['name'])
            name = got['name'] if isinstance(got['name'], str) else fn.__name__
            weight, kwargs, fns = seen.setdefault(name, (got['weight'], got['kwargs'], {}))
            if (weight, kwargs) != (got['weight'], got['kwargs']):
                raise ValueError(f"mix_tasks: task {owner!r}'s default reward {name!r} has "
                                 f"weight {got['weight']} and kwargs {got['kwargs']}, another "
                                 f"task's {weight} and {kwargs}; set --rewards for the mixture")
            fns[owner] = (fn, entry)
    out = []
    for name, (weight, kwargs, fns) in seen.items():
        entries = [entry for _, entry in fns.values()]
        alike = len({id(fn) for fn, _ in fns.values()}) == 1 or name == 'correct'
        if len(fns) == len(named) and alike and all(e == entries[0] for e in entries):
            out.append(entries[0])  # every task's, the same: 'correct' pays the mixture's grade
            continue
        if any(getattr(fn, 'batched', False) for fn, _ in fns.values()):
            raise ValueError(f"mix_tasks: the default reward {name!r} scores batches, and not every "
                             "task lists it alike; set --rewards for the mixture")
        def dispatched(completion, example, _fns=fns, _kwargs=kwargs, **facts):
            fn = _fns.get(task_name(example), (None,))[0]
            if fn is None:
                return None  # not this problem's task's reward
            accepts = _accepts(fn)
            facts = {k: v for k, v in facts.items() if accepts is None or k in accepts}
            return fn(completion, example, **_kwargs, **facts)
        dispatched.__name__ = name
        out.append({'name': dispatched, 'weight': weight})
    return out
