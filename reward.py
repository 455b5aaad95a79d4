"""
Answer extraction, grading and the reward functions GRPO optimises.

Every reward function has one contract, fn(completion: str, example: dict, **kwargs) -> float, or
its batched form (fn.batched = True), fn(completions: [str], examples: [dict], **kwargs) -> [float],
called once per step with every completion (a model scores them in batches, not one call each). A
value may be None: the function does not apply to that sample (a batch mixing tasks), which is left
out of the function's mean and adds nothing to the total. A fn that names `step` in its signature
gets the number of GRPO steps done before this one (0 at the first: TRL's
trainer_state.global_step), e.g. to anneal a format reward. The config says which run, with what
weight and what keyword arguments:
    rewards = [{'name': 'correct', 'weight': 1.0, 'kwargs': {'correct': 1.0}},
               ('format', 0.1, {'pattern': 'boxed'}), ('length', 1.0),
               ('reward_model', 1.0, {'path': DIR})]
check_reward_config() rejects unknown names and unknown kwargs up front, because a kwarg that is
silently dropped looks exactly like a kwarg that works. The model-based rewards ('reward_model',
'judge') are in reward_model.py. A function may be `async def` (an API judge): a step's calls of it
then run at once, on one event loop kept for the run (awaited).
"""
import asyncio
import functools
import importlib
import importlib.util
import inspect
import json
import math
import re
import threading
import time
import types
import urllib.request
from fractions import Fraction

# A number as people write it: optional sign, digits with optional thousands commas, optional
# decimals, optional "/denominator"; or decimals alone (".5" is 0.5) where no word character or dot
# precedes the point (so "1.2.3" is 1.2 and 3, "...5" and "v.5" are 5). ASCII digits only, so
# int-like parsing never meets exotic unicode digits. Every piece is deterministic (no two ways to
# match the same char), so scanning stays linear. The sign counts only where it cannot be a binary
# minus ("12-7" is 12 and 7, not 12 and -7).
_NUM = re.compile(r"(?:(?<![0-9)}\]])-)?"  # the sign
                  r"(?:(?:[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+)"  # digits, maybe with commas
                  r"(?:\.[0-9]+)?"  # decimals
                  r"|(?<![\w.])\.[0-9]+)"  # or decimals alone
                  r"(?: ?/ ?[0-9]+)?")  # a denominator
_BOXED = re.compile(r"\\(?:boxed|fbox)\s{0,8}\{")
# \frac{3}{4}, \dfrac{3}{4}, \tfrac34 -> 3/4, so fractions take the same path as "3/4".
_FRAC = re.compile(r"\\[dt]?frac\s{0,8}\{\s{0,8}(-?[0-9.,]+)\s{0,8}\}"
                   r"\s{0,8}\{\s{0,8}([0-9.,]+)\s{0,8}\}")
_FRAC_SHORT = re.compile(r"\\[dt]?frac([0-9])([0-9])")
# A mixed number, 2\frac{1}{2} or 2\frac12 -> 5/2 (not 21/2); a sign before it stays, so -2\frac{1}{2}
# is -5/2. Not after a letter, '^' or a decimal ("x^2\frac{1}{2}" is a product), nor on numbers
# too long to multiply out (those keep the old reading).
_MIXED = re.compile(r"(?<![\w.,^])([0-9]{1,50}) {0,8}\\[dt]?frac(?:\s{0,8}\{\s{0,8}([0-9]{1,50})\s{0,8}\}"
                    r"\s{0,8}\{\s{0,8}([0-9]{1,50})\s{0,8}\}|([0-9])([0-9]))")
_TEXT = re.compile(r"^\\(?:text|textbf|mathrm)\s{0,8}\{(.*)\}$", re.S)  # \boxed{\text{yes}} -> yes
_MARKERS = [re.compile(r"####"), re.compile(r"answer is", re.I), re.compile(r"final answer", re.I)]
_WINDOW = 80  # how far after a marker ("the answer is") the number may sit
# LaTeX and currency noise that sits between a marker and its number: \$18, 1{,}234, 50\%,
# 1\,000, −3.
_NOISE = (('\\$', ''), ('$', ''), ('{,}', ','), ('\\,', ''), ('\\!', ''), ('\\%', '%'),
          ('\u2212', '-'))


def _mixed(m):
    whole, a, b = int(m[1]), int(m[2] or m[4]), int(m[3] or m[5])
    return f"{whole * b + a}/{b}" if b else m[0]


