"""The jitted step makers (`make_train_step` and friends), the loss's pieces, remat and the program rewrites they apply."""

from ._conv_grads import exact_conv_grads as exact_conv_grads
from ._pipeline import check_microbatches as check_microbatches
from ._remat import ScanResiduals as ScanResiduals, checkpoint as checkpoint, remat as remat
from ._steps import (
    EvalStep as EvalStep,
    PredictStep as PredictStep,
    make_eval_step as make_eval_step,
    make_predict_step as make_predict_step,
    make_step as make_step,
    make_train_step as make_train_step,
)
