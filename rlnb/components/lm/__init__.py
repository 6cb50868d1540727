"""LM RL components: the rollouts (HF ``transformers`` and vLLM), the reward worker and the LM actor.

One module a job, each mode readable in one place:

- :mod:`.layout`: the batch layout every phase reads, and the helpers that cut, pad and join batches.
- :mod:`.rollout`: :class:`LMRollout`, what every LM rollout does whatever its engine; with
  :mod:`.multi_turn` (an interaction answering between the model's turns) and :mod:`.dynamic_sampling` (DAPO).
- :mod:`.hf`: :class:`HFRollout`, a ``transformers`` model sampled by :mod:`.decoding` (``generate`` or
  rlnb's decoding loop), synchronous or in chunks across weight updates (:mod:`.streaming`, asynchronous mode).
- :mod:`.vllm`: :class:`VLLMRollout`, a vLLM engine (synchronous).
- :mod:`.reward`: :class:`RewardWorker`.
- :mod:`.actor`: :class:`LMActor`, its log-prob computation in :mod:`.forward` and its warm start in :mod:`.sft`.
"""

from rlnb.components.lm.actor import LMActor
from rlnb.components.lm.decoding import DROP_ENDED_SHARE, STATIC_PROMPT_MULTIPLE
from rlnb.components.lm.forward import CPU_LENGTH_BUCKETS, GPU_MIN_SHARED_FRACTION
from rlnb.components.lm.hf import HFRollout
from rlnb.components.lm.reward import RewardWorker
from rlnb.components.lm.rollout import LMRollout
from rlnb.components.lm.vllm import VLLMRollout, VLLMWorkerExtension
from rlnb.models.lm import check_dtype

__all__ = [
    "CPU_LENGTH_BUCKETS",
    "DROP_ENDED_SHARE",
    "GPU_MIN_SHARED_FRACTION",
    "STATIC_PROMPT_MULTIPLE",
    "HFRollout",
    "LMActor",
    "LMRollout",
    "RewardWorker",
    "VLLMRollout",
    "VLLMWorkerExtension",
    "check_dtype",
]
