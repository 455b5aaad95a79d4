"""
Tools a model calls in the middle of a rollout, with no torch: what the tools are, how a call is
recognised and parsed in the model's text, how it runs under a time limit, and what text goes back.

Two ways of writing a call (STYLES):
- 'hermes', what Qwen2.5/Qwen3 chat templates teach:
  <tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>. The answers go
  back as tool messages (tool_messages) that the chat template renders.
- 'json', what Llama 3.1+ chat templates teach: a turn that is one JSON object,
  {"name": "calculator", "parameters": {"expression": "6*7"}} (or "arguments"), answered by tool
  messages as for hermes.
- 'fenced', markdown blocks named after the tool, as in tool-integrated math reasoning:
  ```python\\nprint(6*7)\\n``` answered by ```output\\n42\\n``` (response_text).

A call's life: the sampler asks call_closed(turn_text, style) as a row writes, and pauses the row
when it is True; parse_calls reads the turn's calls; start_calls runs them on a thread pool
(run_call: never raises, never waits past the time limit); response_text or tool_messages make the
answer that is prefilled before the row decodes on. A tool is any function with type hints and a
Google-style docstring (json_schema describes it to the model); the tools themselves,
the calculator and the sandboxed python (DEFAULT_TOOLS), are in sandbox.py.
"""
import inspect
import json
import re
import threading
import time
import types
import typing

from sandbox import cut_middle

STYLES = ('hermes', 'json', 'fenced')
TIMEOUT_SLACK_S = 1.0  # extra wait for a tool that keeps the time limit itself (python kills its
# processes at the limit, then cleans up)
RESPONSE_FENCE = 'output'  # the fence of a fenced answer, never a tool's name

# ----------------------------------------------------------------------------- schemas

JSON_TYPES = {str: 'string', int: 'integer', float: 'number', bool: 'boolean',
              type(None): 'null', list: 'array', dict: 'object'}
SECTIONS = ('Args:', 'Returns:', 'Raises:')


def _type_schema(hint, where):
    """The JSON schema of a type hint, by transformers' rules (basic types, list[...],
    dict[str, ...], Optional/Union, Literal, Any)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any:
        return {}
    if origin is None and hint in JSON_TYPES:
        return {'type': JSON_TYPES[hint]}
    if origin is typing.Union or origin is types.UnionType:
        subs = [_type_schema(a, where) for a in args if a is not type(None)]
        if len(subs) == 1:
            out = subs[0]
        elif all(s.keys() == {'type'} and isinstance(s['type'], str) for s in subs):
            names = sorted({s['type'] for s in subs})
            out = {'type': names[0] if len(names) == 1 else names}
        else:
            out = {'anyOf': subs}
        if type(None) in args:
            out['nullable'] = True
        return out
    if origin is typing.Literal and all(type(a) in JSON_TYPES for a in args):
        kinds = list(dict.fromkeys(JSON_TYPES[type(a)] for a in args))
        return {'type': kinds[0] if len(kinds) == 1 else kinds, 'enum': list(args)}
    if origin is list and args:
        return {'type': 'array', 'items': _type_schema(args[0], where)}
    if origin is dict and args:
        return {'type': 'object', 'additionalProperties': _type_schema(args[1], where)}
    if origin in (list, dict):
        return {'type': JSON_TYPES[origin]}
    raise ValueError(f"{where}: no JSON schema for the type hint {hint!r}")


def _docstring_parts(doc):
    """(description, {argument: description}, returns description or None) of a Google-style
    docstring: an argument's continuation lines are joined by single spaces."""
    description, args, returns = [], {}, []
    section, arg, indent = None, None, None
    for line in doc.splitlines():
        if line.strip() in SECTIONS:
            section = line.strip()
            continue
        if section is None:
            description.append(line)
        elif section == 'Args:':
            m = re.match(r'([ \t]*)(\w+)(?:[ \t]*\([^()\n]*\))?:\s*(.*)', line)
            if m and (indent is None or len(m.group(1)) <= indent):
                arg, indent = m.group(2), len(m.group(1))
                args[arg] = [m.group(3).strip()]
            elif arg is not None and line.strip():
                args[arg].append(line.strip())
        elif section == 'Returns:':
            returns.append(line)
    args = {k: ' '.join(p for p in parts if p) for k, parts in args.items()}
    return '\n'.join(description).strip(), args, ('\n'.join(returns).strip() or None)


