# Evaluate a model on the GSM8K test set with sample.py (a train_grpo.py export needs no config: it
# evaluates as the run did, `python sample.py --init_from=out/gsm8k/hf`; this file is for any other
# model):
#   python sample.py config/eval_gsm8k.py --init_from=Qwen/Qwen2.5-0.5B-Instruct \
#       --data_dir=../shared/gsm8k
# and, adding sampled pass@8 and maj@8:
#   python sample.py config/eval_gsm8k.py --init_from=... --num_examples=200 --n_samples=8
task = 'gsm8k'  # its default system prompt and instruction, as config/gsm8k.py trains with
split = 'test'
num_examples = 0  # all 1,319
n_samples = 1
max_new_tokens = 512
temperature = 1.0
batch_size = 128
out_dir = 'out/eval_gsm8k'
