"""
The Fully Looped Transformer (Fu et al., 2026) and the four variants it is compared to, in one file.

A looped transformer runs the same L blocks K times ("loops"): depth without new parameters.
Plain looping (LT) is unstable: the residual stream grows with every loop and training collapses
at high K. The paper's fix, FLT, restarts every loop from the normalised embedding norm(e) and
lets the previous loop steer each layer's attention (queries from its output, keys/values from
the current stream), so what a loop reads is bounded by softmax. Read top to bottom: config,
norm/RoPE, attention, MLP, block, the two variant choices, the model. GPT.loop_states is the
loop; decoding runs the same loop with its KV cache, the exit rule and drafting with fewer loops
(flt/decoding.py: cached_loops, draft_and_verify).

The paper's five variants (VARIANTS), two choices, one loop body (GPT.loop_states); loops count
t = 1..K, and loop 1 is plain in every variant (GPT.loop_start); for loop t >= 2:
  restart(variant, e, x0, h_prev)  its start: h_prev (LT), norm(e + h_prev) (LT_i), x0 = norm(e)
  injection(variant, layer)        how each layer sees h_prev: one of INJECTIONS, which
                                   Block.forward interprets
A new variant is a name in VARIANTS, its rule in restart and injection, and its row in the
float64 reference (tests/test_model.py: REFERENCE_RULES); docs/tour.md walks through one.
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

try:
    from flt.decoding import (Decoder, KVCache, LoopSpan, attention_mask, cached_loops,
                              check_draft, check_inputs, check_prompt, choose, draft_and_verify)
except ImportError:
    # a Hugging Face export (scripts/export_hf.py) has decoding.py beside model.py
    from .decoding import (Decoder, KVCache, LoopSpan, attention_mask, cached_loops,
                           check_draft, check_inputs, check_prompt, choose, draft_and_verify)

VARIANTS = ("LT", "LT_i", "LT_ai", "FLT_res", "FLT")
ATTNS = ("full", "mla")
# RoPE table: ROPE_SPAN * sequence_len positions, as the authors' gpt.py (rotary_seq_len =
# sequence_len * 10), so a forward without a KV cache takes CORE's longer few-shot prompts whole.
ROPE_SPAN = 10


@dataclass
class GPTConfig:
    """The model's shape and its loop. vocab_size: the tokenizer's (the paper's Qwen3: 151,669;
    the CPU BPE: 4096), which padded_vocab rounds up to 64s. n_layer: L unique blocks; n_kv_head <
    n_head: GQA. loops: K, which forward(loops=...) overrides per call. attn: full or mla
    (latent rank kv_rank). window_pattern: L = full causal, S = a window of sequence_len // 4,
    tiled, last layer full. loss_all_loops: train on the mean loss of every loop, not only the
    last. checkpoint_loops: recompute each loop in backward (one loop's activations at a time)."""
    sequence_len: int = 1024
    vocab_size: int = 151669
    n_layer: int = 12
    n_head: int = 6
    n_kv_head: int = 6
    n_embd: int = 768
    loops: int = 1
    variant: str = "FLT"
    attn: str = "full"
    kv_rank: int = 128
    window_pattern: str = "L"
    loss_all_loops: bool = False
    checkpoint_loops: bool = False

    def __post_init__(self):
        def bad(field, allowed):
            value = getattr(self, field)
            raise ValueError(f"GPTConfig.{field}={value!r} is invalid: {allowed}")
        for field, allowed in (("variant", VARIANTS), ("attn", ATTNS)):
            if getattr(self, field) not in allowed:
                bad(field, f"expected one of {allowed}")
        counts = ("sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "kv_rank",
                  "loops")
        for field in counts:
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
        pattern = self.window_pattern
        tiled = [pattern[i % len(pattern)] for i in range(self.n_layer)]
        tiled[-1] = "L"
        return [w if c == "S" else None for c in tiled]


def norm(x):
    # Parameter-free RMSNorm as the authors' nanochat/gpt.py calls it. torch computes it in fp32,
    # with fp32's eps, whatever x's dtype (tests/test_gpu_path.py writes it out), so norm(e) of a
    # bf16 embedding is not shrunk by bf16's eps (0.0078).
    return F.rms_norm(x, (x.size(-1),))


def apply_rotary(x, cos, sin):
    """RoPE on x (B, T, H, D) in nanochat's (and the paper authors') convention: split each head
    into halves x1, x2; y1 = x1 cos + x2 sin, y2 = -x1 sin + x2 cos. Rotating the other way
    would be an equally valid RoPE, but not the function the paper's checkpoints compute."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)


def rotary_tables(config):
    """(cos, sin), each (ROPE_SPAN * sequence_len, 1, D/2): broadcast over batch and heads."""
    head_dim = config.n_embd // config.n_head
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    positions = torch.arange(ROPE_SPAN * config.sequence_len, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    return angles.cos()[:, None, :], angles.sin()[:, None, :]


class CausalSelfAttention(nn.Module):
    """Attention whose queries and keys/values may come from different streams. Self-attention:
    attn(norm(x), norm(x)). Attention injection (FLT, Sec. 4.2): attn(h_prev, norm(x)) (h_prev
    is a norm already) with the same W_Q, W_K, W_V, W_O: the previous loop chooses *what to
    read*, the current stream supplies it."""

    def __init__(self, config, window):
        super().__init__()
        d = config.n_embd
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_dim = d // self.n_head
        self.window = window
        self.mla = config.attn == "mla"
        kv_dim = self.n_kv_head * self.head_dim
        self.c_q = nn.Linear(d, d, bias=False)
        if self.mla:
            # keys and values from a shared low-rank latent c = norm(x W_down)
            self.c_kv_down = nn.Linear(d, config.kv_rank, bias=False)
            self.c_k_up = nn.Linear(config.kv_rank, kv_dim, bias=False)
            self.c_v_up = nn.Linear(config.kv_rank, kv_dim, bias=False)
        else:
            self.c_k = nn.Linear(d, kv_dim, bias=False)
            self.c_v = nn.Linear(d, kv_dim, bias=False)
        self.c_proj = nn.Linear(d, d, bias=False)

    def forward(self, q_in, kv_in, rope, kv_update=None):
        """kv_update: decoding's KVCache.update for this layer and loop, (k, v, window) -> (every
        key and value so far, their mask); None: the keys and values of kv_in's tokens only."""
        B, T, _ = q_in.shape
        q = self.c_q(q_in).view(B, T, self.n_head, self.head_dim)
        if self.mla:
            c = norm(self.c_kv_down(kv_in))
            k, v = self.c_k_up(c), self.c_v_up(c)
        else:
            k, v = self.c_k(kv_in), self.c_v(kv_in)
        k, v = (z.view(B, T, self.n_kv_head, self.head_dim) for z in (k, v))
        # RoPE, then QK-norm
        q, k = norm(apply_rotary(q, *rope)), norm(apply_rotary(k, *rope))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D)
        if kv_update is None:
            # full attention: is_causal (the flash kernel's path); a sliding window: its mask
            mask = None
            if self.window is not None:
                mask = attention_mask(T, T, 0, self.window, q.device)
        else:
            # decoding: append this step's keys/values, attend over all so far (KVCache.update)
            k, v, mask = kv_update(k, v, self.window)
        gqa = self.n_kv_head != self.n_head
        if gqa and mask is not None:
            # enable_gqa with a mask would fall back to the math kernel
            k, v = (z.repeat_interleave(self.n_head // self.n_kv_head, dim=1) for z in (k, v))
        causal = kv_update is None and mask is None
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                           enable_gqa=gqa and mask is None)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x):
        # ReLU^2
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, config, window):
        super().__init__()
        self.attn = CausalSelfAttention(config, window)
        self.mlp = MLP(config)

    def forward(self, x, rope, h_prev=None, inject=None, kv_update=None):
        """One layer; inject, one of INJECTIONS, is how it sees h_prev = h(t-1). These branches
        are the only place the model acts on those names (the float64 references in tests/ have
        their own). kv_update: decoding's (CausalSelfAttention)."""
        # "res" (FLT_res): add the previous loop's output to the stream, renormalise
        if inject == "res":
            x = norm(x + h_prev)
        kv_in = norm(x)
        # "attn", Attention Injection (Sec. 4.2): queries from h(t-1) as it is, since it is
        # already a norm(stream), h(t-1) = norm(x)
        q_in = h_prev if inject == "attn" else kv_in
        x = x + self.attn(q_in, kv_in, rope, kv_update)
        return x + self.mlp(norm(x))


