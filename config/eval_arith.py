# Evaluate the offline demo's model on the arithmetic task's held-out split (the split train_grpo.py evaluates on):
#   python sample.py config/eval_arith.py --init_from=out/arith/hf
data = 'arith'
arith_difficulty = 'starter'
split = 'test'
num_examples = 0
system_prompt = ''  # the demo trains without a system turn or instruction: evaluate with the same prompts
instruction = ''
max_new_tokens = 24
batch_size = 200
out_dir = 'out/eval_arith'
