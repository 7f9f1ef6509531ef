"""Per-token policy-version tags stored as run-length segments.

A response of 900 tokens produced by versions 3 then 4 is two segments,
not 900 integers; the trainer expands them when it needs a per-token view.
"""
from __future__ import annotations

from dataclasses import dataclass, field

#: The tag of tokens no policy produced (a multi-turn trajectory's
#: observations); `min_version`/`max_version` skip it and the wire omits it.
NO_VERSION = -1


@dataclass(slots=True)
class VersionTags:
    """Run-length encoded versions: `segments[i] = [version, start, length]`."""

    segments: list[list[int]] = field(default_factory=list)

    def append(self, version: int, count: int = 1) -> None:
        if count <= 0:
            return
        if self.segments and self.segments[-1][0] == version:
            self.segments[-1][2] += count
        else:
            self.segments.append([version, len(self), count])

    def extend(self, versions: list[int]) -> None:
        for v in versions:
            self.append(v)

    def __len__(self) -> int:
        if not self.segments:
            return 0
        _, start, length = self.segments[-1]
        return start + length

    def per_token(self) -> list[int]:
        out: list[int] = []
        for version, _, length in self.segments:
            out.extend([version] * length)
        return out

    @property
    def min_version(self) -> int:
        """The oldest policy version of any token (-1: none)."""
        return min((s[0] for s in self.segments if s[0] != NO_VERSION), default=-1)

    @property
    def max_version(self) -> int:
        return max((s[0] for s in self.segments if s[0] != NO_VERSION), default=-1)

    def truncated(self, n: int) -> "VersionTags":
        """The tags of the first `n` tokens."""
        out = VersionTags()
        for version, start, length in self.segments:
            if start >= n:
                break
            out.append(version, min(length, n - start))
        return out

    def copy(self) -> "VersionTags":
        return VersionTags([list(s) for s in self.segments])

    @classmethod
    def from_segments(cls, segments: list[tuple[int, int, int]]) -> "VersionTags":
        return cls([list(s) for s in segments])
