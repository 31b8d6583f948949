"""Synthetic tasks with verifiable rewards for the local engine.

A task makes problems (prompt text, answer text) from a seed and scores a response 0/1. Train and held-out
problems are disjoint by construction: a problem's split is a function of its prompt (a stable hash), so no
seed, order or count can put the same prompt in both.

- ``reverse``: reverse a string of 3-6 letters. Easy to learn; after a noisy warm start the policy samples the
  right answer only part of the time, with real entropy, and RL drives it towards certainty: the entropy-collapse
  setting (its numbers: docs/results.md).
- ``explore``: reversal, except that a prompt starting with the trigger letter wants the marker ``#`` as its
  last character instead of the trigger. Trigger prompts are one in eight; the warm start was shown the rule
  rarely, so the policy's greedy answer on them is wrong while ``#`` keeps a small probability. A policy whose
  entropy collapses stops sampling ``#`` and never learns the rule: the setting where exploration pays.
- ``arith``: short-answer addition of two one-digit numbers, phrased for a chat model (smollm-cpu preset); on
  two-digit sums SmolLM2-135M is right too rarely for groups of 4 to carry signal (docs/results.md).
"""
from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass

LETTERS = "abcdefghijklmnopqrst"  # 20 letters
TRIGGER = "a"
MARKER = "#"


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str
    hard: bool = False  # the cases exploration is needed for (explore: trigger prompts)


def _held_out(prompt: str, share: float) -> bool:
    h = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big")
    return (h % 10_000) < share * 10_000


class Task:
    name = "task"
    held_out_share = 0.2
    charset = LETTERS

    def make(self, rng: random.Random) -> Problem:
        raise NotImplementedError

    def problems(self, n: int, *, seed: int, split: str) -> list[Problem]:
        """``n`` problems of ``split`` ("train" or "test"), reproducible from ``seed``."""
        if split not in ("train", "test"):
            raise ValueError(f"unknown split {split!r}; valid splits: train, test")
        rng = random.Random(f"{self.name}:{split}:{seed}")
        want_test = split == "test"
        out = []
        while len(out) < n:
            p = self.make(rng)
            if _held_out(p.prompt, self.held_out_share) == want_test:
                out.append(p)
        return out

    def extract(self, response: str) -> str | None:
        """The answer a response gives, as ``reward`` reads it (None: no answer, a blank response); maj@k votes over
        these."""
        return response.strip() or None

    def reward(self, problem: Problem, response: str) -> float:
        return float(self.extract(response) == problem.answer)

    def demonstration(self, problem: Problem, rng: random.Random, noise: float) -> str:
        """A noisy demonstration for the warm start: with probability ``noise`` one character is wrong."""
        answer = problem.answer
        if answer and rng.random() < noise:
            i = rng.randrange(len(answer))
            answer = answer[:i] + rng.choice(self.charset) + answer[i + 1:]
        return answer


class ReverseTask(Task):
    name = "reverse"

    def __init__(self, min_len: int = 3, max_len: int = 6):
        self.min_len, self.max_len = min_len, max_len

    def make(self, rng):
        s = "".join(rng.choice(LETTERS) for _ in range(rng.randint(self.min_len, self.max_len)))
        return Problem(s, s[::-1])


class ExploreTask(ReverseTask):
    name = "explore"
    trigger_share = 0.125
    demo_rule_rate = 0.003  # how often the warm start's demonstrations on trigger prompts show the rule
    charset = LETTERS + MARKER

    def make(self, rng):
        n = rng.randint(self.min_len, self.max_len)
        if rng.random() < self.trigger_share:
            s = TRIGGER + "".join(rng.choice(LETTERS[1:]) for _ in range(n - 1))
            return Problem(s, s[::-1][:-1] + MARKER, hard=True)
        s = "".join(rng.choice(LETTERS[1:]) for _ in range(n))
        return Problem(s, s[::-1])

    def demonstration(self, problem, rng, noise):
        if problem.hard and rng.random() >= self.demo_rule_rate:
            problem = Problem(problem.prompt, problem.prompt[::-1])  # the plain reversal: the rule unseen
        return super().demonstration(problem, rng, noise)


class ArithTask(Task):
    name = "arith"
    charset = "0123456789"

    def make(self, rng):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        return Problem(f"What is {a} + {b}? Answer with the number only.", str(a + b))

    def extract(self, response):
        # the model tends to restate the sum ("7 + 8 = 15"): the answer is the last number on the first line
        numbers = re.findall(r"-?\d+", response.strip().split("\n")[0])
        return numbers[-1] if numbers else None


TASKS = {"reverse": ReverseTask, "explore": ExploreTask, "arith": ArithTask}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(TASKS)}")
    return TASKS[name]()
