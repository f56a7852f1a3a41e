"""diagnostics.py: which modules train.py's logged gradient norms come from and what they measure
(recomputed here from a model's gradients, selected by parameter name), the step's speed and its
printed line, the divergence monitor by hand, a step's time and the time left, and the log files."""
import json
import math
from types import SimpleNamespace

import pytest
import torch

from flt import diagnostics
from test_model import make_model, random_tokens


def read(tensors):
    """{name: float} of train.py's 0-d tensors, as its one read gives them."""
    return {name: t.item() for name, t in tensors.items()}


def model_with_gradients(n_layer):
    model = make_model("FLT", n_layer=n_layer).train()
    model(random_tokens(2, 16), random_tokens(2, 16, seed=1), loops=2).backward()
    return model


def norm_of(model, *prefixes):
    """The L2 norm of the gradients of the parameters whose names start with one of prefixes."""
    grads = [p.grad.flatten() for n, p in model.named_parameters() if n.startswith(prefixes)]
    assert grads, prefixes
    return torch.cat(grads).double().norm().item()


@pytest.mark.parametrize("n_layer, watch_layer, mid", [(6, -1, 4), (3, -1, 2), (6, 1, 1), (1, -1, 0)])
def test_watched_norms_are_those_of_the_modules_the_figures_follow(n_layer, watch_layer, mid):
    """grad_mlp_first: the first block's MLP; grad_lm_head; grad_mlp_mid and grad_attn_mid: block
    watch_layer's MLP and attention, -1 = the paper's "5th layer" (index 4) or the last of fewer."""
    model = model_with_gradients(n_layer)
    watch = diagnostics.Watch(model, watch_layer)
    sq = {p: p.grad.double().square().sum() for p in model.parameters()}
    looped = SimpleNamespace(resid_norms=torch.tensor([1.0, 2.0]))
    with diagnostics.count_host_reads() as reads:
        tensors = watch.tensors(sq, looped)  # device tensors only: the step reads them in its one read
    assert sum(reads.values()) == 0 and all(t.dim() == 0 for t in tensors.values())
    assert list(tensors) == ["grad_mlp_first", "grad_lm_head", "grad_mlp_mid", "grad_attn_mid", "resid_norm_1",
                             "resid_norm_2"]
    got = {"grad_norm": diagnostics.gradient_norms(sq, watch.modules)[0].item()}
    got |= watch.record(read(tensors), 1.0)  # not clipped=True: no clipped entries
    assert got.pop("resid_norms") == [1.0, 2.0]  # loop 1 first
    want = {"grad_norm": norm_of(model, ""), "grad_mlp_first": norm_of(model, "transformer.h.0.mlp."), "grad_lm_head": norm_of(model, "lm_head."),
            "grad_mlp_mid": norm_of(model, f"transformer.h.{mid}.mlp."),
            "grad_attn_mid": norm_of(model, f"transformer.h.{mid}.attn.")}
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-9), key
    assert len({got["grad_mlp_first"], got["grad_mlp_mid"], got["grad_attn_mid"], got["grad_lm_head"]}) == \
        (3 if mid == 0 else 4)  # distinct modules have distinct norms


def test_clipped_norms_are_the_module_norms_after_torchs_clipping():
    """The authors' view (scripts/base_check.py): clip_grad_norm_ by the total norm, then each module's norm."""
    model = model_with_gradients(6)
    watch = diagnostics.Watch(model, clipped=True)
    sq = {p: p.grad.double().square().sum() for p in model.parameters()}
    numbers = read(watch.tensors(sq, SimpleNamespace(resid_norms=torch.ones(2))))
    total = norm_of(model, "")
    for max_norm in (total / 3, 10 * total):  # clipping, and none
        got = {k: v for k, v in watch.record(numbers, max_norm).items() if k.endswith("_clipped")}
        clipped = make_model("FLT", n_layer=6)
        for (_, p), (_, q) in zip(model.named_parameters(), clipped.named_parameters()):
            q.grad = p.grad.clone()
        torch.nn.utils.clip_grad_norm_(clipped.parameters(), max_norm)
        want = {"grad_mlp_first_clipped": norm_of(clipped, "transformer.h.0.mlp."),
                "grad_lm_head_clipped": norm_of(clipped, "lm_head."),
                "grad_mlp_mid_clipped": norm_of(clipped, "transformer.h.4.mlp."),
                "grad_attn_mid_clipped": norm_of(clipped, "transformer.h.4.attn.")}
        assert got.keys() == want.keys()
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-5), (max_norm, key)
    assert got["grad_lm_head_clipped"] == pytest.approx(norm_of(model, "lm_head."), rel=1e-5)  # unclipped


