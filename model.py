"""
The Fully Looped Transformer (Fu et al., 2026) and its four looped ancestors, in one file.

A looped transformer runs the same L blocks K times ("loops"): depth without new parameters. Plain
looping (LT) is unstable: the residual stream grows with every loop and training collapses at high
K. The paper's fix, FLT, restarts every loop from the normalised embedding norm(e) and lets the
previous loop steer each layer's attention (queries from its output, keys/values from the current
stream), so what a loop reads is bounded by softmax. Read top to bottom: config, norm/RoPE,
attention, MLP, block, the two variant choices, the model, decoding's KV cache, the exit rule.

Five variants, two choices, one loop body (GPT._loop, run K times by GPT.loop_states); loop t >= 2:
  restart(variant, e, x0, h_prev)  its start: h_prev (LT), norm(e + h_prev) (LT_i), x0 = norm(e)
  injection(variant, layer)        how each layer sees h_prev: None, "attn" (injection) or "res"
"""
import math
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

VARIANTS = ("LT", "LT_i", "LT_ai", "FLT_res", "FLT")
ATTNS = ("full", "mla")
# RoPE table: ROPE_SPAN * sequence_len positions, as the authors' gpt.py (rotary_seq_len =
# sequence_len * 10), so a forward without a KV cache takes CORE's longer few-shot prompts whole.
ROPE_SPAN = 10


