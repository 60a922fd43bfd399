"""Checkpoints on disk: `save_checkpoint`, `restore_checkpoint`, `CheckpointManager`, preemption."""