# ------------------------------------------------------------------------------------------------
# The variants as data (the paper's Sec. 4): loop 1 is plain for all of them; for loops t >= 2,
# where the stream restarts and which layers see h(t-1).

# How a layer may see h(t-1), the names injection returns and Block.forward interprets: None
# (plain), "attn" (Attention Injection, Sec. 4.2: its queries from h(t-1)), "res" (FLT_res:
# norm(x + h(t-1)) before the layer). A new kind: a branch there and in the tests' references.
INJECTIONS = (None, "attn", "res")


def restart(variant, e, x0, h_prev):
    """The stream at the start of loop t >= 2; x0 = norm(e) is where loop 1 started."""
    # LT: keep iterating on the previous loop's output
    if variant == "LT":
        return h_prev
    # LT_i: input injection
    if variant == "LT_i":
        return norm(e + h_prev)
    # LT_ai, FLT_res, FLT: every loop starts from norm(e)
    if variant in ("LT_ai", "FLT_res", "FLT"):
        return x0
    raise ValueError(f"restart: no rule for variant {variant!r}")


def injection(variant, layer):
    """How layer `layer` (0 = the first) sees h(t-1) in loops t >= 2 (loop 1 is plain for every
    variant: GPT.loop_start asks only from loop 2 on): one of INJECTIONS."""
    # LT, LT_i: never; LT_ai: Attention Injection in the first layer, FLT: in every layer;
    # FLT_res: h(t-1) added to the stream before every layer. A variant not here: a KeyError
    kinds = {"LT": None, "LT_i": None, "LT_ai": "attn" if layer == 0 else None,
             "FLT_res": "res", "FLT": "attn"}
    return kinds[variant]