def json_schema(fn):
    """The tool description a chat template shows the model, from fn's type hints and Google-style
    docstring, as transformers.utils.get_json_schema writes it: {'type': 'function', 'function':
    {'name', 'description', 'parameters': {'type': 'object', 'properties', 'required'}, 'return'}}.
    Keyword-only parameters are left out: they are the tool's settings (python's timeout, a
    rollout's state), which run_call passes and the model never sets."""
    name = getattr(fn, '__name__', 'operation')
    doc = inspect.getdoc(fn)
    if not doc:
        raise ValueError(f"tool {name}: no docstring to describe it to the model")
    description, arg_docs, returns = _docstring_parts(doc)
    hints = typing.get_type_hints(fn)
    properties, required = {}, []
    for p in inspect.signature(fn).parameters.values():
        if p.kind is p.KEYWORD_ONLY:
            continue
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ValueError(f"tool {name}: *{p.name} cannot be described to the model")
        if p.name not in hints:
            raise ValueError(f"tool {name}: argument {p.name} has no type hint")
        if p.name not in arg_docs:
            raise ValueError(f"tool {name}: the docstring's Args: do not describe {p.name}")
        prop = _type_schema(hints[p.name], f"tool {name}, argument {p.name}")
        text = arg_docs[p.name]
        choices = re.search(r'\(choices:\s*(.*?)\)\s*$', text, flags=re.IGNORECASE)
        if choices:
            prop['enum'] = json.loads(choices.group(1))
            text = text[:choices.start()].strip()
        prop['description'] = text
        properties[p.name] = prop
        if p.default is p.empty:
            required.append(p.name)
    parameters = {'type': 'object', 'properties': properties}
    if required:
        parameters['required'] = required
    function = {'name': name, 'description': description, 'parameters': parameters}
    if 'return' in hints:
        try:
            function['return'] = _type_schema(hints['return'], f"tool {name}, return")
        except ValueError:
            pass  # the model never writes the return value: no schema is better than a wrong one
        else:
            if returns is not None:
                function['return']['description'] = returns
    return {'type': 'function', 'function': function}




# ----------------------------------------------------------------------------- finding calls

HERMES_OPEN, HERMES_CLOSE = '<tool_call>', '</tool_call>'
PYTHON_TAG = '<|python_tag|>'  # Llama 3.1+: may open a json call
# a call is the text between an opening and the next closing with no other opening between them
HERMES_CALL = re.compile(r'<tool_call>((?:(?!<tool_call>).)*?)</tool_call>', re.DOTALL)
# a fenced block: ``` and a word at a line's start, the body, then a line of ``` alone
FENCED_BLOCK = re.compile(r'^```(\w+)[ \t]*\n(.*?)^```[ \t]*$', re.MULTILINE | re.DOTALL)


def _check_style(style):
    if style not in STYLES:
        raise ValueError(f"unknown tool call style {style!r} (styles: {', '.join(STYLES)})")


def _is_tool_name(name, names):
    if names is None:
        return name != RESPONSE_FENCE
    return name in names