def _clean(text):
    for a, b in _NOISE:
        text = text.replace(a, b)
    text = _MIXED.sub(_mixed, text)
    text = _FRAC.sub(r'\1/\2', text)
    return _FRAC_SHORT.sub(r'\1/\2', text)


def _canon_decimal(s):
    # String arithmetic, not int(): Python refuses int() on strings over 4,300 digits.
    neg = s.startswith('-')
    whole, _, frac = s.lstrip('-').replace(',', '').partition('.')
    out = whole.lstrip('0') or '0'
    frac = frac.rstrip('0')
    if frac:
        out += '.' + frac
    return '-' + out if neg and out != '0' else out


def _canon(num):
    """'1,234' -> '1234', '-3.50' -> '-3.5', '6 / 8' -> '6/8' (fractions are compared by value
    later)."""
    num = num.replace(' ', '')
    if '/' in num:
        a, b = num.split('/')
        return _canon_decimal(a) + '/' + _canon_decimal(b)
    return _canon_decimal(num)


def _boxed_spans(text):
    """(start, end) of the contents of every closed \\boxed{...}, in order. One pass pairs all
    braces, so nesting is free and a 100 kB run of unclosed '\\boxed{' costs one scan, not one scan
    per opener."""
    openers = [m.end() - 1 for m in _BOXED.finditer(text)]
    if not openers:
        return []
    close = {}
    stack = []
    for m in re.finditer(r"[{}]", text):
        if m.group() == '{':
            stack.append(m.start())
        elif stack:
            close[stack.pop()] = m.start()
    # spans, not slices: nested boxes would copy O(n^2)
    return [(i + 1, close[i]) for i in openers if i in close]


def last_boxed(text):
    """The contents of the last closed, non-empty \\boxed{...} (or \\fbox{...}), stripped; None when
    there is none. Raw LaTeX, for checkers that read it (tasks/math.py)."""
    for a, b in reversed(_boxed_spans(text)):
        content = text[a:b].strip()
        if content:
            return content
    return None


def _first_number(s):
    m = _NUM.search(s)
    return _canon(m.group()) if m else None


def extract_answer(text):
    """Final answer in canonical form ('1234', '-3.5', '3/4', or a non-numeric boxed string), else
    None. Order of trust: last \\boxed{}, '####', 'the answer is', 'final answer', then the last
    number."""
    try:
        if not isinstance(text, str) or not text:
            return None
        text = _clean(text)
        for a, b in reversed(_boxed_spans(text)):
            content = text[a:b].strip()
            if content:  # an empty \boxed{} is the instruction echoed back, not an answer
                # "x = 5" and "12+7=19" -> the part after '='; then the first number ("25 m^2" ->
                # 25).
                ans = _first_number(content.rpartition('=')[2]) or _TEXT.sub(r'\1', content).strip()
                if ans:
                    return ans
        for marker in _MARKERS:
            last = None
            for last in marker.finditer(text):
                pass
            if last is not None:
                num = _first_number(text[last.end():last.end() + _WINDOW])
                if num is not None:
                    return num
        last = None
        for last in _NUM.finditer(text):
            pass
        return _canon(last.group()) if last else None
    except Exception:  # a grader must never take the run down; an unparseable answer is just wrong
        return None


def _value(s):
    """Exact rational value of a canonical number string, or None for non-numbers / absurd
    lengths."""
    if len(s) > 200 or not re.fullmatch(r"-?[0-9.]+(?:/[0-9.]+)?", s):
        return None
    try:
        a, _, b = s.partition('/')
        return Fraction(a) / Fraction(b) if b else Fraction(a)
    except (ValueError, ZeroDivisionError):
        return None


def is_correct(completion, reference, rel_tol=1e-6):
    """Numeric equality (exact for integers, rel_tol otherwise; fractions evaluated), else string
    equality."""
    pred = extract_answer(completion)
    if pred is None:
        return False
    ref = extract_answer(str(reference)) or str(reference).strip()
    if pred == ref:
        return True
    a, b = _value(pred), _value(ref)
    if a is None or b is None:
        return pred.strip().lower() == ref.strip().lower()
    if a == b or (a.denominator == 1 and b.denominator == 1):
        return a == b  # integers: exact, so 123456789012 never "equals" 123456789013
    return math.isclose(float(a), float(b), rel_tol=rel_tol, abs_tol=1e-9)


