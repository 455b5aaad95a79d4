"""
Training-state memory of full fine-tuning vs LoRA, as train_grpo.py holds it on one GPU: the
weights (parameters: fp32; with lora_base_dtype='bfloat16' the frozen matrices bf16), fp32 gradients
of what trains, AdamW's two fp32 moments per trained parameter, and the sampler's bf16 copy
(dtype=bfloat16: with LoRA a plain copy of the merged weights). Models are built on the meta device
(no memory, no download) from the real config shapes written below, LoRA applied by lora.apply
exactly as a run does, and the sampler made by sample.sampler_model; only the AdamW line is
arithmetic (2 x 4 bytes per trained parameter). Not counted: activations, the LM head's tiles, the
KV cache (they depend on the batch, not on the method).

  python bench/lora_memory.py                  # rank 32, all linear layers of the blocks
  python bench/lora_memory.py --rank=16 --targets=q_proj,v_proj

The last line printed is JSON.
"""
import argparse
import contextlib
import io
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import lora  # noqa: E402
from model import GPT, ModelConfig  # noqa: E402
from sample import sampler_model  # noqa: E402

# config.json shapes of the published checkpoints (copied here: no download)
MODELS = {
    'Qwen2.5-0.5B': ModelConfig(arch='qwen2', vocab_size=151936, n_layer=24, n_head=14, n_kv_head=2,
                                n_embd=896, intermediate_size=4864, tie_word_embeddings=True),
    'Qwen3-1.7B': ModelConfig(arch='qwen3', vocab_size=151936, n_layer=28, n_head=16, n_kv_head=8,
                              n_embd=2048, intermediate_size=6144, head_size=128,
                              tie_word_embeddings=True),
    'SmolLM3-3B': ModelConfig(arch='smollm3', vocab_size=128256, n_layer=36, n_head=16, n_kv_head=4,
                              n_embd=2048, intermediate_size=11008, tie_word_embeddings=True),
    # q/k/v and gate/up fused as stored: one adapter each (peft's qkv_proj, gate_up_proj)
    'Phi-4-mini': ModelConfig(arch='phi3', vocab_size=200064, n_layer=32, n_head=24, n_kv_head=8,
                              n_embd=3072, intermediate_size=8192, tie_word_embeddings=True),
    'Qwen2.5-7B': ModelConfig(arch='qwen2', vocab_size=152064, n_layer=28, n_head=28, n_kv_head=4,
                              n_embd=3584, intermediate_size=18944, tie_word_embeddings=False),
}


def nbytes(params):
    return sum(p.numel() * p.element_size() for p in params)


def measure(cfg, rank, alpha, targets, base_dtype=torch.float32):
    with torch.device('meta'):
        model = GPT(cfg)
    if rank:
        with contextlib.redirect_stdout(io.StringIO()):  # lora.apply's one-line summary
            lora.apply(model, rank, alpha, 0.0, targets, seed=0, base_dtype=base_dtype)
    trained = [p for p in model.parameters() if p.requires_grad]
    gen, _ = sampler_model(model, torch.bfloat16, fsdp=False)
    n_trained = sum(p.numel() for p in trained)
    r = dict(params=nbytes(model.parameters()), grads=nbytes(trained), adamw=2 * 4 * n_trained,
             sampler=nbytes(gen.parameters()), n_params=sum(p.numel() for p in model.parameters()),
             n_trained=n_trained)
    r['total'] = r['params'] + r['grads'] + r['adamw'] + r['sampler']
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--rank', type=int, default=32)
    ap.add_argument('--alpha', type=float, default=64.0)
    ap.add_argument('--targets', default='all-linear')
    a = ap.parse_args()
    gib = 2 ** 30
    rows = []
    print("| model | method | trained parameters | parameters | gradients | AdamW state | "
          "sampler copy (bf16) | total |\n|---|---|---|---|---|---|---|---|")
    for name, cfg in MODELS.items():
        for method, rank, base in (('full', 0, torch.float32), (f'LoRA r={a.rank}', a.rank, torch.float32),
                                   (f'LoRA r={a.rank}, bf16 base', a.rank, torch.bfloat16)):
            r = measure(cfg, rank, a.alpha, a.targets, base)
            rows.append(dict(model=name, method=method, **r))
            parts = ('params', 'grads', 'adamw', 'sampler')
            sizes = ' | '.join(f"{r[k] / gib:.2f} GiB" for k in parts)
            trained = f"{r['n_trained'] / 1e6:,.1f}M of {r['n_params'] / 1e6:,.1f}M"
            print(f"| {name} | {method} | {trained} "
                  f"({100 * r['n_trained'] / r['n_params']:.2f}%) | " + sizes +
                  f" | **{r['total'] / gib:.1f} GiB** |")
    print(json.dumps({'rank': a.rank, 'targets': a.targets, 'rows': rows}))


if __name__ == '__main__':
    main()