def call_closed(turn_text, style, *, names=None):
    """Whether turn_text (what the model wrote since the prompt or the last tool response) ends,
    trailing whitespace aside, with a call it has just closed: hermes, a '</tool_call>' closing the
    last '<tool_call>'; fenced, the closing fence of a ```name block. names: for fenced, the tool
    names that count (None: any word but 'output'); pass the tools so that a ```json block in an
    answer is not taken for a call."""
    _check_style(style)
    text = turn_text.rstrip()
    if style == 'json':
        return bool(parse_calls(text, style))
    if style == 'hermes':
        if not text.endswith(HERMES_CLOSE):
            return False
        before = text[:-len(HERMES_CLOSE)]
        return before.rfind(HERMES_OPEN) > before.rfind(HERMES_CLOSE)
    if not text.endswith('```'):
        return False
    blocks = list(FENCED_BLOCK.finditer(text))
    return bool(blocks) and blocks[-1].end() == len(text) and _is_tool_name(blocks[-1][1], names)


def _parse_error(message):
    return {'error': 'parse', 'message': f"error: cannot read the tool call: {message}"}


def _json_turn(turn_text):
    """json: the turn's one call, or [] when the turn is not a call (it does not start with '{',
    after an optional <|python_tag|>, or is a JSON object without a "name": an answer)."""
    text = turn_text.strip()
    if text.startswith(PYTHON_TAG):
        text = text[len(PYTHON_TAG):].lstrip()
    if not text.startswith('{'):
        return []
    try:
        call = json.loads(text, strict=False)
    except json.JSONDecodeError as e:
        return [_parse_error(f"not JSON ({e})")] if text.startswith('{"name"') else []
    if not isinstance(call, dict) or 'name' not in call:
        return []
    if 'parameters' in call and 'arguments' not in call:
        call = {'name': call['name'], 'arguments': call['parameters']}
    return [_hermes_call(json.dumps(call))]


def _hermes_call(body):
    try:
        # strict=False: a literal newline inside a string (code written across lines) is accepted
        call = json.loads(body, strict=False)
    except json.JSONDecodeError as e:
        return _parse_error(f"not JSON ({e})")
    if not isinstance(call, dict):
        return _parse_error('it must be a JSON object with "name" and "arguments"')
    name, arguments = call.get('name'), call.get('arguments', {})
    if not isinstance(name, str) or not name:
        return _parse_error('it has no "name"')
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments, strict=False)
        except json.JSONDecodeError as e:
            return _parse_error(f'"arguments" of {name} is a string that is not JSON ({e})')
    if not isinstance(arguments, dict):
        return _parse_error(f'"arguments" of {name} must be a JSON object')
    return {'name': name, 'arguments': arguments}


def parse_calls(turn_text, style, *, names=None):
    """Every call in turn_text, in order: {'name', 'arguments': dict}, or {'error': 'parse',
    'message'} for one that cannot be read (bad JSON, no name, arguments not an object).
    hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call>, arguments also as a JSON
    string holding an object, missing arguments as {}; an opening never closed is not a call.
    fenced: ```name\\nBODY\\n``` gives {'name': name, 'arguments': {'_body': BODY}}, which run_call
    hands to the tool's one required parameter. names: as in call_closed."""
    _check_style(style)
    if style == 'hermes':
        return [_hermes_call(m[1]) for m in HERMES_CALL.finditer(turn_text)]
    if style == 'json':
        return _json_turn(turn_text)
    calls = []
    for m in FENCED_BLOCK.finditer(turn_text):
        if _is_tool_name(m[1], names):
            body = m[2][:-1] if m[2].endswith('\n') else m[2]
            calls.append({'name': m[1], 'arguments': {'_body': body}})
    return calls


# ----------------------------------------------------------------------------- running calls

def _one_line(text):
    return ' '.join(str(text).split())


def _result(name, arguments, output, error, start):
    return {'name': name, 'arguments': arguments, 'output': cut_middle(output), 'error': error,
            'seconds': time.monotonic() - start}


def _call_into(fn, kwargs, box):
    """The worker thread's body: the tool's value as text, or what it raised (an `async def` tool
    runs on the run's event loop: reward.awaited)."""
    try:
        value = fn(**kwargs)
        if inspect.isawaitable(value):
            from reward import awaited
            value = awaited(value)
        box['output'] = str(value)
    except BaseException as e:
        box['raised'] = e


