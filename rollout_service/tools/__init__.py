"""Stand-alone tools (`rollout-service build-model`, ...).

A leaf package: it may import :mod:`rollout_service.assets` and third-party
libraries, nothing from ``api``, ``core`` or ``scheduling``.
"""
