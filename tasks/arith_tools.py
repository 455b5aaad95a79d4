"""
The arithmetic word problems of tasks/arith.py with a calculator to call: the offline demo of
rollouts that call tools (config/arith_tools.py). Same problems, prompts and grading as arith.

The warm start's solutions come from two teachers, as in the arith demo: a share
(arith_calculator) call the calculator and copy its answer,

    ```calculator
    80-7
    ```
    ```output
    73
    ```
    #### 73

always right; the others state the result at once with the carry or borrow dropped
(arith.slip: '80-7=83'), right about half the time. A model that imitates the majority is right
about half the time; GRPO has the room to learn to call the tool. During rollouts the ```output
block is not the model's: sample.generate_with_tools inserts the calculator's real answer there.
"""
import random
from functools import lru_cache

import tool_calls
from sandbox import DEFAULT_TOOLS
from tasks import arith

arith_difficulty = 'starter'  # preset of tasks/arith.py: 'starter', 'easy', 'medium', 'hard'
arith_n_train = 5000  # training problems
arith_n_test = 200  # held-out problems
arith_calculator = 0.4  # share of training solutions that call the calculator (the rest slip)
rewards = [{'name': 'correct', 'weight': 1.0}]
tools = ['calculator']
tool_style = 'fenced'


def load(split, data_dir='', seed=0):
    """The train or test split of tasks/arith.py for these knobs, the training solutions rewritten
    in the two styles above (data_dir is not used)."""
    train, test = _splits(arith_n_train, arith_n_test, seed, arith_difficulty, arith_calculator)
    return list(train if split == 'train' else test)


def messages(example, system_prompt='', instruction=''):
    return arith.messages(example, system_prompt, instruction)


def grade(completion, example):
    return arith.grade(completion, example)


def solution(example):
    return example['solution']


def with_calculator(solution):
    """'80-7=73\\n#### 73' -> each line's left side sent to the calculator, its answer copied after
    '####', written exactly as a rollout would hold it (the output block as generate_with_tools
    inserts it)."""
    lines = solution.split('\n')
    out, answer = '', None
    for line in lines:
        if line.startswith('#### '):
            continue
        expression = line.split('=')[0]
        call = f"```calculator\n{expression}\n```"
        result = tool_calls.run_call(tool_calls.parse_calls(call, 'fenced')[0],
                                     DEFAULT_TOOLS, 5.0)
        out += call + '\n' + tool_calls.response_text([result], 'fenced')
        answer = result['output']
    return out + f"#### {answer}"


@lru_cache(maxsize=2)
def _splits(n_train, n_test, seed, difficulty, calculator):
    train, test = arith.arith_splits(n_train, n_test, seed, difficulty=difficulty)
    styles = random.Random(f'calculator {seed}')  # its own stream: the problems stay arith's
    rewritten = []
    for ex in train:
        if styles.random() < calculator:
            rewritten.append({**ex, 'solution': with_calculator(ex['solution'])})
        else:
            rewritten.append({**ex, 'solution': arith.slip(ex['solution'])})
    return tuple(rewritten), tuple(test)