def test_divergence_monitor_by_hand():
    monitor, nats = diagnostics.NEW_MONITOR, 1.0
    seen = []
    for loss in (4.0, 3.0, 3.0, 8.0, 8.0, 8.0, 2.0):
        monitor = diagnostics.divergence(monitor, loss, nats)
        seen.append((round(monitor["ema"], 6), round(monitor["best"], 6), monitor["above"]))
    # ema = 0.9 ema + 0.1 loss: 4, 3.9, 3.81, 4.229, 4.6061, 4.94549 (> 3.81 + 1 nat), 4.650941
    assert seen == [(4.0, 4.0, 0), (3.9, 3.9, 0), (3.81, 3.81, 0), (4.229, 3.81, 0), (4.6061, 3.81, 0),
                    (4.94549, 3.81, 1), (4.650941, 3.81, 0)]
    assert diagnostics.NEW_MONITOR == {"ema": None, "best": math.inf, "above": 0}  # never modified


def test_step_time_leaves_out_what_is_paused(monkeypatch):
    """Evaluations and checkpoints (between pause() and resume()) are not a training step's time."""
    clock = iter([100.0, 101.0, 104.0, 105.5, 106.0, 107.0, 109.0])
    monkeypatch.setattr(diagnostics.time, "time", lambda: next(clock))
    timer = diagnostics.StepTimer()  # 100
    timer.pause()  # 101
    timer.resume()  # 104: 3 s paused
    assert timer.lap() == 105.5 - 100.0 - 3.0
    timer.pause()  # 106
    timer.resume()  # 107: 1 s paused, since the last lap only
    assert timer.lap() == 109.0 - 105.5 - 1.0


def test_log_writes_settings_then_one_line_per_record(tmp_path):
    log = diagnostics.Log(str(tmp_path), {"loops": 3})
    log.write({"step": 0, "loss": 1.5})
    log.write({"step": 1, "loss": float("nan")})
    log.close()
    assert json.loads((tmp_path / "settings.json").read_text()) == {"loops": 3}
    lines = (tmp_path / "log.jsonl").read_text().splitlines()
    assert json.loads(lines[0]) == {"step": 0, "loss": 1.5} and math.isnan(json.loads(lines[1])["loss"])
    quiet = diagnostics.Log(None, {"loops": 3})  # a rank other than 0
    quiet.write({"step": 0})
    quiet.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.jsonl", "settings.json"]


def test_speed_is_the_steps_tokens_per_second_and_its_share_of_the_peak():
    """tok/s = tokens / dt; MFU = FLOPs per token x tok/s over the peak of every accelerator; no peak
    (a CPU): no MFU. The memory entry only where asked (train.py: the first CUDA steps)."""
    got = diagnostics.speed(2048, 0.5, 3e6, 1e12, world_size=2)
    assert got == {"tok_per_s": 4096.0, "dt": 0.5, "mfu": 3e6 * 4096 / 2e12}
    assert diagnostics.speed(2048, 0.5, 3e6, None, world_size=1)["mfu"] is None


def test_time_left_is_the_steps_left_at_the_mean_step_after_the_first(monkeypatch):
    """elapsed: the wall time since the timer began, pauses included; left(n): n steps at the mean
    lap, the first lap's warm-up (compilation) left out: no estimate before a second lap."""
    clock = iter([100.0, 130.0, 131.0, 135.0, 136.0, 138.0, 139.0, 140.0])
    monkeypatch.setattr(diagnostics.time, "time", lambda: next(clock))
    timer = diagnostics.StepTimer()  # 100
    assert timer.lap() == 30.0  # 130: the first step, compiling
    assert timer.left(10) is None  # the first lap is all there is
    timer.pause()  # 131
    timer.resume()  # 135: an evaluation
    assert timer.lap() == 2.0  # 136
    assert timer.lap() == 2.0  # 138
    assert timer.left(10) == 20.0 and timer.left(0) == 0.0
    assert timer.elapsed() == 139.0 - 100.0


@pytest.mark.parametrize("seconds, shown", [(0.4, "0s"), (42.4, "42s"), (59.6, "1m00s"),
                                            (83, "1m23s"), (3599, "59m59s"), (7500, "2h05m"),
                                            (86400 * 3 + 3600 * 4 + 59, "3d04h")])
def test_a_duration_is_shown_to_the_second_or_the_minute(seconds, shown):
    assert diagnostics.duration(seconds) == shown


def test_a_step_line_rounds_each_number_to_what_it_means():
    record = {"step": 7, "loss": 5.43219, "loops": 3, "lrm": 0.8333, "grad_norm": 1.2871,
              "resid_norms": [8.04, 13.96], "tok_per_s": 1758.4, "mfu": None}
    # 83 s since training began; 242 steps left (8 to 249) at 1.5 s
    timer = SimpleNamespace(elapsed=lambda: 83.2, left=lambda steps: 1.5 * steps)
    assert diagnostics.step_line(record, 250, timer) == \
        ("step     7/250 | loss 5.432 | K 3 | lrm 0.83 | grad 1.29 | resid 14.0 | 1,758 tok/s | "
         "1m23s elapsed, ~6m03s left")
    assert diagnostics.step_line(record | {"mfu": 0.3814}, 250, timer).endswith(
        "1,758 tok/s | mfu 38.1% | 1m23s elapsed, ~6m03s left")
    first = SimpleNamespace(elapsed=lambda: 83.2, left=lambda steps: None)  # one step timed
    assert diagnostics.step_line(record, 250, first).endswith("1,758 tok/s | 1m23s elapsed")
