"""Support for model.py's loop: the attention mask, decoding's KV cache of loop slots, the exit
rule (depth per token), which loops a call runs (LoopSpan), drafting with fewer loops, and the
checks of their settings, each written once. A reader of the loop (model.py: GPT.loop_states)
meets each as one name; their bookkeeping lives here.

    mask = attention_mask(n_q, n_k, pos, window, device)  # True = visible (causal, window, padding)
    cache = KVCache(B, K, config)                         # keys/values per (loop slot, layer)
    k, v, mask = cache.update(loop, layer, k, v, window)  # what a layer attends to while decoding
    exits = ExitRule(threshold, idx, head, cache)         # Huginn's KL exit, per position
    stop = exits.update(hs)                               # after each loop: True once all exited
    span = LoopSpan(K, start=K_d, h_start=h)              # loops K_d+1..K, from h(K_d)
    check_draft(K, draft_loops, draft_len)                # a ValueError naming the bad setting

This file needs torch alone: scripts/export_hf.py copies it beside model.py into a Hugging Face
folder, where model.py imports it as `.decoding`."""
from typing import NamedTuple

import torch
import torch.nn.functional as F


def attention_mask(n_q, n_k, pos, window, device, pad=None):
    """Boolean mask, True = visible: query pos+i sees key j iff j <= pos+i (and pos+i-j < window).
    pad (B,): row b's first pad[b] keys are left padding, seen by no query but their own; the
    mask is then (B, 1, n_q, n_k)."""
    i = torch.arange(pos, pos + n_q, device=device)[:, None]
    j = torch.arange(n_k, device=device)[None, :]
    visible = (j <= i) & (i - j < window) if window is not None else j <= i
    if pad is not None:
        # a padding query sees itself: a softmax over no key at all would be NaN
        visible = visible & ((j >= pad[:, None, None, None]) | (i == j))
    return visible


class LoopSpan(NamedTuple):
    """Which loops of a K-loop pass a call of GPT.loop_states runs, from what, and which learn.
    It runs loops start+1..stop (the paper's numbering; stop None: K) from h_start = h(start), None
    when it starts at loop 1. Drafting runs a token's loops 1..K_d, LoopSpan(K, stop=K_d), and
    later its loops K_d+1..K, LoopSpan(K, start=K_d, h_start=h(K_d)), the first K_d loops' keys and
    values already in the cache. bptt_loops: truncated backprop (Huginn), only the last bptt_loops
    loops learn, the earlier run as constants (None: every loop). LoopSpan(K): the whole pass."""
    K: int
    start: int = 0
    stop: int | None = None
    h_start: torch.Tensor | None = None
    bptt_loops: int | None = None

    def loops(self):
        """The loops t to run, counted from 0 (t = 0 is the paper's loop 1)."""
        return range(self.start, self.K if self.stop is None else self.stop)


def check_inputs(T, K, kv_cache, bptt_loops, rope_positions, sequence_len):
    """A ValueError naming the bad value if a forward of T tokens at K loops cannot run: past the
    RoPE table (rope_positions, ROPE_SPAN x sequence_len) or the KV cache's capacity, at another K
    than the cache's, or with bptt_loops not an integer >= 1 (None: every loop)."""
    if kv_cache is None:
        pos, limit = 0, rope_positions
        what = f"the RoPE table's {limit} positions ({limit // sequence_len} x "
    else:
        pos, limit = kv_cache.pos, kv_cache.capacity
        what = f"the KV cache's capacity of {limit} tokens ("
    if pos + T > limit:
        raise ValueError(f"input of {pos + T} tokens exceeds {what}sequence_len={sequence_len})")
    # fewer loops would leave later loops' entries unwritten
    if kv_cache is not None and kv_cache.loops != K:
        raise ValueError(f"loops={K} differs from the KV cache's loops={kv_cache.loops}")
    if bptt_loops is not None and (not isinstance(bptt_loops, int) or bptt_loops < 1):
        raise ValueError(f"bptt_loops={bptt_loops!r} is invalid: expected an integer >= 1 or None")


