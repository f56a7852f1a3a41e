"""Decoding's loop and what it needs: the attention mask, the KV cache of loop slots (and its
static twin, one shape a step), the exit rule (depth per token), which loops a call runs
(LoopSpan), generate's decode step (eager, static or compiled), and the checks of their settings,
each written once. cached_loops is model.py's loop (GPT.loop_states) over the same loop_start
(restart, injection) and blocks, with the cache, the exit rule and partial passes added;
tests/test_loop_cache.py holds the two loops to the same states in float64. Drafting with fewer
loops, built on LoopSpan and the decode step, ends the file (draft_and_verify), with the choice of
a token generate shares with it (choose).

    mask = attention_mask(n_q, n_k, pos, window, device)  # True = visible (causal, window, padding)
    cache = KVCache(B, K, config)                         # keys/values per (loop slot, layer)
    k, v, mask = cache.update(t, layer, k, v, window)     # what a layer attends to while decoding
    hs, exit_loops = cached_loops(model, idx, span, cache, threshold, rule)  # the loop, cached
    step = Decoder(model, idx, K, decode)                 # generate's cache and step (Step = h, logits)
    exits = ExitRule(threshold, idx, model, cache, rule)  # depth per token (EXIT_RULES)
    stop = exits.update(t, hs)                            # after loop t: True once all exited
    span = LoopSpan(K, start=K_d, h_start=h)              # loops K_d+1..K, from h(K_d)
    for tokens in draft_and_verify(model, idx, n, K, K_d, g): ...  # drafting with K_d loops

This file needs torch alone: scripts/export_hf.py copies it beside model.py into a Hugging Face
folder, where model.py imports it as `.decoding`."""
import weakref
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F


def attention_mask(n_q, n_k, pos, window, device, pad=None):
    """Boolean mask, True = visible: query pos+i sees key j iff j <= pos+i (and pos+i-j < window).
    pos: an int, or a device tensor (StaticCache). pad (B,): row b's first pad[b] keys are left
    padding, seen by no query but their own; the mask is then (B, 1, n_q, n_k)."""
    i = (pos + torch.arange(n_q, device=device))[:, None]
    j = torch.arange(n_k, device=device)[None, :]
    visible = (j <= i) & (i - j < window) if window is not None else j <= i
    if pad is not None:
        # a padding query sees itself: a softmax over no key at all would be NaN
        visible = visible & ((j >= pad[:, None, None, None]) | (i == j))
    return visible


class LoopSpan(NamedTuple):
    """Which loops of a K-loop pass a call of cached_loops runs, and from what. It runs loops
    start+1..stop (stop None: K) from h_start = h(start), None when it starts at loop 1. Drafting
    runs a token's loops 1..K_d, LoopSpan(K, stop=K_d), and later its loops K_d+1..K,
    LoopSpan(K, start=K_d, h_start=h(K_d)), the first K_d loops' keys and values already in the
    cache. LoopSpan(K): the whole pass."""
    K: int
    start: int = 0
    stop: int | None = None
    h_start: torch.Tensor | None = None

    def loops(self):
        """The loops t to run, t = 1..K as the paper counts them."""
        return range(self.start + 1, (self.K if self.stop is None else self.stop) + 1)


def cached_loops(model, idx, span, kv_cache=None, exit_threshold=None, exit_rule="kl"):
    """model.py's loop (GPT.loop_states) as decoding runs it: the same loop_start and blocks,
    each layer writing its keys/values at (loop t, layer) into the KV cache at its position and
    attending over every token so far. span (LoopSpan): which loops run (the draft's). The exit
    rule (exit_rule of EXIT_RULES, at exit_threshold) stops positions early. Without a cache,
    the call gets one of its own, so the exit rule computes what cached decoding computes.
    Returns (states, exit_loops), as GPT's Loops; the cache moves past idx's T tokens."""
    T = idx.size(1)
    check_inputs(T, span.K, kv_cache, None, model.cos.size(0), model.config.sequence_len)
    cache = kv_cache
    if cache is None:
        cache = KVCache(idx.size(0), span.K, model.config, capacity=T)
    # depth per token; it does nothing without a threshold
    exits = ExitRule(exit_threshold, idx, model, cache, exit_rule)
    # RoPE positions of this call's tokens: from the cache's position (per row with left padding)
    at = cache.positions(T)
    rope = (model.cos[at], model.sin[at])
    e = model.transformer.wte(idx)
    x0 = model.norm(e)
    hs = []
    h_prev = span.h_start
    for t in span.loops():
        x, injects = model.loop_start(t, e, x0, h_prev)
        for i, (block, inject) in enumerate(zip(model.transformer.h, injects)):
            # a layer's keys/values at loop t; positions that exited keep their exit loop's
            kv_update = partial(cache.update, t, i, done=exits.done)
            # forward, not compile_regions' graphs: a cached step's shapes are its own (Decoder)
            x = block.forward(x, rope, h_prev, inject, kv_update)
        hs.append(model.norm(x))
        # exited positions keep their h; once none loops on, the rest of the K loops are copies
        if exits.update(t, hs):
            break
        h_prev = hs[-1]
    cache.advance(T)
    return hs, exits.exit_loops


