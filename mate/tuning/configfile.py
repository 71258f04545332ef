"""Reading, patching and merging tile config files (`configs/<target>.yaml`).

The merge replaces only the lines of the entries it updates: ruamel.yaml finds
them (its round-trip parser keeps each key's line) and renders the new ones as
one-line flow mappings. Everything else keeps its bytes: the hand-written
comments, the stage and key order, and entries someone broke over two lines
(a full ruamel dump would join those). The result is parsed back and must
equal the intended data.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import yaml
from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap
from ruamel.yaml.scalarstring import DoubleQuotedScalarString

from mate import _dispatch


def _yaml() -> YAML:
    y = YAML()  # round-trip: keeps line numbers, comments and flow style
    y.width = 1 << 16  # an entry is one line, however long its note
    return y


def render(stage: str, entry: dict) -> str:
    """An entry as a flow mapping: the stage's tile parameters in order, then `measured` (double-quoted)."""
    card = _dispatch.STAGES[stage]
    # A parameter with a default that the entry leaves out stays out (nsa_selection's queries).
    m = CommentedMap((p, entry[p]) for p in card.params if p in entry or p not in card.defaults)
    if entry.get("measured"):
        m["measured"] = DoubleQuotedScalarString(entry["measured"])
    m.fa.set_flow_style()
    buf = io.StringIO()
    _yaml().dump({"x": m}, buf)
    return buf.getvalue().strip()[len("x: "):]


def merge(text: str, stage: str, updates: dict[str, dict]) -> str:
    """`text` with the entries `updates` (key -> entry) of `stage` replaced or appended.

    Replaced entries keep their place; new keys follow the stage's last entry; a
    new stage goes at the end. Raises ValueError when the edited text does not
    parse back to the intended config.
    """
    lines = text.splitlines()
    doc = _yaml().load(text) or CommentedMap()
    entries = doc.get(stage)
    if entries is None:
        lines += ["", f"{stage}:"]
        spans, last, indent = {}, len(lines), "  "
    else:
        # Each entry's lines: from its key to its last value (0-based line numbers, end exclusive).
        spans = {}
        for key, entry in entries.items():
            if not isinstance(entry, CommentedMap) or not entry or not entry.fa.flow_style():
                raise ValueError(f"{stage}.{key} is not a flow mapping ({{...}}); the file's layout is not one this merge knows")
            spans[str(key)] = (entries.lc.key(key)[0], entry.lc.value(list(entry)[-1])[0] + 1)
        last = max(b for _, b in spans.values())
        indent = " " * entries.lc.key(next(iter(entries)))[1]
    rendered = {k: f"{indent}{k}: {render(stage, e)}" for k, e in updates.items()}
    # Bottom-up, so the line numbers of the spans still to edit stay valid.
    for key in sorted((k for k in updates if k in spans), key=lambda k: -spans[k][0]):
        a, b = spans[key]
        lines[a:b] = [rendered[key]]
        if a < last:
            last -= b - a - 1
    lines[last:last] = [rendered[k] for k in updates if k not in spans]
    out = "\n".join(lines) + "\n"

    expected = yaml.safe_load(text) or {}
    expected.setdefault(stage, {}).update({k: {p: v for p, v in e.items() if p != "measured" or v} for k, e in updates.items()})
    if yaml.safe_load(out) != expected:
        raise ValueError(f"merging into the {stage} entries did not give the intended config; the file's layout is not one this merge knows")
    return out


def write(path: Path, stage: str, updates: dict[str, dict]) -> None:
    """Merge `updates` into the config file at `path` (validated, replaced atomically)."""
    text = merge(path.read_text(), stage, updates)
    _dispatch.validate_config(yaml.safe_load(text), path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
