"""The evaluation protocols (what a sample is drawn with: k, temperature, top_p, max tokens, the instruction) and
the seed of every sample.

``PROTOCOLS`` holds the named protocols ``stare eval --protocol`` offers, ``resolve_protocol`` applies the
command line's overrides and refuses what no backend can run. Seeds: sample j of the problem at position i draws
from ``problem_seed(seed, i, k) + j``, so no two samples of a run share one and a redone problem draws the same
samples; a tool loop's later turns draw from ``turn_seed``. Standard library only.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class Protocol:
    name: str
    k: int
    temperature: float
    top_p: float
    max_tokens: int
    instruction: str = BOXED_INSTRUCTION


PROTOCOLS = {
    # the paper's: avg@32, temperature 1.0, top_p 0.7, short chain of thought
    "stare": Protocol("stare", 32, 1.0, 0.7, 3072),
    # DAPO's sampling (its own prompt asks for an "Answer:" line; here answers are boxed like the others)
    "dapo": Protocol("dapo", 32, 1.0, 0.7, 20480),
    # DeepSeek-R1's: temperature 0.6, top_p 0.95, long responses
    "r1": Protocol("r1", 64, 0.6, 0.95, 32768),
}


# vLLM 0.29.0 (vllm/sampling_params.py, SamplingParams.__post_init__): a temperature in (0, 1e-2) is raised to
# 1e-2, then one below _SAMPLING_EPS = 1e-5 (so only 0) means greedy decoding, and _verify_greedy_sampling refuses
# n > 1 for it; _verify_args refuses a temperature outside [0, 2]. transformers' generate refuses
# num_return_sequences > 1 without sampling. Both backends follow vLLM's rules.
MAX_TEMPERATURE = 2.0


def is_greedy(proto: Protocol) -> bool:
    """Greedy decoding (one answer per prompt): temperature 0, as vLLM decides it (any temperature > 0 samples)."""
    return proto.temperature == 0


def resolve_protocol(name: str, **overrides) -> Protocol:
    if name not in PROTOCOLS:
        raise ValueError(f"unknown protocol {name!r}; valid protocols: {', '.join(PROTOCOLS)}")
    chosen = {k: v for k, v in overrides.items() if v is not None}
    proto = replace(PROTOCOLS[name], **chosen)
    if proto.k < 1:
        raise ValueError(f"--k must be >= 1, got {proto.k}")
    if not 0 < proto.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {proto.top_p}")
    if not (math.isfinite(proto.temperature) and 0 <= proto.temperature <= MAX_TEMPERATURE):
        raise ValueError(f"--temperature must be in [0, {MAX_TEMPERATURE:g}], got {proto.temperature}")
    if is_greedy(proto) and proto.k > 1:
        raise ValueError(f"--temperature {proto.temperature} is greedy decoding, which gives one sample per "
                         f"problem, but --k is {proto.k}: use --k 1 (or a temperature > 0)")
    if proto.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {proto.max_tokens}")
    return proto


SEED_BLOCK = 2**32  # the sample seeds of one run lie in one block of this size


def problem_seed(seed: int, index: int, k: int) -> int:
    """The seed of sample 0 of the problem at position ``index`` (of the bench's problem list); its sample j draws
    from ``problem_seed(seed, index, k) + j``.

    vLLM 0.29.0 turns a request's seed into per-sample seeds ``seed + j`` for its n samples
    (vllm/v1/engine/parallel_sampling.py, ``ParentRequest._get_child_sampling_params``; with n = 1 the request's
    seed is used as it is, vllm/v1/engine/llm_engine.py ``add_request``). With ``index * k`` as the offset of a
    problem, sample j of problem i gets offset ``i * k + j``: each of [0, n_problems * k) exactly once, so no two
    samples of a run share a seed, whatever k. ``--seed`` picks the block ``(seed mod 2**31) * 2**32``: different
    seeds below 2**31 never overlap, and every seed is below 2**63 (torch generators take up to 2**64 - 1). The
    HF backend draws a problem's k samples together from one generator seeded with the same value (sample 0's
    seed), so no two problems share a generator there either. Depends only on (seed, index, k): ``--resume`` and
    a re-run redo a problem with the same seeds.
    """
    if index < 0 or k < 1 or (index + 1) * k > SEED_BLOCK:
        raise ValueError(f"problem index {index} with k {k} is outside one run's {SEED_BLOCK} sample seeds")
    return (seed % 2**31) * SEED_BLOCK + index * k


def turn_seed(sample_seed: int, turn: int) -> int:
    """The seed of tool-loop turn ``turn`` of the sample seeded ``sample_seed``: the sample's own seed for turn 0,
    then a 63-bit hash of (sample seed, turn) with bit 63 set, so a later turn never takes a sample's seed
    (those are below 2**63); two later turns share one with chance about 2**-63 per pair."""
    if turn == 0:
        return sample_seed
    digest = hashlib.blake2b(f"{sample_seed}/{turn}".encode(), digest_size=8).digest()
    return (1 << 63) | (int.from_bytes(digest, "big") >> 1)
