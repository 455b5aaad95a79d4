# The full recipe (many hours on one GPU; use torchrun on several): 3 epochs, 16 samples, long
# answers, KL anchor.
import os
exec(open(os.path.join(os.path.dirname(__file__), 'gsm8k.py')).read())  # start from config/gsm8k.py
out_dir = 'out/gsm8k_full'
max_steps = 700  # ~3 epochs of 32 prompts per step
group_size = 16
max_new_tokens = 768
beta = 0.01  # a light pull towards the start model over a long run
kl_warmup_steps = 50
grad_checkpoint = True  # long completions: trade recompute for activation memory
eval_every = 100
eval_examples = 0
save_every = 50
