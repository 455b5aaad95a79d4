# GRPO on GSM8K with Qwen2.5-0.5B-Instruct on one GPU (H100-class). The starting point for a real
# run:
#   python train_grpo.py config/gsm8k.py --data_dir=../shared/gsm8k
# The instruct model already answers most problems in some format; GRPO mostly teaches it to finish
# inside the length budget and put the answer in \boxed{}. Watch reward/mean, eval/pass@1 and
# frac_zero_std, not loss.
out_dir = 'out/gsm8k'
init_from = 'Qwen/Qwen2.5-0.5B-Instruct'  # or a local snapshot directory
task = 'gsm8k'  # tasks/gsm8k.py: its prompts (system prompt, \\boxed{} instruction) and rewards
data_dir = ''  # '' downloads openai/gsm8k; offline use --data_dir=../shared/gsm8k
group_size = 8
batch_prompts = 32  # 256 completions per step
micro_batch_size = 32
max_new_tokens = 512  # GSM8K solutions from a 0.5B instruct model fit in ~300 tokens
temperature = 1.0
lr = 1e-6
warmup_steps = 10
max_steps = 300
# no reference model: saves its memory and a forward pass; the small lr keeps steps small (with
# num_iterations = 1 the ratio is 1 and nothing clips)
beta = 0.0
rewards = [{'name': 'correct', 'weight': 1.0},
           {'name': 'format', 'weight': 0.1, 'kwargs': {'pattern': 'boxed'}}]
eval_every = 50
eval_examples = 500
export_best = 'eval/pass@1'  # out_dir/hf_best/: the weights of the best evaluation so far
save_every = 50
