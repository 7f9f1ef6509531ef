"""Kept for `service.py`, which imports `bind_counters` from here: the Ray
fleet lives in `ray_fleet` (building it), `ray_proxy` (the server side)
and `ray_host` (the actor side)."""
from rollout_service.engines.ray_fleet import RayFleet, bind_counters, connect, make_ray_engines  # noqa: F401
from rollout_service.engines.ray_host import EngineHost  # noqa: F401
from rollout_service.engines.ray_proxy import RayEngine, RayHost  # noqa: F401
