# 200 steps of 32 prompts x 8, answers up to 400 tokens. Measured on an H200 (2026-11-27, random
# weights, config/gsm8k.py's shape): about 50 s a step, 37 s of it decoding (72 ms a decode step,
# launch-bound; docs/performance.md), so with 400 tokens about 40 s: some 2 h 15 min.
import os
exec(open(os.path.join(os.path.dirname(__file__), 'gsm8k.py')).read())  # start from config/gsm8k.py
out_dir = 'out/gsm8k_medium'
max_steps = 200
max_new_tokens = 400
eval_every = 50
eval_examples = 300
