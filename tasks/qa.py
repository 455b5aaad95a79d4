"""
Your own problems with reference answers, no code: --task=qa --data_dir=DIR reads DIR/train.jsonl and
DIR/test.jsonl (or the splits' .parquet files) in either of the layouts other trainers take:
- a question and its answer: {'question': str, 'answer': ...} (GSM8K-style .jsonl; TRL's 'prompt'
  column and MATH's 'problem' are read as the question);
- verl's preprocessed parquet (examples/data_preprocess/*.py): {'data_source', 'prompt': [chat
  messages], 'reward_model': {'ground_truth': ...}, ...}.
qa_question_key and qa_answer_key name other columns; a dotted name reaches into a dict column
('reward_model.ground_truth'). An answer may be a string, a number, or a list of strings and numbers
(any one of them is right). A question string becomes the user turn with the system prompt and
instruction; a prompt given as chat messages is used as it stands (a system_prompt or instruction
set in the config is still applied to it). qa_grader says what is right: 'number' (reward.is_correct,
GSM8K's checker: the final number, \\boxed{} or after '####' or 'the answer is', numerically), 'math'
(math-verify on the last \\boxed{}, as tasks/math.py, for LaTeX answers) or 'exact' (the completion,
stripped, is the answer). A data_source column also gives pass@1 per source at each evaluation
(eval/<source>/pass@1, as verl's val-core/<source>/...) when there are several. The data_source,
the answer column as it stands and extra_info are kept for a verl reward function:
rewards=[{'name': 'verl_score', 'kwargs': {'fn': 'my_reward.py:compute_score'}}] (reward.py).
"""
import math
from decimal import Decimal

from data import parse_rows, read_rows

qa_question_key = ''  # the question's column; '' = the first of 'question', 'prompt', 'problem'
qa_answer_key = ''  # the answer's column; '' = the first of 'answer', 'reward_model.ground_truth'
qa_grader = 'number'  # 'number', 'math' (math-verify on the last \boxed{}) or 'exact'
skip_bad_rows = False  # malformed rows: False = stop with file:line, True = skip and count them
SYSTEM_PROMPT = ''
INSTRUCTION = "Reason step by step, then put the final answer in \\boxed{}."
rewards = [{'name': 'correct', 'weight': 1.0}]

QUESTION_KEYS = ('question', 'prompt', 'problem')
ANSWER_KEYS = ('answer', 'reward_model.ground_truth')
GRADERS = ('number', 'math', 'exact')


def column(row, key):
    """row's value at key, a dotted key reaching into dicts ('reward_model.ground_truth'); None
    when absent."""
    for part in key.split('.'):
        if not isinstance(row, dict) or part not in row:
            return None
        row = row[part]
    return row


def first_column(row, given, known, what):
    keys = [given] if given else known
    for key in keys:
        if column(row, key) is not None:
            return column(row, key)
    raise ValueError(f"no {what} column: the row has {sorted(row)}, looked for {list(keys)} "
                     f"(set qa_{what}_key)")


def answers(value):
    """A reference answer as a list of strings (a list: any one of them is right). A float is
    written out without an exponent (0.00005, not 5e-05, which the 'number' grader reads as -5)."""
    values = value if isinstance(value, (list, tuple)) else [value]
    if not values or not all(isinstance(v, (str, int, float)) and not isinstance(v, bool)
                             for v in values):
        raise ValueError(f"the answer {value!r} is not a string, a number or a list of them")
    return [format(Decimal(repr(v)), 'f') if isinstance(v, float) and math.isfinite(v)
            else str(v).strip() for v in values]


def parse_row(row):
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    question = first_column(row, qa_question_key, QUESTION_KEYS, 'question')
    truth = first_column(row, qa_answer_key, ANSWER_KEYS, 'answer')
    # the answer column as it is, for a verl reward function (reward.verl_score)
    example = {'answer': answers(truth), 'ground_truth': truth}
    if isinstance(question, str) and question.strip():
        example['question'] = question.strip()
    elif isinstance(question, (list, tuple)) and question and all(
            isinstance(m, dict) and isinstance(m.get('role'), str)
            and isinstance(m.get('content'), str) for m in question):
        example['messages'] = [{'role': m['role'], 'content': m['content']} for m in question]
    else:
        raise ValueError("the question is neither a non-empty string nor a list of chat messages "
                         "({'role', 'content'})")
    if isinstance(row.get('data_source'), str):
        example['source'] = row['data_source']
    if isinstance(row.get('extra_info'), dict):
        example['extra_info'] = row['extra_info']
    return example


def load(split, data_dir='', seed=0, stats=None):
    """The rows of data_dir's `split` ('train' | 'test'); a malformed row raises one ValueError
    naming file and line (skip_bad_rows: skipped and counted)."""
    if qa_grader not in GRADERS:
        raise ValueError(f"qa_grader={qa_grader!r}: expected one of {GRADERS}")
    if not data_dir:
        raise ValueError("task 'qa' reads your files: --data_dir=DIR holding train.jsonl and "
                         "test.jsonl (or the splits' .parquet files)")
    return parse_rows(read_rows(data_dir, split), parse_row, skip_bad_rows, 'qa', stats)


def messages(example, system_prompt=None, instruction=None):
    """A question: [system,] user = question + instruction (None: this task's defaults). Chat
    messages: as they stand, a given system prompt replacing their system turn ('': none) and a
    given instruction after the last user turn."""
    if 'question' in example:
        system = SYSTEM_PROMPT if system_prompt is None else system_prompt
        extra = INSTRUCTION if instruction is None else instruction
        user = f"{example['question']}\n{extra}" if extra else example['question']
        return ([{'role': 'system', 'content': system}] if system else []) + [
            {'role': 'user', 'content': user}]
    msgs = [dict(m) for m in example['messages']]
    if system_prompt is not None:  # replaces the system turn ('': none)
        msgs = [m for m in msgs if m['role'] != 'system']
        msgs = ([{'role': 'system', 'content': system_prompt}] if system_prompt else []) + msgs
    last_user = max((i for i, m in enumerate(msgs) if m['role'] == 'user'), default=None)
    if instruction and last_user is not None:
        msgs[last_user]['content'] += f"\n{instruction}"
    return msgs


def grade(completion, example):
    """Right when the completion matches any of the example's answers by qa_grader."""
    return any(_grade_one(completion, a) for a in example['answer'])


def _grade_one(completion, reference):
    if qa_grader == 'exact':
        return completion.strip() == reference
    if qa_grader == 'math':
        from tasks import math as math_task
        return math_task.grade(completion, {'answer': reference})
    from reward import is_correct
    return is_correct(completion, reference)


def metrics(completions, examples):
    """pass@1 per data source, when the examples come from several (verl's data_source)."""
    by_source = {}
    for c, ex in zip(completions, examples):
        by_source.setdefault(ex.get('source', 'no_source'), []).append(grade(c, ex))
    if len(by_source) < 2:
        return {}
    return {f'{source}/pass@1': sum(v) / len(v) for source, v in by_source.items()}
