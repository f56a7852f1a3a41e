"""
Ouro's learned exit gate (arXiv 2510.25741, its second stage), trained after the fact on a frozen
run.

    python -m flt.exit_gate out/d3_flt_k3                          # the newest checkpoint, its K
    python -m flt.exit_gate out/d3_flt_k3/step_000250 --margin=0.02 --steps=500
    model(idx, exit_threshold=0.5, exit_rule="gate")             # then: checkpoint.load_model's

The run's weights stay frozen (eval mode, no gradients); only the gate (flt/decoding.py: ExitGate,
a small MLP) learns. Its data is the run's own training data: a text run's training shards,
tokenized with the tokenizer.json beside the weights (flt/inputs.py: shards, as train.py finds
them), or a reasoning task's item stream (flt/tasks.py). --tokens of it pass once through the
frozen model at K = --loops (default: the run's), and each scored position's loss after every
loop, l_1 .. l_K, gives the targets

    c_t = 1  if  l_t - min_{s > t} l_s > margin,  else 0        (t = 1 .. K-1)

"later loops still lower this position's loss by more than margin nats"; at t = K there is no
later loop, so no target. The gate, fed [h(t), h(t) - h(t-1)] (h(0) = 0), learns c_t with
binary cross-entropy (AdamW, --steps steps, one cached batch each, in turn). The exit rule
"gate" then stops a position once the gate's probability falls below the threshold.

It writes <step_dir>/exit_gate.pt beside the checkpoint, whole or not at all (a previous one only
under --force, and said so: eval.json's "gate" results were measured with it): {"gate": its state
dict, "config": {n_embd, hidden, margin}, "trained": {tokens, steps, loops, loss_before,
loss_after, positives, ...}}. flt/checkpoint.py's load_model attaches it as model.exit_gate
(attach_gate); pruning never deletes it (CHECKPOINT_FILE).
"""
import functools
import math
import os
import sys

import torch
import torch.nn.functional as F

import data
from flt import checkpoint, errors, inputs, runtime, tasks
from flt.decoding import ExitGate

# the settings a run's training data is found from (train.py's; a run imported from the authors'
# code may lack them)
DATA_SETTINGS = ("dataset", "data_dir", "sequence_len")


def exit_targets(losses, margin):
    """(K-1, B, T) floats c_t from losses (K, B, T), the per-loop losses l_1 .. l_K:
    1 where l_t - min_{s > t} l_s > margin, else 0 (see the module's docstring)."""
    # later[t] = min over s > t of l_s: a cumulative min from the last loop backwards
    later = torch.flip(torch.cummin(torch.flip(losses[1:], [0]), dim=0).values, [0])
    return (losses[:-1] - later > margin).to(losses.dtype)


@torch.no_grad()
def frozen_pass(model, x, y, loops, margin):
    """One batch through the frozen model: (its states h(1) .. h(K-1), a (K-1, B, T, d) tensor,
    the targets (K-1, B, T), scored (B, T): the positions whose target y is not -1)."""
    states = model.loop_states(x, loops).states
    scored = y != -1
    losses = []
    for h in states:
        loss = F.cross_entropy(model.head(h).flatten(0, 1), y.flatten(), ignore_index=-1,
                               reduction="none")
        losses.append(loss.view(y.shape))
    targets = exit_targets(torch.stack(losses).double(), margin).float()
    return torch.stack(states[:-1]).float(), targets, scored


def gate_loss(gate, states, targets, scored):
    """The gate's binary cross-entropy (logits) over the scored positions and loops t < K."""
    logits = [gate.logits(h, states[t - 1] if t > 0 else None) for t, h in enumerate(states)]
    logits = torch.stack(logits)
    return F.binary_cross_entropy_with_logits(logits[:, scored], targets[:, scored])