def takes_state(fn):
    """Whether tool fn has a keyword-only `state` parameter: it is given its rollout's state (the
    task's rollout_state(example)), which the model neither sees nor sets."""
    try:
        p = inspect.signature(fn).parameters.get('state')
    except (TypeError, ValueError):
        return False
    return p is not None and p.kind is p.KEYWORD_ONLY


def run_call(call, tools, timeout, state=None):
    """Run one parsed call: {'name', 'arguments', 'output', 'error', 'seconds'}. error is None, or
    'parse' (unreadable call or arguments), 'unknown' (no such tool), 'raised' (the tool raised;
    output 'error: ValueError: ...') or 'timeout'. output is what the model reads, str()-ed and
    cut to sandbox.MAX_OUTPUT_CHARS. Never raises, and returns within timeout (+ TIMEOUT_SLACK_S for a
    tool with a keyword-only timeout, which gets the limit and keeps it: python kills its
    processes), and state to a tool with a keyword-only state (takes_state). A tool that raises
    TimeoutError is a 'timeout' with its message as the output (python's holds what the program
    printed). The tool runs in a thread of its own, and a thread cannot be killed: a tool that
    overruns is abandoned, still running, and its thread ends when the tool returns."""
    start = time.monotonic()
    name, arguments = call.get('name', ''), call.get('arguments', {})
    if call.get('error'):
        return _result(name, arguments, call.get('message', 'error: cannot read the tool call'),
                       'parse', start)
    if not isinstance(arguments, dict):
        return _result(name, arguments, 'error: the arguments must be a JSON object', 'parse',
                       start)
    fn = tools.get(name)
    if fn is None:
        message = f"error: unknown tool {name!r} (tools: {', '.join(tools)})"
        return _result(name, arguments, message, 'unknown', start)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}  # a builtin without a signature: called as it is
    settings = {k for k, p in params.items() if p.kind is p.KEYWORD_ONLY}
    if '_body' in arguments:
        needed = [k for k, p in params.items()
                  if p.kind is not p.KEYWORD_ONLY and p.default is p.empty]
        if len(needed) != 1:
            message = (f"error: tool {name!r} takes {len(needed)} required arguments, "
                       "and a fenced block gives it one")
            return _result(name, arguments, message, 'parse', start)
        arguments = {needed[0]: arguments['_body']}
    for key in arguments:
        if key in settings:
            message = f"error: TypeError: {name}() got an unexpected keyword argument {key!r}"
            return _result(name, arguments, message, 'raised', start)
    kwargs, wait = dict(arguments), timeout
    if 'timeout' in settings:
        kwargs['timeout'], wait = timeout, timeout + TIMEOUT_SLACK_S
    if 'state' in settings:
        kwargs['state'] = state
    box = {}
    worker = threading.Thread(target=_call_into, args=(fn, kwargs, box), name=f'tool {name}',
                              daemon=True)
    worker.start()
    worker.join(wait)
    if worker.is_alive():
        return _result(name, arguments, f"error: timed out after {timeout:g} s", 'timeout', start)
    if 'output' in box:
        return _result(name, arguments, box['output'], None, start)
    e = box['raised']
    if isinstance(e, TimeoutError):
        message = str(e) or f"error: timed out after {timeout:g} s"
        return _result(name, arguments, message, 'timeout', start)
    message = f"error: {type(e).__name__}"
    if _one_line(e):
        message += f": {_one_line(e)}"
    return _result(name, arguments, message, 'raised', start)


