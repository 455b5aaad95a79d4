# The offline demo: a ~1M-parameter model from scratch (byte tokenizer) on the built-in arithmetic word problems,
# on a CPU in minutes:  python train_grpo.py config/arith.py
# A supervised warm start on the reference solutions teaches the format, copying the numbers and some arithmetic
# (about 44% greedy on the held-out split after 1,600 steps); GRPO then trains on the correctness reward alone.
# Measured on 2 CPU cores (9 min 14 s in all): the warm-start model has pass@8 0.85 but pass@1 0.44, so there is
# room, and GRPO with 64 prompts per step raised greedy pass@1 to 0.505 in 100 steps. Its mistakes are carries and
# borrows, which a sparse reward fixes slowly; small batches or lr >= 3e-4 made it worse (README, Offline demo).
out_dir = 'out/arith'
init_from = 'scratch'
data = 'arith'
arith_difficulty = 'starter'  # "Liz has 80 books and sells 7. ..." -> "80-7=73\n#### 73"
system_prompt = ''  # every prompt byte is a token here: keep prompts short
instruction = ''
n_layer = 4
n_embd = 128
n_head = 4
n_kv_head = 2
max_seq_len = 256
sft_steps = 1600  # copying the numbers emerges around step 500, arithmetic after
sft_lr = 3e-3
sft_batch_size = 32
group_size = 8
batch_prompts = 64  # 512 completions per step: fewer, less noisy updates beat many small ones here
micro_batch_size = 256
max_new_tokens = 24  # "46+7=53\n#### 53" and the end token fit easily
temperature = 1.0
lr = 2e-4  # RL wants a far smaller step than the warm start's 3e-3
warmup_steps = 5
max_steps = 100
rewards = [{'name': 'correct', 'weight': 1.0}]
eval_every = 20
eval_examples = 200
save_every = 25
plot_every = 20
device = 'cpu'
dtype = 'float32'
