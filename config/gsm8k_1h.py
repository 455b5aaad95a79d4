# About an hour on one H100 (estimated from the step workload, not yet measured): 200 steps of 32
# prompts x 8.
import os
exec(open(os.path.join(os.path.dirname(__file__), 'gsm8k.py')).read())  # start from config/gsm8k.py
out_dir = 'out/gsm8k_1h'
max_steps = 200
max_new_tokens = 400
eval_every = 50
eval_examples = 300
