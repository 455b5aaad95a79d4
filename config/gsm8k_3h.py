# About three hours on one H100 (estimated, not yet measured): ~1.1 epochs of GSM8K train, full
# test-set eval.
import os
exec(open(os.path.join(os.path.dirname(__file__), 'gsm8k.py')).read())  # start from config/gsm8k.py
out_dir = 'out/gsm8k_3h'
max_steps = 260  # 260 x 32 prompts ~ 1.1 epochs of 7,473 problems
group_size = 16  # more samples per prompt: fewer all-equal groups as accuracy rises
micro_batch_size = 32
max_new_tokens = 512
eval_every = 65
eval_examples = 0  # all 1,319 test problems