# --------------------------------------------------------------------------------------------------
# reward functions: fn(completion, example, **kwargs) -> float. Keyword defaults are the config
# defaults.

def correctness_reward(completion, example, correct=1.0, incorrect=0.0):
    """example['answer'] is the reference final answer."""
    return correct if is_correct(completion, example['answer']) else incorrect


def format_reward(completion, example, pattern='boxed', reward=1.0, missing=0.0, regex=''):
    """Did the completion put a number where the prompt asked? pattern: 'boxed' (\\boxed{n}) or
    '####' (within 80 characters after the last '####', where `correct` reads it: '#### **18**' and
    '####\\n18' count). regex: instead, does the completion match this regular expression
    (re.search, '.' also matching newlines; anchor it with \\A and \\Z), e.g. R1's
    r'\\A<think>.*?</think>\\s*<answer>.*?</answer>\\Z'."""
    if regex:
        return reward if re.search(regex, completion, re.DOTALL) else missing
    text = _clean(completion)
    if pattern == 'boxed':
        ok = any(_NUM.search(text, a, b) for a, b in _boxed_spans(text))
    elif pattern == '####':
        last = None
        for last in re.finditer('####', text):
            pass
        ok = last is not None and _NUM.search(text[last.end():last.end() + _WINDOW]) is not None
    else:
        raise ValueError(f"format_reward: pattern must be 'boxed' or '####', got {pattern!r}")
    return reward if ok else missing


def length_penalty(completion, example, *, max_len=0, cache_len=0, penalty=1.0, n_tokens=None,
                   max_new_tokens=None):
    """DAPO soft overlong penalty: 0 up to max_len - cache_len, then linear down to -penalty at
    max_len. max_len 0: the run's max_new_tokens (train_grpo passes it per sample, with n_tokens);
    cache_len 0: a quarter of max_len. Length is n_tokens when the caller passes it, else characters
    (the same for the byte tokenizer)."""
    max_len = max_len or max_new_tokens
    if not max_len:
        raise ValueError("length: no max_len, and no max_new_tokens from the training loop "
                         "to default it to")
    cache_len = cache_len or max_len // 4
    n = len(completion) if n_tokens is None else n_tokens
    soft = max_len - cache_len
    if n <= soft:
        return 0.0
    return -penalty * min(1.0, (n - soft) / max(cache_len, 1))


def repetition_penalty(completion, example, ngram_size=3, max_penalty=-1.0):
    """N-gram repetition penalty (Demystifying Long CoT, appendix C.2; open-r1's `repetition_penalty`):
    max_penalty x the share of the completion's word n-grams (lowercased, split on whitespace) that
    repeat an earlier one; 0 for a completion shorter than one n-gram."""
    if max_penalty > 0 or ngram_size < 1:
        raise ValueError(f"repetition: max_penalty must be <= 0 (got {max_penalty}) and ngram_size >= 1 "
                         f"(got {ngram_size})")
    words = completion.lower().split()
    ngrams = [tuple(words[i:i + ngram_size]) for i in range(len(words) - ngram_size + 1)]
    if not ngrams:
        return 0.0
    return max_penalty * (1 - len(set(ngrams)) / len(ngrams))


def verl_score(completion, example, fn=''):
    """A verl reward function as it is: fn ('module:function' or 'path/to/file.py:function', verl's
    custom_reward_function path and name) is called as verl's reward manager calls it,
    fn(data_source=, solution_str=, ground_truth=, extra_info=), with the example's data_source,
    ground_truth and extra_info (tasks/qa.py keeps verl's columns; other tasks: their answer and
    no source). A dict it returns pays its 'score', as in verl."""
    value = _user_fn(fn, 'verl_score')(
        data_source=example.get('source', ''), solution_str=completion,
        ground_truth=example.get('ground_truth', example.get('answer')),
        extra_info=example.get('extra_info'))
    return value['score'] if isinstance(value, dict) else float(value)