def check_cache_slots(cache_slots, K, prefix=""):
    """A ValueError naming {prefix}cache_slots unless it is None (K slots, exact) or an integer from
    1 to K: decoding at K loops keeps 1 to K loop slots per layer (KVCache). prefix: "" for a
    keyword argument, "--" for a command-line setting."""
    if cache_slots is not None and not (isinstance(cache_slots, int) and 1 <= cache_slots <= K):
        raise ValueError(f"{prefix}cache_slots={cache_slots!r}: expected an integer 1 to loops={K} "
                         f"(decoding at K={K} loops keeps 1 to {K} loop slots per layer), "
                         f"or None ({K} slots, exact)")


class KVCache:
    """Keys and values per (loop slot, layer), each loop's from its own stream. K slots (K*L
    entries): exact, the default. cache_slots=m < K keeps m*L (Huginn's): loop t uses slot t mod m,
    so earlier forwards' tokens are seen as the slot's last loop left them. A forward's tokens go
    at `pos` (of `capacity`); attention_mask (B, T) of the first forward: 0 = left padding, unseen.
    """

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
        self.pad = None
        if attention_mask is not None and not attention_mask.all():
            self.pad = (attention_mask == 0).sum(1)
        # a 1 before a 0 in a row: padding on the right
        if self.pad is not None and (attention_mask != 0).int().diff(dim=1).min() < 0:
            raise ValueError("attention_mask: expected left padding, "
                             "each row's 0s (padding) before its 1s")

    def positions(self, n):
        """RoPE positions of the next n tokens: from pos, or per row (B, n) from its first token."""
        if self.pad is None:
            return slice(self.pos, self.pos + n)
        at = torch.arange(self.pos, self.pos + n, device=self.pad.device)
        return (at - self.pad[:, None]).clamp(min=0)

    def slot(self, loop, layer, like):
        # loop t's slot
        loop %= self.cache_slots
        if (loop, layer) not in self.kv:
            self.kv[loop, layer] = (like.new_zeros(self.shape), like.new_zeros(self.shape))
        return self.kv[loop, layer]

    def update(self, loop, layer, k, v, window=None, done=None):
        """Store this step's k/v (B, H_kv, T, D) for (loop, layer); return all keys/values so far
        and the attention mask (window: the layer's). done (B, T): this forward's positions that
        stopped looping before `loop` (ExitRule); they keep the previous loop's keys/values, their
        exit loop's (as Huginn's cache)."""
        k_all, v_all = self.slot(loop, layer, k)
        end = self.pos + k.size(2)
        # loop - 1's slot holds this forward's tokens at loop - 1
        if done is not None and loop > 0:
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
        """All n tokens from pos exited by loop `last`: copy their keys/values into the loops not
        run after it."""
        for loop in range(last + 1, self.loops):
            for layer in range(self.n_layer):
                prev = self.slot(loop - 1, layer, None)
                for dst, src in zip(self.slot(loop, layer, prev[0]), prev):
                    dst[:, :, self.pos:self.pos + n] = src[:, :, self.pos:self.pos + n]


class ExitRule:
    """Depth per token (Huginn's KL exit) in one forward over idx (B, T): from loop 2 on, a
    position stops looping once KL(p(t-1) || p(t)) of its LM-head distributions is below
    `threshold` (nats). Its h(t) then stays h(exit loop), and its keys/values at later loops are
    its exit loop's (`done`, for KVCache.update), so later tokens attend to the last state it
    reached. exit_loops (B, T): the loops each position ran; threshold None: no rule."""

    def __init__(self, threshold, idx, head, kv_cache):
        self.threshold = threshold
        self.head = head
        self.kv_cache = kv_cache
        self.logp = None
        # done: exited yet; exit_loops: K until a position exits
        self.done = None
        self.exit_loops = None
        if threshold is not None:
            self.done = torch.zeros_like(idx, dtype=torch.bool)
            self.exit_loops = torch.full(idx.shape, kv_cache.loops, device=idx.device)

    def update(self, hs):
        """After loop t = len(hs): positions that exited before it keep their h; those whose
        prediction moved less than the threshold since loop t-1 exit at t. True once no position
        loops on: the later loops' h and keys/values are then copies, filled in here, and the
        loop can stop."""
        if self.threshold is None:
            return False
        t, K = len(hs), self.kv_cache.loops
        logp = F.log_softmax(self.head(hs[-1]), dim=-1)
        # loop 1 has nothing to compare with
        if self.logp is not None:
            # KL(p(t-1) || p(t)), clamped: 0 never exits on rounding
            kl = F.kl_div(logp, self.logp, log_target=True, reduction="none").sum(-1)
            exits = ~self.done & (kl.clamp(min=0) < self.threshold)
            hs[-1] = torch.where(self.done[..., None], hs[-2], hs[-1])
            self.exit_loops[exits] = t
            # a done position is never checked again
            self.done = self.done | exits
        self.logp = logp
        if t < K and self.done.all():
            self.kv_cache.fill(t - 1, hs[-1].size(1))
            hs += hs[-1:] * (K - t)
            return True
        return False


