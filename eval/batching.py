"""How ``stare eval`` hands problems to its engine (``--batching``), and what each mode promises about the samples.

Every sample has its own seed (``stare.eval.protocols.problem_seed``) in every mode, so a sample's randomness never
depends on which engine drew it or when. What can still move a sample is the engine's arithmetic: a GPU kernel may
add the same numbers in another order when the batch around a request is larger or smaller (cuBLAS picks its tiling
and split of the reduction from the batch shape), and a token whose two likeliest choices are within that rounding
of each other can flip, after which the rest of that sample differs. The modes trade that against speed:

- ``all`` (default): every problem not yet done is in flight at once (each engine schedules them as it can), and
  each problem is written as soon as its k samples are done. The engine's own speed. An uninterrupted run on one
  machine and the same run resumed, or dealt among another number of engines, draw every sample from the same seed;
  where the engine's arithmetic does not depend on the batch (measured: the vLLM CPU engine in float32, see
  docs/evaluation.md) they are the same samples bit for bit; on GPUs a resumed or re-dealt run may differ in a few
  samples from the first token that fell within rounding on: another draw of the same distribution.
- ``invariant``: as ``all``, with vLLM's batch-invariant kernels (``VLLM_BATCH_INVARIANT=1``; CUDA GPUs, vLLM only):
  a sample no longer depends on what else is in the batch, so the samples are the same bit for bit across
  ``--resume`` and ``--engines`` on the same GPU model, drivers and versions. Slower than ``all``.
- ``problem``: one problem at a time per engine (its k samples as one request): a sample's batch holds only its own
  problem, so the samples are the same bit for bit across ``--resume`` and ``--engines`` on any device. The slowest;
  what ``stare eval`` did before ``--batching`` existed, so a folder written then resumes with it.

``eval_settings.json`` records the mode, and ``--resume`` refuses another one. Standard library only.
"""
from __future__ import annotations

BATCHING = {
    "all": "every remaining problem in flight at once, each written as it completes (the engine's speed); the same "
           "seeds, bit-exact across --resume and --engines only where the engine's arithmetic ignores the batch "
           "(the vLLM CPU engine), not on GPUs",
    "invariant": "as all, with vLLM's batch-invariant kernels (VLLM_BATCH_INVARIANT=1; vLLM on CUDA GPUs): "
                 "bit-exact across --resume and --engines, slower than all",
    "problem": "one problem at a time per engine: bit-exact across --resume and --engines on any device; the "
               "slowest (what folders written before --batching used)",
}
DEFAULT_BATCHING = "all"
LEGACY_BATCHING = "problem"  # what an eval folder whose record names no batching was drawn with
INVARIANT_ENV = "VLLM_BATCH_INVARIANT"  # vLLM's switch for its batch-invariant kernels (read when vLLM starts)


def check_batching(batching: str, backend: str | None = None) -> None:
    """``ValueError`` (one line) when ``batching`` is not a mode, or is ``invariant`` on a backend other than vLLM."""
    if batching not in BATCHING:
        raise ValueError(f"--batching {batching!r}: unknown mode; valid modes: {', '.join(BATCHING)}")
    if batching == "invariant" and backend is not None and backend != "vllm":
        raise ValueError(f"--batching invariant is vLLM's batch-invariant mode, and the backend is {backend}; use "
                         f"--backend vllm, or --batching all or problem")


def help_text() -> str:
    """The modes for ``--help``: each name with its promise."""
    return "; ".join(f"{name}: {text}" for name, text in BATCHING.items())
