"""flt/guard.py: the duties of a real run, one call each in train.py's loop, checked on one CPU
process (the runs that exercise them end to end, on two ranks: test_cluster.py and test_train.py).
Every stop is the same on every rank: the numbers it decides on are the all-reduced ones."""
import math
import os
import signal

import pytest

from flt import checkpoint, cluster, diagnostics, runtime
from flt.guard import Guard, restore_ranks, resume_point


class Log:
    def __init__(self):
        self.records = []

    def write(self, record):
        self.records.append(record)


@pytest.fixture
def make_guard():
    """Guards whose signal handlers are this test's only: the handlers before it come back after."""
    before = {s: signal.getsignal(s) for s in cluster.SIGNALS + (signal.SIGINT,)}
    yield lambda **kw: Guard(runtime.setup("cpu"), Log(), kw.pop("save", lambda step: None), **kw)
    for s, handler in before.items():
        signal.signal(s, handler)


def stops(capsys, call):
    """(exit code, stderr) of a call that must stop the run."""
    with pytest.raises(SystemExit) as e:
        call()
    return e.value.code, capsys.readouterr().err.strip()


def flags(preempted=0.0, save_due=0.0, interrupted=0.0):
    """The step's read numbers the guard takes: its signals, summed over the ranks."""
    return {"preempted": preempted, "interrupted": interrupted, "save_due": save_due, "loss": 3.0,
            "grad_norm": 1.0, "resid_sum": 1.0}


def test_the_signals_are_this_ranks_signal_and_clock(make_guard):
    guard = make_guard(save_interval_minutes=1e-9)
    assert guard.signals() == {"preempted": 0.0, "interrupted": 0.0, "save_due": 1.0}
    os.kill(os.getpid(), signal.SIGUSR1)  # the handler only sets a flag
    assert guard.signals()["preempted"] == 1.0 and guard.preemption.signal == "SIGUSR1"
    assert guard.signals()["interrupted"] == 0.0
    assert make_guard().signals()["save_due"] == 0.0  # 0 minutes: no time-based saves


def test_what_the_ranks_agreed_decides_the_save(make_guard):
    guard = make_guard()
    guard.take_signals(flags(save_due=2.0))  # two ranks' clocks were due: a save, no exit
    assert guard.save_due and not guard.preempted
    guard.take_signals(flags(preempted=1.0))  # another rank was signalled
    assert guard.save_due and guard.preempted
    guard.take_signals(flags())
    assert not guard.save_due


@pytest.mark.parametrize("loss, grad_norm, resid", [(math.nan, 1.0, 1.0), (3.0, math.inf, 1.0),
                                                    (3.0, 1.0, math.inf)])
def test_a_non_finite_step_stops_every_rank_before_the_update(make_guard, capsys, loss, grad_norm,
                                                              resid):
    guard = make_guard(last_good="out/step_000004")
    numbers = {"loss": loss, "grad_norm": grad_norm, "resid_sum": resid}
    code, err = stops(capsys, lambda: guard.exit_before_update(7, numbers))
    assert code == 1
    assert err == (f"step 7: loss {loss}, gradient norm {grad_norm}, residual norms' sum {resid}: not "
                   "finite; stopped before the optimizer step, so the parameters were not updated. "
                   "Last good checkpoint: out/step_000004")
    assert guard.log.records[-1]["diverged"] is True and guard.log.records[-1]["step"] == 7


def test_a_save_becomes_the_last_good_checkpoint_and_restarts_the_clock(make_guard, capsys):
    guard = make_guard(save=lambda step: f"out/step_{step:06d}", save_interval_minutes=1e-9)
    assert guard.clock.due()
    guard.clock.seconds = 60.0
    guard.save(8)
    assert guard.last_good == "out/step_000008" and not guard.clock.due()
    assert capsys.readouterr().out == "step     8 | saved out/step_000008\n"  # every save is printed


