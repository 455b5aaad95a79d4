# The offline demo: a ~1M-parameter model from scratch (byte tokenizer) on the built-in arithmetic word problems,
# on a CPU in minutes. A short supervised warm start on the reference solutions teaches the answer format and
# gets some sums right; GRPO then raises greedy accuracy on the held-out split.
#   python train_grpo.py config/arith.py
out_dir = 'out/arith'
init_from = 'scratch'
data = 'arith'
arith_difficulty = 'easy'
system_prompt = ''  # every prompt byte is a token here: keep prompts short
instruction = ''
n_layer = 4
n_embd = 128
n_head = 4
n_kv_head = 2
max_seq_len = 256
sft_steps = 300
sft_lr = 2e-3
sft_batch_size = 32
group_size = 8
batch_prompts = 16
micro_batch_size = 128
max_new_tokens = 24  # "12+7=19\n#### 19" and the end token fit easily
temperature = 1.0
lr = 2e-4
warmup_steps = 5
max_steps = 100
rewards = [{'name': 'correct', 'weight': 1.0}]
eval_every = 20
eval_examples = 200
save_every = 25
plot_every = 20
device = 'cpu'
dtype = 'float32'
