"""
GSM8K with a Python interpreter to call (config/gsm8k_tools.py): the problems, grading, rewards and
warm-start targets of tasks/gsm8k.py, with the sandboxed `python` tool (sandbox.python) written
as a chat-template call, as Qwen2.5-Instruct was trained to write them (tool_style 'hermes'):

    <tool_call>
    {"name": "python", "arguments": {"code": "print(16 - 3 - 4)"}}
    </tool_call>

then the turn ends; sample.generate_with_tools runs the program and inserts its output as a tool
message rendered by the snapshot's chat template, after which the model's next turn goes on. The
prompt lists the tool's schema (the chat template's `tools`) and asks for the final answer in
\\boxed{}, which gsm8k's grader reads first. grade sees the whole rollout: the calls, the inserted
outputs and the final answer.
"""
from tasks import gsm8k

skip_bad_rows = False  # malformed rows: False = stop with file:line, True = skip and count them
SYSTEM_PROMPT = ("You are a helpful assistant that solves math problems. You may run Python with "
                 "the python tool: each call runs its code as a new program and returns only what "
                 "it prints, so print every value you need.")
INSTRUCTION = ("Reason step by step, using the python tool for the calculations if it helps, then "
               "put the final answer in \\boxed{}.")
rewards = gsm8k.rewards  # correct + 0.1 format (a number in \boxed{})
tools = ['python']  # sandbox.python: a fresh sandboxed interpreter per call
tool_style = 'hermes'  # <tool_call>{json}</tool_call> ends the turn; the output is a tool message


def load(split, data_dir='', seed=0, stats=None):
    """GSM8K `split` as tasks/gsm8k.py loads it, with this task's skip_bad_rows."""
    saved, gsm8k.skip_bad_rows = gsm8k.skip_bad_rows, skip_bad_rows
    try:
        return gsm8k.load(split, data_dir, seed, stats)
    finally:
        gsm8k.skip_bad_rows = saved


def messages(example, system_prompt=SYSTEM_PROMPT, instruction=INSTRUCTION, few_shot=()):
    """gsm8k's messages with this task's prompt; the tool's schema is not in them: the chat template
    renders it from the task's tools."""
    return gsm8k.messages(example, system_prompt, instruction, few_shot)


grade = gsm8k.grade
solution = gsm8k.solution  # the warm start's target: the reference working, no tool calls
