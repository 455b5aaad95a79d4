# The offline demo of rollouts that call tools: the arith demo's model and problems, with a
# calculator (tasks/arith_tools.py):  python train_grpo.py config/arith_tools.py
# The warm start imitates two teachers: one calls the calculator and copies its answer (always
# right), the other states the sum at once and drops the carry ("80-7=83": right about half the
# time) and writes 60% of the solutions. GRPO, rewarded for the right answer only, has the room to
# learn that calling the tool pays. During rollouts the calculator's answer is inserted into each
# completion (sample.generate_with_tools); the inserted tokens carry no weight in the loss.
out_dir = 'out/arith_tools'
init_from = 'scratch'
task = 'arith_tools'
arith_difficulty = 'starter'
arith_calculator = 0.4  # share of training solutions that call the calculator
n_layer = 4
n_embd = 64
n_head = 4
n_kv_head = 2
max_seq_len = 256
sft_steps = 4000  # as the arith demo: copying the operands right takes about this long
sft_lr = 2e-3
sft_batch_size = 8
group_size = 8
batch_prompts = 32  # 256 completions per step
micro_batch_size = 256
max_new_tokens = 80  # a call, its inserted answer and '#### N': about 50 bytes
max_tool_calls = 2
tool_timeout = 5.0
temperature = 1.0
lr = 2e-4
warmup_steps = 5
max_steps = 40
rewards = [{'name': 'correct', 'weight': 1.0}]
eval_every = 10
eval_examples = 200
save_every = 20
plot_every = 10
device = 'cpu'
dtype = 'float32'
