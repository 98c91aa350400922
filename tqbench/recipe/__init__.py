"""Recipes (how each tier of a model is stored), their role rules, the exact size preview and the fit verdict."""

from tqbench.machine import Machine, machine, measure_disk
from tqbench.recipe.fit import Fit, Footprint, Verdict, assess, parse_size
from tqbench.recipe.plan import ModulePlan, Plan, Sources, group_sources, make_plan, plan_checkpoint
from tqbench.recipe.recipe import Format, Recipe, RecipeError, RecipeFlags
from tqbench.recipe.rules import Choice, choose

__all__ = ["Choice", "Fit", "Footprint", "Format", "Machine", "ModulePlan", "Plan", "Recipe",
           "RecipeError", "RecipeFlags", "Sources", "Verdict", "assess", "choose", "group_sources", "machine", "make_plan",
           "measure_disk", "parse_size", "plan_checkpoint"]
