"""The planner: `plan`, and the compiled program's collectives, FLOPs and memory it reads."""

from ._hlo import collective_summary as collective_summary
from ._plan import Plan as Plan, plan as plan
from ._timing import compare_plans as compare_plans
