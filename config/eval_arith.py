# Evaluate the offline demo's model on the arithmetic task's held-out split. Its export carries the
# run's config, so
#   python sample.py --init_from=out/arith/hf
# alone evaluates exactly as training did (its eval/pass@1); this file spells the same settings
# out, and overrides the number of problems (all 200) and the output directory.
task = 'arith'
arith_difficulty = 'starter'
split = 'test'
num_examples = 0
max_new_tokens = 80
batch_size = 200
out_dir = 'out/eval_arith'
