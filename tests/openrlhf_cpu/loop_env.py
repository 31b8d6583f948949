"""How one `stare train` runs through OpenRLHF's real loop on CPU: the environment of its processes and the shared
CPU sizing, and the reading of its TensorBoard log. Used by tests/test_openrlhf_e2e.py and
benchmarks/bench_openrlhf_loop.py (no pytest; TensorBoard is imported only to read a log)."""
from __future__ import annotations

import json
import os
from pathlib import Path

PATCH_DIR = Path(__file__).resolve().parent
TESTS = PATCH_DIR.parent
PRESET = "qwen-7b-short-cot"
# what vLLM's CPU build and the CPU run need (no flash-attn, no NCCL); no CUDA graphs is the setting
# vllm_enforce_eager in SIZING (its --vllm.enforce_eager comes from stare train's argv, once)
CPU_FLAGS = "--ds.attn_implementation sdpa --vllm.sync_backend gloo"

# The shared sizing: 3 problems x 8 samples per step, 16 new tokens. One DeepSpeed optimizer step per group of 8
# (train_batch_size = samples_per_prompt), so dynamic filtering never leaves half an accumulation window. With 8
# samples of a model that answers right one time in three, a group is all-equal (and filtered out) with
# probability (1/3)^8 + (2/3)^8 = 4%, all three at once 6e-5: a step always trains.
SIZING = ["colocate=false", "packing=false", "apply_chat_template=false", "gpus_per_node=1", "vllm_engines=1",
          "samples_per_prompt=8", "prompts_per_step=3", "train_batch_size=8", "micro_batch_size=8",
          "rollout_micro_batch_size=8", "max_prompt_len=64", "max_response_len=16", "save_steps=1",
          "max_checkpoints=2", "episodes=2", "vllm_enforce_eager=true"]


def loop_env(env_dir: Path, *, gpus: int, ray_tmpdir: str, patch_log: Path, positions: Path | None = None,
             extra_flags: str = "", environ: dict | None = None) -> dict:
    """The environment of a `stare train` subprocess through the real loop: the CPU patches at every process's
    start-up (tests/openrlhf_cpu/sitecustomize.py), ``gpus`` logical GPUs for Ray, a Ray temp folder of its own, and
    the vLLM CPU environment ``env_dir``'s DeepSpeed ops and OpenMP."""
    env = {k: v for k, v in (os.environ if environ is None else environ).items()
           if not k.startswith(("STARE_E2E_", "RAY_"))}
    iomp = Path(env_dir) / "lib" / "libiomp5.so"
    env.update(
        PYTHONPATH=os.pathsep.join([str(PATCH_DIR), str(TESTS)]),
        STARE_E2E_CPU_PATCHES="1",
        STARE_E2E_PATCH_LOG=str(patch_log),
        STARE_E2E_EXTRA_ARGS=f"{CPU_FLAGS} {extra_flags}".strip(),
        RAY_OVERRIDE_RESOURCES=json.dumps({"GPU": gpus, "CPU": 8}),
        RAY_TMPDIR=ray_tmpdir,
        DS_ACCELERATOR="cpu",
        TORCH_EXTENSIONS_DIR=str(Path(env_dir) / "torch_extensions"),  # DeepSpeed's CPU ops, built by the env script
        VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_CI_ENV="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
    )
    if positions is not None:
        env["STARE_E2E_POSITIONS"] = str(positions)
    if iomp.exists():  # vLLM's CPU build wants Intel's OpenMP first
        env["LD_PRELOAD"] = " ".join(p for p in (str(iomp), env.get("LD_PRELOAD", "")) if p)
    return env


def event_files(out: Path) -> list[Path]:
    """The run's TensorBoard event files, oldest first."""
    return sorted((Path(out) / "tensorboard").rglob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime)


def scalars(out: Path) -> dict[str, dict[int, float]]:
    """Every TensorBoard scalar of a run: tag -> {step: value} (later event files win)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags: dict[str, dict[int, float]] = {}
    for f in event_files(out):
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            for event in acc.Scalars(tag):
                tags.setdefault(tag, {})[event.step] = event.value
    return tags
