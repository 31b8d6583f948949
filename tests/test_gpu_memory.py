"""The GPU memory plan (stare.cli.gpu_memory) against independent computations.

- the shapes: every shipped model's parameter count and KV width against the model transformers builds from the
  same config on the meta device (no memory), and against the model cards' published sizes;
- every term, for every shipped GPU preset, against the arithmetic written out by hand from the preset's YAML and
  the model's published shapes;
- the logits and entropy terms against the peak memory of OpenRLHF's own lines, measured on CPU at a small scale;
- what the plan claims: the micro-batch it suggests fits and the next one does not; the shipped presets fit with
  their arms; what does not fit is refused in one line, before anything starts.
(The KV cache term against the real vLLM engine's own capacity is in tests/test_vllm_cpu.py.)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stare.cli import gpu_memory as gm
from stare.cli.main import app
from stare.cli.presets import preset_names, resolve

GIB = 2 ** 30
GPU_PRESETS = [n for n in preset_names() if resolve(n, "grpo")["backend"] == "openrlhf"]


@pytest.fixture(autouse=True)
def offline_hub(tmp_path, monkeypatch):
    """An empty hub cache: every plan here reads the shipped shapes, as a dry run offline would."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


# ---- shapes -----------------------------------------------------------------------------------------------------

# the model cards' "Model size" (the Hub's count of the safetensors' parameters), in billions, 3 significant digits
PUBLISHED_B = {"Qwen/Qwen2.5-Math-1.5B": 1.54, "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": 1.78,
               "Qwen/Qwen2.5-Math-7B": 7.62, "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B": 7.62, "Qwen/Qwen2.5-7B": 7.62,
               "Qwen/Qwen2.5-14B-Instruct": 14.8, "Qwen/Qwen2.5-32B": 32.8, "Qwen/Qwen3-8B-Base": 8.19}


@pytest.mark.parametrize("model", sorted(gm.shipped_shapes()))
def test_shapes_match_the_model_transformers_builds(model):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(gm.shipped_shapes()[model])
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(config)
    shapes = gm.load_shapes(model)
    assert shapes.source.startswith("shipped")
    assert shapes.params() == sum(p.numel() for p in built.parameters())  # tied weights counted once
    assert round(shapes.params() / 1e9, 2 if shapes.params() < 1e10 else 1) == PUBLISHED_B[model]
    k_proj = built.model.layers[0].self_attn.k_proj
    assert shapes.kv_bytes_per_token(1) == 2 * len(built.model.layers) * k_proj.out_features * 2  # K and V, bf16


def test_every_shipped_gpu_preset_has_shapes_offline():
    for name in GPU_PRESETS:
        model = resolve(name, "grpo")["settings"]["model"]
        assert model in gm.shipped_shapes(), name


# ---- every term by hand -----------------------------------------------------------------------------------------

# per preset, from its YAML and the model's card: parameters P, actor GPUs N, micro-batch tokens T (the packing
# budget), vocabulary V, layers L, hidden h, q width (heads x head dim), KV width (KV heads x head dim),
# intermediate I, rollout tensor parallelism, prompt + response
HAND = {
    "qwen-1.5b-1gpu": dict(P=1_543_714_304, N=1, T=16384, V=151936, L=28, h=1536, q=1536, kv=256, I=8960, tp=1,
                           seq=1024 + 3072),
    "qwen-1.5b-long-cot": dict(P=1_777_088_000, N=8, T=32768, V=151936, L=28, h=1536, q=1536, kv=256, I=8960, tp=1,
                               seq=1024 + 16384),
    "qwen-7b-short-cot": dict(P=7_615_616_512, N=8, T=16384, V=152064, L=28, h=3584, q=3584, kv=512, I=18944, tp=1,
                              seq=1024 + 3072),
    "qwen-7b-long-cot": dict(P=7_615_616_512, N=8, T=24576, V=152064, L=28, h=3584, q=3584, kv=512, I=18944, tp=1,
                             seq=2048 + 20480),
    "qwen-7b-tool-use": dict(P=7_615_616_512, N=8, T=16384, V=152064, L=28, h=3584, q=3584, kv=512, I=18944, tp=1,
                             seq=1024 + 8192),
    "qwen3-8b-long-cot": dict(P=8_190_735_360, N=8, T=20480, V=151936, L=36, h=4096, q=4096, kv=1024, I=12288, tp=1,
                              seq=1024 + 16384),
    "qwen-14b-short-cot": dict(P=14_770_033_664, N=8, T=12288, V=152064, L=48, h=5120, q=5120, kv=1024, I=13824,
                               tp=2, seq=1024 + 3072),
    "qwen-32b-short-cot": dict(P=32_763_876_352, N=32, T=8192, V=152064, L=64, h=5120, q=5120, kv=1024, I=27648,
                               tp=4, seq=1024 + 3072),
}


