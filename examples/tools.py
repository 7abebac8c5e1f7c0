"""A tool for examples/tool_use.toml: a calculator that answers a response ending in "=" with
the sum the question asks for. It reads the two numbers from the prompt (the tiny model cannot
write an expression yet), so what the policy learns is when to call it."""

import re


def calculator(prompts: list[str], responses: list[str]) -> list[str | None]:
    answers = []
    for prompt, response in zip(prompts, responses):
        numbers = [int(n) for n in re.findall(r"\d+", prompt)]
        answers.append(f" {sum(numbers)} " if response.endswith("=") and len(numbers) == 2 else None)
    return answers
