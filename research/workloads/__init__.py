"""Moved to `rollout_service.bench.workloads` (installed with the package, for
`rollout-service bench`); these names stay aliases of those modules."""
import sys

from rollout_service.bench import workloads as _workloads
from rollout_service.bench.workloads import polytrace, synthetic, tiny_reasoner

sys.modules[__name__] = _workloads
for _m in (polytrace, synthetic, tiny_reasoner):
    sys.modules[f"{__name__}.{_m.__name__.rsplit('.', 1)[1]}"] = _m
