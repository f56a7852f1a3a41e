"""CORE's prompts, as nanochat's core_eval builds them (the protocol: docs/evaluation.md): the
few-shot draw, the prompt of each option, its tokens and the span that is scored, and the batches
that score them. eval.py keeps the scoring rule (score_sequences, item_correct, centered); the
bundle is fetched and read by flt/corpus.py (fetch_bundle, load_bundle, load_items).

    tasks = corpus.load_bundle(corpus.fetch_bundle(bundle_dir, core.BUNDLE_URL))
    core.task_sequences(tokenizer, task, items, idx, max_len)   # [(tokens, s)]: tokens[s:] scored
"""
import os
import random

from model import ROPE_SPAN

# the DCLM eval bundle nanochat downloads (core.yaml, eval_meta_data.csv, eval_data/)
BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"


def fewshot_indices(idx, n_items, k):
    """k distinct item indices != idx, drawn with random.Random(1234 + idx). Same draw as
    rng.sample([i for i in range(n_items) if i != idx], k), without building that list."""
    picks = random.Random(1234 + idx).sample(range(n_items - 1), k)
    return [j + (j >= idx) for j in picks]


def render(task, item, examples):
    """nanochat's prompts: one per option for MC and schema; [without, with] the continuation
    for LM. Each few-shot example is rendered with its gold answer and a blank line."""
    d, kind = task["delimiter"], task["type"]
    if kind == "multiple_choice":
        shots = "".join(f"{ex['query']}{d}{ex['choices'][ex['gold']]}\n\n" for ex in examples)
        return [f"{shots}{item['query']}{d}{choice}" for choice in item["choices"]]
    if kind == "schema":
        shots = "".join(f"{ex['context_options'][ex['gold']]}{d}{ex['continuation']}\n\n"
                        for ex in examples)
        return [f"{shots}{context}{d}{item['continuation']}" for context in item["context_options"]]
    # language_modeling: contexts are stripped (some carry trailing whitespace), and so is `without`
    shots = "".join(f"{str(ex['context']).strip()}{d}{ex['continuation']}\n\n" for ex in examples)
    prompt = f"{shots}{str(item['context']).strip()}{d}"
    return [prompt.strip(), f"{prompt}{item['continuation']}"]


def task_sequences(tokenizer, task, items, idx, max_len):
    """Item idx as [(tokens, s)], one per option: BOS + the prompt, and the span tokens[s:] that is
    scored. Longer than max_len tokens (the model's longest input, eval.longest_input) is a
    ValueError naming the task and item."""
    examples = [items[j] for j in fewshot_indices(idx, len(items), task["fewshot"])]
    prompts = render(task, items[idx], examples)
    seqs = [[tokenizer.bos_id] + ids for ids in tokenizer.encode_batch(prompts)]
    # os.path.commonprefix compares any sequences element-wise, token lists included
    if task["type"] == "multiple_choice":
        # words the choices share are not scored
        starts = [len(os.path.commonprefix(seqs))] * len(seqs)
    elif task["type"] == "schema":
        # the suffix common to all options; it may reach back into the contexts
        suffix = len(os.path.commonprefix([s[::-1] for s in seqs]))
        starts = [len(s) - suffix for s in seqs]
    else:
        without, seqs = seqs[0], seqs[1:]
        if len(without) >= len(seqs[0]) or seqs[0][:len(without)] != without:
            raise ValueError(f"task {task['label']!r} item {idx}: the prompt without the "
                             "continuation is not a token prefix of the prompt with it "
                             "(nanochat's evaluator asserts this)")
        starts = [len(without)]
    # fed whole, as the authors' core_eval does: their model has no max_seq_len
    for s in seqs:
        if len(s) > max_len:
            raise ValueError(f"task {task['label']!r} item {idx}: a prompt of {len(s)} tokens is "
                             f"longer than the {max_len} positions of the model's RoPE table "
                             f"({ROPE_SPAN} x sequence_len)")
    return list(zip(seqs, starts))


def length_batches(seqs, batch_size, sequence_len):
    """The indices of [(tokens, s)] in batches, sorted by length (each the longest of its batch):
    batch_size sequences per batch, but never more than batch_size * sequence_len tokens once
    padded to the longest, unless one sequence is longer: it is a batch alone."""
    lengths = [len(tokens) for tokens, _ in seqs]
    batches, budget = [], batch_size * sequence_len
    for i in sorted(range(len(seqs)), key=lengths.__getitem__):
        current = batches[-1] if batches else []
        if not batches or len(current) == batch_size or (len(current) + 1) * lengths[i] > budget:
            batches.append([])
        batches[-1].append(i)
    return batches
