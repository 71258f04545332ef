"""Reading, patching and merging tile config files (`configs/<target>.yaml`).

The merge edits the text line by line instead of dumping the parsed YAML, so
the hand-written comments, the stage and key order and the one-line flow
mappings survive; the result is parsed back and must equal the intended data.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from pathlib import Path

import yaml

from mate import _dispatch

_TOP_KEY = re.compile(r"^([A-Za-z_][\w.-]*)\s*:\s*(#.*)?$")
_ENTRY = re.compile(r"^(\s+)(\S[^:]*?)\s*:\s*\{")


def render(stage: str, entry: dict) -> str:
    """An entry as a flow mapping: the stage's tile parameters in order, then `measured`."""
    params = _dispatch.STAGES[stage].params
    parts = [f"{p}: {entry[p]}" for p in params]
    if entry.get("measured"):
        parts.append(f"measured: {json.dumps(entry['measured'])}")
    return "{" + ", ".join(parts) + "}"


def _entry_end(lines: list[str], start: int) -> int:
    """The index after the last line of the flow mapping that starts on line `start`."""
    depth, quoted = 0, False
    for i in range(start, len(lines)):
        line = lines[i]
        j = line.index("{") if i == start else 0
        while j < len(line):
            c = line[j]
            if c == '"' and (j == 0 or line[j - 1] != "\\"):
                quoted = not quoted
            elif not quoted and c == "{":
                depth += 1
            elif not quoted and c == "}":
                depth -= 1
                if depth == 0:
                    return i + 1
            elif not quoted and c == "#":
                break
            j += 1
    raise ValueError(f"unterminated mapping at line {start + 1}")


def merge(text: str, stage: str, updates: dict[str, dict]) -> str:
    """`text` with the entries `updates` (key -> entry) of `stage` replaced or appended.

    Replaced entries keep their place; new keys follow the stage's last entry; a
    new stage goes at the end. Raises ValueError when the edited text does not
    parse back to the intended config.
    """
    lines = text.splitlines()
    begin = next((i for i, l in enumerate(lines) if (m := _TOP_KEY.match(l)) and m.group(1) == stage), None)
    if begin is None:
        lines += ["", f"{stage}:"]
        begin = len(lines) - 1
    end = next((i for i in range(begin + 1, len(lines)) if lines[i][:1] not in ("", " ", "#")), len(lines))
    spans, i = {}, begin + 1
    while i < end:
        m = _ENTRY.match(lines[i])
        if m:
            stop = _entry_end(lines, i)
            spans[m.group(2).strip("'\"")] = (i, stop, m.group(1))
            i = stop
        else:
            i += 1
    last = max((s[1] for s in spans.values()), default=begin + 1)
    indent = next(iter(spans.values()))[2] if spans else "  "
    new_keys = [k for k in updates if k not in spans]
    # Bottom-up, so the line numbers of the spans still to edit stay valid.
    for key in sorted((k for k in updates if k in spans), key=lambda k: -spans[k][0]):
        a, b, ind = spans[key]
        lines[a:b] = [f"{ind}{key}: {render(stage, updates[key])}"]
        if a < last:
            last -= b - a - 1
    lines[last:last] = [f"{indent}{k}: {render(stage, updates[k])}" for k in new_keys]
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


@contextlib.contextmanager
def using_tiles(target: str, stage: str, key: str, tiles: dict, base: dict | None = None):
    """Run the dispatcher with `tiles` as the entry of (stage, key), through a patched copy of `base`
    (default: the target's config as the dispatcher reads it).

    The API wrappers read tile values too (grid sizes, limits), so the whole
    dispatch path, not only the kernel, must see the candidate.
    """
    cfg = {s: dict(e) for s, e in (base or _dispatch.load_config(target)).items()}
    cfg.setdefault(stage, {})[key] = dict(tiles)
    saved = os.environ.get("MATE_CONFIG_DIR")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / f"{target}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        os.environ["MATE_CONFIG_DIR"] = tmp
        _dispatch.clear_caches()
        try:
            yield
        finally:
            if saved is None:
                os.environ.pop("MATE_CONFIG_DIR", None)
            else:
                os.environ["MATE_CONFIG_DIR"] = saved
            _dispatch.clear_caches()
