"""Drafting with fewer loops (self-speculative decoding, docs/beyond.md), and the choice of a token
that model.py's generate shares with it. `model.generate(idx, n, draft_loops=K_d, draft_len=...)`
checks the settings (check_draft) and streams the tokens of draft_and_verify, the whole algorithm.

Why it works: loop t reads only e, h(t-1) and the cache's slot of loop t, so the first K_d loops of
a K-loop forward are a K_d-loop forward, keys and values included. A round drafts draft_len tokens,
each with loops 1..K_d of one token, keeping its state h(K_d); one forward then runs loops K_d+1..K
over all of them, continued from those states, and keeps the drafts the K-loop model confirms. No
loop of a kept token runs twice. The two partial passes are spans of the loop (flt/decoding.py:
LoopSpan), run by generate's decode step (flt/decoding.py: Decoder):

    step(token, LoopSpan(K, stop=K_d))                  # loops 1..K_d: the draft step, (h, logits)
    step(fed, LoopSpan(K, start=K_d, h_start=states))   # loops K_d+1..K of the drafted tokens

Greedy, the tokens are K-loop decoding's; sampling, speculative sampling's rule (accept) keeps
K-loop decoding's distribution. Like flt/decoding.py, a Hugging Face export copies this file beside
model.py (scripts/export_hf.py)."""
import torch
import torch.nn.functional as F

try:
    from flt.decoding import Decoder, LoopSpan
except ImportError:
    # a Hugging Face export has decoding.py beside this file
    from .decoding import Decoder, LoopSpan


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
    # device). Each step runs flt/decoding.py: cached_loops, which writes its tokens at pos and
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
