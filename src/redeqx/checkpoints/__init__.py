"""Checkpoints on disk: `save_checkpoint`, `restore_checkpoint`, `CheckpointManager`, preemption.

One checkpoint's format (``_format``), writing (``_save``), reading
(``_restore``) and checks (``_integrity``); a run's directory of them
(``_directory``), which to write and keep (``_retention``), the data
position (``_position``), and the manager over them (``_manager``)."""

from ._format import CheckpointError as CheckpointError
from ._integrity import read_metadata as read_metadata
from ._manager import CheckpointManager as CheckpointManager
from ._writer import finish_in_flight as finish_in_flight
from ._preemption import PREEMPTED_EXIT_CODE as PREEMPTED_EXIT_CODE, Preempted as Preempted
from ._restore import restore_checkpoint as restore_checkpoint
from ._save import save_checkpoint as save_checkpoint
