"""redeqx: distributed training and inference of Equinox models from three
small functions (``collate_fn``, ``loss_fn``, ``pred_fn``) and one number
(``n_model_shards``)."""

from .checkpoints import (
    CheckpointError as CheckpointError,
    read_metadata as read_metadata,
    restore_checkpoint as restore_checkpoint,
    save_checkpoint as save_checkpoint,
)
from .state import (
    TrainState as TrainState,
    apply_gradients as apply_gradients,
    init_model as init_model,
    init_opt_state as init_opt_state,
    init_state as init_state,
    lr_schedule as lr_schedule,
    muon_dimensions as muon_dimensions,
    with_opt_state_dtype as with_opt_state_dtype,
)
from .mesh import check_mesh as check_mesh, constrain as constrain, make_mesh as make_mesh, shard as shard
from .steps import exact_conv_grads as exact_conv_grads
from .context import (
    attention as attention,
    context_order as context_order,
    restore_order as restore_order,
    sequence_positions as sequence_positions,
)
from .data import batches as batches, shuffled as shuffled
from .run import (
    HUNG_EXIT_CODE as HUNG_EXIT_CODE,
    StepWatchdog as StepWatchdog,
    initialize as initialize,
    preflight as preflight,
)
from .data import GrainBatches as GrainBatches, grain_batches as grain_batches
from .planner import Plan as Plan, collective_summary as collective_summary, compare_plans as compare_plans, plan as plan
from ._inference import evaluate as evaluate, predict as predict
from ._logging import Logger as Logger
from .checkpoints import CheckpointManager as CheckpointManager
from .checkpoints import PREEMPTED_EXIT_CODE as PREEMPTED_EXIT_CODE, Preempted as Preempted
from .steps import checkpoint as checkpoint, remat as remat
from .sharding import explain as explain, sharding_rules as sharding_rules, specs_from_overrides as specs_from_overrides
from .steps import (
    make_eval_step as make_eval_step,
    make_predict_step as make_predict_step,
    make_step as make_step,
    make_train_step as make_train_step,
)
from ._version import __version__ as __version__