def trl_reward(completions, examples, fn='', conversational=True, messages=None, step=None):
    """A TRL reward function as it is: fn ('module:function' or 'path/to/file.py:function') is
    called as GRPOTrainer calls it, once for the step's completions: fn(prompts=, completions=,
    completion_ids=, trainer_state=, log_extra=, log_metric=, **columns), each example field a
    column (a list, one value per completion). conversational: prompts as chat messages and each
    completion as [{'role': 'assistant', 'content': text}] (TRL's conversational datasets, as this
    project's prompts are), else plain strings (the prompt's last user turn). trainer_state has
    global_step (the steps done); log_extra and log_metric accept and drop their values. A None in
    what it returns: does not apply (as in TRL)."""
    prompts = [messages(ex) if messages else [] for ex in examples]
    if conversational:
        completions = [[{'role': 'assistant', 'content': c}] for c in completions]
    else:
        prompts = [next((m['content'] for m in reversed(p) if m['role'] == 'user'), '')
                   if isinstance(p, list) else p for p in prompts]
    columns = {k: [ex.get(k) for ex in examples] for k in examples[0] if k not in (
        'prompt', 'completion', 'completion_ids')} if examples else {}
    state = types.SimpleNamespace(global_step=step or 0)
    values = _user_fn(fn, 'trl_reward')(
        prompts=prompts, completions=completions, completion_ids=[None] * len(completions),
        trainer_state=state, log_extra=lambda *a, **k: None, log_metric=lambda *a, **k: None,
        **columns)
    if inspect.isawaitable(values):  # TRL's async reward functions
        values = awaited(values)
    return list(values)


trl_reward.batched = True


def openrlhf_reward(completions, examples, *, url='', fn='', label_key='answer', timeout=180.0, retries=5,
                    query=None, prompt_text=None):
    """OpenRLHF's reward protocol as it is, once for the step's completions: url (a reward server, or
    a list that the completions are shared over, OpenRLHF's --remote_rm_url) is sent
    {'query': [prompt + completion as the model saw them, special tokens included], 'prompts':
    [prompt text], 'labels': [example[label_key]]} by POST and pays the reply's 'rewards'; or fn
    ('path/to/file.py:reward_func' or 'module:function') is called as
    reward_func(queries, prompts, labels) and pays its dict's 'rewards'. A request that fails is
    tried again, retries times in all, a second apart; then the step's samples fail (counted in
    reward/<name>/errors; a run whose every reward fails stops after zero_reward_patience steps).
    query and prompt_text are per-sample facts from the training loop."""
    labels = [ex.get(label_key) for ex in examples]
    queries = query or completions
    prompts = prompt_text or [''] * len(completions)
    if fn:
        out = _user_fn(fn, 'openrlhf_reward')(queries, prompts, labels)
        return [float(v) for v in out['rewards']]
    urls = [url] if isinstance(url, str) else list(url)
    size = -(-len(completions) // len(urls))
    rewards = []
    for i, server in enumerate(urls):
        part = slice(i * size, (i + 1) * size)
        body = {'query': queries[part], 'prompts': prompts[part], 'labels': labels[part]}
        rewards += [float(v) for v in _post_json(server, body, timeout, retries)['rewards']]
    return rewards


openrlhf_reward.batched = True


def _post_json(url, body, timeout, retries):
    """The JSON reply to a JSON POST, tried up to retries times a second apart."""
    error = None
    for attempt in range(max(retries, 1)):
        if attempt:
            time.sleep(1.0)
        request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                         headers={'Content-Type': 'application/json'})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as reply:
                return json.loads(reply.read())
        except (OSError, ValueError) as e:  # refused, timed out, HTTP error, not JSON
            error = e
    raise RuntimeError(f"reward server {url}: {retries} tries failed, the last with "
                       f"{type(error).__name__}: {error}")


def _check_openrlhf(url='', fn='', **_):
    """At start-up: one of url (http or https) and fn, and fn loads (nothing is sent or run)."""
    if bool(url) == bool(fn):
        raise ValueError("give url (a reward server) or fn (a reward_func), one of them")
    if fn:
        _user_fn(fn, 'openrlhf_reward')
    for u in [url] if isinstance(url, str) else url:
        if not str(u).startswith(('http://', 'https://')):
            raise ValueError(f"url {u!r}: an http:// or https:// address")


openrlhf_reward.check = _check_openrlhf


@functools.lru_cache(maxsize=None)
def _user_fn(spec, who):
    """The function spec ('module:function' or 'path/to/file.py:function') names, for reward
    `who`. Raises ValueError naming what is wrong."""
    where, _, name = spec.rpartition(':')
    try:
        if where.endswith('.py'):
            mod_spec = importlib.util.spec_from_file_location(f'{who}_{name}', where)
            module = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
        found = getattr(module, name)
    except Exception as e:
        raise ValueError(f"{who}: cannot load {spec!r} ('module:function' or "
                         f"'path/to/file.py:function'): {type(e).__name__}: {e}") from None
    if not callable(found):
        raise ValueError(f"{who}: {spec!r} is not a function")
    return found


