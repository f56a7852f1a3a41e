"""Support for data.py's DataLoader: the checks of its arguments, each a ValueError that names
the bad value and says what is allowed, and its resume from a saved position. The loader itself
(the packing, the position it saves) reads in data.py.

    check_arguments(files, names, batch_size, seq_len, rank, world_size)  # before any file is read
    check_groups(loader, row_groups)     # a cycling rank must get at least one row group
    restore(loader, state, row_groups)   # the loader at a saved position, checked
"""
from flt import checkpoint


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


def restore(loader, state, row_groups):
    """Move a new loader to `state`: its own state_dict() (or [it]), or every rank's state of a
    run with another world size, continued after the furthest row group any rank had begun
    (checkpoint.continue_loader, which counts the documents skipped)."""
    if isinstance(state, list):
        if len(state) != 1 or state[0]["world_size"] != loader.world_size:
            continued = checkpoint.continue_loader(loader, state)
            loader.epoch, loader.pos, loader.skipped_documents = continued
            return
        state = state[0]
    check_state(loader, state, row_groups)
    loader.epoch = state["epoch"]
    loader.pos = loader.groups.index((loader.names.index(state["file"]), state["row_group"]))
    loader.offset = state["offset"]
    loader.epoch_tokens = state["epoch_tokens"]
    loader.epoch_batches = state["epoch_batches"]
    # the row group it names, tokenized (and the next ones queued), as the loader would have it
    loader.tokens = loader._load()
    if not 0 <= loader.offset < len(loader.tokens):
        raise ValueError(f"loader state {state}: offset outside the row group "
                         f"({len(loader.tokens)} tokens)")


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
