"""Every config key with its type, default and description, read from the config dataclasses
themselves (the comment beside each field, the class docstring of each section), so the text
`rlctl config show` prints and docs/config.md can never drift from the code.

    rlctl config show examples/ppo.toml --set update.lr=1e-5
    rlctl config diff runs/grpo runs/drgrpo        # the keys two runs (or TOML files) differ in
    python -m rlctl.config_doc docs/config.md      # regenerate the reference (a test checks it)
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import sys
import tokenize
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlctl.config import (
    RESOLVED_CONFIG,
    SECTIONS,
    Config,
    ConfigError,
    RewardTerm,
    _toml_value,
    load_config,
    recorded_config,
    to_dict,
)


@dataclass(frozen=True)
class KeyDoc:
    section: str
    key: str
    type: str
    default: Any
    description: str

    @property
    def name(self) -> str:
        return f"{self.section}.{self.key}"


def field_comments(cls: type) -> dict[str, str]:
    """field name → the comment on its line in the class source."""
    source = inspect.getsource(cls)
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
    found = {}
    for number, line in enumerate(source.splitlines(), start=1):
        name, colon, _ = line.strip().partition(":")
        if colon and name.isidentifier() and number in comments and line.startswith("    ") and not line.startswith("     "):
            found[name] = comments[number]
    return found


def type_name(hint: Any) -> str:
    if typing.get_origin(hint) is tuple:
        item = typing.get_args(hint)[0]
        if dataclasses.is_dataclass(item):
            return "list of {" + ", ".join(f.name for f in dataclasses.fields(item)) + "}"
        return f"list of {item.__name__}"
    if typing.get_origin(hint) is dict:
        return "table of name = value"
    return getattr(hint, "__name__", str(hint))


def key_docs() -> list[KeyDoc]:
    docs = []
    for section, cls in SECTIONS.items():
        comments, hints, defaults = field_comments(cls), typing.get_type_hints(cls), to_dict(cls())
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):  # a table of its own (update.lora): its keys, dotted
                inner, inner_hints = field_comments(hints[f.name]), typing.get_type_hints(hints[f.name])
                for g in dataclasses.fields(hints[f.name]):
                    docs.append(KeyDoc(section, f"{f.name}.{g.name}", type_name(inner_hints[g.name]), defaults[f.name][g.name], inner.get(g.name, "")))
                continue
            docs.append(KeyDoc(section, f.name, type_name(hints[f.name]), defaults[f.name], comments.get(f.name, "")))
    return docs


def value_of(values: dict[str, Any], doc: KeyDoc) -> Any:
    value = values[doc.section]
    for part in doc.key.split("."):
        value = value[part]
    return value


def section_summary(section: str) -> str:
    return inspect.cleandoc(SECTIONS[section].__doc__ or "").split("\n\n")[0].replace("\n", " ")


def show(cfg: Config) -> str:
    """The config as TOML a user can copy, every key annotated; changed keys are marked."""
    values = to_dict(cfg)
    lines: list[str] = []
    current = None
    for doc in key_docs():
        if doc.section != current:
            current = doc.section
            lines += ([""] if lines else []) + [f"[{doc.section}]  # {section_summary(doc.section)}"]
        value = value_of(values, doc)
        assignment = f"{doc.key} = {_toml_value(value)}"
        changed = "" if value == doc.default else f"; default {_toml_value(doc.default)}"
        lines.append(f"{assignment:<40} # {doc.type}{changed}: {doc.description}" if len(assignment) <= 40 else f"{assignment}\n{'':<40} # {doc.type}{changed}: {doc.description}")
    return "\n".join(lines)


def differences(a: Config, b: Config) -> list[tuple[str, Any, Any]]:
    """(key, value in a, value in b) of every key where the two configs differ, in the order
    `rlctl config show` lists them."""
    left, right = to_dict(a), to_dict(b)
    return [(d.name, value_of(left, d), value_of(right, d)) for d in key_docs() if value_of(left, d) != value_of(right, d)]


def config_of(source: str | Path) -> Config:
    """A TOML config file, or a run folder's config.resolved.toml (what it ran with)."""
    if not Path(source).is_dir():
        return load_config(source)
    if (recorded := recorded_config(source)) is None:
        raise ConfigError(f"{source}: a folder without {RESOLVED_CONFIG} (not a pipeline run folder)")
    return recorded


def as_json(cfg: Config) -> list[dict[str, Any]]:
    values = to_dict(cfg)
    return [{"key": d.name, "type": d.type, "default": d.default, "value": value_of(values, d), "description": d.description} for d in key_docs()]


def markdown() -> str:
    """docs/config.md: one table per section."""
    out = [
        "# Config reference",
        "",
        "Every key of a pipeline TOML file (and of `--config` for the stage commands), generated from",
        "`rlctl/config.py` by `python -m rlctl.config_doc docs/config.md`; `rlctl config show FILE`",
        "prints the same with a file's values. `--set section.key=value` overrides any key.",
    ]
    current = None
    for doc in key_docs():
        if doc.section != current:
            current = doc.section
            out += ["", f"## [{doc.section}]", "", section_summary(doc.section), "", "| key | type | default | description |", "|---|---|---|---|"]
        default = _toml_value(doc.default).replace("|", "\\|")
        out.append(f"| `{doc.key}` | {doc.type} | `{default}` | {doc.description.replace('|', chr(92) + '|')} |")
    term = ", ".join(f"`{f.name}`" for f in dataclasses.fields(RewardTerm))
    out += ["", f"Each entry of `score.rewards` is a table with {term}: {section_summary_of(RewardTerm)}", ""]
    return "\n".join(out)


def section_summary_of(cls: type) -> str:
    comments = field_comments(cls)
    parts = [f"`{f.name}` ({comments.get(f.name, '')})" for f in dataclasses.fields(cls)]
    return "; ".join(parts) + "."


def main(argv: list[str]) -> None:
    target = Path(argv[0] if argv else "docs/config.md")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(markdown())
    print(target)


if __name__ == "__main__":
    main(sys.argv[1:])