# at start-up: the function loads (no dry call)
verl_score.check = lambda fn='', **_: _user_fn(fn, 'verl_score')
trl_reward.check = lambda fn='', **_: _user_fn(fn, 'trl_reward')

REWARD_FNS = {'correct': correctness_reward, 'format': format_reward, 'length': length_penalty,
              'repetition': repetition_penalty, 'verl_score': verl_score, 'trl_reward': trl_reward,
              'openrlhf_reward': openrlhf_reward}
# reward_model.py's, imported on first use: it needs torch and hf.py
MODEL_REWARDS = ('reward_model', 'judge')
# per-sample facts, as train_grpo passes them
DRY_RUN_FACTS = {'n_tokens': 0, 'truncated': False, 'max_new_tokens': 512, 'step': 0}


def check_reward_config(rewards):
    """Normalise the reward config to [(name, fn, weight, kwargs)], raising on anything that would
    be ignored. Entries: {'name', 'weight'=1.0, 'kwargs'={}} dicts, or (name, weight[, kwargs])
    tuples; name is a key of REWARD_FNS or a callable."""
    out = []
    for entry in rewards:
        if isinstance(entry, dict):
            unknown = set(entry) - {'name', 'weight', 'kwargs'}
            if unknown:
                fixed = {k: v for k, v in entry.items() if k not in unknown}
                fixed['kwargs'] = {**(entry.get('kwargs') or {}), **{k: entry[k] for k in sorted(unknown)}}
                raise ValueError(f"reward config {entry!r}: unknown keys {sorted(unknown)}; a reward's own "
                                 f"arguments go in 'kwargs': {fixed!r}")
            if 'name' not in entry:
                raise ValueError(f"reward config {entry!r}: no 'name' (a reward or 'module:fn')")
            name = entry['name']
            weight = entry.get('weight', 1.0)
            kwargs = entry.get('kwargs') or {}
        else:
            entry = (entry,) if isinstance(entry, str) or callable(entry) else tuple(entry)
            if not 1 <= len(entry) <= 3:
                raise ValueError(f"reward config {entry!r}: expected (name, weight, kwargs)")
            # defaults fill what is missing
            name, weight, kwargs = (entry + (1.0, {})[len(entry) - 1:])[:3]
        fn = name if callable(name) else _builtin(name)
        if fn is None:
            known = sorted(REWARD_FNS) + list(MODEL_REWARDS)
            raise ValueError(f"reward config: unknown reward {name!r}; known: {known}")
        name = getattr(fn, '__name__', str(fn)) if callable(name) else name
        params = set(inspect.signature(fn).parameters)
        params -= {'completion', 'example', 'completions', 'examples'}
        if _accepts(fn) is not None:
            bad = sorted(set(kwargs) - params)
            if bad:
                raise ValueError(f"reward config: {name!r} has no keyword argument(s) {bad}; "
                                 f"it accepts {sorted(params)}")
        if not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ValueError(f"reward config: weight of {name!r} must be a finite number, "
                             f"got {weight!r}")
        if name in [o[0] for o in out]:
            raise ValueError(f"reward config: {name!r} listed twice")
        if callable(getattr(fn, 'check', None)):
            # a model reward's snapshot and template, verl_score's function: checked, none run
            try:
                fn.check(**kwargs)
            except (ValueError, OSError, TypeError) as e:
                # TypeError: a required kwarg (path) is missing
                raise ValueError(f"reward config: {name!r}: {e}") from None
        elif fn in REWARD_FNS.values():
            # a dry run, so a bad value (pattern='boxd') fails now, not every step
            try:
                # with the per-sample facts score() would pass (as train_grpo does)
                accepts = _accepts(fn)
                facts = {k: v for k, v in DRY_RUN_FACTS.items() if accepts is None or k in accepts}
                example = {'question': '', 'answer': '0', 'solution': ''}
                value = fn('', example, **{**kwargs, **facts})
                if value is not None:
                    float(value)
            except Exception as e:
                raise ValueError(f"reward config: {name!r} rejects kwargs {kwargs}: {e}") from e
        out.append((name, fn, float(weight), dict(kwargs)))
    return out


