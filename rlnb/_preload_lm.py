"""Imported by the workers' fork server after :mod:`rlnb._preload` when it is started for LM work (``rlnb run``
of a recipe whose ``rollout.backend`` is ``hf`` or ``vllm``, or ``rlnb.warm_up(lm=True)``): what building a
``transformers`` model imports, ``torch._dynamo`` among it (~1 s here), imported once there rather than in
every worker."""

from rlnb._dask import import_with_collector_paused

LM_PRELOAD = ("torch._dynamo", "transformers", "transformers.models.auto.modeling_auto", "rlnb.components.lm")

import_with_collector_paused(LM_PRELOAD, freeze=True)
