"""Reward functions the training tests name as 'grpo_test_rewards:fn' (tests/ is put on PYTHONPATH)."""


def digit_fraction(completion, example, **kwargs):
    """Easy to learn from a random init: a byte model only has to favour 10 of its 260 tokens."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)


def always_zero(completion, example):
    return 0.0


def always_raise(completion, example):
    raise RuntimeError("reward server unreachable")
