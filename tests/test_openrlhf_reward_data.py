"""The reward file OpenRLHF loads (math-verify on the last boxed answer; never raises) and the prompt file."""
from __future__ import annotations

import importlib.util
import json
import threading

import pytest

from stare.cli.openrlhf_backend import launch as orl
from stare.cli.openrlhf_backend.data import normalise_row, prepare_prompts, strip_dapo_instruction

PROMPT = "<|im_start|>user\nWhat is 33?\nPlease reason step by step, and put your final answer within \\boxed{}.<|im_end|>\n<|im_start|>assistant\n"


def load_reward_module():
    """Exactly how the pinned OpenRLHF loads --reward.remote_url FILE.py (spec_from_file_location)."""
    spec = importlib.util.spec_from_file_location("reward_func", str(orl.REWARD_FILE))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def call(fn, responses, labels):
    queries = [PROMPT + r for r in responses]
    return fn(queries, [PROMPT] * len(responses), labels)


def test_reward_scores_real_answers():
    fn = load_reward_module().reward_func
    responses = ["so the answer is \\boxed{033}.", "\\boxed{34}", "no box here, 33", "\\boxed{\\frac12}",
                 "first \\boxed{1} then \\boxed{33}"]
    labels = ["33", "33", "33", "0.5", "33"]
    out = call(fn, responses, labels)
    assert out["rewards"].tolist() == [1.0, 0.0, 0.0, 1.0, 1.0]
    assert out["scores"].tolist() == out["rewards"].tolist()
    assert out["extra_logs"]["stare/reward_no_answer"].item() == pytest.approx(1 / 5)
    assert out["extra_logs"]["stare/reward_error"].item() == 0.0


def test_the_prompts_own_empty_box_never_counts():
    fn = load_reward_module().reward_func
    out = call(fn, ["I give up."], [""])  # an empty label must not match the prompt's \\boxed{}
    assert out["rewards"].tolist() == [0.0]


def test_a_crash_inside_the_checker_scores_zero_and_is_counted(monkeypatch):
    module = load_reward_module()

    def boom(*a, **k):
        raise RuntimeError("math-verify exploded")

    monkeypatch.setattr(module, "check_many", boom)
    out = call(module.reward_func, ["\\boxed{33}", "\\boxed{33}"], ["33", "33"])
    assert out["rewards"].tolist() == [0.0, 0.0]
    assert out["extra_logs"]["stare/reward_error"].item() == 1.0
    assert out["extra_logs"]["stare/reward_scoring_failed"].item() == 0.0


def test_a_checker_that_cannot_run_is_counted_apart_from_wrong_answers(tmp_path, monkeypatch):
    """Workers that cannot import math-verify: the batch scores 0 (never raised into the rollout) and the
    zeros are counted as scoring failures, not as wrong answers or generic errors."""
    from stare.eval.scoring import shutdown

    module = load_reward_module()
    (tmp_path / "math_verify.py").write_text("raise ImportError('math_verify is broken in this environment')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    shutdown()
    try:
        out = call(module.reward_func, ["\\boxed{33}", "\\boxed{34}", "no box"], ["33", "33", "33"])
    finally:
        monkeypatch.undo()
        shutdown()
    assert out["rewards"].tolist() == [0.0, 0.0, 0.0]
    logs = {k: v.item() for k, v in out["extra_logs"].items()}
    assert logs["stare/reward_scoring_failed"] == 1.0 and logs["stare/reward_error"] == 0.0
    assert logs["stare/reward_no_answer"] == pytest.approx(1 / 3)
    out = call(module.reward_func, ["\\boxed{33}", "\\boxed{34}"], ["33", "33"])  # fixed: real scores again
    assert out["rewards"].tolist() == [1.0, 0.0] and out["extra_logs"]["stare/reward_scoring_failed"].item() == 0.0


def test_a_pathological_answer_is_bounded_in_time(monkeypatch):
    import time

    monkeypatch.setenv("STARE_REWARD_TIMEOUT_S", "2")
    fn = load_reward_module().reward_func
    result = {}

    def run():  # OpenRLHF calls it from a worker thread (asyncio.to_thread)
        t0 = time.monotonic()
        result["out"] = call(fn, ["\\boxed{9^{9^{9^{9^{9^{9}}}}}}"], ["1"])
        result["s"] = time.monotonic() - t0

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout=60)
    assert not t.is_alive()
    assert result["out"]["rewards"].tolist() == [0.0]
    assert result["out"]["extra_logs"]["stare/reward_timeout"].item() == 1.0
    assert result["s"] < 30


