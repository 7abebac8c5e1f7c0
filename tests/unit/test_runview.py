"""The plain per-iteration line: where the run is, and how long is left."""

import io

from rlctl.runview import Eta, PlainView, duration, plain_line


def test_durations_read_to_the_unit_that_matters():
    assert [duration(s) for s in (0, 7.4, 80, 3600 * 2 + 5 * 60 + 9)] == ["0s", "7s", "1m20s", "2h05m"]


def test_the_plain_line_says_the_iteration_of_the_total_and_the_time_left():
    row = {"iteration": 3, "reward_mean": 0.5, "kl": 0.01, "seconds/total": 2.0}
    assert plain_line(row, 30, 80.0) == "iter 3/30  reward 0.500  kl 0.01  2.0s  eta 1m20s"
    assert plain_line(row) == "iter 3  reward 0.500  kl 0.01  2.0s"


def test_the_eta_is_the_pace_of_this_process_times_the_iterations_left(monkeypatch):
    clock = iter([100.0, 130.0])
    monkeypatch.setattr("rlctl.runview.time.monotonic", lambda: next(clock))
    eta = Eta()
    eta.start(iteration_before=10)  # resumed after iteration 10
    assert eta.seconds_left(13, 20) == 10.0 * 7  # 30 s for 3 iterations, 7 to go


def test_a_plain_view_prints_one_line_per_iteration_with_its_eta():
    out = io.StringIO()
    view = PlainView(out, first_iteration=0)
    view.stage("rollout", total=None)
    view.iteration_done({"iteration": 1, "reward_mean": 0.25, "seconds/total": 0.1}, 4)
    line = out.getvalue().strip()
    assert line.startswith("iter 1/4  reward 0.250") and " eta " in line
