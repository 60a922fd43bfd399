"""Processes: `initialize` and `preflight` over hosts, cluster detection, the step watchdog."""

from ._distributed import (
    ENV as ENV,
    initialize as initialize,
    launcher_start as launcher_start,
    preflight as preflight,
)
from ._watchdog import HUNG_EXIT_CODE as HUNG_EXIT_CODE, StepWatchdog as StepWatchdog