def check_inputs(T, K, kv_cache, bptt_loops, rope_positions, sequence_len):
    """A ValueError naming the bad value if a forward of T tokens at K loops cannot run: past the
    RoPE table (rope_positions, ROPE_SPAN x sequence_len) or the KV cache's capacity, at another K
    than the cache's, or with bptt_loops not an integer >= 1 (None: every loop)."""
    if kv_cache is None:
        pos, limit = 0, rope_positions
        what = f"the RoPE table's {limit} positions ({limit // sequence_len} x "
    else:
        # a StaticCache's position is on the device, where reading it would wait for the GPU:
        # generate checks the prompt and its new tokens against the capacity before decoding
        pos, limit = 0 if kv_cache.static else kv_cache.pos, kv_cache.capacity
        what = f"the KV cache's capacity of {limit} tokens ("
    if pos + T > limit:
        raise ValueError(f"input of {pos + T} tokens exceeds {what}sequence_len={sequence_len})")
    # fewer loops would leave later loops' entries unwritten
    if kv_cache is not None and kv_cache.loops != K:
        raise ValueError(f"loops={K} differs from the KV cache's loops={kv_cache.loops}")
    if bptt_loops is not None and (not isinstance(bptt_loops, int) or bptt_loops < 1):
        raise ValueError(f"bptt_loops={bptt_loops!r} is invalid: expected an integer >= 1 or None")


def check_prompt(idx, max_new_tokens, attention_mask, sequence_len):
    """generate's ValueError naming the value if the prompt idx (B, T) and its new tokens pass
    sequence_len, or attention_mask is not the prompt's shape."""
    if idx.size(1) + max_new_tokens > sequence_len:
        raise ValueError(f"prompt ({idx.size(1)}) + max_new_tokens ({max_new_tokens}) "
                         f"exceeds sequence_len={sequence_len}")
    if attention_mask is not None and attention_mask.shape != idx.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)}: "
                         f"expected the prompt's {tuple(idx.shape)}")


def check_cache_slots(cache_slots, loops, prefix=""):
    """A ValueError naming {prefix}cache_slots unless it is None (K slots, exact) or an integer from
    1 to K: decoding at K loops keeps 1 to K loop slots per layer (KVCache). loops: K, or the list
    of K a cache serves (eval.py's, lm_eval_flt's), so 1 to the smallest. prefix: "" for a keyword
    argument, "--" for a command-line setting."""
    K = loops if isinstance(loops, int) else min(loops)
    if cache_slots is None or isinstance(cache_slots, int) and 1 <= cache_slots <= K:
        return
    if isinstance(loops, int):
        bound = f"loops={K} (decoding at K={K} loops keeps 1 to {K} loop slots per layer)"
        exact = f"{K} slots"
    else:
        budgets = ",".join(map(str, loops))
        bound = f"{K}, the smallest K of {prefix}loops={budgets} (K loops keep 1 to K slots a layer)"
        exact = "K slots at each K"
    raise ValueError(f"{prefix}cache_slots={cache_slots!r}: expected an integer 1 to {bound}, "
                     f"or None ({exact}, exact)")


def left_padding(attention_mask):
    """(B,) each row's count of left padding (the 0s of attention_mask (B, T)), None if none."""
    if attention_mask is None or attention_mask.all():
        return None
    # a 1 before a 0 in a row: padding on the right
    if (attention_mask != 0).int().diff(dim=1).min() < 0:
        raise ValueError("attention_mask: expected left padding, "
                         "each row's 0s (padding) before its 1s")
    return (attention_mask == 0).sum(1)


