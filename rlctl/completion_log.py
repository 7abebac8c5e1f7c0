"""`pipeline.log_completions = N`: a few of each iteration's samples, seen while a run trains.

Metrics say that the reward rose; only the text says how (a format exploited, an answer
repeated, a response cut at the limit). After each iteration N rows of the batch that trained,
drawn without replacement from (pipeline.seed, iteration) so a re-run shows the same ones, are
printed under its line (prompt's end, response, reward, advantage) and sent to the trackers: a
text panel in TensorBoard, a table in wandb, a Markdown file per iteration in MLflow (TRL's
`log_completions`, `num_completions_to_print`). Every sample stays in RUN/iter-N/advantage;
`rlctl show RUN/iter-N/advantage` reads them all.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

PROMPT_TAIL = 80  # characters of the prompt's end shown on the console
RESPONSE_HEAD = 240  # characters of the response shown on the console


@dataclass(frozen=True)
class Completion:
    row: int  # its row in the iteration's batch
    prompt: str
    response: str
    reward: float
    advantage: float  # the mean over its response's tokens (GRPO's is the same on each)
    finish_reason: str

    def as_record(self) -> dict:
        return {"row": self.row, "prompt": self.prompt, "response": self.response, "reward": self.reward, "advantage": self.advantage, "finish_reason": self.finish_reason}


def drawn_completions(batch: pa.Table, count: int, *, seed: int, iteration: int) -> list[Completion]:
    """`count` rows of the iteration's batch (all of them if it has fewer), in row order."""
    size = min(count, batch.num_rows)
    if size <= 0:
        return []
    rows = sorted(np.random.default_rng([seed, iteration]).choice(batch.num_rows, size=size, replace=False).tolist())
    picked = batch.take(pa.array(rows, pa.int64()))
    def column(name: str, missing) -> list:
        return picked.column(name).to_pylist() if name in picked.column_names else [missing] * size

    prompts = [prompt if prompt is not None else last_message(chat) for prompt, chat in zip(column("prompt", None), column("messages", None))]
    return [
        Completion(row, prompt, str(response), float(reward), float(np.mean(advantage)) if advantage else 0.0, reason or "")
        for row, prompt, response, reward, advantage, reason in zip(
            rows, prompts, column("response", ""), column("reward", 0.0), column("advantages", None), column("finish_reason", ""),
        )
    ]


def last_message(chat: list[dict] | None) -> str:
    """A conversation's last message as `role: content` (a chat prompt has no plain text)."""
    if not chat:
        return ""
    return f"{chat[-1].get('role', '')}: {chat[-1].get('content', '')}"


def shortened(text: str, limit: int, *, tail: bool = False) -> str:
    """`text` on one line (newlines shown as ⏎), cut to `limit` characters with … where cut."""
    flat = text.replace("\r\n", "\n").replace("\n", "⏎")
    if len(flat) <= limit:
        return flat
    return "…" + flat[-(limit - 1):] if tail else flat[: limit - 1] + "…"


def console_lines(iteration: int, completions: list[Completion]) -> list[str]:
    """One line per sample for the plain console view."""
    return [
        f"  iter {iteration} row {c.row}: reward {c.reward:.4g}  advantage {c.advantage:+.3g}{'  (cut at the limit)' if c.finish_reason == 'length' else ''}  "
        f"{shortened(c.prompt, PROMPT_TAIL, tail=True)!r} → {shortened(c.response, RESPONSE_HEAD)!r}"
        for c in completions
    ]


def markdown_table(completions: list[Completion]) -> str:
    """The samples whole, as a Markdown table (TensorBoard's text panel, MLflow's file)."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\r\n", "\n").replace("\n", "<br>")

    lines = ["| row | reward | advantage | finish | prompt | response |", "|---|---|---|---|---|---|"]
    lines += [f"| {c.row} | {c.reward:.4g} | {c.advantage:+.4g} | {c.finish_reason} | {cell(c.prompt)} | {cell(c.response)} |" for c in completions]
    return "\n".join(lines)
