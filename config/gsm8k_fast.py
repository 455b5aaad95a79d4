# A quick look: does the loop run, does reward move? Small batch, short answers: at the decode
# speed measured on an H200 (2026-11-27: 72 ms a decode step; docs/performance.md) some 20 minutes.
import os
exec(open(os.path.join(os.path.dirname(__file__), 'gsm8k.py')).read())  # start from config/gsm8k.py
out_dir = 'out/gsm8k_fast'
batch_prompts = 16
micro_batch_size = 32
max_new_tokens = 256
max_steps = 50
eval_every = 25
eval_examples = 100
save_every = 25