def graded(grade, completion, example, state=None):
    """A task's grade(completion, example), given the rollout's state (tasks.rollout_states) when it
    takes one."""
    if 'state' in inspect.signature(grade).parameters:
        return grade(completion, example, state=state)
    return grade(completion, example)


def grade_reward(grade):
    """The 'correct' reward of a task: `correct` when grade(completion, example) holds, else
    `incorrect` (graded: with the rollout's state for a grade that takes it)."""
    def correct(completion, example, correct=1.0, incorrect=0.0, state=None):
        return correct if graded(grade, completion, example, state) else incorrect
    return correct


def _builtin(name):
    if name in MODEL_REWARDS:
        import reward_model
        return getattr(reward_model, name)
    return REWARD_FNS.get(name)


def _with_fn(entry, fn):
    """A reward config entry with fn in place of its name, in the entry's own form."""
    if isinstance(entry, dict):
        return {**entry, 'name': fn}
    if isinstance(entry, str) or callable(entry):
        return fn
    return (fn, *tuple(entry)[1:])  # (name, weight[, kwargs])


def resolve_rewards(entries, grade=None, device='cpu', dtype='float32', messages=None):
    """The config's reward entries made runnable: a 'module:function' name imported (a user's reward
    function), and 'correct' paying the task's grade() when one is given, so the reward and
    eval/pass@1 judge alike. The run's device, compute dtype and messages (example -> the task's
    prompt messages) are given to each fn that names them in its signature (the model rewards),
    unless the entry's kwargs set them. Returns {'name', 'weight', 'kwargs'} dicts, checked by
    check_reward_config. Raises ValueError naming the entry."""
    run = {'device': device, 'dtype': dtype, 'messages': messages}
    out = []
    for entry in entries:
        if isinstance(entry, dict):
            name = entry.get('name')
        elif isinstance(entry, str) or callable(entry):
            name = entry
        else:  # (name, weight[, kwargs])
            name = (tuple(entry) or (None,))[0]
        if isinstance(name, str) and ':' in name:
            mod, _, attr = name.partition(':')
            try:
                entry = _with_fn(entry, getattr(importlib.import_module(mod), attr))
            except (ImportError, AttributeError) as e:
                raise ValueError(f"rewards: cannot import {mod}:{attr} ({e})") from e
        elif name == 'correct' and grade is not None:
            entry = _with_fn(entry, grade_reward(grade))
        out.append(entry)
    resolved = []
    for name, fn, weight, kwargs in check_reward_config(out):
        if _builtin(name) is not fn:  # a user's function or the task's grade: named by itself
            name = fn
        params = inspect.signature(fn).parameters
        given = {k: v for k, v in run.items() if k in params}
        resolved.append({'name': name, 'weight': weight, 'kwargs': {**given, **kwargs}})
    return resolved


def declared_facts(rewards):
    """The per-sample facts the configured rewards name in their signatures (not through
    **kwargs): what the training loop need work out only when some function asks ('query')."""
    return set().union(*(_accepts(fn) or () for _, fn, _, _ in check_reward_config(rewards)))


def _accepts(fn):
    # Per-sample facts (n_tokens, truncated, ...) are offered to every fn; each gets the ones it
    # declares.
    params = inspect.signature(fn).parameters
    return None if any(p.kind is p.VAR_KEYWORD for p in params.values()) else set(params)


# ----------------------------------------------------------------------------- async functions
_LOOP = {}  # 'loop': the run's event loop for async rewards and tools, started by the first one
_LOOP_LOCK = threading.Lock()


def awaited(awaitable):
    """What an awaitable (an `async def` reward's or tool's call) returns or raises, run on one
    event loop kept on a thread of its own for the whole run: a client an async function keeps
    between calls (an HTTP client) stays on the loop it was made on, as in TRL, which runs async
    reward functions on one loop too. Callable from any thread."""
    with _LOOP_LOCK:
        if 'loop' not in _LOOP:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name='async rewards and tools', daemon=True).start()
            _LOOP['loop'] = loop
    return asyncio.run_coroutine_threadsafe(_wait(awaitable), _LOOP['loop']).result()


async def _wait(awaitable):
    return await awaitable


async def _all(awaitables):
    """Every awaitable at once; what each returns or raises, in order."""
    return await asyncio.gather(*awaitables, return_exceptions=True)


