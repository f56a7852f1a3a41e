"""The duties of a real run, kept out of train.py's loop, where each is one call: the preemption
signal and its requeue exit, time-based checkpoints, the last good checkpoint, a full disk, a
non-finite step, divergence; and, when the requeued job starts again, where it resumes.

    guard = Guard(rt, log, save, last_good=ckpt_path, monitor=monitor, ...)
    guard.signals()                         # this rank's signal and clock (0/1), for the all-reduce
    guard.exit_before_update(step, numbers)  # a step not finite: every rank exits, before the update
    guard.take_signals(numbers)             # what the ranks agreed: a preemption, a save due
    if ... or guard.save_due: guard.save(step)  # printed; a full disk stops every rank, one message
    guard.leave_if_preempted(step, last_step)   # exit PREEMPTED (75): the job script requeues;
                                                # after a Ctrl-C, INTERRUPTED (130): no requeue
    guard.watch_divergence(step, loss)      # the smoothed loss far above its minimum: exit 3

Every rank takes the same decision at the same step: the signals are summed by the all-reduce the
step runs anyway, so one signalled rank (or one node's faster clock) is enough for all of them, and
every stop names the last good checkpoint. docs/operations.md has the exit codes and the requeue.
"""

from flt import checkpoint, cluster, diagnostics, owndata, planning, runtime
from flt.runtime import print0


class Guard:
    """The run's operational state: the signal handler (installed when the Guard is made), the
    save clock, the last good checkpoint, and the divergence monitor (saved with each checkpoint:
    `monitor`). save(step) -> the checkpoint's path is train.py's: what a checkpoint holds."""

    def __init__(self, rt, log, save, last_good=None, monitor=diagnostics.NEW_MONITOR,
                 save_interval_minutes=0.0, divergence_window=0, divergence_nats=1.0):
        self.rt, self.log, self.write = rt, log, save
        self.last_good = last_good  # the checkpoint a failed run points back to
        self.monitor = monitor
        self.window = divergence_window
        self.nats = divergence_nats
        # SIGTERM / SIGUSR1 / Ctrl-C end the run at the next step's end, with a checkpoint; a clock
        # asks for one
        self.preemption = cluster.Preemption()
        self.clock = cluster.Clock(save_interval_minutes)
        # what the ranks agreed at the last step: a stop (any signal), a Ctrl-C among them, a save
        self.preempted = False
        self.interrupted = False
        self.clock_due = False

    @property
    def save_due(self):
        """A checkpoint the ranks agreed on at the last step: the clock's, or a preemption's."""
        return self.clock_due or self.preempted

    def signals(self):
        """{"preempted", "interrupted", "save_due"}: 1.0 or 0.0, this rank's signal (a Ctrl-C is
        also "interrupted") and clock, host numbers for train.py's step all-reduce to sum: any
        rank's 1 makes every rank's sum positive."""
        return {"preempted": float(self.preemption.requested),
                "interrupted": float(self.preemption.interrupted), "save_due": float(self.clock.due())}

    def take_signals(self, numbers):
        """What the ranks agreed, from the step's one host read (`numbers`: the signals summed over
        the ranks): a preemption, a Ctrl-C, a save the clock asks for; acted on at the next step's
        start."""
        self.preempted = numbers["preempted"] > 0
        self.interrupted = numbers["interrupted"] > 0
        self.clock_due = numbers["save_due"] > 0

    def exit_before_update(self, step, numbers):
        """Stop every rank, before the optimizer step, of a step whose read `numbers` (loss,
        grad_norm, resid_sum: the ranks' sum of their last micro-batch's loop norms) are not
        all finite (train.py checks): the parameters stay those of a good step, logged as
        diverged. Every rank decides alike: the numbers are the all-reduced ones. An overflowed
        stream can give a finite, useless loss, so the residual norm is checked too."""
        loss, grad_norm = numbers["loss"], numbers["grad_norm"]
        self.log.write({"step": step, "diverged": True, "loss": loss, "grad_norm": grad_norm})
        self.fail(f"step {step}: loss {loss}, gradient norm {grad_norm}, residual norms' sum "
                  f"{numbers['resid_sum']}: not finite; stopped before the optimizer step, so the "
                  "parameters were not updated", 1)

    def save(self, step):
        """train.py's checkpoint of this step, which becomes the last good one (printed); the save
        clock starts again. Too little disk (or a disk that filled while written): every rank stops
        with one message, the earlier checkpoints untouched."""
        self.clock.reset()
        try:
            self.last_good = self.write(step)
        except runtime.DiskSpaceError as e:
            self.fail(f"step {step}: {e}; the earlier checkpoints are untouched", 1)
        print0(f"step {step:5d} | saved {self.last_good}")

    def leave_if_preempted(self, step, last_step):
        """After a preemption's checkpoint: exit PREEMPTED, for the job script to requeue the same
        command with --resume=auto; after a Ctrl-C's (on any rank: it outranks a preemption, a run
        its user stopped is not requeued), exit INTERRUPTED. At the last step the checkpoint is the
        run: it finishes."""
        if self.preempted and not last_step:
            ctrl_c = self.interrupted
            kind = "interrupted" if ctrl_c else "preempted"
            code = cluster.INTERRUPTED if ctrl_c else cluster.PREEMPTED
            # this rank's signal if it is the one that decided; None: another rank's
            signal = self.preemption.signal if self.preemption.interrupted == ctrl_c else None
            self.log.write({"step": step, kind: signal or "another rank",
                            "checkpoint": self.last_good})
            runtime.stop(self.rt, f"{kind} ({signal or 'signal on another rank'}): saved "
                         f"{self.last_good}; exit {code}: {'continue' if ctrl_c else 'requeue'} "
                         "with --resume=auto", code)

    def watch_divergence(self, step, loss):
        """One more step's loss into the monitor; a stop (exit 3) once the smoothed loss has been
        more than divergence_nats above its running minimum for divergence_window steps in a row
        (0: never)."""
        self.monitor = diagnostics.divergence(self.monitor, loss, self.nats)
        if self.window and self.monitor["above"] >= self.window:
            self.log.write({"step": step, "diverged": True, "loss": loss})
            self.fail(diagnostics.diverged(step, self.monitor, self.nats, self.window), 3)

    def fail(self, message, code):
        """Every rank stops (they all saw the same numbers), naming the checkpoint to go back to."""
        runtime.stop(self.rt, f"{message}. Last good checkpoint: {self.last_good or 'none yet'}",
                     code)