DAPO_USER = ("Solve the following math problem step by step. The last line of your response should be of the form "
             "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
             "Find the number of ordered pairs $(a,b)$ with $a+b=10$.\n\n"
             "Remember to put your answer on its own line after \"Answer:\".")


def test_dapo_rows_lose_dapos_own_instruction():
    assert strip_dapo_instruction(DAPO_USER) == "Find the number of ordered pairs $(a,b)$ with $a+b=10$."
    assert strip_dapo_instruction("Plain problem.") == "Plain problem."
    row = {"prompt": [{"role": "user", "content": DAPO_USER}], "reward_model": {"ground_truth": "11"}}
    assert normalise_row(row, "r") == ("Find the number of ordered pairs $(a,b)$ with $a+b=10$.", "11")
    assert normalise_row({"prompt": "P?", "solution": "3"}, "r") == ("P?", "3")
    assert normalise_row({"problem": "Q?", "answer": 7.0}, "r") == ("Q?", "7")
    with pytest.raises(ValueError, match=r"row 4.*has \['question'\]"):
        normalise_row({"question": "x"}, "file row 4")


def test_prepare_prompts_applies_the_template_and_drops_repeats(tmp_path):
    src = tmp_path / "dapo.jsonl"
    row = {"prompt": [{"role": "user", "content": DAPO_USER}], "reward_model": {"ground_truth": "11"}}
    other = {"problem": "What is $1+1$?", "answer": "2"}
    src.write_text("\n".join(json.dumps(r) for r in [row, other, row, row]) + "\n")
    template = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{}."
    out = tmp_path / "run" / "data" / "train.jsonl"
    info = prepare_prompts(str(src), template, out)
    assert (info["rows"], info["problems"]) == (4, 2)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines[0] == {"prompt": "Find the number of ordered pairs $(a,b)$ with $a+b=10$.\nPlease reason step by "
                                  "step, and put your final answer within \\boxed{}.", "label": "11"}
    assert lines[1]["label"] == "2" and lines[1]["prompt"].startswith("What is $1+1$?\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "x", "answer": "1"}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: malformed JSON"):
        prepare_prompts(str(bad), template, tmp_path / "o.jsonl")
    with pytest.raises(ValueError, match="neither a file nor a hub id"):
        prepare_prompts("no-such-file", template, tmp_path / "o.jsonl")


def test_start_writes_the_prompt_file_the_argv_names_then_launches(tmp_path, monkeypatch):
    from stare.cli.openrlhf_backend.argv import SETTINGS_ENV
    from stare.cli.presets import resolve

    src = tmp_path / "train.jsonl"
    src.write_text('{"problem": "What is $2+2$?", "answer": "4"}\n')
    resolved = resolve("qwen-7b-short-cot", "stare", [f"data={src}"])
    plan = orl.plan(resolved, tmp_path / "run")
    called = {}
    monkeypatch.setattr(orl, "launch", lambda argv, ray_address=None, dashboard=None: called.update(
        argv=argv, address=ray_address, dashboard=dashboard))
    import os

    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != SETTINGS_ENV})  # restored after
    orl.start(resolved, plan, log=lambda *a: None)
    assert called == {"argv": plan["openrlhf_argv"], "address": None, "dashboard": False}  # ray_dashboard's default
    argv = plan["openrlhf_argv"]
    prompt_file = argv[argv.index("--data.prompt_dataset") + 1]
    rows = [json.loads(x) for x in open(prompt_file)]
    assert rows == [{"prompt": "What is $2+2$?\nPlease reason step by step, and put your final answer within "
                               "\\boxed{}.", "label": "4"}]
    assert (tmp_path / "run" / "command.sh").read_text().splitlines()[1] == plan["command"]
    assert json.loads(os.environ[SETTINGS_ENV])["algo"]["name"] == "stare"  # what Ray hands the workers
    bad = resolve("qwen-7b-short-cot", "stare", [f"data={tmp_path / 'missing.jsonl'}"])
    with pytest.raises(orl.LaunchError, match="training data file not found"):
        orl.start(bad, orl.plan(bad, tmp_path / "run2"), log=lambda *a: None)
