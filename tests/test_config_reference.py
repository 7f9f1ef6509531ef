"""docs/configuration.md documents every configuration key, with its default.

The reference table's keys are compared with the keys reachable from
`ServiceConfig`: top-level fields bare (`grpc_port`), nested dataclass fields
dotted (`engine.ray.address`), and a field that holds a plain value (a dict
such as `engine.spec` included) counts as one key. Defaults are compared as
JSON, the way the table writes them.
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from rollout_service.config import ServiceConfig

DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def config_keys(obj: object, prefix: str = "") -> dict[str, object]:
    """Dotted key -> default value, walking nested dataclasses."""
    keys: dict[str, object] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            keys.update(config_keys(value, f"{prefix}{f.name}."))
        else:
            keys[f"{prefix}{f.name}"] = value
    return keys


def render(value: object) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _unquote(cell: str) -> str:
    m = re.fullmatch(r"`(.*)`", cell)
    return m.group(1) if m else cell


def documented_keys() -> dict[str, str]:
    """Key -> default as written, from the table headed `| key | default | ...`."""
    lines = DOC.read_text().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("|") and _cells(line)[:2] == ["key", "default"]]
    assert len(starts) == 1, f"{DOC.name} must hold exactly one table headed '| key | default |', found {len(starts)}"
    rows: dict[str, str] = {}
    for line in lines[starts[0] + 2:]:
        if not line.startswith("|"):
            break
        cells = _cells(line)
        key, default = _unquote(cells[0]), _unquote(cells[1])
        assert key not in rows, f"{key!r} is documented twice"
        rows[key] = default
    return rows


def test_every_configuration_key_is_documented_and_no_other():
    actual = set(config_keys(ServiceConfig()))
    documented = set(documented_keys())
    missing = sorted(actual - documented)
    extra = sorted(documented - actual)
    assert not missing and not extra, (
        f"docs/configuration.md is out of date: keys missing from the table: {missing}; "
        f"keys in the table that ServiceConfig does not have: {extra}"
    )


def test_documented_defaults_are_the_dataclass_defaults():
    actual = config_keys(ServiceConfig())
    documented = documented_keys()
    wrong = {
        key: (documented[key], render(value))
        for key, value in actual.items()
        if key in documented and documented[key] != render(value)
    }
    assert not wrong, "defaults in docs/configuration.md differ (documented, actual): " + ", ".join(
        f"{k}: {d} != {a}" for k, (d, a) in sorted(wrong.items())
    )


def test_documented_keys_and_defaults_work_with_set():
    # What the table lists is what `--set KEY=VALUE` and a TOML file address.
    from rollout_service.config import set_field

    cfg = ServiceConfig()
    for key, default in documented_keys().items():
        set_field(cfg, key, json.loads(default))