@dataclass
class GPTConfig:
    sequence_len: int = 1024
    vocab_size: int = 151644      # Qwen3: 151643 BPE ids + <|endoftext|>; padded to 64 below
    n_layer: int = 12             # L unique blocks
    n_head: int = 6
    n_kv_head: int = 6            # GQA when < n_head
    n_embd: int = 768
    loops: int = 1                # K; forward(loops=...) overrides it per call
    variant: str = "FLT"          # LT | LT_i | LT_ai | FLT_res | FLT
    attn: str = "full"            # full | mla
    kv_rank: int = 128            # MLA latent rank R
    window_pattern: str = "L"     # L = full causal, S = window of sequence_len // 4; tiled
    loss_all_loops: bool = False  # train on the mean loss of every loop, not only the last
    checkpoint_loops: bool = False  # recompute each loop in backward (memory ~ 1 loop)

    def __post_init__(self):
        def bad(field, allowed):
            raise ValueError(f"GPTConfig.{field}={getattr(self, field)!r} is invalid: {allowed}")
        for field, allowed in (("variant", VARIANTS), ("attn", ATTNS)):
            if getattr(self, field) not in allowed:
                bad(field, f"expected one of {allowed}")
        for field in ("sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "kv_rank", "loops"):
            if getattr(self, field) < 1:
                bad(field, "expected an integer >= 1")
        if self.n_head % self.n_kv_head:
            bad("n_kv_head", f"must divide n_head={self.n_head}")
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            bad("n_embd", f"must be n_head={self.n_head} times an even head dimension")
        if not self.window_pattern or set(self.window_pattern) - {"L", "S"}:
            bad("window_pattern", "expected a non-empty string of 'L' (full) and 'S' (sliding)")
        if "S" in self.window_pattern and self.sequence_len < 4:
            bad("window_pattern", "'S' needs sequence_len >= 4 (the window is sequence_len // 4)")

    @property
    def padded_vocab(self):
        return -(-self.vocab_size // 64) * 64

    def windows(self):
        """Attention window per layer: the pattern tiled, the last layer always full."""
        w = self.sequence_len // 4
        tiled = [self.window_pattern[i % len(self.window_pattern)] for i in range(self.n_layer)]
        tiled[-1] = "L"
        return [w if c == "S" else None for c in tiled]


def norm(x):
    # Parameter-free RMSNorm as the authors' nanochat/gpt.py calls it: fp32 math and eps whatever x's dtype
    # (CUDA autocast: fp32 out), so norm(e) of a bf16 embedding is not shrunk by bf16's eps (0.0078).
    return F.rms_norm(x, (x.size(-1),))


def apply_rotary(x, cos, sin):
    """RoPE on x (B, T, H, D) in nanochat's (and the paper authors') convention: split each head
    into halves x1, x2; y1 = x1 cos + x2 sin, y2 = -x1 sin + x2 cos. Rotating the other way
    would be an equally valid RoPE, but not the function the paper's checkpoints compute."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)


def rotary_tables(config):
    """(cos, sin), each (ROPE_SPAN * sequence_len positions, 1, D/2): broadcast over batch and heads."""
    head_dim = config.n_embd // config.n_head
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(ROPE_SPAN * config.sequence_len, dtype=torch.float32), inv_freq)
    return angles.cos()[:, None, :], angles.sin()[:, None, :]


class CausalSelfAttention(nn.Module):
    """Attention whose queries and keys/values may come from different streams. Self-attention:
    attn(norm(x), norm(x)). Attention injection (FLT, Sec. 4.2): attn(norm(h_prev), norm(x)) with the
    same W_Q, W_K, W_V, W_O: the previous loop chooses *what to read*, the current stream supplies it."""

    def __init__(self, config, window):
        super().__init__()
        d, self.n_head, self.n_kv_head = config.n_embd, config.n_head, config.n_kv_head
        self.head_dim, self.window, self.mla = d // self.n_head, window, config.attn == "mla"
        kv_dim = self.n_kv_head * self.head_dim
        self.c_q = nn.Linear(d, d, bias=False)
        if self.mla:  # keys and values from a shared low-rank latent c = norm(x W_down)
            self.c_kv_down = nn.Linear(d, config.kv_rank, bias=False)
            self.c_k_up = nn.Linear(config.kv_rank, kv_dim, bias=False)
            self.c_v_up = nn.Linear(config.kv_rank, kv_dim, bias=False)
        else:
            self.c_k = nn.Linear(d, kv_dim, bias=False)
            self.c_v = nn.Linear(d, kv_dim, bias=False)
        self.c_proj = nn.Linear(d, d, bias=False)

    def forward(self, q_in, kv_in, rope, cache=None):
        B, T, _ = q_in.shape
        q = self.c_q(q_in).view(B, T, self.n_head, self.head_dim)
        if self.mla:
            c = norm(self.c_kv_down(kv_in))
            k, v = self.c_k_up(c), self.c_v_up(c)
        else:
            k, v = self.c_k(kv_in), self.c_v(kv_in)
        k, v = (z.view(B, T, self.n_kv_head, self.head_dim) for z in (k, v))
        q, k = norm(apply_rotary(q, *rope)), norm(apply_rotary(k, *rope))  # RoPE, then QK-norm
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)       # (B, H, T, D)
        if cache is None:  # full attention: is_causal (the flash kernel's path); a sliding window: its mask
            mask = None if self.window is None else attention_mask(T, T, 0, self.window, q.device)
        else:  # decoding: append this step's keys/values, attend over all so far, as the cache's mask says
            k, v, mask = cache(k, v, self.window)
        gqa = self.n_kv_head != self.n_head
        if gqa and mask is not None:  # enable_gqa with a mask would fall back to the math kernel
            k, v = (z.repeat_interleave(self.n_head // self.n_kv_head, dim=1) for z in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=cache is None and mask is None,
                                           enable_gqa=gqa and mask is None)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


def attention_mask(n_q, n_k, pos, window, device, pad=None):
    """Boolean mask, True = visible: query pos+i sees key j iff j <= pos+i (and pos+i-j < window).
    pad (B,): row b's first pad[b] keys are left padding, seen by no query but their own (B, 1, n_q, n_k)."""
    i = torch.arange(pos, pos + n_q, device=device)[:, None]
    j = torch.arange(n_k, device=device)[None, :]
    visible = (j <= i) & (i - j < window) if window is not None else j <= i
    if pad is not None:  # a padding query sees itself: a softmax over no key at all would be NaN
        visible = visible & ((j >= pad[:, None, None, None]) | (i == j))
    return visible


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())  # ReLU^2


class Block(nn.Module):
    def __init__(self, config, window):
        super().__init__()
        self.attn = CausalSelfAttention(config, window)
        self.mlp = MLP(config)

    def forward(self, x, rope, h_prev=None, inject=None, cache=None):
        if inject == "res":   # FLT_res: add the previous loop's output to the stream, renormalise
            x = norm(x + h_prev)
        kv_in = norm(x)
        # Attention injection: queries from h(t-1), already norm(stream) (norm is idempotent: no extra cost)
        q_in = h_prev if inject == "attn" else kv_in
        x = x + self.attn(q_in, kv_in, rope, cache)
        return x + self.mlp(norm(x))


# ------------------------------------------------------------------------------------
# The five variants as data (the paper's Sec. 4): loop 1 is plain for all of them; for loops t >= 2,
# where the stream restarts and which layers see h(t-1).

def restart(variant, e, x0, h_prev):
    """The stream at the start of loop t >= 2; x0 = norm(e) is where loop 1 started."""
    if variant == "LT":
        return h_prev                 # keep iterating on the previous loop's output
    if variant == "LT_i":
        return norm(e + h_prev)       # input injection
    return x0                         # LT_ai, FLT_res, FLT: every loop starts from norm(e)


def injection(variant, layer):
    if variant == "FLT" or (variant == "LT_ai" and layer == 0):
        return "attn"
    return "res" if variant == "FLT_res" else None


class Loops(NamedTuple):
    states: list                  # [h(1), ..., h(K)], h(t) = norm(stream after loop t): each a prediction point
    resid_norms: torch.Tensor     # (K,) mean L2 norm of the stream after loop t (before norm), detached
    exit_loops: torch.Tensor | None = None  # (B, T) loops each position ran (ExitRule); None without it


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.padded_vocab, config.n_embd),
            h=nn.ModuleList([Block(config, w) for w in config.windows()]),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab, bias=False)
        for name, table in zip(("cos", "sin"), rotary_tables(config)):  # not saved: rebuilt from the config
            self.register_buffer(name, table, persistent=False)

    @torch.no_grad()
    def init_weights(self):
        """The paper's initialisation (nanochat's):
        | parameter                         | init                                   |
        |-----------------------------------|----------------------------------------|
        | transformer.wte                   | N(0, 1)                                |
        | lm_head                           | N(0, 0.001)                            |
        | attn.c_q, c_k, c_v, c_kv_down     | U(-s, s), s = sqrt(3 / d_model)        |
        | attn.c_k_up, c_v_up (MLA)         | U(-s, s), s = sqrt(3 / kv_rank)        |
        | mlp.c_fc                          | U(-s, s), s = sqrt(3 / d_model)        |
        | attn.c_proj, mlp.c_proj           | 0: every block starts as the identity  |
        """
        nn.init.normal_(self.transformer.wte.weight, std=1.0)
        nn.init.normal_(self.lm_head.weight, std=0.001)
        s = math.sqrt(3 / self.config.n_embd)
        s_up = math.sqrt(3 / self.config.kv_rank)
        for name, p in self.transformer.h.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.zeros_(p)
            elif name.endswith(("c_k_up.weight", "c_v_up.weight")):
                nn.init.uniform_(p, -s_up, s_up)
            else:
                nn.init.uniform_(p, -s, s)

    def loop_states(self, idx, loops=None, kv_cache=None, bptt_loops=None, exit_threshold=None):
        """The loop (Sec. 4), one body for all five variants: Loops(states=[h(1), ..., h(K)], resid_norms, exit_loops)
        from one pass, h(t) = norm(stream after loop t), each a prediction point (`head`). kv_cache: decoding's
        KVCache for K loops; this call's tokens are written at its pos (RoPE positions: KVCache.positions).
        bptt_loops: truncated backpropagation (_truncated_backprop); None = every loop.
        exit_threshold: depth per token (ExitRule), at most K loops. A full forward gets a KV cache of
        its own, as long as the input, so cached decoding and a full forward compute the same function."""
        K, (B, T) = self.loop_count(loops), idx.shape
        self._check_inputs(T, K, kv_cache, bptt_loops)
        if exit_threshold is not None and kv_cache is None:  # the exit rule's own cache
            kv_cache = KVCache(B, K, self.config, capacity=T)
        exits = ExitRule(exit_threshold, idx, self.head, kv_cache)  # does nothing without a threshold
        at = slice(0, T) if kv_cache is None else kv_cache.positions(T)  # RoPE positions of this call's tokens
        rope, e = (self.cos[at], self.sin[at]), self.transformer.wte(idx)
        x0, hs, norms = norm(e), [], []
        for t in range(K):
            h_prev = hs[-1] if hs else None
            with self._truncated_backprop(t, K, bptt_loops):                          # no_grad before the window
                x = x0 if t == 0 else restart(self.config.variant, e, x0, h_prev)     # where loop t starts
                x = self._checkpointed_loop(x, h_prev, t, rope, kv_cache, exits.done)  # the L blocks, injected
            norms.append(x.detach().float().norm(dim=-1).mean())                     # residual norm (Sec. 3, Fig. 2)
            hs.append(norm(x))                                                       # h(t)
            if exits.update(hs):                                                     # no position loops on
                break
        if kv_cache is not None:
            kv_cache.pos += T
        return Loops(hs, torch.stack(norms), exits.exit_loops)

    def _check_inputs(self, T, K, kv_cache, bptt_loops):
        pos, limit = (0, self.cos.size(0)) if kv_cache is None else (kv_cache.pos, kv_cache.capacity)
        if pos + T > limit:
            what = (f"the RoPE table's {limit} positions ({ROPE_SPAN} x " if kv_cache is None
                    else f"the KV cache's capacity of {limit} tokens (")
            raise ValueError(f"input of {pos + T} tokens exceeds {what}sequence_len={self.config.sequence_len})")
        if kv_cache is not None and kv_cache.loops != K:  # fewer would leave later loops' entries unwritten
            raise ValueError(f"loops={K} differs from the KV cache's loops={kv_cache.loops}")
        if bptt_loops is not None and (not isinstance(bptt_loops, int) or bptt_loops < 1):
            raise ValueError(f"bptt_loops={bptt_loops!r} is invalid: expected an integer >= 1 or None")

    @staticmethod
    def _truncated_backprop(t, K, bptt_loops):
        """Truncated backpropagation (Huginn): loops before the last bptt_loops run under no_grad (constants)."""
        return torch.no_grad() if bptt_loops is not None and t < K - bptt_loops else nullcontext()

    def _checkpointed_loop(self, *args):
        """_loop(*args); with checkpoint_loops in training, in an activation checkpoint: backward recomputes
        it (memory ~ one loop, not K) from its saved inputs x and h_prev, so with this loop's h(t-1)."""
        if self.config.checkpoint_loops and self.training and torch.is_grad_enabled():
            return checkpoint(self._loop, *args, use_reentrant=False)
        return self._loop(*args)

    def _loop(self, x, h_prev, t, rope, kv_cache=None, done=None):
        """Loop t: the L blocks, each with its injection; the loop body, shared by all five variants.
        With a KV cache each layer writes and reads loop t's slot (done: KVCache.update)."""
        for i, block in enumerate(self.transformer.h):
            inject = injection(self.config.variant, i) if t > 0 else None
            if kv_cache is None:
                x = block(x, rope, h_prev, inject)
            else:  # decoding runs eagerly: its shapes change every step, so a compiled block would recompile
                x = block.forward(x, rope, h_prev, inject, partial(kv_cache.update, t, i, done=done))
        return x

    def head(self, h):
        logits = self.lm_head(h)[..., :self.config.vocab_size].float()  # padded ids never predicted
        return 15 * torch.tanh(logits / 15)  # logit softcap, in fp32

    def loss(self, h, targets):
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten(), ignore_index=-1)

    def forward(self, idx, targets=None, loops=None, all_loops=False, kv_cache=None, bptt_loops=None,
                exit_threshold=None, return_loops=False):
        """Logits (B, T, V) of the last loop, or the loss if targets are given. all_loops=True: a list of K
        logits, or a (K,) tensor of per-loop losses, from one pass. return_loops=True: (that output, the pass's
        Loops), e.g. `loss, looped = model(x, y, return_loops=True)` for looped.resid_norms."""
        looped = self.loop_states(idx, loops, kv_cache, bptt_loops, exit_threshold)
        every = all_loops or (targets is not None and self.config.loss_all_loops)
        hs = looped.states if every else looped.states[-1:]  # other loops cost no head FLOPs unless asked for
        outputs = [self.head(h) if targets is None else self.loss(h, targets) for h in hs]
        if targets is not None:  # losses: (K,) for every loop or (1,) for the last
            outputs = torch.stack(outputs)
        out = outputs if all_loops else outputs.mean() if targets is not None else outputs[-1]
        return (out, looped) if return_loops else out

    @torch.inference_mode()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, seed=None, loops=None,
                 exit_threshold=None, attention_mask=None, cache_slots=None):
        """Stream (B, 1) tokens with a KV cache: a prefill, then one token a step. cache_slots: its
        m (KVCache; None = K, exact). exit_threshold: depth per token (loop_states). attention_mask
        (B, T): 0 marks left padding, so prompts of different lengths share a batch."""
        if idx.size(1) + max_new_tokens > self.config.sequence_len:
            raise ValueError(f"prompt ({idx.size(1)}) + max_new_tokens ({max_new_tokens}) "
                             f"exceeds sequence_len={self.config.sequence_len}")
        if attention_mask is not None and attention_mask.shape != idx.shape:
            raise ValueError(f"attention_mask {tuple(attention_mask.shape)}: expected the prompt's {tuple(idx.shape)}")
        rng = None if seed is None else torch.Generator(device=idx.device).manual_seed(seed)
        cache = self.new_kv_cache(idx.size(0), loops, attention_mask, cache_slots)
        logits = self(idx, loops=loops, kv_cache=cache, exit_threshold=exit_threshold)[:, -1]
        for step in range(max_new_tokens):
            if temperature == 0:
                token = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                token = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=rng)
            yield token
            if step + 1 < max_new_tokens:
                logits = self(token, loops=loops, kv_cache=cache, exit_threshold=exit_threshold)[:, -1]

    def new_kv_cache(self, batch_size, loops=None, attention_mask=None, cache_slots=None):
        K = self.loop_count(loops)
        return KVCache(batch_size, K, self.config, attention_mask=attention_mask,
                       cache_slots=cache_slots)

    def loop_count(self, loops=None):
        K = self.config.loops if loops is None else loops
        if not isinstance(K, int) or K < 1:
            raise ValueError(f"loops={K!r} is invalid: expected an integer >= 1")
        return K

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def estimate_flops(self, loops=None, bptt_loops=None):
        """Training FLOPs per token (forward + backward = 3x forward = 6 per weight). The blocks run K times;
        the LM head once per supervised loop; attention scores cost 12 * d_model * (visible keys) per layer and
        loop (nanochat's convention). With truncated backpropagation the loops before the last bptt_loops run
        forward only, 2 FLOPs per weight (and a third of the attention cost)."""
        c, K = self.config, self.loop_count(loops)
        G = K if bptt_loops is None else min(K, bptt_loops)
        block = sum(p.numel() for p in self.transformer.h.parameters())
        head = self.lm_head.weight.numel() * (K if c.loss_all_loops else 1)
        attn = sum(12 * c.n_embd * (w or c.sequence_len) for w in c.windows())
        return 6 * head + (2 * block + attn // 3) * (3 * G + (K - G))  # in forward passes

    def compile_regions(self, **kwargs):
        """Regional compilation: torch.compile(**kwargs) each block and the loss, not the whole model. The blocks
        share their code: graphs per kind of layer (window x injection), reused in every loop, so compile time
        does not grow with K and checkpoint_loops keeps working (a whole-model graph's backward keeps every loop's
        activations alive). Past recompile_limit graphs dynamo silently runs calls eagerly: training needs one per
        kind, grad mode and requires_grad of x and h_prev (at most 4 a kind in loop 1, 8 later), so the limit is
        raised to that; evaluation runs eagerly (train.py: set_stance("force_eager")), or each input length would
        add graphs. Runs with a KV cache stay eager. Returns the model."""
        for block in self.transformer.h:
            block.compile(**kwargs)
        self.loss = torch.compile(self.loss, **kwargs)  # fuses softcap + cross-entropy over (B, T, V)
        kinds = {(w, injection(self.config.variant, i)) for i, w in enumerate(self.config.windows())}
        limit = 4 * len({w for w, _ in kinds}) + 8 * len(kinds)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
        return self


# ------------------------------------------------------------------------------------
# Decoding and depth per token: a KV cache of loop slots per layer, and the exit rule.

class KVCache:
    """Keys and values per (loop slot, layer), each loop's from its own stream. K slots (K*L
    entries): exact, the default. cache_slots=m < K keeps m*L (Huginn's): loop t uses slot t mod m,
    so earlier forwards' tokens are seen as the slot's last loop left them. A forward's tokens go at
    `pos` (of `capacity`); attention_mask (B, T) of the first forward: 0 = left padding, unseen."""

    def __init__(self, B, loops, config, capacity=None, attention_mask=None, cache_slots=None):
        self.loops, self.n_layer, self.pos = loops, config.n_layer, 0
        self.cache_slots = loops if cache_slots is None else cache_slots
        if not (isinstance(self.cache_slots, int) and 1 <= self.cache_slots <= loops):
            raise ValueError(f"cache_slots={cache_slots!r}: expected an integer 1 to loops={loops}")
        self.capacity = capacity or config.sequence_len
        self.shape = (B, config.n_kv_head, self.capacity, config.n_embd // config.n_head)
        self.kv = {}  # (slot, layer) -> (k, v), each (B, H_kv, capacity, D), made when written
        self.pad = None if attention_mask is None or attention_mask.all() else (attention_mask == 0).sum(1)
        if self.pad is not None and (attention_mask != 0).int().diff(dim=1).min() < 0:  # a 1 before a 0
            raise ValueError("attention_mask: expected left padding, each row's 0s (padding) before its 1s")

    def positions(self, n):
        """RoPE positions of the next n tokens: from pos, or per row (B, n) from its first token."""
        if self.pad is None:
            return slice(self.pos, self.pos + n)
        return (torch.arange(self.pos, self.pos + n, device=self.pad.device) - self.pad[:, None]).clamp(min=0)

    def slot(self, loop, layer, like):
        loop %= self.cache_slots  # loop t's slot
        if (loop, layer) not in self.kv:
            self.kv[loop, layer] = (like.new_zeros(self.shape), like.new_zeros(self.shape))
        return self.kv[loop, layer]

    def update(self, loop, layer, k, v, window=None, done=None):
        """Store this step's k/v (B, H_kv, T, D) for (loop, layer); return all keys/values so far and the
        attention mask (window: the layer's). done (B, T): this forward's positions that stopped looping before
        `loop` (ExitRule); they keep the previous loop's keys/values, their exit loop's (as Huginn's cache)."""
        k_all, v_all = self.slot(loop, layer, k)
        end = self.pos + k.size(2)
        if done is not None and loop > 0:  # loop - 1's slot holds this forward's tokens at loop - 1
            k_prev, v_prev = self.slot(loop - 1, layer, k)
            k = torch.where(done[:, None, :, None], k_prev[:, :, self.pos:end], k)
            v = torch.where(done[:, None, :, None], v_prev[:, :, self.pos:end], v)
        k_all[:, :, self.pos:end], v_all[:, :, self.pos:end] = k, v
        unmasked = window is None and self.pad is None and k.size(2) == 1  # one new token sees every key
        mask = None if unmasked else attention_mask(k.size(2), end, self.pos, window, k.device, self.pad)
        return k_all[:, :, :end], v_all[:, :, :end], mask

    def fill(self, last, n):
        """All n tokens from pos exited by loop `last`: copy their keys/values into the loops not run after it."""
        for loop in range(last + 1, self.loops):
            for layer in range(self.n_layer):
                prev = self.slot(loop - 1, layer, None)
                for dst, src in zip(self.slot(loop, layer, prev[0]), prev):
                    dst[:, :, self.pos:self.pos + n] = src[:, :, self.pos:self.pos + n]


class ExitRule:
    """Depth per token (Huginn's KL exit) in one forward over idx (B, T): from loop 2 on, a position stops looping
    once KL(p(t-1) || p(t)) of its LM-head distributions is below `threshold` (nats). Its h(t) then stays h(exit
    loop), and its keys/values at later loops are its exit loop's (`done`, for KVCache.update), so later tokens
    attend to the last state it reached. exit_loops (B, T): the loops each position ran; threshold None: no rule."""

    def __init__(self, threshold, idx, head, kv_cache):
        self.threshold, self.head, self.kv_cache, self.logp = threshold, head, kv_cache, None
        on = threshold is not None  # done: exited yet; exit_loops: K until a position exits
        self.done = torch.zeros_like(idx, dtype=torch.bool) if on else None
        self.exit_loops = torch.full(idx.shape, kv_cache.loops, device=idx.device) if on else None

    def update(self, hs):
        """After loop t = len(hs): positions that exited before it keep their h; those whose prediction
        moved less than the threshold since loop t-1 exit at t. True once no position loops on: the
        later loops' h and keys/values are then copies, filled in here, and the loop can stop."""
        if self.threshold is None:
            return False
        t, K, logp = len(hs), self.kv_cache.loops, F.log_softmax(self.head(hs[-1]), dim=-1)
        if self.logp is not None:  # loop 1 has nothing to compare with
            kl = F.kl_div(logp, self.logp, log_target=True, reduction="none").sum(-1)  # KL(p(t-1) || p(t))
            exits = ~self.done & (kl.clamp(min=0) < self.threshold)  # clamped: 0 never exits on rounding
            hs[-1] = torch.where(self.done[..., None], hs[-2], hs[-1])
            self.exit_loops[exits] = t
            self.done = self.done | exits  # a done position is never checked again
        self.logp = logp
        if t < K and self.done.all():
            self.kv_cache.fill(t - 1, hs[-1].size(1))
            hs += hs[-1:] * (K - t)
            return True
        return False
