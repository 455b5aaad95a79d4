"""
One hand-written decoder-only transformer for these checkpoint families:
- Qwen2 / Qwen2.5: RoPE, RMSNorm, grouped-query attention, SwiGLU MLP, biased q/k/v, tied or untied
  head;
- Qwen3, Llama 3.x, Mistral, OLMo 2, SmolLM3 and Phi-3 / Phi-4-mini: the same without q/k/v
  biases, with an explicit head_dim; Qwen3 adds a per-head RMSNorm on q and k before RoPE, Llama
  3.x may scale RoPE frequencies ('llama3' rope_scaling), Mistral is Llama's network, OLMo 2 norms
  each sublayer's output instead of its input and q and k over all heads at once (its norms and
  RoPE in fp32), SmolLM3 leaves RoPE out of every fourth layer (NoPE), Phi-3 rotates part of each
  head (and scales RoPE by 'longrope') and stores q/k/v and gate/up fused as we do;
- Gemma 3 (text: 270M, 1B): the embedding scaled by sqrt(width), every RMSNorm's gain 1 + w in
  fp32, q and k RMS-normed per head, attention scaled by query_pre_attn_scalar, GELU (tanh) gate,
  norms before and after each sublayer, its sliding-window layers seeing the last sliding_window
  positions with their own RoPE base;
- GPT-2: learned positions, LayerNorm, GELU (tanh) MLP, fused c_attn, tied head.
Each as a causal LM or (num_labels > 0) a sequence classifier (reward model). Plus a preallocated
KV cache with per-row lengths for batched sampling. Loading and saving Hugging Face snapshots is
hf.py's.
"""
import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

# FlexAttention (torch >= 2.5): packed groups' attention from a block mask, computing only the
# blocks it keeps
try:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:
    BlockMask = flex_attention = None


@dataclass
class ModelConfig:
    # 'qwen2', 'qwen3', 'llama', 'mistral', 'olmo2', 'smollm3', 'phi3', 'gemma3_text' or 'gpt2'
    arch: str = 'qwen2'
    vocab_size: int = 260            # rows of the embedding (and of the LM head)
    n_layer: int = 2                 # transformer blocks
    n_head: int = 4                  # query heads
    # key/value heads (GQA: n_head is a multiple of it; gpt2: == n_head)
    n_kv_head: int = 4
    n_embd: int = 64                 # residual stream width
    intermediate_size: int = 256     # MLP hidden size
    max_seq_len: int = 1024          # max_position_embeddings (gpt2: size of the position table)
    rope_theta: float = 10000.0      # RoPE base (not gpt2)
    # 'llama3' RoPE: (factor, low_freq_factor, high_freq_factor, original max_len)
    rope_scaling: tuple | None = None
    # smollm3: per layer, 1 where it applies RoPE, 0 where it sees no positions (NoPE); None: all
    no_rope_layers: tuple | None = None
    # phi3: RoPE on the first rotary_dim channels of each head, the others passed through; 0: all
    rotary_dim: int = 0
    # phi3's 'longrope': (max_position_embeddings, attention factor, short_factor, long_factor).
    # Positions stop at max_seq_len, its original_max_position_embeddings (GPT.hidden refuses more),
    # up to which transformers divides the frequencies by short_factor and scales cos/sin by the
    # attention factor
    longrope: tuple | None = None
    # per layer, 1 for a sliding-window layer: it sees the last sliding_window positions, itself
    # included (gemma3_text's, with RoPE base local_rope_theta; every layer of a Mistral 7B v0.1 or
    # a Phi-3-mini-4k); gemma3_text: attention scores scaled by query_pre_attn_scalar ** -0.5
    # instead of head_dim's
    sliding_layers: tuple | None = None
    local_rope_theta: float = 10000.0
    sliding_window: int = 0
    query_pre_attn_scalar: float = 0.0
    # explicit head_dim (all but qwen2 and gpt2 may differ from n_embd // n_head); 0: that
    head_size: int = 0
    norm_eps: float = 1e-6           # rms_norm_eps (qwen2) / layer_norm_epsilon (gpt2)
    tie_word_embeddings: bool = True  # LM head shares the token embedding matrix
    bos_token_id: int | None = None  # written back into config.json on export
    eos_token_id: int | list | None = None  # same
    # > 0: a sequence classifier (reward model): a score head replaces the LM head
    num_labels: int = 0
    # config.json's pad id, written back on export; a classifier reads each row at its rightmost
    # token that is not this id
    pad_token_id: int | None = None

    @property
    def head_dim(self):
        return self.head_size or self.n_embd // self.n_head

    @property
    def attn_scale(self):
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def context_note(self):
        """Why max_seq_len stops short of the snapshot's max_position_embeddings, for messages."""
        if self.longrope:
            return f" (past {self.max_seq_len} positions transformers switches Phi-3's longrope to long_factor)"
        return ''


