"""Support for data.py's DataLoader: the checks of its arguments, each a ValueError that names
the bad value and says what is allowed, the position it saves as it packs, and its whole resume
from that position, on the same number of ranks or another. The loader itself (the packing, its
row groups, their prefetch) reads in data.py; this module reads only its public layout (files,
names, rows, groups, rank, world_size, cycle, lengths), its tokenize() and its load() (a row group,
and the next ones queued), and keeps its position (epoch, pos, offset) and the epoch's counts.

    check_arguments(files, names, batch_size, seq_len, rank, world_size)  # before any file is read
    check_groups(loader, row_groups)     # a cycling rank must get at least one row group
    advance(loader, n)                   # the position after a row of n tokens, the epoch's line
    restore(loader, state, row_groups)   # the loader at a saved position, checked
    continue_loader(loader, states)      # where another number of ranks' run continues
"""


def check_arguments(files, names, batch_size, seq_len, rank, world_size):
    if not files:
        raise ValueError("DataLoader: no files given")
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank}")
    if len(set(names)) < len(names):
        raise ValueError(f"DataLoader: file names must differ (a loader state names files): "
                         f"{names}")


def check_groups(loader, row_groups):
    # without cycle, no row group is an empty stream; with it, a search for a token without end
    if not loader.groups and loader.cycle:
        raise ValueError(f"rank {loader.rank} of {loader.world_size} gets no documents: row "
                         f"groups per file {row_groups} in {loader.files[0]}, ...; use fewer "
                         "ranks or more data")


def advance(loader, n):
    """Move the loader's position past its next row, n tokens of the row groups it has packed
    (loader.lengths: the tokens of each, from its position on), with the epoch's counts."""
    # a row that crosses the end of an epoch counts for the one it began in
    loader.epoch_batches += 1
    while n:
        used = min(n, loader.lengths[0] - loader.offset)
        n -= used
        loader.offset += used
        loader.epoch_tokens += used
        # row group used up: the state names the next one
        if loader.offset == loader.lengths[0]:
            loader.lengths.popleft()
            loader.pos += 1
            loader.offset = 0
            if loader.pos == len(loader.groups):
                end_epoch(loader)


def end_epoch(loader):
    """The rank's row groups are used up: a new epoch (cycle), else the end of the stream."""
    if loader.cycle:
        files = len({file for file, _ in loader.groups})
        print(f"DataLoader rank {loader.rank}: epoch {loader.epoch} is used up (row groups: "
              f"{len(loader.groups)}, files: {files}, tokens: {loader.epoch_tokens:,}, batches "
              f"served: {loader.epoch_batches}); epoch {loader.epoch + 1} starts: its documents "
              "are seen again", flush=True)
    loader.pos = loader.epoch_tokens = loader.epoch_batches = 0
    loader.epoch += 1


def restore(loader, state, row_groups):
    """Move a new loader to `state`: its own state_dict() (or [it]), or every rank's state of a
    run with another world size, continued after the furthest row group any rank had begun
    (continue_loader, which counts the documents skipped). Returns the documents of the row group
    it resumes in, read now (and the next `prefetch` queued), or None where none was begun."""
    if isinstance(state, list):
        if len(state) != 1 or state[0]["world_size"] != loader.world_size:
            continued = continue_loader(loader, state)
            loader.epoch, loader.pos, loader.skipped_documents = continued
            return None
        state = state[0]
    check_state(loader, state, row_groups)
    loader.epoch = state["epoch"]
    loader.pos = loader.groups.index((loader.names.index(state["file"]), state["row_group"]))
    loader.offset = state["offset"]
    loader.epoch_tokens = state["epoch_tokens"]
    loader.epoch_batches = state["epoch_batches"]
    # the row group it names, tokenized (and the next `prefetch` queued), as the loader has it
    documents = loader.load(loader.pos)
    tokens = sum(1 + len(ids) for ids in documents)
    if not 0 <= loader.offset < tokens:
        raise ValueError(f"loader state {state}: offset outside the row group ({tokens} tokens)")
    return documents


def check_state(loader, state, row_groups):
    """state: one rank's loader.state_dict(), to resume at: its keys, its file's row group, and
    a position of this loader's rank and world size."""
    if missing := sorted(loader.state_dict().keys() - state.keys()):
        raise ValueError(f"loader state {state} lacks {missing}: saved before data.py packed as "
                         "the authors' loader does; resume with a state this loader saved")
    if not 0 <= state["row_group"] < row_groups.get(state["file"], 0):
        raise ValueError(f"loader state: no row group {state['row_group']} of file "
                         f"{state['file']!r} in the loader's files (row groups: {row_groups}); "
                         "resume with the run's files")
    where = (loader.names.index(state["file"]), state["row_group"])
    rank, world_size = loader.rank, loader.world_size
    if (state["rank"], state["world_size"]) != (rank, world_size) or where not in loader.groups:
        raise ValueError(f"loader state {state} is not a position of rank {rank} of "
                         f"{world_size} in these {len(loader.files)} files")


def continue_loader(loader, states):
    """(epoch, position, documents skipped): where a data.DataLoader starts when a run saved by another
    number of ranks resumes (states: each of its ranks' loader state, in rank order): at the first row
    group after the furthest one any of them had begun, so no document is read twice. The documents
    its ranks had not reached by then are skipped, and counted."""
    W, sizes = len(states), [len(rows) for rows in loader.rows]
    names = loader.names
    if not states or [(s["rank"], s["world_size"]) for s in states] != [(r, W) for r in range(W)] or any(
            s["file"] not in names or s["row_group"] >= sizes[names.index(s["file"])] for s in states):
        raise ValueError(f"loader states {states}: expected one per rank of the saved run, in rank order, "
                         f"at row groups of these files {loader.names}")

    def after(e, f, g):  # the row group after (f, g) in file order, whichever rank reads it
        return (e, f, g + 1) if g + 1 < sizes[f] else (e, f + 1, 0) if f + 1 < len(sizes) else (e + 1, 0, 0)
    beyond = []  # for each old rank: the position after the last row group it had begun
    for r, s in enumerate(states):
        mine = [(f, g) for f, n in enumerate(sizes) for g in range(r, n, W)]
        e, p = s["epoch"], mine.index((loader.names.index(s["file"]), s["row_group"]))
        beyond.append(after(e, *mine[p]) if s["offset"] else after(e, *mine[p - 1]) if p else
                      after(e - 1, *mine[-1]) if e else (0, 0, 0))
    start = max(beyond)
    ahead = [i for i, group in enumerate(loader.groups) if group >= start[1:]]
    skipped = 0
    for r, (e, f, g), s in zip(range(W), beyond, states):
        if s["offset"]:  # the documents of its row group it had not begun: bos at or after offset
            stream = []
            for ids in loader.tokenize(loader.names.index(s["file"]), s["row_group"]):
                stream += [loader.tokenizer.bos_id, *ids]
            skipped += stream[s["offset"]:].count(loader.tokenizer.bos_id)
        while (e, f, g) < start:  # then its row groups nobody read
            skipped += loader.rows[f][g] if g % W == r else 0
            e, f, g = after(e, f, g)
    return (start[0], ahead[0], skipped) if ahead else (start[0] + 1, 0, skipped)