def test_a_full_disk_stops_every_rank_naming_the_last_good_checkpoint(make_guard, capsys):
    def full(step):
        raise runtime.DiskSpaceError("checkpoint", "out", 10**9, 10**6, "free some space")
    guard = make_guard(save=full, last_good="out/step_000004")
    code, err = stops(capsys, lambda: guard.save(8))
    assert code == 1 and err.startswith("step 8: checkpoint: needs 1.00 GB")
    assert err.endswith("the earlier checkpoints are untouched. Last good checkpoint: out/step_000004")
    assert guard.last_good == "out/step_000004"


@pytest.mark.parametrize("own, summed, code, kind, then", [
    (None, flags(preempted=1.0), 75, "preempted", "requeue"),  # a signal on another rank
    # a Ctrl-C on another rank outranks this rank's SIGTERM: a run its user stopped is not requeued
    (signal.SIGTERM, flags(preempted=2.0, interrupted=1.0), 130, "interrupted", "continue")])
def test_a_stopped_run_leaves_after_its_checkpoint_with_75_or_after_a_ctrl_c_130(
        make_guard, capsys, own, summed, code, kind, then):
    assert (cluster.PREEMPTED, cluster.INTERRUPTED) == (75, 130)
    guard = make_guard(last_good="out/step_000009")
    guard.leave_if_preempted(9, last_step=False)  # not preempted: nothing happens
    if own:
        os.kill(os.getpid(), own)  # this rank's own signal
    guard.take_signals(summed)  # what every rank reads
    guard.leave_if_preempted(10, last_step=True)  # the last step's checkpoint is the run
    exit_code, err = stops(capsys, lambda: guard.leave_if_preempted(10, last_step=False))
    assert exit_code == code
    assert err == (f"{kind} (signal on another rank): saved out/step_000009; exit {code}: {then} "
                   "with --resume=auto")
    assert guard.log.records == [{"step": 10, kind: "another rank", "checkpoint": "out/step_000009"}]


def test_a_ctrl_c_asks_for_the_same_stop_and_says_so_at_once(make_guard, capfd):
    guard = make_guard()
    # the guard's handler, else the Ctrl-C below would end the test session
    assert signal.getsignal(signal.SIGINT) not in (signal.default_int_handler, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGUSR1)  # a preemption first: a Ctrl-C still outranks it
    os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt: the handler sets a flag, and says so
    assert capfd.readouterr().err == cluster.SAVING + "\n"
    assert guard.preemption.signal == "SIGINT" and guard.preemption.interrupted
    assert guard.signals() == {"preempted": 1.0, "interrupted": 1.0, "save_due": 0.0}


def test_divergence_stops_after_the_window_and_is_watched_without_one(make_guard, capsys):
    losses = [3.0] * 5 + [9.0] * 10
    quiet = make_guard()  # divergence_window=0: the monitor still follows the loss (it is saved)
    for step, loss in enumerate(losses):
        quiet.watch_divergence(step, loss)
    expected = diagnostics.NEW_MONITOR
    for loss in losses:
        expected = diagnostics.divergence(expected, loss, 1.0)
    assert quiet.monitor == expected and expected["above"] >= 3
    guard = make_guard(divergence_window=3, divergence_nats=1.0)
    step = 0
    with pytest.raises(SystemExit) as e:
        for step, loss in enumerate(losses):
            guard.watch_divergence(step, loss)
    assert e.value.code == 3 and guard.monitor["above"] == 3
    err = capsys.readouterr().err.strip()
    assert err == (diagnostics.diverged(step, guard.monitor, 1.0, 3) + ". Last good checkpoint: "
                   "none yet")


def test_resume_point_is_none_for_a_fresh_run(tmp_path):
    rt = runtime.setup("cpu")
    assert resume_point(rt, str(tmp_path), False, {}, 10, None) == (None, None)
    assert resume_point(rt, str(tmp_path), "auto", {}, 10, None) == (None, None)  # nothing to resume
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):  # --resume: one is needed
        resume_point(rt, str(tmp_path), True, {}, 10, None)
    assert checkpoint.list_checkpoints(str(tmp_path)) == []
    # nothing to restore: no loader state, a new divergence monitor, no saving ranks to reshard from
    assert restore_ranks(rt, None, None, []) == (None, diagnostics.NEW_MONITOR, None)