def start_calls(calls, tools, timeout, pool, state=None):
    """Start every call on pool (a concurrent.futures executor): one future per call, each
    resolving to run_call's dict. The calls run at once, unless one of them goes to a tool that
    takes the rollout's state: then one after another, in the order written (a call that timed out
    is abandoned, still running, as run_call says, and the next one starts)."""
    if not any(takes_state(tools.get(c.get('name'))) for c in calls):
        return [pool.submit(run_call, call, tools, timeout) for call in calls]
    futures = []
    for call in calls:
        futures.append(pool.submit(_run_after, futures[-1] if futures else None, call, tools, timeout,
                                   state))
    return futures


def _run_after(previous, call, tools, timeout, state):
    if previous is not None:
        previous.result()
    return run_call(call, tools, timeout, state)


def tool_messages(results):
    """hermes: the chat messages that answer the calls, for the chat template to render."""
    return [{'role': 'tool', 'name': r['name'], 'content': r['output']} for r in results]


def response_text(results, style):
    """fenced: the text that answers the calls, a ```output block for each. It starts a line: put
    '\\n' before it if the model's text does not end with one. hermes answers are tool messages
    (tool_messages), which the chat template renders."""
    _check_style(style)
    if style == 'hermes':
        raise ValueError("hermes answers are tool messages for the chat template: use "
                         "tool_messages(results)")
    blocks = []
    for r in results:
        output = r['output'].rstrip('\n')
        blocks.append(f"```{RESPONSE_FENCE}\n{output}\n```\n")
    return ''.join(blocks)


# ----------------------------------------------------------------------------- template answers

TURN_STYLES = ('hermes', 'json')  # calls that end the turn, answered by the chat template
PROBE_RESULT = 'probe result 7'  # what the start-up check's tool returns


def schemas(tools):
    """The JSON schemas of tools ({name: function}), as a chat template's `tools` variable takes
    them."""
    return [json_schema(fn) for fn in tools.values()]


def template_variables(tools, style):
    """What render_chat takes to show tools to the model: hermes and json tools are shown by the
    chat template (its `tools` variable); fenced ones, and none, by the task's own prompt."""
    return {'tools': schemas(tools)} if style in TURN_STYLES else {}


def _probe(name, content, n_calls, system=None):
    """A conversation that ends with an assistant turn making n_calls calls of name."""
    call = {'type': 'function', 'function': {'name': name, 'arguments': {'x': content}}}
    messages = [{'role': 'user', 'content': f'question {content}'}]
    if system is not None:
        messages.insert(0, {'role': 'system', 'content': system})
    return messages + [{'role': 'assistant', 'content': content, 'tool_calls': [call] * n_calls}]


def _stop_positions(ids, stops):
    return [i for i, t in enumerate(ids) if t in stops]


