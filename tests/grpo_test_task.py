"""A task defined outside the project, as a user's would be (tests/ is put on PYTHONPATH):
--task=grpo_test_task:parity plugs in the object `parity`, --task=tests/grpo_test_task.py the module
itself. Its grade is deliberately one that the built-in numeric checker would never agree with, so a
test can tell whose grade an evaluation used."""
import types

from data import question_messages

parity_n_train = 40  # a knob of this task: training questions
parity_n_test = 16  # and held-out ones


def load(split, data_dir='', seed=0):
    n = parity_n_train if split == 'train' else parity_n_test
    offset = 100 * (split == 'test')
    return [{'question': f"Is {i + offset} odd?", 'answer': str(i % 2)} for i in range(n)]


def messages(example, system_prompt='', instruction=''):
    return question_messages(example['question'], system_prompt, instruction)


def grade(completion, example):
    """Right when the parity of the completion's byte sum is the example's answer: about half of any
    model's."""
    return sum(completion.encode()) % 2 == int(example['answer'])


parity = types.SimpleNamespace(load=load, messages=messages, grade=grade)
no_grade = types.SimpleNamespace(load=load, messages=messages)
