"""The planner: `plan`, and the compiled program's collectives, FLOPs and memory it reads."""
