"""
GSM8K grade-school math (openai/gsm8k, MIT): the hub, or a local directory of train/test .jsonl or
.parquet. An example is {'question', 'answer' (the final answer, commas dropped), 'solution' (the
reference working)}.
"""
from data import parse_rows, question_messages, read_rows
from reward import is_correct

skip_bad_rows = False  # malformed rows: False = stop with file:line, True = skip and count them
SYSTEM_PROMPT = "You are a helpful assistant that solves math problems."
INSTRUCTION = "Reason step by step, then put the final answer in \\boxed{}."
# format: a number in \boxed{}
rewards = [{'name': 'correct', 'weight': 1.0}, {'name': 'format', 'weight': 0.1}]


def parse_row(row):
    """GSM8K row {'question', 'answer': 'reasoning ... #### 72'} -> our example dict. Raises
    ValueError(reason)."""
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    for key in ('question', 'answer'):
        if not isinstance(row.get(key), str) or not row[key].strip():
            raise ValueError(f"missing or empty field {key!r}")
    if '####' not in row['answer']:
        raise ValueError("no '####' before the final answer")
    final = row['answer'].rpartition('####')[2].strip().replace(',', '')
    if not final:
        raise ValueError("empty final answer after '####'")
    return {'question': row['question'].strip(), 'answer': final, 'solution': row['answer'].strip()}


def boxed_solution(solution):
    """A solution with its '#### n' line rewritten as the \\boxed{} answer the default instruction
    asks for."""
    if '####' not in solution:
        return solution
    body, _, final = solution.rpartition('####')
    return f"{body.rstrip()}\nThe final answer is \\boxed{{{final.strip()}}}.".lstrip()


def _hub_rows(split):
    try:
        import datasets
        ds = datasets.load_dataset('openai/gsm8k', 'main', split=split)
    except Exception as e:  # offline, no `datasets`, hub down: all end the same way for the user
        raise RuntimeError(f"could not load openai/gsm8k ({type(e).__name__}: {e}). Offline? "
                           "Point at a local copy of train.jsonl/test.jsonl with "
                           "--data_dir=../shared/gsm8k") from e
    for i, row in enumerate(ds):
        yield f'openai/gsm8k[{split}]:row {i}', row


def load(split, data_dir='', seed=0, stats=None):
    """GSM8K `split` ('train' | 'test'). data_dir '' downloads openai/gsm8k. A malformed row raises
    one ValueError naming file and line; with skip_bad_rows it is skipped and counted in
    stats['skipped'] (a dict you pass)."""
    rows = read_rows(data_dir, split) if data_dir else _hub_rows(split)
    return parse_rows(rows, parse_row, skip_bad_rows, 'GSM8K', stats)


def messages(example, system_prompt=SYSTEM_PROMPT, instruction=INSTRUCTION, few_shot=()):
    """Chat messages for one example. few_shot: examples shown as earlier user/assistant turns (for
    base models); their answers take the format the instruction asks for, since a demonstration in
    another format teaches that."""
    *msgs, last = question_messages(example['question'], system_prompt, instruction)
    for shot in few_shot:
        if instruction and '\\boxed' in instruction:
            answer = boxed_solution(shot['solution'])
        else:
            answer = shot['solution']
        msgs += question_messages(shot['question'], '', instruction)
        msgs += [{'role': 'assistant', 'content': answer}]
    return msgs + [last]


def grade(completion, example):
    return is_correct(completion, example['answer'])


def solution(example):
    """The warm start's target: the reference working, its '#### n' line as the \\boxed{} the prompt
    asks for."""
    return boxed_solution(example['solution'])