def template_answers(tok, tools, style='hermes'):
    """hermes and json: checks once that tok's chat template can answer calls token in, token
    out, and returns answer(results) -> the token ids to insert after the stop token that ended a
    turn of calls: the rest of that turn as the template writes it, the tool messages, and the
    next assistant turn's generation prompt. They are the template's own delta, cut from one
    rendering of a short conversation (its user turn, an assistant turn of calls, the tool
    messages) after the stop token that ends the assistant turn, and tokenized whole (a result's
    newlines merge with the template's; special-token text in a result stays text, as in every
    message content).

    The model's own turn is never rendered again: what it sampled is kept as sampled. So what this
    needs is only that the delta does not depend on the conversation before it, which is checked
    here on conversations that differ in system turn, user text, assistant text and number of calls
    (a template that fails gets one ValueError naming its file). Qwen2.5's template passes and is
    also prefix-preserving (the turn renders the same whether or not a tool message follows).
    Qwen3's is not prefix-preserving (a last assistant turn gets an empty <think> block that
    vanishes once a tool message follows), which matters to a trainer that renders the whole
    conversation again after each turn (TRL swaps in a patched template for it); here it does not
    matter, since earlier turns are never rendered again, and Qwen3's delta passes the check."""
    where = getattr(tok, 'template_file', None) or 'the tokenizer'
    if getattr(tok, 'template', None) is None:
        raise ValueError(f"tool_style {style!r} answers calls through the snapshot's chat "
                         f"template, and {where} has none: use tool_style='fenced'")
    listed = schemas(tools)
    stops = set(tok.stop_ids)
    name = next(iter(tools))

    turn_ends = {}  # probe -> stop tokens before its assistant turn (rendered once per probe)

    def delta(results, probe=('probe', 1, None)):
        content, n_calls, system = probe
        before = _probe(name, content, n_calls, system)
        if probe not in turn_ends:
            turn_ends[probe] = len(_stop_positions(tok.render_chat(
                before[:-1], add_generation_prompt=False, tools=listed), stops))
        k = turn_ends[probe]
        ids = tok.render_chat(before + tool_messages(results), add_generation_prompt=True,
                              tools=listed)
        ends = _stop_positions(ids, stops)
        if len(ends) <= k:
            raise ValueError(f"{where}: the chat template does not end an assistant turn of tool "
                             "calls with a stop token, so tool answers cannot be inserted")
        return ids[ends[k] + 1:]

    prompt = tok.decode(tok.render_chat(_probe(name, 'probe', 1)[:-1], tools=listed))
    if name not in prompt:
        raise ValueError(f"{where}: the chat template does not show the tools (no {name!r} in a "
                         "prompt rendered with tools=...): the model cannot know them")
    results = [{'name': name, 'output': PROBE_RESULT}]
    want = delta(results)
    if PROBE_RESULT not in tok.decode(want):
        raise ValueError(f"{where}: the chat template does not render tool messages' contents")
    most = 3 if style == 'hermes' else 1  # a json turn is one call
    for probe in (('other text', 1, None), ('', most, 'a system turn'), ('x\n\n', 2, '')):
        probe = probe[:1] + (min(probe[1], most),) + probe[2:]
        if delta(results, probe) != want:
            raise ValueError(f"{where}: the chat template's tool answer depends on the turns "
                             "before it, so it cannot be inserted token in, token out: use "
                             "tool_style='fenced' or a template whose tool turns do not")

    def answer(results):
        return delta([{'name': r['name'], 'output': r['output']} for r in results])
    return answer


def user_turns(tok):
    """For a task that answers the model's turns (its respond hook): checks once that tok's chat
    template can add a user turn token in, token out, and returns answer(text) -> the token ids to
    insert after the stop token that ended an assistant turn: the rest of that turn as the template
    writes it, a user turn holding text, and the next assistant turn's generation prompt. Cut from
    renderings of short conversations, checked not to depend on what came before, as
    template_answers' tool turns are; a template that fails gets one ValueError naming it."""
    where = getattr(tok, 'template_file', None) or 'the tokenizer'
    stops = set(tok.stop_ids)

    def delta(text, content='probe', system=None):
        before = [{'role': 'user', 'content': f'question {content}'}]
        if system is not None:
            before.insert(0, {'role': 'system', 'content': system})
        k = len(_stop_positions(tok.render_chat(before, add_generation_prompt=False), stops))
        turns = before + [{'role': 'assistant', 'content': content}, {'role': 'user', 'content': text}]
        ids = tok.render_chat(turns, add_generation_prompt=True)
        ends = _stop_positions(ids, stops)
        if len(ends) <= k:
            raise ValueError(f"{where}: the chat template does not end an assistant turn with a stop "
                             "token, so a user turn cannot be added after one")
        return ids[ends[k] + 1:]

    want = delta(PROBE_RESULT)
    if PROBE_RESULT not in tok.decode(want):
        raise ValueError(f"{where}: the chat template does not render the user turn's content")
    for content, system in (('other text', None), ('', 'a system turn'), ('x\n\n', '')):
        if delta(PROBE_RESULT, content, system) != want:
            raise ValueError(f"{where}: the chat template's user turn depends on the turns before "
                             "it, so it cannot be added token in, token out")
    return delta