def resume_point(rt, out_dir, resume, settings, num_steps, tok):
    """(step_dir, meta) of the newest readable checkpoint in out_dir (load_newest) if the run
    resumes (resume=True, or "auto" and out_dir holds a checkpoint), else (None, None). A resumed
    run's settings may differ only in planning.RESUMABLE, and its tokenizer (tok, read from
    data_dir) must be the checkpoint's; one already at num_steps has nothing to do (exit 0; past
    it, exit 2); newer unreadable checkpoints are set aside (rank 0), so that they do not outrank
    the ones this run writes."""
    if not (resume is True or (resume == "auto" and checkpoint.list_checkpoints(out_dir))):
        return None, None
    path, meta = checkpoint.load_newest(out_dir, rt.device, rank_files=True, log=print0)
    # your own files must still hold the documents it trained on (and its tokenizer was trained on)
    owndata.check_unchanged(meta.get("data"), settings, f"--resume: {path}")
    # the same token ids: data_dir's tokenizer (a BPE cache rebuilt, another machine) is the run's
    checkpoint.check_same_tokenizer(path, tok, settings)
    step = meta["step"]
    changed = planning.resume_changes(meta["settings"], settings, path)
    if step >= num_steps:
        runtime.stop(rt, f"--resume: {path} is at step {step} and num_steps={num_steps}: nothing "
                     "to do (raise --num_steps to train further); checkpoints untouched",
                     0 if step == num_steps else 2)
    print0(f"resuming from {path} (step {step}); settings changed: {', '.join(changed)}")
    if rt.master:
        checkpoint.set_aside_newer(out_dir, step, log=print0)
    return path, meta


def restore_ranks(rt, ckpt_path, meta, optimizers):
    """This rank's state from the checkpoint at ckpt_path (resume_point's): the optimizers (in the
    order given) take their own state, or, if another number of ranks saved it, every saved rank's,
    resharded exactly; the RNGs are restored. Returns (the loader's state, the divergence monitor,
    the number of ranks that saved); a fresh run (ckpt_path None): (None, a new monitor, None)."""
    if not ckpt_path:
        return None, diagnostics.NEW_MONITOR, None
    states = checkpoint.load_rank_states(ckpt_path, meta, rt.rank, rt.world, rt.device)
    loader_state, monitor = checkpoint.restore_rank_state(states, optimizers, rt.rank,
                                                          rt.device_type == "cuda")
    return loader_state, monitor, checkpoint.saved_world(ckpt_path, meta)
