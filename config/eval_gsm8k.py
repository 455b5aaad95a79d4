# Evaluate a model on the GSM8K test set with sample.py:
#   python sample.py config/eval_gsm8k.py --init_from=out/gsm8k/hf --data_dir=../shared/gsm8k
#   python sample.py config/eval_gsm8k.py --init_from=... --num_examples=200 --n_samples=8   # + pass@8, maj@8
data = 'gsm8k'
split = 'test'
num_examples = 0  # all 1,319
n_samples = 1
max_new_tokens = 512
temperature = 1.0
batch_size = 128
out_dir = 'out/eval_gsm8k'
