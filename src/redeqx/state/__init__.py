"""The training state: `TrainState`, `init_state`, the optimizer state and its dtypes, `init_model`, `lr_schedule`."""