def qwen25_05b_config():
    """The exact shape of Qwen2.5-0.5B(-Instruct), for benchmarks from random weights."""
    return ModelConfig(arch='qwen2', vocab_size=151936, n_layer=24, n_head=14, n_kv_head=2,
                       n_embd=896, intermediate_size=4864, max_seq_len=32768, rope_theta=1e6,
                       norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=151643,
                       eos_token_id=151643)


class Norm(nn.Module):
    """RMSNorm (qwen2; computed in fp32 like HF) or LayerNorm with bias (gpt2). fp32_gain (olmo2):
    the gain too is applied in fp32, before rounding to x's dtype, as OLMo 2's RMSNorm does.
    unit_offset (gemma3_text): the gain is 1 + weight, in fp32, as Gemma's."""

    def __init__(self, dim, eps, rms, fp32_gain=False, unit_offset=False):
        super().__init__()
        self.eps = eps
        self.fp32_gain, self.unit_offset = fp32_gain, unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.bias = None if rms else nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        if self.bias is not None:
            return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
        if self.unit_offset:  # in fp32 at least (fp64 stays fp64)
            wide = torch.promote_types(x.dtype, torch.float32)
            return (F.rms_norm(x.to(wide), x.shape[-1:], eps=self.eps) * (1.0 + self.weight.to(wide))).to(x.dtype)
        if x.dtype == torch.float32:  # the gain inside: one kernel on CUDA
            return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)
        if self.fp32_gain:
            return F.rms_norm(x.float(), x.shape[-1:], self.weight.float(), self.eps).to(x.dtype)
        # HF's order in half precision: normalized in fp32 and rounded to x's dtype (F.rms_norm
        # computes in fp32 whatever its input: one kernel on CUDA, no casts around it), then the gain
        return self.weight * F.rms_norm(x, x.shape[-1:], eps=self.eps)


def rope_cos_sin(pos, head_dim, theta, dtype, scaling=None, longrope=None):
    """cos/sin for integer positions pos (..., T) -> (..., T, head_dim), computed in fp32 exactly as
    HF's Qwen2 does, then cast; the sin's first half negated for apply_rope. Computed once per
    forward rather than kept as a buffer: model.to(bfloat16) would cast a buffer and lose precision
    at large positions. head_dim: the rotated channels (phi3: rotary_dim)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float, device=pos.device) / head_dim
    if longrope:  # phi3: each frequency divided by its short_factor, as HF's longrope (op for op)
        short = torch.tensor(longrope[2], dtype=torch.float, device=pos.device)
        inv_freq = 1.0 / (short * theta ** exponents)
    else:
        inv_freq = 1.0 / (theta ** exponents)
    # llama3: long wavelengths slowed by factor, short kept, smooth in between (as HF's, op for op)
    if scaling:
        factor, lo, hi, old = scaling
        wavelen = 2 * math.pi / inv_freq
        smooth = (old / wavelen - lo) / (hi - lo)
        inv_freq = torch.where(wavelen > old / lo, inv_freq / factor, torch.where(
            wavelen < old / hi, inv_freq, (1 - smooth) * inv_freq / factor + smooth * inv_freq))
    freqs = pos[..., None].float() * inv_freq
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((-freqs, freqs), -1).sin()
    if longrope:
        cos, sin = cos * longrope[1], sin * longrope[1]
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x, cos, sin):
    """HF's x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1) for x's halves (x1, x2): the
    halves swapped by a roll and the sign carried by rope_cos_sin's sin (sin(-f) = -sin(f), the
    same numbers), four kernels instead of six. cos narrower than x (phi3): only x's first channels
    rotate."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)
    return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * sin


def packed_backend(choice, device):
    """The attention for packed groups: 'flex' (FlexAttention with a block mask: computes only the
    blocks the mask keeps, K/V shared by GQA heads as they are) or 'sdpa' (SDPA with a dense (B, 1,
    T, T) mask: every query-key pair computed, K/V repeated for GQA). 'auto': flex on CUDA where
    torch has it, sdpa elsewhere (on the CPU FlexAttention has no backward, and its kernel compiles
    anew for every shape there)."""
    if choice not in ('auto', 'flex', 'sdpa'):
        raise ValueError(f"packed_attention must be 'auto', 'flex' or 'sdpa', not {choice!r}")
    if choice == 'auto':
        if flex_attention is not None and torch.device(device).type == 'cuda':
            return 'flex'
        return 'sdpa'
    if choice == 'flex' and flex_attention is None:
        raise ValueError("packed_attention='flex' needs torch >= 2.5 (FlexAttention); "
                         f"this is {torch.__version__}")
    return choice