def train_gate(model, batches, held_out, loops, steps, margin=0.01, hidden=64, lr=3e-3, seed=0,
               log=print):
    """(gate, record): an ExitGate trained on the frozen model's own loss curves. batches: the
    (x, y) pairs to learn from, each passed through the model once; held_out: one more (x, y),
    where the BCE before and after training is measured. record: what exit_gate.pt keeps."""
    model.eval()
    model.requires_grad_(False)
    device = model.lm_head.weight.device
    torch.manual_seed(seed)
    gate = ExitGate(model.config.n_embd, hidden, margin).to(device)
    with runtime.Timer(device) as passed:
        pool = [frozen_pass(model, x, y, loops, margin) for x, y in batches]
        test = frozen_pass(model, *held_out, loops, margin)
    tokens = sum(scored.numel() for _, _, scored in pool)
    positives = torch.cat([t[:, s] for _, t, s in pool], dim=1).mean().item()
    log(f"the frozen model at K={loops} on {tokens:,} training tokens ({len(pool)} batches) in "
        f"{passed.seconds:.1f}s; {positives:.1%} of the targets say later loops still help")
    with torch.no_grad():
        loss_before = gate_loss(gate, *test).item()
    opt = torch.optim.AdamW(gate.parameters(), lr=lr)
    every = max(1, steps // 10)
    with runtime.Timer(device) as took:
        for step in range(1, steps + 1):
            loss = gate_loss(gate, *pool[(step - 1) % len(pool)])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if step % every == 0 or step == steps:
                log(f"step {step:5d}/{steps} | loss {loss.item():.4f} | {took.elapsed():.1f}s")
    with torch.no_grad():
        loss_after = gate_loss(gate, *test).item()
    record = dict(tokens=tokens, steps=steps, loops=loops, loss_before=loss_before,
                  loss_after=loss_after, positives=positives, held_out_tokens=int(test[2].sum()),
                  lr=lr, seed=seed, seconds=passed.seconds + took.seconds)
    return gate.eval(), record


def training_batches(model, meta, batch_size, device, n_batches):
    """n_batches + 1 batches (x, y) of the run's own training data (the last: held out from the
    gate's training): its task's stream, or its training shards through its own tokenizer."""
    settings = meta.get("settings", {})
    missing = [key for key in DATA_SETTINGS if key not in settings]
    if missing:
        raise ValueError(f"{meta['path']}: the run's settings lack {', '.join(missing)}, so its "
                         "training data cannot be found (a run train.py wrote has them)")
    task = tasks.task_of(settings)
    if task:
        loader = task.loader(batch_size, 0, 1, device, settings.get("seed", 0))
    else:
        tokens = (n_batches + 1) * batch_size * model.config.sequence_len
        # the fewest training shards that hold them, as train.py finds them (a FineWeb run's first
        # shard is fetched if data_dir lacks it; none of num_shards' others is needed)
        train_files = inputs.shards(settings | {"num_shards": -1}, tokens, meta.get("data"))[:-1]
        tokenizer_file = os.path.join(meta["path"], "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            raise FileNotFoundError(f"{tokenizer_file}: missing; the gate reads the run's training "
                                    "data with the tokenizer its weights were trained with")
        tok = checkpoint.run_tokenizer(meta)
        loader = data.DataLoader(train_files, tok, batch_size, model.config.sequence_len,
                                 device=device)
    return [next(loader) for _ in range(n_batches + 1)]


def write_gate(step_dir, gate, record, log=print):
    """<step_dir>/exit_gate.pt (checkpoint.GATE_FILE), written whole (a temp file renamed over
    it); a previous one is replaced, and said so."""
    path = os.path.join(step_dir, checkpoint.GATE_FILE)
    if os.path.exists(path):
        log(f"replacing {path}, an earlier exit gate")
    state = {k: v.detach().cpu() for k, v in gate.state_dict().items()}
    obj = {"gate": state, "config": checkpoint.gate_config(gate), "trained": record}
    runtime.atomic_write(path, functools.partial(torch.save, obj))
    return path


def check(args):
    """Each setting checked before any work: a ValueError naming it."""
    for key in ("tokens", "steps", "batch_size", "hidden"):
        errors.positive(f"--{key}", getattr(args, key))
    for key in ("margin", "lr"):
        value = getattr(args, key)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"--{key}={value}: expected a number > 0")
    if args.loops is not None and args.loops < 2:
        raise ValueError(f"--loops={args.loops}: expected an integer >= 2 (the gate learns "
                         "whether loops after t still help, t < K)")
    if not os.path.exists(args.run):
        raise FileNotFoundError(f"run {args.run!r}: no such directory")


def main(argv):
    p = errors.ArgumentParser(prog="python -m flt.exit_gate",
                              description="Train the learned exit gate of a run (see the module's "
                              "docstring); it is written to <step_dir>/exit_gate.pt.")
    p.add_argument("run", help="a run's out_dir (its newest readable step_*) or a step directory")
    p.add_argument("--tokens", type=int, default=65536, help="training tokens the gate learns from")
    p.add_argument("--steps", type=int, default=300, help="the gate's optimizer steps")
    p.add_argument("--margin", type=float, default=0.01,
                   help="nats by which later loops must still lower a position's loss")
    p.add_argument("--hidden", type=int, default=64, help="the gate's hidden width")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate")
    p.add_argument("--batch_size", type=int, default=8, help="sequences per frozen forward")
    p.add_argument("--loops", type=int, default=None, help="K; default: the run's")
    p.add_argument("--device", default="", help="cpu | cuda | cuda:N | mps; empty: cuda if any")
    p.add_argument("--seed", type=int, default=0, help="the gate's initialisation")
    p.add_argument("--force", action="store_true",
                   help="replace the step's earlier exit_gate.pt (eval.json's gate results were "
                   "measured with it)")
    args = p.parse_args(argv)
    check(args)
    device = runtime.setup(args.device).device
    model, meta = checkpoint.load_model(args.run, device)
    step_dir = meta["path"]
    if not os.path.isfile(os.path.join(step_dir, "model.pt")):
        raise ValueError(f"{args.run}: an exported folder; train the gate on the run it came from "
                         "(its step directory), then export again")
    gate_file = os.path.join(step_dir, checkpoint.GATE_FILE)
    if os.path.exists(gate_file) and not args.force:
        raise FileExistsError(f"{gate_file}: an earlier exit gate, which eval.json's gate results "
                              "(if any) were measured with; --force replaces it")
    if hasattr(model, "exit_gate"):
        del model.exit_gate  # the earlier gate: the new one learns from scratch
    loops = args.loops or model.config.loops
    n_batches = math.ceil(args.tokens / (args.batch_size * model.config.sequence_len))
    batches = training_batches(model, meta, args.batch_size, device, n_batches)
    gate, record = train_gate(model, batches[:-1], batches[-1], loops, args.steps, args.margin,
                              args.hidden, args.lr, args.seed)
    record["step"] = meta.get("step")
    path = write_gate(step_dir, gate, record)
    print(f"exit gate: BCE {record['loss_before']:.4f} -> {record['loss_after']:.4f} on a held-out "
          f"batch ({record['held_out_tokens']:,} tokens x {loops - 1} loops); "
          f"{record['positives']:.1%} positive targets (margin {args.margin} nats); wrote {path}")
    return path


if __name__ == "__main__":
    with errors.user_errors("flt.exit_gate"):  # a bad path or setting: one line, exit status 1
        main(sys.argv[1:])
