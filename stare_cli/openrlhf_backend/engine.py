"""The rollout engine's half of seeded rollouts (``rollouts``): OpenRLHF's vLLM engine actor with one more method,
``generate_seeded_responses``, which generates a prompt's group with a seed of its own for every sample.

The pinned OpenRLHF's ``RolloutRayActor.generate_responses`` (openrlhf/trainer/ray/vllm_engine.py) runs a prompt's n
samples as n vLLM requests, each with a copy of the one ``SamplingParams`` it was sent, so a seed put into those
params would give all n samples the same tokens. ``generate_seeded_responses`` is sent the group's seed and gives
sample i the seed ``seeds.sample_seed(seed, i)`` (``seed + i``: vLLM's own rule for the n samples of one request with
``n=n, seed=seed``). It then runs OpenRLHF's own ``generate_responses`` once per
sample, all at once, as that method runs its samples itself, and marks every response with the prompt's draw index
(``DRAW_KEY``), by which the trainer puts the step's groups in draw order. ``generate_responses`` itself is OpenRLHF's,
unchanged: with the ``seeded_rollouts`` setting off nothing calls the new method.

This module imports OpenRLHF's engine module only (no trainer, no DeepSpeed): Ray imports it in the engine's process
to build the actor, where OpenRLHF keeps its trainer out.
"""
from __future__ import annotations

import asyncio
import copy

from . import compat
from .seeds import sample_seed

DRAW_KEY = "stare_draw"  # added to every response dict: the prompt's draw index in its step (rollouts)


def with_seed(sampling_params, seed: int):
    """A copy of ``sampling_params`` with ``seed``; the original is left as it was. vLLM's ``SamplingParams`` caches
    its ``sampling_type`` (random or seeded) on first use, so a cached value is dropped from the copy."""
    params = copy.deepcopy(sampling_params)
    getattr(params, "__dict__", {}).pop("sampling_type", None)
    params.seed = seed
    return params


_BaseRolloutActor = compat.vllm_engine.RolloutRayActor.__ray_actor_class__  # the class behind OpenRLHF's actor


class StareRolloutActor(_BaseRolloutActor):
    """OpenRLHF's vLLM engine actor (the class behind ``RolloutRayActor``) with ``generate_seeded_responses``."""

    async def generate_seeded_responses(self, *, draw: int, seed: int, sampling_params, num_samples: int = 1,
                                        **kwargs) -> list[dict]:
        """OpenRLHF's ``generate_responses`` for one prompt's ``num_samples`` samples (the same keyword arguments),
        sample i with ``sampling_params`` seeded ``sample_seed(seed, i)``; the responses in sample order, each with
        ``DRAW_KEY`` set to ``draw``."""
        generate = super().generate_responses
        groups = await asyncio.gather(*[generate(sampling_params=with_seed(sampling_params, sample_seed(seed, i)),
                                                 num_samples=1, **kwargs) for i in range(num_samples)])
        responses = [response for group in groups for response in group]
        for response in responses:
            response[DRAW_KEY] = draw
        return responses