class KVCache:
    """Keys and values per (loop slot, layer), each loop's from its own stream. K slots (K*L
    entries): exact, the default. cache_slots=m < K keeps m*L (Huginn's): loop t (1..K) uses slot
    (t - 1) mod m, so earlier forwards' tokens are seen as the slot's last loop left them. A
    forward's tokens go at `pos` (of `capacity`); attention_mask (B, T) of the first forward: 0 =
    left padding, unseen.
    """
    # its position is a Python int, and a step attends to the keys written so far (StaticCache: not)
    static = False

    def __init__(self, B, loops, config, capacity=None, attention_mask=None, cache_slots=None):
        self.loops = loops
        self.n_layer = config.n_layer
        self.pos = 0
        check_cache_slots(cache_slots, loops)
        self.cache_slots = loops if cache_slots is None else cache_slots
        self.capacity = capacity or config.sequence_len
        self.shape = (B, config.n_kv_head, self.capacity, config.n_embd // config.n_head)
        # (slot, layer) -> (k, v), each (B, H_kv, capacity, D), made when first written
        self.kv = {}
        self.pad = left_padding(attention_mask)

    def positions(self, n):
        """RoPE positions of the next n tokens: from pos, or per row (B, n) from its first token."""
        if self.pad is None:
            return slice(self.pos, self.pos + n)
        # pos may be a device tensor (StaticCache)
        at = self.pos + torch.arange(n, device=self.pad.device)
        return (at - self.pad[:, None]).clamp(min=0)

    def advance(self, n):
        """Past a forward's n tokens."""
        self.pos += n

    def rewind(self, pos):
        """Back to position pos (drafting): the entries from pos on are stale, and overwritten
        before any query reads them. A StaticCache's position is a device tensor: written there,
        no host read."""
        self.pos = pos

    def slot(self, loop, layer, like):
        # loop t's slot, (t - 1) mod m
        index = (loop - 1) % self.cache_slots
        if (index, layer) not in self.kv:
            self.kv[index, layer] = self.allocate(like)
        return self.kv[index, layer]

    def allocate(self, like):
        """A slot's (k, v), zeros at the capacity, as `like`'s dtype and device."""
        return like.new_zeros(self.shape), like.new_zeros(self.shape)

    def update(self, loop, layer, k, v, window=None, done=None):
        """Store this step's k/v (B, H_kv, T, D) for (loop, layer); return all keys/values so far
        and the attention mask (window: the layer's). loop: t = 1..K. done (B, T): this forward's
        positions that stopped looping before `loop` (ExitRule); they keep the previous loop's
        keys/values, their exit loop's (as Huginn's cache)."""
        k_all, v_all = self.slot(loop, layer, k)
        end = self.pos + k.size(2)
        # loop - 1's slot holds this forward's tokens at loop - 1
        if done is not None and loop > 1:
            k_prev, v_prev = self.slot(loop - 1, layer, k)
            k = torch.where(done[:, None, :, None], k_prev[:, :, self.pos:end], k)
            v = torch.where(done[:, None, :, None], v_prev[:, :, self.pos:end], v)
        k_all[:, :, self.pos:end], v_all[:, :, self.pos:end] = k, v
        # one new token, no window, no padding: it sees every key
        unmasked = window is None and self.pad is None and k.size(2) == 1
        mask = None
        if not unmasked:
            mask = attention_mask(k.size(2), end, self.pos, window, k.device, self.pad)
        return k_all[:, :, :end], v_all[:, :, :end], mask

    def fill(self, last, n):
        """All n tokens from pos exited by loop `last` (1..K): copy their keys/values into the
        loops not run after it."""
        for loop in range(last + 1, self.loops + 1):
            for layer in range(self.n_layer):
                prev = self.slot(loop - 1, layer, None)
                for dst, src in zip(self.slot(loop, layer, prev[0]), prev):
                    dst[:, :, self.pos:self.pos + n] = src[:, :, self.pos:self.pos + n]


class StaticCache(KVCache):
    """A KVCache whose decode steps have one shape (gpt-fast's recipe): a step's keys and values
    are written at its positions given as a device tensor (pos), and each layer attends over the
    whole capacity with a mask (causal, its window, left padding), so a step of the K loops, a
    draft step and a verification each have the same shapes at every position, and one compiled
    graph serves them all. The position advances on the device: no host read. The slots are
    allocated at the capacity when the prefill first writes them, and marked static (a captured
    CUDA graph reads and writes them in place); pad is a tensor even without padding (zeros), so
    padded and unpadded prompts share a graph. The exit rule decodes with KVCache."""
    static = True

    def __init__(self, B, loops, config, device, cache_slots=None):
        # the next position, on the device; set before KVCache's pos = 0 (the setter below)
        self.at = torch.zeros((), dtype=torch.long, device=device)
        super().__init__(B, loops, config, cache_slots=cache_slots)
        self.pad = torch.zeros(B, dtype=torch.long, device=device)
        for tensor in (self.at, self.pad):
            torch._dynamo.mark_static_address(tensor)

    @property
    def pos(self):
        return self.at

    @pos.setter
    def pos(self, value):
        # in place: a captured graph reads this tensor, not a new one
        self.at.fill_(value)

    def advance(self, n):
        self.at.add_(n)

    def reset(self, attention_mask=None):
        """Ready for a new prompt, in place: position 0, its left padding, every slot zeroed."""
        pad = left_padding(attention_mask)
        self.pos = 0
        self.pad.copy_(0 if pad is None else pad)
        for k, v in self.kv.values():
            k.zero_()
            v.zero_()
        return self

    def allocate(self, like):
        kv = super().allocate(like)
        for tensor in kv:
            torch._dynamo.mark_static_address(tensor)
        return kv

    def update(self, loop, layer, k, v, window=None, done=None):
        """Store this step's k/v (B, H_kv, T, D) at its positions; return the slot's keys/values
        over the whole capacity and the mask that hides the unwritten and the padding."""
        if done is not None:
            raise ValueError("the exit rule decodes with KVCache: its positions are read on the host")
        k_all, v_all = self.slot(loop, layer, k)
        at = self.at + torch.arange(k.size(2), device=k.device)
        # in k's dtype, as KVCache (under CUDA autocast v is bf16, k fp32 from the fp32 norm)
        k_all.index_copy_(2, at, k)
        v_all.index_copy_(2, at, v.to(v_all.dtype))
        mask = attention_mask(k.size(2), self.capacity, self.at, window, k.device, self.pad)
        return k_all, v_all, mask


# each model's last StaticCache, dropped with the model: the next decode of the same shape reuses
# it, so the step's captured CUDA graphs replay at its addresses (a new cache would re-record them)
RESERVED = weakref.WeakKeyDictionary()


def static_cache(model, B, K, device, attention_mask, cache_slots, owner):
    """A StaticCache of B rows at K loops, reset for a new prompt: the model's last one if its shape
    and numerics fit and no unfinished decode (its owner, held weakly) still uses it, else new."""
    autocast = torch.is_autocast_enabled(device.type) and torch.get_autocast_dtype(device.type)
    key = (B, K, K if cache_slots is None else cache_slots, device, model.lm_head.weight.dtype, autocast)
    cache = RESERVED.get(model)
    if cache is None or cache.key != key or cache.owner() is not None:
        cache = RESERVED[model] = StaticCache(B, K, model.config, device, cache_slots)
        # the shape and numerics it serves
        cache.key = key
    cache.owner = weakref.ref(owner)
    return cache.reset(attention_mask)


# The exit rules (depth per token): each gives a position's score after loop t, and the position
# exits once it is below the threshold (argmax: once its count reaches it). Huginn's rules
# (seal-rg/recurrent-pretraining) and Ouro's learned gate (arXiv 2510.25741), side by side.
EXIT_RULES = {
    "kl": "KL(p(t-1) || p(t)) of the LM head's distributions, in nats (Huginn's)",
    "entropy": "the entropy of p(t), in nats",
    "latent": "|h(t) - h(t-1)| / |h(t)|, the relative change of the state",
    "argmax": "the loops p's top-1 token has stayed the same; exits once it reaches the threshold",
    "gate": "the learned exit gate's probability that later loops still help (flt/exit_gate.py)",
}


def check_exit(rule, threshold, gate=None, prefix=""):
    """A ValueError naming {prefix}exit_rule or {prefix}exit_threshold unless the rule can run:
    a rule of EXIT_RULES, a threshold >= 0 (argmax: an integer >= 1), and for "gate" a model
    that carries one. prefix: "" for keyword arguments, "--" for command-line settings."""
    if rule not in EXIT_RULES:
        raise ValueError(f"{prefix}exit_rule={rule!r}: expected one of {', '.join(EXIT_RULES)}")
    if rule == "argmax" and not (isinstance(threshold, int) and threshold >= 1):
        raise ValueError(f"{prefix}exit_threshold={threshold!r} with exit_rule='argmax': expected "
                         "an integer >= 1, the loops the top-1 token must stay the same")
    if not isinstance(threshold, (int, float)) or not threshold >= 0:
        raise ValueError(f"{prefix}exit_threshold={threshold!r}: expected a number >= 0")
    if rule == "gate" and gate is None:
        raise ValueError(f"{prefix}exit_rule='gate': this model has no exit gate; train one "
                         "with `python -m flt.exit_gate RUN`")


class ExitGate(torch.nn.Module):
    """Ouro's learned exit gate (its second stage), trained after the fact on a frozen model
    (flt/exit_gate.py): from h(t) and its change since h(t-1) (h(0) = 0), the probability (B, T)
    that later loops still lower the position's loss by more than `margin` nats. A small MLP;
    the exit rule "gate" stops a position once it is below the threshold."""

    def __init__(self, n_embd, hidden=64, margin=0.01):
        super().__init__()
        self.fc = torch.nn.Linear(2 * n_embd, hidden)
        self.out = torch.nn.Linear(hidden, 1)
        # the margin it was trained with, saved with its weights
        self.register_buffer("margin", torch.tensor(float(margin)), persistent=True)

    def logits(self, h, h_prev=None):
        delta = h if h_prev is None else h - h_prev
        x = torch.cat([h, delta], dim=-1).to(self.fc.weight.dtype)
        return self.out(F.gelu(self.fc(x)))[..., 0]

    def forward(self, h, h_prev=None):
        return torch.sigmoid(self.logits(h, h_prev))


class ExitRule:
    """Depth per token in one forward over idx (B, T): after loop t a position stops looping once
    its rule's score (EXIT_RULES) passes `threshold`. Its h(t) then stays h(exit loop), and its
    keys/values at later loops are its exit loop's (`done`, for KVCache.update), so later tokens
    attend to the last state it reached. The rules that compare two loops (kl, latent, argmax)
    exit from loop 2 on, entropy and gate from loop 1. exit_loops (B, T): the loops each position
    ran; threshold None: no rule."""

    def __init__(self, threshold, idx, model, kv_cache, rule="kl"):
        self.threshold = threshold
        self.rule = rule
        self.model = model
        self.kv_cache = kv_cache
        # the last loop's log-probabilities (kl, entropy, argmax) and h (latent, gate)
        self.logp = None
        self.h = None
        # argmax: the loops each position's top-1 token has stayed the same
        self.same = None
        # done: exited yet; exit_loops: K until a position exits
        self.done = None
        self.exit_loops = None
        if threshold is not None:
            check_exit(rule, threshold, getattr(model, "exit_gate", None))
            self.done = torch.zeros_like(idx, dtype=torch.bool)
            self.same = torch.zeros_like(idx)
            self.exit_loops = torch.full(idx.shape, kv_cache.loops, device=idx.device)

    def settled(self, h):
        """(B, T) True where the rule says the position may stop after this loop, h = h(t); None
        after loop 1 for the rules that compare two loops."""
        h_prev, self.h = self.h, h
        if self.rule == "latent":
            if h_prev is None:
                return None
            return (h - h_prev).norm(dim=-1) / h.norm(dim=-1) < self.threshold
        if self.rule == "gate":
            return self.model.exit_gate(h, h_prev) < self.threshold
        logp_prev, self.logp = self.logp, F.log_softmax(self.model.head(h), dim=-1)
        if self.rule == "entropy":
            return -(self.logp.exp() * self.logp).sum(-1) < self.threshold
        if logp_prev is None:
            return None
        if self.rule == "argmax":
            same = self.logp.argmax(-1) == logp_prev.argmax(-1)
            self.same = torch.where(same, self.same + 1, 0)
            return self.same >= self.threshold
        # KL(p(t-1) || p(t)), clamped: 0 never exits on rounding
        kl = F.kl_div(self.logp, logp_prev, log_target=True, reduction="none").sum(-1)
        return kl.clamp(min=0) < self.threshold

    def update(self, t, hs):
        """After loop t (1..K), hs = [h(1), ..., h(t)]: positions that exited before it keep their
        h; those the rule calls settled exit at t. True once no position loops on:
        the later loops' h and keys/values are then copies, filled in here, and the loop can
        stop."""
        if self.threshold is None:
            return False
        K = self.kv_cache.loops
        settled = self.settled(hs[-1])
        if settled is not None:
            exits = ~self.done & settled
            self.exit_loops[exits] = t
        if t > 1:
            hs[-1] = torch.where(self.done[..., None], hs[-2], hs[-1])
        if settled is not None:
            # a done position is never checked again
            self.done = self.done | exits
        if t < K and self.done.all():
            self.kv_cache.fill(t, hs[-1].size(1))
            hs += hs[-1:] * (K - t)
            return True
        return False


# ---------------------------------------------------------------------------- the decode step
# generate's steps on one of three paths. Eager: the KVCache grows by each step, so every step has
# new shapes (how decoding ran before). Static: a StaticCache, so each kind of step (a token's K
# loops; drafting's draft step and its verification) has one shape. Compiled: the static step
# compiled whole; on CUDA captured as CUDA graphs, so a token's K*L block calls are one replay
# instead of hundreds of kernel launches from Python (gpt-fast's recipe for decoding at the
# memory bandwidth's speed). The prefill runs eagerly on every path: its length varies.

DECODE_PATHS = ("eager", "static", "compiled")


class Step(NamedTuple):
    """A decode step's output: h (B, T, d), the state of its span's last loop; logits (B, T, V)."""
    h: torch.Tensor
    logits: torch.Tensor


def loops_step(model, tokens, span, cache, exit_threshold=None, exit_rule="kl"):
    """A span's loops over tokens (B, T) written at the cache's position, and their logits: Step."""
    hs, _ = cached_loops(model, tokens, span, cache, exit_threshold, exit_rule)
    return Step(hs[-1], model.head(hs[-1]))


def compile_step(device_type, backend="inductor"):
    """loops_step compiled whole: fullgraph=True (a graph break is an error, not a silent split),
    dynamic=False (a graph per shape of step: K, batch, cache slots, kind of span), and on CUDA
    mode="reduce-overhead", which captures each graph as a CUDA graph."""
    options = dict(mode="reduce-overhead") if device_type == "cuda" else {}
    # a graph per (model, K, batch, cache slots, kind of step) can pass dynamo's default of 8
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(loops_step, backend=backend, fullgraph=True, dynamic=False, **options)


# the compiled step per device type, built on first use
COMPILED = {}


def decode_path(decode, device, exit_threshold=None):
    """generate's path: decode, or by default "compiled" on CUDA and "eager" elsewhere. The exit
    rule decodes eagerly (a position's depth is decided on the host), so it refuses the others."""
    if decode is None:
        return "compiled" if device.type == "cuda" and exit_threshold is None else "eager"
    if decode not in DECODE_PATHS:
        raise ValueError(f"decode={decode!r}: expected one of {', '.join(DECODE_PATHS)}, or None "
                         "(compiled on CUDA, eager elsewhere)")
    if decode != "eager" and exit_threshold is not None:
        raise ValueError(f"decode={decode!r} with exit_threshold={exit_threshold!r}: the exit rule "
                         "decodes on the eager path (decode='eager' or None)")
    return decode


class Decoder:
    """generate's KV cache (.cache) and its step on one path (decode_path): a call runs a span's
    loops (default: all K) over tokens (B, T) at the cache's position and returns a Step. On the
    static paths a step's tokens and outputs stay on the device: no host read a token."""

    def __init__(self, model, idx, K, decode=None, attention_mask=None, cache_slots=None,
                 exit_threshold=None, exit_rule="kl"):
        self.model = model
        self.K = K
        self.exit_threshold = exit_threshold
        self.exit_rule = exit_rule
        self.path = decode_path(decode, idx.device, exit_threshold)
        if self.path == "eager":
            self.cache = model.new_kv_cache(idx.size(0), K, attention_mask, cache_slots)
        else:
            self.cache = static_cache(model, idx.size(0), K, idx.device, attention_mask,
                                      cache_slots, owner=self)
        self.device_type = idx.device.type
        if self.path == "compiled" and self.device_type not in COMPILED:
            COMPILED[self.device_type] = compile_step(self.device_type)

    def __call__(self, tokens, span=None, eager=False):
        """eager: this call uncompiled whatever the path (another shape would be another graph)."""
        span = LoopSpan(self.K) if span is None else span
        if eager or self.path != "compiled":
            return loops_step(self.model, tokens, span, self.cache, self.exit_threshold,
                              self.exit_rule)
        captured = self.device_type == "cuda"
        if captured:
            # a new replay begins: the last one's outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        # standard strides: a slice's (drafting's last token) would be another graph
        tokens = tokens.clone(memory_format=torch.contiguous_format)
        out = COMPILED[self.device_type](self.model, tokens, span, self.cache)
        # a captured graph's outputs live in its memory pool, overwritten by its next replay
        return Step(out.h.clone(), out.logits.clone()) if captured else out


# ----------------------------------------------------------------------------- drafting
# Drafting with fewer loops (self-speculative decoding, docs/beyond.md), and the choice of a token
# that generate shares with it: model.generate(idx, n, draft_loops=K_d, draft_len=g) checks the
# settings (check_draft) and streams the tokens of draft_and_verify, the whole algorithm.
#
# Why it works: loop t reads only e, h(t-1) and the cache's slot of loop t, so the first K_d loops
# of a K-loop forward are a K_d-loop forward, keys and values included. A round drafts draft_len
# tokens, each with loops 1..K_d of one token, keeping its state h(K_d); one forward then runs
# loops K_d+1..K over all of them, continued from those states, and keeps the drafts the K-loop
# model confirms. No loop of a kept token runs twice. The two partial passes are spans of the loop
# (LoopSpan), run by generate's decode step (Decoder):
#
#     step(token, LoopSpan(K, stop=K_d))                  # loops 1..K_d: the draft step, (h, logits)
#     step(fed, LoopSpan(K, start=K_d, h_start=states))   # loops K_d+1..K of the drafted tokens
#
# Greedy, the tokens are K-loop decoding's; sampling, speculative sampling's rule (accept) keeps
# K-loop decoding's distribution.


def token_probs(logits, temperature, top_k=None):
    """The distribution a token is sampled from: softmax(logits / temperature), top_k kept."""
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return F.softmax(logits, dim=-1)


def choose(logits, temperature, top_k, rng):
    """The next token (B, 1) from (B, V) logits: the argmax at temperature 0, else a sample."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    return torch.multinomial(token_probs(logits, temperature, top_k), 1, generator=rng)


def acceptance(p, q, draft):
    """Speculative sampling's rule (Leviathan et al. 2023; Chen et al. 2023): a token drafted
    from q is kept with probability min(1, p / q) at it, p the target distribution; (N,)."""
    at = draft[:, None]
    return (p.gather(-1, at) / q.gather(-1, at)).clamp(max=1)[:, 0]


def residual(p, q):
    """The weights a rejected draft is resampled from: max(0, p - q), unnormalised (p where
    p = q); torch.multinomial normalises them."""
    r = (p - q).clamp(min=0)
    return torch.where(r.sum(-1, keepdim=True) > 0, r, p)


def accept(p, q, draft, rng):
    """(kept (N,), token (N,)): each row's draft, or a sample of the residual where rejected.
    The token is distributed as p, whatever q (tests/test_speculative.py enumerates it)."""
    kept = torch.rand(draft.shape, generator=rng, device=draft.device) < acceptance(p, q, draft)
    resampled = torch.multinomial(residual(p, q), 1, generator=rng)[:, 0]
    return kept, torch.where(kept, draft, resampled)


def check_draft(K, draft_loops, draft_len, cache_slots=None, exit_threshold=None, prefix=""):
    """A ValueError unless drafting with draft_loops = K_d of K loops can run, naming only the
    settings that refuse it and the true bound: 1 <= K_d <= K - 1, so K_d loops need K >= K_d + 1;
    draft_len >= 1; the exact cache (cache_slots None or K); no exit rule. prefix: "" for
    generate()'s keyword arguments, "--" for command-line settings (eval.py)."""
    drafts = f"{prefix}draft_loops={draft_loops!r}"
    # the true bound, 1 <= K_d <= K - 1
    if not isinstance(draft_loops, int) or not 1 <= draft_loops < K:
        allowed = f"an integer from 1 to {K - 1}" if K > 1 else "none: K=1 has no fewer loops"
        raise ValueError(f"{drafts}: the draft runs fewer loops than K={K}, so K_d loops need "
                         f"K >= K_d + 1; allowed: {allowed}")
    if not isinstance(draft_len, int) or draft_len < 1:
        raise ValueError(f"{prefix}draft_len={draft_len!r}: expected an integer >= 1, the tokens "
                         "drafted a round")
    if cache_slots not in (None, K):
        raise ValueError(f"{prefix}cache_slots={cache_slots!r} with {drafts}: drafting needs the "
                         f"exact cache, where loop t's keys are loop t's own: {prefix}cache_slots "
                         "unset (None, K slots at each K)")
    if exit_threshold is not None:
        raise ValueError(f"{prefix}exit_threshold={exit_threshold!r} with {drafts}: a token's "
                         "depth is either drafted and verified, or chosen by the exit rule; use "
                         "one of the two")


def draft_and_verify(model, idx, max_new_tokens, K, draft_loops, draft_len, temperature=0.0,
                     top_k=None, rng=None, attention_mask=None, stats=None, decode=None):
    """Yield (B, n) tokens, n >= 1 per round, max_new_tokens in all (0: none): those of K-loop
    decoding (greedy: the same tokens; sampling: the same distribution). A round drafts up to
    draft_len tokens with loops 1..K_d, verifies them with loops K_d+1..K in one forward, keeps
    the longest prefix every row confirms, and ends with the K-loop model's own token (all
    confirmed: the last draft is that token). The cache's entries past the kept tokens are
    overwritten before any query reads them. decode: the steps' path (Decoder). stats (a dict):
    rounds, drafted, accepted (the drafts each row confirmed, the rows' mean: more than those
    emitted when another row confirmed fewer), and the cache."""
    K_d, B = draft_loops, idx.size(0)
    # step(tokens, span): the span's loops over tokens at the cache's position -> Step(h, logits)
    step = Decoder(model, idx, K, decode, attention_mask)
    cache = step.cache
    counts = {} if stats is None else stats
    counts.update(rounds=0, drafted=0, accepted=0, cache=cache)
    # none asked for: none emitted, as K-loop decoding
    if max_new_tokens < 1:
        return
    # the prefill, as generate's: the prompt in one forward (eager: its length varies)
    token = choose(step(idx, eager=True).logits[:, -1], temperature, top_k, rng)
    yield token
    done = 1
    # The cache position's invariant, set and used here: at a round's start, cache.pos = start =
    # the prompt and every emitted token but the last (counted on the host, never read from the
    # device). Each step runs cached_loops (above), which writes its tokens at pos and
    # moves pos past them: the n draft steps leave pos = start + n (their loops 1..K_d written),
    # the verification is rewound to start and writes loops K_d+1..K of the same n tokens, and
    # the round ends rewound to start + the tokens it emitted. Entries past pos are stale drafts,
    # overwritten before any query reads them: KVCache.update returns the keys before pos + n
    # only, and StaticCache's causal mask hides those past each query.
    while done < max_new_tokens:
        # the invariant: the prompt's P tokens and the `done` emitted ones but the last (`token`,
        # fed first this round) are in the cache, so start = P + done - 1
        start = idx.size(1) + done - 1
        n = min(draft_len, max_new_tokens - done)
        # the draft: fed[i] through loops 1..K_d, its h(K_d) kept, drafts[i] the token after it
        fed, states, drafts, q = [token], [], [], []
        for i in range(n):
            out = step(fed[-1], LoopSpan(K, stop=K_d))
            states.append(out.h)
            logits = out.logits[:, -1]
            drafts.append(choose(logits, temperature, top_k, rng))
            if temperature:
                q.append(token_probs(logits, temperature, top_k))
            if i + 1 < n:
                fed.append(drafts[-1])
        # the verification: loops K_d+1..K of the n fed tokens in one forward, at their positions
        # (the draft steps left pos at start + n)
        cache.rewind(start)
        rest = LoopSpan(K, start=K_d, h_start=torch.cat(states, 1))
        # a shorter last round runs uncompiled: its shape would be another graph
        logits = step(torch.cat(fed, 1), rest, eager=n < draft_len).logits
        drafts = torch.cat(drafts, 1)
        if temperature == 0:
            tokens = logits.argmax(-1)
            kept = tokens == drafts
        else:
            p = token_probs(logits, temperature, top_k).flatten(0, 1)
            kept, tokens = accept(p, torch.stack(q, 1).flatten(0, 1), drafts.flatten(), rng)
            kept, tokens = kept.view(B, n), tokens.view(B, n)
        # every row keeps the prefix that all rows confirm, then the K-loop model's next token
        confirmed = kept.int().cumprod(1).sum(1)
        # the round's one host read: the prefix every row confirms, and the rows' mean (stats)
        least, mean = torch.stack([confirmed.min().float(), confirmed.float().mean()]).tolist()
        m = int(least)
        # the m confirmed drafts, then the K-loop token after them; all n confirmed, the last
        # draft is itself the K-loop token (no token after it: it was never fed)
        emitted = tokens[:, :min(m + 1, n)]
        # the invariant for the next round: positions start..start+k-1 (k emitted) hold the fed
        # `token` and the first k-1 drafts, which are the confirmed, emitted ones
        cache.rewind(start + emitted.size(1))
        token = emitted[:, -1:]
        counts["rounds"] += 1
        counts["drafted"] += n
        counts["accepted"] += mean
        done += emitted.size(1)
        yield emitted
