"""Reward functions the training tests name as 'grpo_test_rewards:fn' (tests/ is put on
PYTHONPATH)."""
import ctypes
import os


def digit_fraction(completion, example, **kwargs):
    """Easy to learn from a random init: a byte model only has to favour 10 of its 260 tokens."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)


def segfault_after_step_1(completion, example, step):
    """From the second step on: a line written below Python, then a read of address 0, as a broken
    compiled extension would do (the process dies of SIGSEGV)."""
    if step >= 1:
        os.write(2, b"native library: about to fail\n")
        ctypes.string_at(0)
    return digit_fraction(completion, example)


def always_zero(completion, example):
    return 0.0


def always_raise(completion, example):
    raise RuntimeError("reward server unreachable")


def first_char_even(completion, example):
    """A coin flip per completion for a random model: about half of the groups of 2 get identical
    rewards."""
    return float(ord(completion[:1] or 'a') % 2 == 0)


def step_count(completion, example, step):
    """The GRPO steps done before this one: the step reaches a reward that names it."""
    return float(step)


def not_applicable(completion, example):
    """A checker for another task's samples: applies to none of these."""
    return None


def length_even(completion, example):
    """A coin flip per completion for a policy whose completions vary in length (one that calls
    tools, say, whose first characters do not vary)."""
    return float(len(completion) % 2 == 0)


def even_answer(completion, example):
    """1 for every completion of a problem whose answer is even (solved, as far as drop_easy can
    tell); else half digit_fraction: below 1, with a spread to train on."""
    if int(example['answer']) % 2 == 0:
        return 1.0
    return 0.5 * digit_fraction(completion, example)


def always_one(completion, example):
    return 1.0


def verl_compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """A verl custom reward function (its signature, keyword-called as verl's reward manager calls
    it): 1 when the text after the last '####' is the ground truth; a dict for the MATH source, as
    verl allows; extra_info's bonus added."""
    right = float(solution_str.rpartition('####')[2].strip() == str(ground_truth))
    right += (extra_info or {}).get('bonus', 0.0)
    return {'score': right, 'acc': right} if data_source == 'lighteval/MATH' else right


def trl_accuracy(completions, answer, **kwargs):
    """A TRL reward function for a conversational dataset (its signature and calling convention):
    the completions as assistant turns, the dataset's answer column as a keyword list."""
    return [float(c[0]['content'].rpartition('####')[2].strip() == a)
            for c, a in zip(completions, answer)]


def trl_state_and_prompts(prompts, completions, trainer_state, log_metric, log_extra, **kwargs):
    """A TRL reward function reading the step, the prompts as plain text (a standard dataset) and
    logging through the trainer's hooks; None for a completion it does not judge."""
    log_metric('prompt_chars', 1.0)
    log_extra('note', ['x'] * len(completions))
    return [None if c == 'skip' else trainer_state.global_step + len(p) for p, c in zip(prompts, completions)]


async def async_digit_fraction(completion, example, **kwargs):
    """digit_fraction as an `async def` (an API judge's shape): the same value, after yielding to
    the event loop once."""
    import asyncio
    await asyncio.sleep(0)
    return digit_fraction(completion, example)


async def trl_async_accuracy(completions, answer, **kwargs):
    """trl_accuracy as an async TRL reward function."""
    import asyncio
    await asyncio.sleep(0)
    return trl_accuracy(completions, answer)
