"""Imported by the workers' fork server after :mod:`rlnb._preload` when ``rlnb run`` starts it for an LM recipe
(``rollout.backend`` ``hf`` or ``vllm``): what building a ``transformers`` model imports, ``torch._dynamo``
among it (~1 s here), imported once there rather than in every worker, again with the collector paused."""

import gc
import importlib

LM_PRELOAD = ("torch._dynamo", "transformers", "transformers.models.auto.modeling_auto", "rlnb.components.lm")

_was_enabled = gc.isenabled()
gc.disable()
try:
    for _name in LM_PRELOAD:
        importlib.import_module(_name)
finally:
    gc.freeze()
    if _was_enabled:
        gc.enable()
