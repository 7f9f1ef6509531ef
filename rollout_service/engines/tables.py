"""Configuration tables (TOML) into typed settings: one helper, used by every
`[engine.spec...]` settings class."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping


def from_table(cls, values: Mapping[str, Any] | None, where: str):
    """`cls(**values)`, naming unknown keys (a config table `where`) in the error."""
    values = dict(values or {})
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - known
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}; known: {sorted(known)}")
    return cls(**values)
