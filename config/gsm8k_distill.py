# On-policy distillation on GSM8K: Qwen2.5-0.5B-Instruct samples as in config/gsm8k.py, Qwen2.5-7B-Instruct
# scores every token it sampled, and each token's advantage gains the teacher's log-prob minus the policy's
# (docs/objective.md); the correctness reward's group advantage stays beside it (--advantage=none: the
# teacher alone). The teacher takes some 15 GB in bf16 beside the run. --teacher=self instead: the policy
# itself, shown GSM8K's worked solution, is the teacher (no second model). Not yet run on a GPU.
import os
exec(open(os.path.join(os.path.dirname(__file__), 'gsm8k.py')).read())  # start from config/gsm8k.py
out_dir = 'out/gsm8k_distill'
teacher = 'Qwen/Qwen2.5-7B-Instruct'  # the same tokenizer as the 0.5B student
teacher_coef = 1.0
