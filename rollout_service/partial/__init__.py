"""Partial rollout across policy versions: what happens to unfinished work
at a weight update."""
from rollout_service.partial.carry_over import CARRY_MODES, CarryOverConfig, CarryPlan, plan_carry_over

__all__ = ["CARRY_MODES", "CarryOverConfig", "CarryPlan", "plan_carry_over"]
