"""The training state: `TrainState`, `init_state`, the optimizer state and its dtypes, Muon's matrices, `init_model`, `lr_schedule`."""

from ._build import abstract_model as abstract_model, init_model as init_model, is_constructor as is_constructor
from ._opt_state import (
    Optimizer as Optimizer,
    as_optimizer as as_optimizer,
    init_opt_state as init_opt_state,
    mirror_specs as mirror_specs,
    split_trainable as split_trainable,
    trainable_params as trainable_params,
)
from ._muon import muon_dimensions as muon_dimensions, warn_muon_layout as warn_muon_layout
from ._optimizers import with_opt_state_dtype as with_opt_state_dtype
from ._schedules import lr_schedule as lr_schedule
from ._state import (
    TrainState as TrainState,
    apply_gradients as apply_gradients,
    init_state as init_state,
    optimizer_update as optimizer_update,
)