def _values(fn, completions, examples, kwargs, extra_kwargs, step=None):
    """fn's value for each sample, or the exception raised in its place. A batched fn is called once
    for them all, with each per-sample fact it accepts as a list over the samples; any other fn once
    per sample. step (when not None) goes to a fn that accepts it, as one number."""
    accepts = _accepts(fn)
    if step is not None and (accepts is None or 'step' in accepts):
        kwargs = {**kwargs, 'step': step}
    if getattr(fn, 'batched', False):
        names = {k for extra in extra_kwargs for k in extra if accepts is None or k in accepts}
        try:
            facts = {k: [e.get(k) for e in extra_kwargs] for k in names}
            vs = fn(completions, examples, **{**kwargs, **facts})
            if inspect.isawaitable(vs):  # async def
                vs = awaited(vs)
            vs = list(vs)
            if len(vs) != len(completions):
                raise ValueError(f"returned {len(vs)} values for {len(completions)} completions")
            return vs
        except Exception as e:
            return [e] * len(completions)
    out = []
    for c, ex, extra in zip(completions, examples, extra_kwargs):
        try:
            facts = {k: x for k, x in extra.items() if accepts is None or k in accepts}
            out.append(fn(c, ex, **{**kwargs, **facts}))
        except Exception as e:
            out.append(e)
    pending = [i for i, v in enumerate(out) if inspect.isawaitable(v)]
    if pending:  # async def: every sample's call at once
        for i, v in zip(pending, awaited(_all([out[i] for i in pending]))):
            out[i] = v
    return out


def score(completions, examples, rewards, failure_reward=0.0, extra_kwargs=None, max_msgs=5, *,
          step=None):
    """Weighted sum of the configured rewards per sample (a batched fn called once for all of them).
    extra_kwargs: None or one dict per sample (e.g. {'n_tokens': 87}), passed to the fns that accept
    them; step: the GRPO steps done, for the fns that take it. A fn that raises (or returns a
    non-finite value) scores failure_reward for that sample, weighted like a normal value; it is
    counted in errors[name], and the first max_msgs messages are kept. A None is kept as None in
    per_fn and adds nothing to the total. Returns dict(total=[float],
    per_fn={name: [float or None]} (unweighted), errors={name: int},
    error_msgs=[str], all_failed=bool: every sample had at least one failing fn, which the training
    loop's guards watch)."""
    assert len(completions) == len(examples), (len(completions), len(examples))
    extra_kwargs = extra_kwargs or [{}] * len(completions)
    assert len(extra_kwargs) == len(completions), (len(extra_kwargs), len(completions))
    config = check_reward_config(rewards)
    total = [0.0] * len(completions)
    per_fn = {}
    errors = {}
    msgs = []
    failed = [False] * len(completions)
    for name, fn, weight, kwargs in config:
        per_fn[name] = []
        errors[name] = 0
        values = _values(fn, completions, examples, kwargs=kwargs, extra_kwargs=extra_kwargs,
                         step=step)
        for i, v in enumerate(values):
            if v is None:  # does not apply to this sample
                per_fn[name].append(None)
                continue
            try:
                if isinstance(v, Exception):
                    raise v
                v = float(v)
                if not math.isfinite(v):
                    raise ValueError(f"returned non-finite {v}")
            except Exception as e:
                v = float(failure_reward)
                failed[i] = True
                errors[name] += 1
                # one message per call: a batched fn's failures all come from its one call
                first_of_call = not getattr(fn, 'batched', False) or errors[name] == 1
                if len(msgs) < max_msgs and first_of_call:
                    msgs.append(f"{name} on sample {i}: {type(e).__name__}: {e}")
            per_fn[name].append(v)
            total[i] += weight * v
    return dict(total=total, per_fn=per_fn, errors=errors, error_msgs=msgs,
                all_failed=bool(failed) and all(failed))


def merge_scores(scs):
    """score()'s results for consecutive slices of samples (ranks, dynamic-sampling rounds) as one
    result."""
    def joined(lists):
        return [x for xs in lists for x in xs]
    return {'total': joined(s['total'] for s in scs),
            'per_fn': {k: joined(s['per_fn'][k] for s in scs) for k in scs[0]['per_fn']},
            'errors': {k: sum(s['errors'][k] for s in scs) for k in scs[0]['errors']},
            'error_msgs': joined(s['error_msgs'] for s in scs)[:5],
            'all_failed': all(s['all_failed'] for s in scs)}