# ---------------------------------------------------------------------------- drafting with fewer loops
# Self-speculative decoding. Loop t reads only loops 1..t-1 and the cache's slots up to t, so the
# first K_d loops of a K-loop forward are a K_d-loop forward, keys and values included: a token
# is drafted with loops 1..K_d, and draft_len drafted tokens are verified at once by loops
# K_d+1..K, continued from their h(K_d) (GPT.loop_states with a LoopSpan). No loop runs twice.

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
    """What a rejected draft is replaced by: max(0, p - q), normalised (p where p = q)."""
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
                         f"exact cache ({prefix}cache_slots={K} or None), where loop t's keys are "
                         "loop t's own")
    if exit_threshold is not None:
        raise ValueError(f"{prefix}exit_threshold={exit_threshold!r} with {drafts}: a token's "
                         "depth is either drafted and verified, or chosen by the exit rule; use one "
                         "of the two")


def draft_and_verify(model, idx, max_new_tokens, K, draft_loops, draft_len, temperature=0.0,
                     top_k=None, rng=None, attention_mask=None, stats=None):
    """Yield (B, n) tokens, n >= 1 per round, max_new_tokens in all: those of K-loop decoding
    (greedy: the same tokens; sampling: the same distribution). A round drafts up to draft_len
    tokens with loops 1..K_d, verifies them with loops K_d+1..K in one forward, keeps the
    longest prefix every row confirms, and ends with the K-loop model's own token. The cache
    is rewound past the rest: its entries there are overwritten before any query reads them.
    stats (a dict): rounds, drafted and accepted tokens per row, and the cache."""
    K_d, B = draft_loops, idx.size(0)
    cache = model.new_kv_cache(B, K, attention_mask)
    counts = {} if stats is None else stats
    counts.update(rounds=0, drafted=0, accepted=0, cache=cache)
    token = choose(model(idx, loops=K, kv_cache=cache)[:, -1], temperature, top_k, rng)
    yield token
    done = 1
    while done < max_new_tokens:
        start, n = cache.pos, min(draft_len, max_new_tokens - done)
        # the draft: fed[i] through loops 1..K_d, its h(K_d) kept, drafts[i] the token after it
        fed, states, drafts, q = [token], [], [], []
        for i in range(n):
            h = model.loop_states(fed[-1], LoopSpan(K, stop=K_d), cache).states[-1]
            states.append(h)
            logits = model.head(h)[:, -1]
            drafts.append(choose(logits, temperature, top_k, rng))
            if temperature:
                q.append(token_probs(logits, temperature, top_k))
            if i + 1 < n:
                fed.append(drafts[-1])
        # the verification: loops K_d+1..K of the n fed tokens in one forward, at their positions
        cache.pos = start
        rest = LoopSpan(K, start=K_d, h_start=torch.cat(states, 1))
        h = model.loop_states(torch.cat(fed, 1), rest, cache)
        logits = model.head(h.states[-1])
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
        emitted = tokens[:, :min(m + 1, n)]
        cache.pos = start + emitted.size(1)
        token = emitted[:, -1:]
        counts["rounds"] += 1
        counts["drafted"] += n
        counts["accepted"] += mean
        done += emitted.size(1)
        yield emitted
