"""
Compile every Triton kernel variant the code launches (each logits dtype, each constexpr
combination, pointers passed as None) to sm_90a and sm_80 machine code, without a GPU and without
TRITON_INTERPRET: the interpreter runs kernels as numpy and forgives what the compiler will not
(loop-carried type changes, unsupported ops, keyword-only parameters before Triton 3.9). Exits
non-zero naming the first kernel that fails. Run by tests/test_kernels.py under the installed
Triton, and by .ci/run under the oldest supported Triton and the GPU machine's:

  python tests/compile_kernels.py
  PYTHONPATH=/path/to/triton-3.2.0 python tests/compile_kernels.py
"""
import inspect
import itertools
import os
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import logprob_kernels as K  # noqa: E402
import sample_kernels as S  # noqa: E402

# Triton 3.2 names the constexpr values `constants`, 3.3 on `constexprs`
KEY = 'constexprs' if 'constexprs' in inspect.signature(ASTSource).parameters else 'constants'
BUILT = []


def build(fn, sig, warps=8, **consts):
    sig = {k: 'constexpr' if k in consts else v for k, v in sig.items()}
    for arch in (90, 80):
        try:
            c = triton.compile(ASTSource(fn, sig, **{KEY: consts}),
                               target=GPUTarget('cuda', arch, 32), options=dict(num_warps=warps))
            BUILT.append(len(c.asm['cubin']))
        except Exception as e:
            where = f'{fn.__name__} {consts} {sig} on sm_{arch}'
            raise SystemExit(f'{where}: {type(e).__name__}: {e}')


for dt, has_mask in itertools.product(('*fp32', '*bf16'), (True, False)):
    # no mask: the targets stand in
    rows = dict(x_ptr=dt, stride_b='i64', stride_t='i64', T1='i32', tgt_ptr='*i64',
                mask_ptr='*i8' if has_mask else '*i64')
    fwd = dict(rows, logp_ptr='*fp32', ent_ptr='*fp32', m_ptr='*fp32', logs_ptr='*fp32',
               V='i32', inv_temp='fp32', HAS_MASK=0, BLOCK=0)
    bwd = dict(rows, m_ptr='*fp32', logs_ptr='*fp32', ent_ptr='*fp32', g_lp_ptr='*fp32',
               g_ent_ptr='*fp32', dx_ptr=dt, V='i32', inv_temp='fp32', HAS_MASK=0, BLOCK=0)
    build(K._logprob_fwd_kernel, fwd, HAS_MASK=has_mask, BLOCK=4096)
    build(K._logprob_bwd_kernel, bwd, HAS_MASK=has_mask, BLOCK=4096)
# 512: the byte tokenizer's vocab
for dt, block in itertools.product(('*fp32', '*bf16'), (4096, 512)):
    tile = dict(x_ptr=dt, stride='i32', n_cols='i32', col0='i32', tgt_ptr='*i64')
    hf = dict(tile, m_ptr='*fp32', s_ptr='*fp32', w_ptr='*fp32', xt_ptr='*fp32',
              inv_temp='fp32', BLOCK=0)
    hb = dict(tile, lse_ptr='*fp32', a_ptr='*fp32', b_ptr='*fp32', g_lp_ptr='*fp32',
              inv_temp='fp32', BLOCK=0)
    build(K._head_fwd_kernel, hf, K.num_warps(block), BLOCK=block)
    build(K._head_bwd_kernel, hb, K.num_warps(block), BLOCK=block)
# sample_tokens: a first pass without a threshold (t_ptr None) for top-k/top-p/min-p, then
# the draw with or without one, greedy or not
passes = [(False, False, False), (True, True, False), (False, True, False),
          (False, True, True)]
for dt, (thresh, draw, greedy) in itertools.product(('*fp32', '*bf16'), passes):
    sp = dict(x_ptr=dt, stride_row='i32', V='i32', inv_temp='fp32', tile='i32',
              t_ptr='*fp32', r1_ptr='*i64', r2_ptr='*i64', m_ptr='*fp32', s_ptr='*fp32',
              bv_ptr='*fp32', bi_ptr='*i32', HAS_THRESH=0, DRAW=0, GREEDY=0, BLOCK=0)
    t_ptr = {} if thresh else dict(t_ptr=None)
    build(S._sample_pass_kernel, sp, HAS_THRESH=thresh, DRAW=draw, GREEDY=greedy,
          BLOCK=4096, **t_ptr)
# the threshold search's passes: BLOCK 256 and its warps, as sample_tokens launches them
for dt, count, first in itertools.product(('*fp32', '*bf16'), (True, False), (True, False)):
    bp = dict(x_ptr=dt, stride_row='i32', V='i32', inv_temp='fp32', tile='i32', m_ptr='*fp32',
              lo_ptr='*i64', hi_ptr='*i64', tgt_ptr='*fp32', cnt_ptr='*i32', mass_ptr='*fp32',
              done_ptr='*i32', mass_lo_ptr='*fp32', t_ptr='*fp32', top_k='i32', COUNT=0,
              FIRST=0, NC=0, BLOCK=0)
    build(S._bisect_pass_kernel, bp, K.num_warps(256), COUNT=count, FIRST=first, NC=S._NC,
          BLOCK=256)
print(f'compiled {len(BUILT)} kernels for sm_90a and sm_80 with Triton {triton.__version__}')
