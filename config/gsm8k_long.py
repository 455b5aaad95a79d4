# ~1.1 epochs of GSM8K train at 16 samples a prompt, full test-set eval. At the step time measured
# on an H200 (2026-11-27: 50 s for config/gsm8k.py's 256 rows, decode-bound; docs/performance.md),
# 512 rows a step make this some 4-5 hours.
import os
exec(open(os.path.join(os.path.dirname(__file__), 'gsm8k.py')).read())  # start from config/gsm8k.py
out_dir = 'out/gsm8k_long'
max_steps = 260  # 260 x 32 prompts ~ 1.1 epochs of 7,473 problems
group_size = 16  # more samples per prompt: fewer all-equal groups as accuracy rises
micro_batch_size = 32
max_new_tokens = 512
eval_every = 65
eval_examples = 0  # all 1,319 test problems
