# GRPO on GSM8K with a Python interpreter to call (tasks/gsm8k_tools.py, docs/tools.md):
# Qwen2.5-0.5B-Instruct writes <tool_call>{"name": "python", "arguments": {"code": ...}}</tool_call>
# as its chat template taught it, ends the turn, and reads what the program printed as a tool
# message, then goes on to the answer in \boxed{}. Needs a GPU (H100-class); not yet run or timed:
#   python train_grpo.py config/gsm8k_tools.py --data_dir=../shared/gsm8k
# Only the right answer is rewarded, never a call: GRPO decides whether calling pays. Watch, beside
# reward/mean, eval/pass@1 and frac_zero_std (metrics.jsonl; the step line shows `calls`):
#   tools/calls_per_completion  calls per completion: does the model call at all, and does GRPO move
#                               it up or down
#   tools/errors/parse          calls it cannot write (bad JSON, no name); /unknown: names other
#                               than python; /raised: calls the tool refused (no `code`);
#                               /timeout: programs past tool_timeout. A program's own traceback
#                               comes back as its output and is not an error here
#   tools/turn_limit_frac       rows ended for calling past max_tool_calls (a model stuck calling)
#   tools/token_frac            inserted / all completion tokens; with response_len/clip_frac, how
#                               much of max_new_tokens the answers take and how many rows it cuts
#   tools/latency_p50, _p95     seconds per call (a fresh interpreter each)
out_dir = 'out/gsm8k_tools'
init_from = 'Qwen/Qwen2.5-0.5B-Instruct'  # or a local snapshot directory (its chat template shows
# the tools and renders their answers: tool_style 'hermes' needs it)
# Qwen3 (e.g. init_from = 'Qwen/Qwen3-0.6B') thinks at length unless its template is told not to;
# for it this config uses, so that answers fit max_new_tokens:
#   chat_template_kwargs = {'enable_thinking': False}
task = 'gsm8k_tools'  # tasks/gsm8k_tools.py: gsm8k's data, grading and rewards, the python tool
data_dir = ''  # '' downloads openai/gsm8k; offline use --data_dir=../shared/gsm8k
group_size = 8  # completions per prompt
batch_prompts = 32  # 256 completions per step
micro_batch_size = 16  # rows per forward/backward: half gsm8k's, the rows are up to twice as long
# sampled and inserted tokens together: a ~300-token solution, a few calls of ~50 tokens and their
# answers (~20 tokens of template each, plus what the program printed)
max_new_tokens = 1024
max_tool_calls = 4  # calls per completion: a few steps of working and a retry; one more ends it
tool_timeout = 5.0  # seconds per program: GSM8K arithmetic takes milliseconds, a loop is cut here
# decode steps before a program's output goes in: a python call takes ~0.04-0.1 s (a new sandboxed
# interpreter), an H100 decode step of 0.5B ~0.02-0.03 s; a later tool is waited for (tools/wait_s)
tool_delay_steps = 4
temperature = 1.0  # sampling temperature
lr = 1e-6  # peak learning rate
warmup_steps = 10  # linear warmup
max_steps = 300  # GRPO steps
# no reference model: saves its memory and a forward pass; the small lr keeps steps small (with
# num_iterations = 1 the ratio is 1 and nothing clips)
beta = 0.0
rewards = [{'name': 'correct', 'weight': 1.0},
           {'name': 'format', 'weight': 0.1, 'kwargs': {'pattern': 'boxed'}}]  # as config/gsm8k.py
eval_every = 50  # greedy pass@1 on held-out problems, with tools as in training
eval_examples = 500  # held-out problems per evaluation
export_best = 'eval/pass@1'  # out_dir/hf_best/: the weights of the best evaluation so far
save_every = 50  # checkpoint every N steps
