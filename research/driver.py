"""Moved to `rollout_service.bench.driver` (installed with the package, for
`rollout-service bench`); this name stays an alias of that module."""
import sys

from rollout_service.bench import driver as _driver

sys.modules[__name__] = _driver