def packed_mask(seg, backend, pos=None, window=0):
    """Who-sees-whom of packed groups from segment ids seg (B, T) int64, built on seg's device: 0
    the prompt, s >= 1 the s-th completion, -1 padding. A token sees earlier prompt tokens and
    earlier tokens of its own segment; padding sees only itself (finite, never read, and no work for
    a block-sparse kernel). window (with the positions pos): only those fewer than window positions
    back (a sliding-window layer's). backend 'sdpa': a (B, 1, T, T) bool mask; 'flex': a
    FlexAttention BlockMask over (B, T, T), the same for every head."""
    B, T = seg.shape
    if backend == 'sdpa':
        ar = torch.arange(T, device=seg.device)
        q, k = seg[:, :, None], seg[:, None, :]
        visible = (k == 0) | (k == q)  # the prompt, or the query's own segment
        if window:
            visible = visible & (pos[:, :, None] - pos[:, None, :] < window)
        pad_self = (q == -1) & (ar[:, None] == ar)
        return ((ar[:, None] >= ar) & visible & (q != -1) | pad_self)[:, None]

    n = -(-T // _BLOCK)
    seg = F.pad(seg, (0, n * _BLOCK - T), value=-2)  # -2: past the end, seen by no one
    at = F.pad(pos, (0, n * _BLOCK - T)) if window else None

    def mask_mod(b, h, q_idx, kv_idx):
        sq, sk = seg[b, q_idx], seg[b, kv_idx]
        visible = (sk == 0) | (sk == sq)  # the prompt, or the query's own segment
        if window:
            visible = visible & (at[b, q_idx] - at[b, kv_idx] < window)
        pad_self = (sq == -1) & (kv_idx == q_idx)
        return (kv_idx <= q_idx) & visible & (sq >= 0) | pad_self
    return block_mask(mask_mod, B, T, seg.device)


_BLOCK = 128  # FlexAttention's tile: query and key blocks of 128 positions
# torch >= 2.7's from_kv_blocks takes the true lengths (else they are rounded up to the tile)
_KV_BLOCKS_TAKE_LENGTHS = BlockMask is not None and (
    'seq_lengths' in inspect.signature(BlockMask.from_kv_blocks).parameters)


def block_mask(mask_mod, B, T, device, chunk=1 << 26):
    """create_block_mask's BlockMask (the same for every head), built here instead: compiled, its
    fast path, the first build took 93 s on an H200 (torch 2.11) and new lengths compile again;
    eager, it evaluates mask_mod over all B x T x T pairs at once. This evaluates mask_mod on about
    chunk pairs at a time and keeps, per tile of _BLOCK x _BLOCK, whether any pair is visible (the
    kernel computes the tile) and whether all are (a full tile: no mask_mod inside). mask_mod must
    accept positions up to T rounded up to the tile and hide those past T."""
    n = -(-T // _BLOCK)
    pos = torch.arange(n * _BLOCK, device=device)
    b = torch.arange(B, device=device)[:, None, None]
    per = max(1, min(n, chunk // (B * _BLOCK * n * _BLOCK)))  # query tiles per chunk
    partial, full = [], []
    for i in range(0, n, per):
        q = pos[i * _BLOCK:(i + per) * _BLOCK]
        tiles = mask_mod(b, None, q[None, :, None], pos[None, None, :]).view(B, -1, _BLOCK, n, _BLOCK)
        some, every = tiles.any(4).any(2), tiles.all(4).all(2)
        partial.append(some & ~every)
        full.append(every)

    def ordered(tiles):  # (B, n, n) bool -> per row of tiles, the count and the kept ones first
        tiles = torch.cat(tiles, 1)[:, None]
        idx = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True)
        return tiles.sum(-1, dtype=torch.int32), idx.to(torch.int32)
    kv_n, kv_i = ordered(partial)
    full_n, full_i = ordered(full)
    lengths = {'seq_lengths': (T, T)} if _KV_BLOCKS_TAKE_LENGTHS else {}
    return BlockMask.from_kv_blocks(kv_n, kv_i, full_n, full_i, BLOCK_SIZE=_BLOCK, mask_mod=mask_mod,
                                    **lengths)


_FLEX = {}  # device type -> flex_attention through torch.compile


def flex(q, k, v, block_mask, gqa, scale=None):
    """FlexAttention's fused kernel (called eagerly it would materialize every score). Compiled once
    per device type: dynamic shapes on CUDA (after the first shape), static on the CPU (torch 2.13's
    dynamic-shape CPU kernel does not build). CPU: forward only, torch has no FlexAttention backward
    there."""
    if torch.compiler.is_compiling():  # inside a torch.compile'd model: traced with it
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=gqa, scale=scale)
    dev = q.device.type
    if dev not in _FLEX:
        _FLEX[dev] = torch.compile(flex_attention, dynamic=False if dev == 'cpu' else None)
    return _FLEX[dev](q, k, v, block_mask=block_mask, enable_gqa=gqa, scale=scale)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        self.sizes = [cfg.n_head * hd, cfg.n_kv_head * hd, cfg.n_kv_head * hd]
        # q, k, v in one matmul (GPT-2 stores them fused; Qwen2's three are concatenated on load)
        self.c_attn = nn.Linear(cfg.n_embd, sum(self.sizes), bias=cfg.arch in ('qwen2', 'gpt2'))
        self.c_proj = nn.Linear(cfg.n_head * hd, cfg.n_embd, bias=cfg.arch == 'gpt2')
        # an RMSNorm of queries and of keys: qwen3 per head (weights of head_dim), olmo2 over all
        # heads at once (weights of n_head * head_dim and n_kv_head * head_dim)
        self.q_norm = self.k_norm = None
        if cfg.arch in ('qwen3', 'gemma3_text'):
            gemma = cfg.arch == 'gemma3_text'
            self.q_norm, self.k_norm = (Norm(hd, cfg.norm_eps, True, unit_offset=gemma) for _ in 'qk')
        elif cfg.arch == 'olmo2':
            self.q_norm = Norm(self.sizes[0], cfg.norm_eps, True, fp32_gain=True)
            self.k_norm = Norm(self.sizes[1], cfg.norm_eps, True, fp32_gain=True)

    def forward(self, x, shape, rope, mask, kv):
        """x (B*T, n_embd): the rows of shape (B, T), as every block keeps them (each matmul 2-D,
        no reshape around it) -> (B*T, n_embd)."""
        B, T = shape
        nh, nkv, hd = self.cfg.n_head, self.cfg.n_kv_head, self.cfg.head_dim
        qkv = self.c_attn(x)
        if self.cfg.arch == 'olmo2':  # all queries RMS-normed together, all keys too, before RoPE
            q, k, v = qkv.split(self.sizes, dim=-1)
            qkv = torch.cat([self.q_norm(q), self.k_norm(k), v], dim=-1)
        # (B, T, heads, hd): queries, keys, values; RoPE and the cache write need no transpose
        qk, v = qkv.view(B, T, nh + 2 * nkv, hd).split([nh + nkv, nkv], dim=2)
        if self.cfg.arch in ('qwen3', 'gemma3_text'):  # each head's query and key RMS-normed before RoPE
            qk = torch.cat([self.q_norm(qk[:, :, :nh]), self.k_norm(qk[:, :, nh:])], dim=2)
        if rope is not None:
            qk = apply_rope(qk, *rope)  # both at once: one set of kernels, not two
            if self.cfg.arch == 'olmo2':  # rotated in fp32 (its cos/sin), then rounded back
                qk = qk.to(v.dtype)
        q, k = qk.split([nh, nkv], dim=2)               # (B, T, nh, hd), (B, T, nkv, hd)
        if kv is not None:
            # this layer's cache (B, nkv, max_len, hd); new tokens go to pos (B, T)
            kc, vc, rows, pos = kv
            kc[rows, :, pos] = k
            vc[rows, :, pos] = v
        if kv is not None and mask is not None and mask.dtype != torch.bool:  # (bool: an empty cache)
            y = self.cached(q, kc, vc, mask)
        else:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, hd)
            if mask is None:
                # causal LM, or a prefill into an empty cache: the fused kernels' fast path
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=nh != nkv,
                                                   scale=self.cfg.attn_scale)
            elif BlockMask is not None and isinstance(mask, BlockMask):
                # packed groups through FlexAttention (under autocast v is in the compute dtype)
                y = flex(q.to(v.dtype), k.to(v.dtype), v, mask, nh != nkv, self.cfg.attn_scale)
            else:
                # packed sequences (training): an explicit mask, broadcast over heads, so K/V are
                # repeated
                g = nh // nkv
                if g != 1:
                    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.cfg.attn_scale)
            y = y.transpose(1, 2).reshape(B * T, nh * hd)  # (B, nh, T, hd) -> rows
        return self.c_proj(y)

    def cached(self, q, kc, vc, bias):
        """Attention of new queries q (B, T, nh, hd) over a cache (B, nkv, max_len, hd) with bias
        (B, 1, g*T, L) (0 where seen, -inf elsewhere; see GPT.hidden) -> rows (B*T, nh*hd). Each kv
        head's group of g query heads is folded into the query axis: attention then reads the
        shared K/V as they are (no expanded copy) and any SDPA backend takes the mask."""
        B, T, nh, hd = q.shape
        nkv, L = kc.size(1), bias.size(-1)
        if L < kc.size(2):
            kc, vc = kc[:, :, :L], vc[:, :, :L]
        if T == 1 and q.device.type == 'cpu':
            # decode on CPU: SDPA's CPU kernel costs 0.2-0.5 ms a call whatever the size, 2-3x
            # what these take; batched over (row, kv head) as views of the cache, no copy of it
            q = (q * self.cfg.attn_scale).view(B * nkv, nh // nkv, hd)
            scores = torch.bmm(q, kc.reshape(B * nkv, L, hd).transpose(1, 2))
            p = torch.softmax(scores.view(B, nkv, -1, L) + bias, dim=-1)
            return torch.bmm(p.view(B * nkv, -1, L), vc.reshape(B * nkv, L, hd)).view(B, nh * hd)
        q = q.transpose(1, 2).reshape(B, nkv, nh // nkv * T, hd)
        y = F.scaled_dot_product_attention(q, kc, vc, attn_mask=bias, scale=self.cfg.attn_scale)
        return y.reshape(B, nh, T, hd).transpose(1, 2).reshape(B * T, nh * hd)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.swiglu = cfg.arch != 'gpt2'
        self.gelu_gate = cfg.arch == 'gemma3_text'  # GELU (tanh) of the gate instead of SiLU
        # qwen2: gate and up projections fused into one matmul, split before SiLU(gate) * up
        n_out = 2 * cfg.intermediate_size if self.swiglu else cfg.intermediate_size
        self.c_fc = nn.Linear(cfg.n_embd, n_out, bias=not self.swiglu)
        self.c_proj = nn.Linear(cfg.intermediate_size, cfg.n_embd, bias=not self.swiglu)

    def forward(self, x):
        if self.swiglu:
            gate, up = self.c_fc(x).chunk(2, dim=-1)
            gate = F.gelu(gate, approximate='tanh') if self.gelu_gate else F.silu(gate)
            return self.c_proj(gate * up)
        return self.c_proj(F.gelu(self.c_fc(x), approximate='tanh'))  # GPT-2's 'gelu_new'


class Block(nn.Module):
    """Pre-norm: ln_1 and ln_2 normalize the attention's and the MLP's inputs. olmo2 norms their
    outputs instead, before each is added to the residual stream; gemma3_text both (ln_1a, ln_2a:
    the outputs')."""

    def __init__(self, cfg, layer=0):
        super().__init__()
        rms, self.post_norm = cfg.arch != 'gpt2', cfg.arch == 'olmo2'
        gemma = cfg.arch == 'gemma3_text'
        # smollm3: some layers apply no RoPE (NoPE); gemma3_text: its sliding-window layers their own
        self.rope = cfg.no_rope_layers is None or bool(cfg.no_rope_layers[layer])
        self.local = bool(cfg.sliding_layers and cfg.sliding_layers[layer])
        self.ln_1 = Norm(cfg.n_embd, cfg.norm_eps, rms, fp32_gain=self.post_norm, unit_offset=gemma)
        self.attn = Attention(cfg)
        self.ln_2 = Norm(cfg.n_embd, cfg.norm_eps, rms, fp32_gain=self.post_norm, unit_offset=gemma)
        self.mlp = MLP(cfg)
        self.ln_1a = Norm(cfg.n_embd, cfg.norm_eps, True, unit_offset=True) if gemma else None
        self.ln_2a = Norm(cfg.n_embd, cfg.norm_eps, True, unit_offset=True) if gemma else None

    def forward(self, x, shape, rope, mask, kv):
        rope = rope[self.local] if isinstance(rope, list) else rope if self.rope else None
        mask = mask[self.local] if isinstance(mask, list) else mask  # gemma3_text: [global, local]
        if self.post_norm:
            x = x + self.ln_1(self.attn(x, shape, rope, mask, kv))
            return x + self.ln_2(self.mlp(x))
        if self.ln_1a is not None:
            x = x + self.ln_1a(self.attn(self.ln_1(x), shape, rope, mask, kv))
            return x + self.ln_2a(self.mlp(self.ln_2(x)))
        x = x + self.attn(self.ln_1(x), shape, rope, mask, kv)
        return x + self.mlp(self.ln_2(x))


class KVCache:
    """Preallocated keys/values, one (B, n_kv_head, max_len, head_dim) tensor per layer; lengths
    (B,) = valid positions per row. GPT.forward writes new tokens at each row's own length, so rows
    may be at different positions. (Separate tensors, not one stacked one: a compiled decode step
    then writes each in place, where a write into a slice of a stacked cache makes torch.compile
    copy the whole cache every step.)"""

    def __init__(self, cfg, batch_size, max_len, dtype, device):
        shape = (batch_size, cfg.n_kv_head, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layer)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layer)]
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.max_len = max_len
        # host-side upper bound on lengths.max(): attention reads only this far, without a sync
        self.extent = 0
        # static: attention reads all max_len positions (masked by lengths), a shape that does not
        # change from step to step (sample.generate's graphs=True); see make_static
        self.static = False

    def _with(self, k, v, lengths, max_len=None):
        c = object.__new__(KVCache)
        c.k, c.v, c.lengths, c.extent, c.static = k, v, lengths, self.extent, False
        c.max_len = self.max_len if max_len is None else max_len
        return c.make_static() if self.static else c

    def make_static(self):
        """From here on every forward attends over all max_len positions, and the tensors keep
        their addresses (torch.compile may then replay a CUDA graph that writes them in place; a
        select or window is a new cache, static too, whose tensors are new: one more graph, so
        sample.generate copies rows between caches it keeps instead, with load_)."""
        self.static = True
        for t in (*self.k, *self.v, self.lengths):
            torch._dynamo.mark_static_address(t)
        return self

    def load_(self, src, rows=None):
        """Copy src's rows (all of them, or these, in this order) into this cache's own tensors,
        which keep their addresses."""
        for dst, t in zip((*self.k, *self.v, self.lengths), (*src.k, *src.v, src.lengths)):
            if rows is None:
                dst.copy_(t)
            else:
                torch.index_select(t, 0, rows.to(t.device), out=dst)
        self.extent = src.extent
        return self

    def repeat_interleave(self, n):
        """Each row copied n times, adjacent (prefill a prompt once, then share it with its G
        samples). Through select, so the copies are plain tensors as after compaction:
        Tensor.repeat_interleave returns a view of the copy it makes, a compiled decode step guards
        on a view's base, and the first compaction then recompiled it."""
        rows = torch.arange(len(self.lengths), device=self.lengths.device).repeat_interleave(n)
        return self.select(rows)

    def select(self, rows):
        """Keep only these rows, in this order (drop finished sequences from the decode batch)."""
        rows = rows.to(self.lengths.device)
        return self._with([t[rows] for t in self.k], [t[rows] for t in self.v], self.lengths[rows])

    def window(self, rows, max_len):
        """A cache of max_len positions holding these rows' first ones (copies that much, not the
        whole cache), to extend by a few tokens and put back with put_window. max_len may exceed
        this cache's: a right-padded chunk may run past its end, with pads only."""
        rows = rows.to(self.lengths.device)
        n = min(max_len, self.max_len)

        def part(t):
            out = t.new_zeros((len(rows), t.shape[1], max_len, t.shape[3]))
            out[:, :, :n] = t[rows, :, :n]
            return out
        return self._with([part(t) for t in self.k], [part(t) for t in self.v],
                          self.lengths[rows], max_len)

    def put_window(self, rows, sub):
        """Copy a window's positions back (those this cache has: past them, only pads)."""
        rows = rows.to(self.lengths.device)
        n = min(sub.max_len, self.max_len)
        for mine, theirs in ((self.k, sub.k), (self.v, sub.v)):
            for t, s in zip(mine, theirs):
                t[rows, :, :n] = s[:, :, :n]
        self.lengths[rows] = sub.lengths