def test_the_hand_table_covers_every_gpu_preset():
    assert sorted(HAND) == sorted(GPU_PRESETS)


@pytest.mark.parametrize("name", sorted(HAND))
def test_every_term_by_hand(name):
    x = HAND[name]
    r = resolve(name, "grpo")
    s = r["settings"]
    plan = gm.plan_memory(s, r["algo"], eval_tp_=2, eval_response_tokens=3072)
    train, rollout, ev = (p.to_json() for p in plan.phases)
    P, N, T, V = x["P"], x["N"], x["T"], x["V"]
    layer_bytes = (4 * x["h"] + 2 * x["q"] + 2 * x["kv"] + 4 * x["I"]) * 2 * 2  # bf16, forward and gradient
    want = {"weights (bf16)": 2 * P / N, "gradients (bf16)": 2 * P / N,
            "optimizer (fp32 weights, Adam m and v)": 12 * P / N,
            "activation checkpoints": T * x["L"] * x["h"] * 2,
            "one layer's activations with gradients": T * layer_bytes,
            "logits (fp32, with gradients)": T * V * (4 + 4 + 2),
            "vLLM asleep (context, CUDA graphs)": GIB, "CUDA context": GIB}
    for term, value in want.items():
        assert train["terms_gib"][term] == pytest.approx(value / GIB, abs=0.006), term
    # ZeRO-3 gathers the largest module twice: here always the embedding (V x h) or the lm_head, bf16
    assert train["terms_gib"]["ZeRO-3 gathered modules"] == pytest.approx(2 * 2 * V * x["h"] / GIB, abs=0.006)
    # rollout: vLLM's share of the card, the sleeping actor's bf16 shard and context beside it; the KV cache of one
    # sequence at the rollout's tensor parallelism: K and V of every layer, the rank's share of the KV heads, bf16
    assert rollout["terms_gib"]["vLLM's share (0.6 of the card)"] == pytest.approx(0.6 * 80, abs=0.006)
    assert rollout["terms_gib"]["actor asleep (bf16 weight shard, context)"] == pytest.approx(
        (2 * P / N + GIB) / GIB, abs=0.006)
    assert rollout["kv_cache"]["max_model_len"] == x["seq"]
    assert rollout["kv_cache"]["one_sequence_gib"] == pytest.approx(
        2 * x["L"] * (x["kv"] // x["tp"]) * 2 * x["seq"] / GIB, abs=0.006)
    # vLLM's KV cache: its share less weights (2P / tp), its profiling run and a context (graphs off: eager)
    q_kv = x["q"] + 2 * x["kv"]
    profile = 16384 * (2 * x["h"] + max(q_kv, 3 * x["I"]) // x["tp"]) * 2 + 2 * 1024 * V * 4
    assert rollout["kv_cache"]["available_gib"] == pytest.approx(
        (0.6 * 80 * GIB - 2 * P // x["tp"] - profile - GIB) / GIB, abs=0.006)
    # stare eval at tp 2: vLLM's default share 0.92, CUDA graphs on, one sequence of the model's own context
    context = gm.shipped_shapes()[s["model"]]["max_position_embeddings"]
    assert ev["kv_cache"]["one_sequence_gib"] == pytest.approx(2 * x["L"] * (x["kv"] // 2) * 2 * context / GIB,
                                                               abs=0.006)


def test_the_entropy_bonus_adds_its_gradient_and_two_chunks():
    r = resolve("qwen-7b-short-cot", "entropy-adaptive")
    train = gm.plan_memory(r["settings"], r["algo"]).phases[0]
    T, V = 16384, 152064
    assert train.terms["entropy bonus"] == T * V * 6 + 2 * 1024 * V * 4
    assert "entropy bonus" not in gm.plan_memory(r["settings"], resolve("qwen-7b-short-cot", "grpo")["algo"]
                                                 ).phases[0].terms


def test_zero_stages_shard_what_they_shard():
    r = resolve("qwen-7b-short-cot", "grpo")
    P, N = 7_615_616_512, 8
    got = {}
    for stage in (0, 1, 2, 3):
        terms = gm.plan_memory({**r["settings"], "zero_stage": stage}, r["algo"]).phases[0].terms
        got[stage] = (terms["weights (bf16)"], terms["gradients (bf16)"],
                      terms["optimizer (fp32 weights, Adam m and v)"], "ZeRO-3 gathered modules" in terms)
    assert got[0] == (2 * P, 2 * P, 12 * P, False)
    assert got[1] == (2 * P, 2 * P, 12 * P // N, False)
    assert got[2] == (2 * P, 2 * P // N, 12 * P // N, False)
    assert got[3] == (2 * P // N, 2 * P // N, 12 * P // N, True)


# ---- the logits and the entropy bonus, measured on CPU ----------------------------------------------------------

PEAK = r"""
import sys, torch
mode, T, V = sys.argv[1], 8192, 8192
torch.set_num_threads(1)  # one allocator arena: the peak is the tensors, not per-thread heaps
if mode == "fallback":  # OpenRLHF's own log_probs_from_logits (importing it takes DeepSpeed: 15 s)
    sys.path.insert(0, sys.argv[2])
    import openrlhf_standins
    openrlhf_standins.install()
    import openrlhf.models.utils as U

class FusedLogProb(torch.autograd.Function):
    # the contract of flash-attn's cross_entropy_loss, which OpenRLHF's log_probs_from_logits calls on a GPU: the
    # forward keeps the float32 logits and one logsumexp per row, the backward writes one float32 gradient
    @staticmethod
    def forward(ctx, logits, labels):
        lse = torch.cat([torch.logsumexp(c, -1) for c in logits.split(256)])
        ctx.save_for_backward(logits, lse, labels)
        return logits.gather(-1, labels[:, None])[:, 0] - lse

    @staticmethod
    def backward(ctx, g):
        logits, lse, labels = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for rows in range(0, len(logits), 256):
            sl = slice(rows, rows + 256)
            torch.exp(logits[sl] - lse[sl, None], out=grad[sl])
        grad.mul_(-g[:, None])
        grad.scatter_add_(-1, labels[:, None], g[:, None])
        return grad, None

torch.manual_seed(0)
# the lm_head's bf16 logits, as a leaf made before the baseline (its 2 B per entry are not counted below, and its
# gradient, the bf16 copy of the float32 one, is): no matmul, whose CPU scratch a GPU does not have
z = torch.empty(T, V, dtype=torch.bfloat16).normal_().requires_grad_()  # in place: no float32 temporary
labels = torch.randint(0, V, (T,))
def status(key):  # kB in /proc/self/status
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key + ":"))
open("/proc/self/clear_refs", "w").write("5")  # resets the peak (VmHWM) to what is resident now
base = status("VmRSS")
output = {"logits": z.to(torch.float32)}                      # OpenRLHF's Actor.forward casts to float32
if mode != "forward":
    log_probs = FusedLogProb.apply(output["logits"], labels) if mode.startswith("fused") else \
        U.log_probs_from_logits(output["logits"], labels)
    loss = -log_probs.mean()
    if mode.endswith("+bonus"):
        from stare.algorithms.entropy_bonus import chunked_entropy
        loss = loss - 0.01 * chunked_entropy(output["logits"]).mean()
    loss.backward()
peak = status("VmHWM")
print((peak - base) / (T * V))
"""


def _peak_bytes_per_entry(*modes: str) -> list[float]:
    """Each mode's peak in a fresh process (a process's peak RSS only grows), all at once."""
    # glibc hands every block above 64 KiB to mmap and back on free: the resident peak is then the live tensors'
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    procs = [subprocess.Popen([sys.executable, "-c", PEAK, mode, str(Path(__file__).parent)], text=True, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for mode in modes]
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        out.append(float(stdout.strip().splitlines()[-1]))
    return out


def test_logits_and_entropy_terms_against_peak_memory_on_cpu():
    """Peak memory of OpenRLHF's logit lines on an 8192 x 8192 micro-batch (256 MiB per float32 copy), per token and
    vocabulary entry: the forward's bf16 + float32 logits (6 B), the backward through a kernel with flash-attn's
    contract (the plan's 10 B), and the chunked entropy bonus on top (the plan's 6 B, its chunks being 1024 rows)."""
    forward, fused, bonus, fallback = _peak_bytes_per_entry("forward", "fused", "fused+bonus", "fallback")
    assert forward == pytest.approx(4, abs=0.3)  # the float32 copy (the bf16 logits are the baseline's)
    assert fused == pytest.approx(gm.LOGIT_BYTES, abs=0.3)
    # the plan's term per entry: the bonus's gradient and the sum autograd makes of the two gradients (4 + 4 - the
    # bf16 copy made after them, 2), and at most two float32 chunks of 1024 rows (gone at the peak: an overcount)
    chunks = gm.ENTROPY_CHUNK_COPIES * gm.ENTROPY_CHUNK_ROWS * 4 / 8192
    assert gm.ENTROPY_BYTES - 0.2 <= bonus - fused <= gm.ENTROPY_BYTES + chunks + 0.2
    # without flash-attn (OpenRLHF's gather + logsumexp fallback, the CPU runs) the log-probs cost more: the plan
    # counts the GPU image's kernel, and says so
    assert fallback > gm.LOGIT_BYTES + 2


# ---- what the plan claims ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(HAND))
def test_shipped_presets_fit_80gb_with_their_arms(name):
    r = resolve(name, "grpo")
    for arm in r["settings"]["algos"].split(","):
        ra = resolve(name, arm)
        plan = gm.plan_memory(ra["settings"], ra["algo"])
        assert not plan.problems(), (name, arm, plan.problems())


def test_the_suggested_micro_batch_fits_and_the_next_does_not():
    r = resolve("qwen-7b-short-cot", "entropy-adaptive")
    s = {**r["settings"], "gpu_memory_gib": 60.0}
    plan = gm.plan_memory(s, r["algo"])
    assert plan.problems() and plan.fit.startswith("max_tokens_per_gpu 16384 -> ")
    value = int(plan.fit.split("-> ")[1])
    assert value % 1024 == 0
    ok = gm.plan_memory({**s, "max_tokens_per_gpu": value}, r["algo"]).phases[0]
    over = gm.plan_memory({**s, "max_tokens_per_gpu": value + 1024}, r["algo"]).phases[0]
    assert ok.total <= 0.9 * 60 * GIB < over.total


def test_eval_tp_is_the_smallest_that_holds_the_model_and_its_context():
    big = gm.load_shapes("Qwen/Qwen2.5-32B")
    # tp 1: 61 GiB of weights leave too little of 0.92 x 80 GiB for one 131072-token sequence (32 GiB of KV)
    assert not gm.eval_fits(big, 1, 80 * GIB) and gm.eval_fits(big, 2, 80 * GIB)
    assert gm.eval_tp(big, 80 * GIB, 1, 8) == 2
    assert gm.eval_tp(big, 141 * GIB, 1, 8) == 1  # an H200 holds it whole
    assert gm.eval_tp(gm.load_shapes("Qwen/Qwen2.5-Math-7B"), 80 * GIB, 1, 8) == 1


def test_a_local_config_json_and_the_hub_cache_come_before_the_shipped_shapes(tmp_path, monkeypatch):
    cfg = {**gm.shipped_shapes()["Qwen/Qwen2.5-Math-7B"], "vocab_size": 1000}
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    assert gm.load_shapes(str(folder)).vocab == 1000
    snap = tmp_path / "cache" / "models--Qwen--Qwen2.5-Math-7B"
    (snap / "snapshots" / "abc").mkdir(parents=True)
    (snap / "refs").mkdir()
    (snap / "refs" / "main").write_text("abc")
    (snap / "snapshots" / "abc" / "config.json").write_text(json.dumps({**cfg, "vocab_size": 2000}))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    got = gm.load_shapes("Qwen/Qwen2.5-Math-7B")
    assert got.vocab == 2000 and got.source.endswith("abc/config.json")
    assert gm.load_shapes("someone/unknown-model") is None


# ---- the CLI: shown in every dry run, refused in one line -------------------------------------------------------

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, list(args), terminal_width=200)


def test_a_24gib_card_is_refused_in_one_line_naming_the_term(tmp_path):
    res = invoke("train", "--preset", "qwen-7b-short-cot", "--set", "gpu_memory_gib=24", "--dry-run",
                 "--out", str(tmp_path / "r"))
    assert res.exit_code == 2
    plan = json.loads(res.stdout)["memory"]  # the dry run still prints the plan it refuses
    assert plan["verdict"] == "does not fit"
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: this layout does not fit the GPU: train: ")
    assert "of 24.0 GiB (gpu_memory_gib)" in lines[0] and "logits" in lines[0] and "23.2 GiB" in lines[0]
    assert not (tmp_path / "r").exists()
    res = invoke("train", "--preset", "qwen-7b-short-cot", "--set", "gpu_memory_gib=24", "--set",
                 "memory_check=warn", "--dry-run", "--out", str(tmp_path / "r"))
    assert res.exit_code == 0
    assert any(n.startswith("memory: train: ") and "launching anyway" in n for n in json.loads(res.stdout)["notes"])


def test_the_long_cot_entropy_bonus_is_refused_with_what_would_fit(tmp_path):
    res = invoke("train", "--preset", "qwen-7b-long-cot", "--algo", "entropy-adaptive", "--dry-run",
                 "--out", str(tmp_path / "r"))
    assert res.exit_code == 2
    memory = json.loads(res.stdout)["memory"]
    assert "entropy bonus" in memory["phases"]["train"]["terms_gib"]
    # OpenRLHF's packing budget holds at least one whole prompt and response: nothing below 22528 tokens
    assert "not even a micro-batch of one full sequence (22528 tokens) fits" in res.stderr
    res = invoke("train", "--preset", "qwen-1.5b-long-cot", "--algo", "entropy-adaptive", "--dry-run",
                 "--out", str(tmp_path / "r"))
    assert res.exit_code == 2 and "lower max_tokens_per_gpu 32768 -> " in res.stderr
    assert invoke("train", "--preset", "qwen-7b-long-cot", "--algo", "grpo", "--dry-run",
                  "--out", str(tmp_path / "r")).exit_code == 0


def test_stare_run_evaluates_the_32b_model_at_tp_2_and_refuses_tp_1(tmp_path):
    res = invoke("run", "--preset", "qwen-32b-short-cot", "--dry-run", "--out", str(tmp_path / "r"))
    assert res.exit_code == 0, res.stderr
    layout = json.loads(res.stdout)["eval_layout"]
    assert (layout["tp"], layout["engines"]) == (2, 4)
    assert layout["memory"]["kv_cache"]["full_sequences"] >= 1
    res = invoke("run", "--preset", "qwen-32b-short-cot", "--dry-run", "--tp", "1", "--out", str(tmp_path / "r"))
    assert res.exit_code == 2
    assert "eval: vLLM's KV cache has" in res.stderr and "--tp" in res.stderr


def test_stare_eval_engines_auto_sizes_tp_from_the_model_config(tmp_path, monkeypatch):
    """``stare eval --engines auto`` on a folder with a config.json: tp from the memory plan (weights and one
    sequence of the model's context within vLLM's share), here 2 for the 32B model on 80 GiB cards, 1 on 141 GiB."""
    from types import SimpleNamespace

    import torch

    from stare.cli.eval_plan import auto_layout

    folder = tmp_path / "m"
    folder.mkdir()
    cfg = gm.shipped_shapes()["Qwen/Qwen2.5-32B"]
    (folder / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    console = SimpleNamespace(print=lambda text, **kw: None)
    plan = SimpleNamespace(ray_address=None, tp=1, backend="vllm", model=str(folder))
    for card_gib, want in ((80, (4, 2)), (141, (8, 1))):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=card_gib << 30))
        assert auto_layout(plan, console) == want


def test_stare_run_refuses_an_evaluation_shorter_than_the_training(tmp_path):
    """Issue 58's first item: an evaluation whose responses stop before the training's would score every longer
    answer wrong. The long chain-of-thought presets evaluate with DAPO's 20480-token protocol; the paper's 3k one, or
    a --max-tokens below max_response_len, is refused in one line naming both numbers."""
    for preset, trained in (("qwen-7b-long-cot", 20480), ("qwen-1.5b-long-cot", 16384), ("qwen3-8b-long-cot", 16384)):
        res = invoke("run", "--preset", preset, "--dry-run", "--out", str(tmp_path / preset))
        assert res.exit_code == 0, res.stderr
        evals = [s for s in json.loads(res.stdout)["steps"] if s["step"] == "eval"]
        assert evals and all(s["command"][s["command"].index("--protocol") + 1] == "dapo" for s in evals)
        res = invoke("run", "--preset", preset, "--dry-run", "--set", "eval_protocol=stare", "--out", str(tmp_path))
        assert res.exit_code == 2 and res.stdout == ""
        assert f"stops responses at 3072 tokens" in res.stderr and f"up to {trained} (max_response_len)" in res.stderr
    res = invoke("run", "--preset", "qwen-7b-short-cot", "--dry-run", "--max-tokens", "3071", "--out", str(tmp_path))
    assert res.exit_code == 2 and "(--max-tokens)" in res.stderr
    assert invoke("run", "--preset", "qwen-7b-short-cot", "--dry-run", "--max-tokens", "3072",
                  "--out", str(tmp_path / "ok")).exit_code == 0