class Loops(NamedTuple):
    """One pass's loops. states: [h(1), ..., h(K)], h(t) = norm(stream after loop t), each a
    prediction point (GPT.head). resid_norms: the mean L2 norm of the stream after each loop
    (before norm), detached; None from decoding's loop. exit_loops (B, T): the loops each
    position ran under the exit rule (flt/decoding.py: ExitRule), or None."""
    states: list
    resid_norms: torch.Tensor | None
    exit_loops: torch.Tensor | None = None


class GPT(nn.Module):
    # the parameter-free norm, for decoding's loop (flt/decoding.py cannot import this file)
    norm = staticmethod(norm)

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.padded_vocab, config.n_embd),
            h=nn.ModuleList([Block(config, w) for w in config.windows()]),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab, bias=False)
        # the RoPE tables, not saved: rebuilt from the config
        for name, table in zip(("cos", "sin"), rotary_tables(config)):
            self.register_buffer(name, table, persistent=False)

    @torch.no_grad()
    def init_weights(self):
        """The paper's initialisation (nanochat's):
        | parameter                         | init                                   |
        |-----------------------------------|----------------------------------------|
        | transformer.wte                   | N(0, 1)                                |
        | lm_head                           | N(0, 0.001²): std 0.001                |
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

    def loop_states(self, idx, loops=None, bptt_loops=None):
        """The loop (Sec. 4), one body for every variant: Loops, whose states [h(1), ..., h(K)],
        h(t) = norm(stream after loop t), are each a prediction point (head). bptt_loops: only the
        last bptt_loops loops learn (None or >= K: all); LT's embedding, read in loop 1 alone, then
        gets no gradient (flt/planning.py: check_settings refuses it). flt/decoding.py: cached_loops
        runs it with a KV cache, exit rule and draft spans; tests/test_loop_cache.py ties them."""
        K = self.loop_count(loops)
        T = idx.size(1)
        # a ValueError for T past the RoPE table or a bptt_loops not an integer >= 1 (or None)
        check_inputs(T, K, None, bptt_loops, self.cos.size(0), self.config.sequence_len)
        rope = (self.cos[:T], self.sin[:T])
        # e: the raw embedding; loop 1 starts from x0 = norm(e)
        e = self.transformer.wte(idx)
        x0 = norm(e)
        # checkpoint_loops: backward recomputes each loop's blocks (one loop's activations, not K)
        blocks = self.blocks
        if self.config.checkpoint_loops and self.training and torch.is_grad_enabled():
            blocks = partial(checkpoint, self.blocks, use_reentrant=False)
        # truncated backprop (Huginn): loops 1..frozen run as constants, the last bptt_loops learn
        # (bptt_loops None or >= K: frozen <= 0, every loop learns)
        frozen = K - (bptt_loops or K)
        hs, norms, h_prev = [], [], None
        for t in range(1, K + 1):
            with torch.no_grad() if t <= frozen else nullcontext():
                # where loop t starts and how each layer sees h(t-1): the variant's choices
                x, injects = self.loop_start(t, e, x0, h_prev)
                x = blocks(x, rope, h_prev, injects)
            # the residual stream's norm (Sec. 3, Fig. 2), then h(t) = norm(x)
            norms.append(x.detach().float().norm(dim=-1).mean())
            h_prev = norm(x)
            hs.append(h_prev)
        return Loops(hs, torch.stack(norms))

    def loop_start(self, t, e, x0, h_prev):
        """Loop t's first stream and each layer's injection (t = 1..K, the paper's numbering).
        Loop 1 is plain in every variant: x0 = norm(e), no injection. From loop 2 on: restart
        and injection. Both loops, this file's and decoding's, ask here."""
        if t == 1:
            return x0, [None] * self.config.n_layer
        variant = self.config.variant
        injects = [injection(variant, i) for i in range(self.config.n_layer)]
        return restart(variant, e, x0, h_prev), injects

    def blocks(self, x, rope, h_prev, injects):
        """One loop's L blocks from x; layer i sees h(t-1) as injects[i] says."""
        for block, inject in zip(self.transformer.h, injects):
            x = block(x, rope, h_prev, inject)
        return x

    def head(self, h):
        # padded ids are never predicted; the logit softcap is computed in fp32
        logits = self.lm_head(h)[..., :self.config.vocab_size].float()
        return 15 * torch.tanh(logits / 15)

    def loss(self, h, targets):
        # targets[b, i] labels position i: the token after it in text; in a reasoning task
        # (flt/tasks.py) the answer at position i itself, computed from tokens <= i; -1: unscored
        logits = self.head(h).flatten(0, 1)
        return F.cross_entropy(logits, targets.flatten(), ignore_index=-1)

    def forward(self, idx, targets=None, loops=None, all_loops=False, kv_cache=None,
                bptt_loops=None, exit_threshold=None, return_loops=False, exit_rule="kl"):
        """Logits (B, T, V) of the last loop, or the loss if targets are given. all_loops=True:
        a list of K logits, or a (K,) tensor of per-loop losses, from one pass.
        return_loops=True: (that output, the pass's Loops), e.g.
        `loss, looped = model(x, y, return_loops=True)` for looped.resid_norms. kv_cache or
        exit_threshold (of exit_rule, EXIT_RULES): decoding's loop (flt/decoding.py:
        cached_loops), which does not train."""
        K = self.loop_count(loops)
        if kv_cache is None and exit_threshold is None:
            looped = self.loop_states(idx, K, bptt_loops)
        elif bptt_loops is not None:
            raise ValueError(f"bptt_loops={bptt_loops} with kv_cache or exit_threshold: "
                             "decoding's loop does not train")
        else:
            hs, exit_loops = cached_loops(self, idx, LoopSpan(K), kv_cache, exit_threshold,
                                          exit_rule)
            looped = Loops(hs, None, exit_loops)
        every = all_loops or (targets is not None and self.config.loss_all_loops)
        # the other loops cost no head FLOPs unless asked for
        hs = looped.states if every else looped.states[-1:]
        if targets is None:
            outputs = [self.head(h) for h in hs]
        else:
            # (K,) losses for every loop, or (1,) for the last
            outputs = torch.stack([self.loss(h, targets) for h in hs])
        out = outputs if all_loops else outputs.mean() if targets is not None else outputs[-1]
        return (out, looped) if return_loops else out

    @torch.inference_mode()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, seed=None, loops=None,
                 exit_threshold=None, attention_mask=None, cache_slots=None, draft_loops=None,
                 draft_len=4, decode=None, exit_rule="kl"):
        """Stream (B, 1) tokens with a KV cache: a prefill, then one token a step. cache_slots:
        its m (KVCache; None = K, exact). exit_threshold: depth per token under exit_rule.
        attention_mask (B, T): 0 marks left padding, so prompts of different lengths share a
        batch. draft_loops = K_d < K: draft draft_len tokens with K_d loops, verify them with
        loops K_d+1..K (flt/decoding.py): the same tokens, or sampling the same distribution.
        decode: the steps' path (flt/decoding.py: Decoder), "eager", "static" (one shape a step)
        or "compiled" (CUDA graphs on CUDA); None: compiled on CUDA, eager elsewhere or exiting."""
        check_prompt(idx, max_new_tokens, attention_mask, self.config.sequence_len)
        rng = None if seed is None else torch.Generator(device=idx.device).manual_seed(seed)
        K = self.loop_count(loops)
        if draft_loops is not None:
            check_draft(K, draft_loops, draft_len, cache_slots, exit_threshold)
            for tokens in draft_and_verify(self, idx, max_new_tokens, K, draft_loops, draft_len,
                                           temperature, top_k, rng, attention_mask, decode=decode):
                yield from tokens.split(1, dim=1)
            return
        step = Decoder(self, idx, K, decode, attention_mask, cache_slots, exit_threshold,
                       exit_rule)
        # the prefill: the prompt in one forward (eager: its length varies)
        logits = step(idx, eager=True).logits[:, -1]
        for i in range(max_new_tokens):
            # chosen on the device: no host read
            token = choose(logits, temperature, top_k, rng)
            yield token
            if i + 1 < max_new_tokens:
                # one token through the K loops, at the cache's next position
                logits = step(token).logits[:, -1]

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
        """Training FLOPs per token (forward + backward = 3x forward = 6 per weight). The blocks
        run K times; the LM head once per supervised loop; attention scores cost
        12 * d_model * (window, or sequence_len) per layer and loop (nanochat's). With truncated
        backpropagation the loops before the last bptt_loops run forward only, 2 FLOPs per weight
        (and a third of the attention cost); the head on such a loop takes 4 (forward, and its
        weight's gradient: no gradient flows into that h)."""
        c, K = self.config, self.loop_count(loops)
        G = K if bptt_loops is None else min(K, bptt_loops)
        block = sum(p.numel() for p in self.transformer.h.parameters())
        heads = (6 * G + 4 * (K - G)) if c.loss_all_loops else 6
        # attention scores, forward and backward (nanochat's 12 d T); a third for forward only
        attn = sum(12 * c.n_embd * (w or c.sequence_len) for w in c.windows())
        # in forward passes: G loops forward and backward, K - G forward only
        return heads * self.lm_head.weight.numel() + (2 * block + attn // 3) * (3 * G + (K - G))

    def compile_regions(self, **kwargs):
        """Regional compilation: torch.compile(**kwargs) each block and the loss, not the whole
        model. The blocks share their code: graphs per kind of layer (window x injection), reused
        in every loop, so compile time does not grow with K and checkpoint_loops keeps working
        (a whole-model graph's backward keeps every loop's activations alive). Past
        recompile_limit graphs dynamo runs calls eagerly, after one logged warning: training
        needs one per kind, grad mode and requires_grad of x and h_prev (at most 4 a kind in
        loop 1, 8 later), so the limit is raised to that; evaluation runs eagerly
        (flt/runtime.py: evaluating, set_stance("force_eager")), or each input length would add
        graphs. Cached decoding bypasses them (its compiled step: flt/decoding.py: Decoder).
        Returns the model."""
        for block in self.transformer.h:
            block.compile(**kwargs)
        # fuses softcap + cross-entropy over (B, T, V)
        self.loss = torch.compile(self.loss, **kwargs)
        windows = self.config.windows()
        kinds = {(w, injection(self.config.variant, i)) for i, w in enumerate(windows)}
        limit = 4 * len({w for w, _ in kinds}) + 8 * len(kinds)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
        return self
