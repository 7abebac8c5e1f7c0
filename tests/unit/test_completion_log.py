"""pipeline.log_completions: which samples are drawn, and how they read on the console and in
the trackers' Markdown."""

import io

import pyarrow as pa
import pytest

from rlctl.completion_log import (
    Completion,
    console_lines,
    drawn_completions,
    markdown_table,
    shortened,
)
from rlctl.runview import PlainView


def batch(rows: int) -> pa.Table:
    return pa.table({
        "prompt": [f"prompt {i}" for i in range(rows)], "response": [f"response {i}" for i in range(rows)],
        "reward": pa.array([i / 10 for i in range(rows)], pa.float32()), "advantages": [[float(i), float(i) + 1] for i in range(rows)],
        "finish_reason": ["length" if i % 2 else "stop" for i in range(rows)],
    })


def test_the_same_seed_and_iteration_draw_the_same_rows_and_another_iteration_others():
    table = batch(64)
    first = drawn_completions(table, 4, seed=0, iteration=1)
    assert first == drawn_completions(table, 4, seed=0, iteration=1)
    assert [c.row for c in first] == sorted({c.row for c in first}) and len(first) == 4
    assert [c.row for c in drawn_completions(table, 4, seed=0, iteration=2)] != [c.row for c in first]
    one = first[0]
    assert (one.prompt, one.response, one.reward, one.advantage) == (f"prompt {one.row}", f"response {one.row}", pytest.approx(one.row / 10), one.row + 0.5)


def test_a_chat_prompt_shows_its_last_message():
    table = batch(2).drop_columns(["prompt"]).append_column("messages", pa.array([[{"role": "user", "content": "hi"}], [{"role": "system", "content": "x"}, {"role": "user", "content": "2+2?"}]]))
    assert [c.prompt for c in drawn_completions(table, 2, seed=0, iteration=1)] == ["user: hi", "user: 2+2?"]


def test_asking_for_more_than_the_batch_gives_the_whole_batch_and_none_gives_nothing():
    assert [c.row for c in drawn_completions(batch(3), 8, seed=0, iteration=1)] == [0, 1, 2]
    assert drawn_completions(batch(3), 0, seed=0, iteration=1) == []


def test_the_console_shows_one_line_a_sample_cut_and_the_trackers_get_them_whole():
    long = Completion(7, "system…\nWhat is 2 + 2?", "<think>\n" + "x" * 400 + "</think> 4", 1.0, 0.5, "length")
    (line,) = console_lines(3, [long])
    assert line.startswith("  iter 3 row 7: reward 1  advantage +0.5  (cut at the limit)  ")
    assert "What is 2 + 2?" in line and "\n" not in line and "⏎" in line and line.endswith("…'")
    assert shortened("abcdef", 4, tail=True) == "…def" and shortened("abc", 4) == "abc"
    table = markdown_table([long, Completion(8, "a | b", "c", 0.0, -1.0, "stop")])
    assert table.splitlines()[2].endswith("| system…<br>What is 2 + 2? | <think><br>" + "x" * 400 + "</think> 4 |")  # whole, one row
    assert "| a \\| b | c |" in table.splitlines()[3]
    stream = io.StringIO()
    PlainView(stream=stream).completions(3, [long])
    assert stream.getvalue() == line + "\n"


def test_the_live_view_prints_them_as_a_table_above_itself():
    from rich.console import Console

    from rlctl.runview import LiveView

    view = LiveView(0, 2)
    view.console = Console(file=io.StringIO(), width=160)
    view.completions(3, [Completion(7, "What is [b]2[/b] + 2?", "[/i] 4", 1.0, 0.5, "length")])  # a sample's brackets are text, not markup
    out = view.console.file.getvalue()
    assert "iteration 3: samples" in out and "What is [b]2[/b] + 2?" in out and "[/i] 4 [cut at the limit]" in out
