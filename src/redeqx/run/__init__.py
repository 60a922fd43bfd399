"""Processes: `initialize` and `preflight` over hosts, cluster detection, the step watchdog."""
