"""The jitted step makers (`make_train_step` and friends), the loss's pieces, remat and the program rewrites they apply."""
from ._conv_grads import exact_conv_grads as exact_conv_grads
from ._remat import checkpoint as checkpoint
from ._remat import remat as remat
from ._steps import make_eval_step as make_eval_step
from ._steps import make_predict_step as make_predict_step
from ._steps import make_step as make_step
from ._steps import make_train_step as make_train_step
from ._steps import EvalStep as EvalStep
from ._compiled import narrow_64bit as narrow_64bit
from ._remat import ScanResiduals as ScanResiduals