class GPT(nn.Module):
    """Qwen2, Qwen3, Llama, Mistral, OLMo 2, SmolLM3, Phi-3, Gemma 3 or GPT-2, switched on cfg.arch.
    Parameter names follow nanoGPT; hf_layout maps them to HF's."""

    def __init__(self, cfg):
        super().__init__()
        assert cfg.arch in ('qwen2', 'qwen3', 'llama', 'mistral', 'olmo2', 'smollm3', 'phi3', 'gemma3_text', 'gpt2')
        assert cfg.no_rope_layers is None or len(cfg.no_rope_layers) == cfg.n_layer
        assert (cfg.head_size or cfg.n_embd % cfg.n_head == 0) and cfg.n_head % cfg.n_kv_head == 0
        assert cfg.arch != 'gpt2' or cfg.n_kv_head == cfg.n_head
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.n_embd) if cfg.arch == 'gpt2' else None
        self.h = nn.ModuleList([Block(cfg, i) for i in range(cfg.n_layer)])
        self.ln_f = Norm(cfg.n_embd, cfg.norm_eps, cfg.arch != 'gpt2', cfg.arch == 'olmo2',
                         cfg.arch == 'gemma3_text')
        # a tied head is not a module: one tensor, so loading with assign=True cannot untie it
        self.lm_head = None
        if not (cfg.tie_word_embeddings or cfg.num_labels):
            self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.score = None  # classifier head
        if cfg.num_labels:
            self.score = nn.Linear(cfg.n_embd, cfg.num_labels, bias=False)
        # training sets it: recompute activations in backward instead of storing them
        self.grad_checkpoint = False
        # packed groups' attention: 'flex', 'sdpa' or 'auto' (see packed_backend)
        self.packed_attention = 'auto'

    @property
    def lm_head_weight(self):
        return self.wte.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, idx, kv_cache=None, input_lengths=None, *, last_only=False, select=None,
                head=None, pos=None, attn_mask=None):
        """idx (B, T) -> logits (B, T, vocab) in the model dtype. No cache: causal LM at positions
        0..T-1 (right padding is harmless to the real tokens). With a cache: idx are new tokens; row
        b's sit at positions kv_cache.lengths[b] + arange(T), see all earlier positions of their
        row, and are appended to the cache. input_lengths (B,): only the first input_lengths[b]
        tokens of row b are real (right-padded prefill); lengths advance by that much. last_only:
        logits (B, 1, vocab) of each row's last real token only (skips the rest of the head). select
        (B, T) bool: only these positions reach the head, flattened to (N, ...) (training:
        completion tokens); or int64 (N,) indices into the B*T positions, where one position may be
        picked more than once. pos (B, T) and attn_mask (no cache): explicit positions and
        who-sees-whom, for several sequences packed into one row (training: a prompt once, then its
        G completions, each seeing the prompt and its own earlier tokens): attn_mask is that
        layout's segment ids (B, T) int64 (0 prompt, s the s-th completion, -1 padding; the mask is
        built from them on the device, for FlexAttention or SDPA by self.packed_attention:
        packed_mask), or any (B, 1, T, T) bool mask (SDPA). head(h, lm_head_weight) replaces the
        plain LM head, e.g. with a fused log-prob kernel; it runs in here so that a DDP or FSDP
        wrapper sees every use of the weights (FSDP only gathers them in forward)."""
        h = self.hidden(idx, kv_cache, input_lengths, pos, attn_mask)
        if last_only:
            B, T = idx.shape
            if input_lengths is None:
                last = torch.full((B,), T - 1, device=h.device)
            else:
                last = input_lengths.to(h.device) - 1
            h = h[torch.arange(B, device=h.device), last][:, None]
        if select is not None:
            h = h[select] if select.dtype == torch.bool else h.flatten(0, 1)[select]
        return F.linear(h, self.lm_head_weight) if head is None else head(h, self.lm_head_weight)

    def sequence_scores(self, idx):
        """Classifier: idx (B, T) -> (B, num_labels) at each row's rightmost token that is not
        pad_token_id, as transformers pools (right padding needs no mask; a real last token equal to
        the pad id is passed over)."""
        not_pad = idx != self.config.pad_token_id
        last = (torch.arange(idx.size(1), device=idx.device) * not_pad).argmax(-1)
        return self.score(self.hidden(idx)[torch.arange(len(idx), device=idx.device), last])

    def hidden(self, idx, kv_cache=None, input_lengths=None, pos=None, attn_mask=None):
        """Final-normed hidden states (B, T, n_embd), for computing log-probs a chunk of the vocab
        at a time."""
        cfg, cache = self.config, kv_cache
        B, T = idx.shape
        ar = torch.arange(T, device=idx.device)
        window = cfg.sliding_window if cfg.sliding_layers else 0
        if cache is None:
            mask = attn_mask
            L = T
            if pos is not None and (self.wpe is not None or cfg.longrope or window):
                L = int(pos.max()) + 1  # (a sync: GPT-2, phi3's longrope and a sliding window only)
            pos = ar[None] if pos is None else pos
            if mask is not None and mask.dim() == 2:
                # packed groups' segment ids: the mask is built here, on device; and for the
                # sliding-window layers another, where the window cuts
                backend = packed_backend(self.packed_attention, mask.device)
                seg, mask = mask, packed_mask(mask, backend)
                if window and L > window:
                    mask = [mask, packed_mask(seg, backend, pos, window)]
            elif window and L > window:  # plain rows, or a (B, 1, T, T) mask: cut by the window
                near = (pos[:, :, None] - pos[:, None, :] < window)[:, None]
                causal = (ar[:, None] >= ar)[None, None]
                mask = [mask, near & (causal if mask is None else mask)]
        else:
            # a static cache: attention over every position, those not yet written masked, so
            # each decode step has one shape (a CUDA graph); else only as far as any row has got
            L = cache.max_len if cache.static else cache.extent + T
            if L > cache.max_len:
                raise ValueError(f'KV cache overflow: {cache.extent} cached + {T} new > '
                                 f'max_len {cache.max_len}')
            pos = cache.lengths[:, None] + ar  # (B, T)
            # (B, 1, g*T, L), 0 or -inf, added to the scores: query t of row b sees positions <=
            # pos[b, t], repeated for the g query heads that share a kv head (Attention.cached folds
            # them into the query axis); built once here, in the model dtype, rather than a bool
            # mask that SDPA would turn into this in every layer. Its rows are laid out a multiple
            # of 8 apart (positions past L sliced off): SDPA's memory-efficient CUDA kernel copies a
            # bias whose strides are not, in every layer. Always some past L, so that the layout
            # does not depend on L (a compiled forward would guard on it and compile twice). An
            # empty cache: every row starts at 0, so plain causal attention over the new tokens
            # (right padding is harmless: pad positions are overwritten by the tokens that follow,
            # and masked until then)
            g = cfg.n_head // cfg.n_kv_head
            mask = None
            def bias(seen):  # (B, T, positions) bool -> (B, 1, g*T, L)
                b = torch.zeros(seen.shape, dtype=self.ln_f.weight.dtype, device=idx.device)
                return b.masked_fill_(~seen, float('-inf'))[:, None].repeat(1, 1, g, 1)[..., :L]
            if cache.static or cache.extent != 0:  # static first: a graph reads no extent
                at = torch.arange(L // 8 * 8 + 8, device=idx.device)
                seen = at <= pos[:, :, None]
                mask = bias(seen)
                if window and L > window:  # the sliding-window layers: the last window positions
                    mask = [mask, bias(seen & (at > pos[:, :, None] - window))]
            elif window and T > window:  # an empty cache, a prefill longer than the window
                mask = [None, ((ar <= ar[:, None]) & (ar > ar[:, None] - window))[None, None]]
            rows = torch.arange(B, device=idx.device)[:, None]
        # GPT-2's position table ends at max_seq_len (with a cache, only pads of a batched prefill
        # run past it: sample.py checks the rows' lengths); past phi3's (its original context)
        # transformers switches longrope to long_factor (a static cache: sample.py's check)
        static = cache is not None and cache.static
        if L > cfg.max_seq_len and (self.wpe is not None and cache is None or cfg.longrope and not static):
            raise ValueError(f'sequence of {L} positions exceeds the model maximum '
                             f'{cfg.max_seq_len}')
        # the blocks work on rows (B*T, n_embd): each matmul 2-D, no reshape around it
        # the residual stream in the norms' dtype: with a LoRA base kept in bf16 (lora.store_base)
        # the embedding is bf16 and the norms fp32, and the stream stays fp32 as before
        x = self.wte(idx)
        if cfg.arch == 'gemma3_text':  # scaled by sqrt(width), rounded to the embedding's dtype first
            x = x * torch.tensor(cfg.n_embd ** 0.5).to(x.dtype)
        x = x.to(self.ln_f.weight.dtype)
        rope = None
        if self.wpe is not None:  # a pad's position past the table's end reads its last row, unused
            x = x + self.wpe(pos if cache is None else pos.clamp(max=cfg.max_seq_len - 1))
        else:
            # OLMo 2 rotates in fp32 whatever the model's dtype, the others in theirs
            dtype = torch.float32 if cfg.arch == 'olmo2' else x.dtype
            cos_sin = rope_cos_sin(pos, cfg.rotary_dim or cfg.head_dim, cfg.rope_theta, dtype,
                                   cfg.rope_scaling, cfg.longrope)
            rope = tuple(t[:, :, None] for t in cos_sin)  # (B, T, 1, hd): over the heads
            if cfg.arch == 'gemma3_text':  # [global, local]: each block takes its own
                local = rope_cos_sin(pos, cfg.head_dim, cfg.local_rope_theta, dtype)
                rope = [rope, tuple(t[:, :, None] for t in local)]
        x = x.view(B * T, -1)
        for i, block in enumerate(self.h):
            if self.grad_checkpoint and self.training and cache is None and torch.is_grad_enabled():
                # keep only each block's input; recompute its activations in backward (long
                # completions)
                x = torch.utils.checkpoint.checkpoint(block, x, (B, T), rope, mask, None,
                                                      use_reentrant=False)
            else:
                layer_kv = None if cache is None else (cache.k[i], cache.v[i], rows, pos)
                x = block(x, (B, T), rope, mask, layer_kv)
        if cache is not None:
            cache.lengths += T if input_lengths is None else input_lengths.to(cache.lengths)
            cache.extent = L
        return self.ln_f(x).view(B, T, -1)

    def packed_kind(self):
        """The attention packed rows get on this model's device: 'flex' or 'sdpa'
        (packed_backend)."""
        return packed_backend(self.packed_attention, self.wte.weight.device)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def matmul_weights(self):
        """(the blocks' matmul weights, the LM head's): what one position multiplies in the body and
        one scored token in the head, a multiply-add each (the N of the FLOP counts; the embedding
        is a lookup)."""
        body = sum(p.numel() for n, p in self.named_parameters() if n.startswith('h.') and p.dim() == 2)
        return body, self.config.vocab_size * self.config.n_embd

    def attention_width(self):
        """Query heads x head size: per attended position, a layer's scores and values cost 2 x 2 x
        this FLOPs forward."""
        return self.config.n_head * self.config.head_dim


def from_scratch(cfg, dtype=torch.float32, device='cpu', seed=0):
    """Random init as nanoGPT: normal(0, 0.02), residual projections scaled by 1/sqrt(2 n_layer),
    zero biases, unit norms. Drawn on the CPU in fp32 so a seed gives the same weights on every
    device."""
    with torch.device('meta'):
        model = GPT(cfg)
    model.to_empty(device='cpu')
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith('bias'):
            nn.init.zeros_(p)
        elif p.dim() == 1:  # norm gains
            nn.init.ones_(p)
        else:
            std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith('c_proj.weight') else 0.02
            nn.init.normal_(p, 0.0, std, generator=g)
    return model.to(device=device, dtype=dtype)


@torch.no_grad()
def copy_weights(dst, src):
    """dst's weights set to src's (the sampler's low-precision copy after an update); an
    FSDP-sharded src is gathered weight by weight, and every rank must take part."""
    for p, q in zip(dst.parameters(), src.parameters()):
        p.copy_(q.full_tensor() if hasattr(q, 'full_tensor') else q)
