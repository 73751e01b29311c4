"""PyTorch: modules, optimizers, GradScalers; DDP, DataParallel and ``torch.compile`` wrappers.

Always active (mpdoctor itself imports torch). The tensor facts every model gets
(dtype tallies, per-parameter records, per-module dtype sets) live in
:mod:`mpdoctor.facts.tensors`; this declaration says which objects they apply to.
"""

from __future__ import annotations

from ...compat import GRAD_SCALER_CLASSES
from ...objects.integrations import Integration, Unwrap
from ...objects.readers.scaler import is_scaler_state
from .averaging import model_facts as island_facts
from .averaging import shadow_facts

MODULE = "torch.nn.modules.module.Module"
OPTIMIZER = "torch.optim.optimizer.Optimizer"
SCALERS = GRAD_SCALER_CLASSES

INTEGRATION = Integration(
    name="torch",
    modules=("torch",),
    kinds=((MODULE, "model"), (OPTIMIZER, "optimizer")) + tuple((s, "scaler") for s in SCALERS),
    model_unwraps=(
        Unwrap("torch.nn.parallel.distributed.DistributedDataParallel", "module", ".module"),
        Unwrap("torch.nn.parallel.data_parallel.DataParallel", "module", ".module"),
        Unwrap("torch._dynamo.eval_frame.OptimizedModule", "_orig_mod"),
    ),
    model_facts=island_facts,  # intent: averaged copies, metrics, frozen shadows, _keep_in_fp32_modules
    facts=shadow_facts,  # EMA / averaging objects and what their updates lose
    # A checkpoint's GradScaler state (``ckpt["scaler"]``), found by its keys: what a resumed scaler can load.
    value_kinds=(("builtins.dict", is_scaler_state, "scaler_state"),),
)
