"""Seeded rollouts (``stare_cli/openrlhf_backend/rollouts.py`` and ``engine.py``) through the pinned OpenRLHF's real
sampling code, in about a second.

What runs for real: OpenRLHF 0.11.2's ``SamplesGenerator`` (the prompt draws, its dispatch with the engine chosen by
pending load, ``_generate_vllm``'s completion-order loop with dynamic filtering and replacement draws, its
``_process_response_into_experience``), its ``PPOTrainer.fit`` and ``init_checkpoint_states`` (the resume), the
prompt loader as ``DeepspeedStrategy.setup_dataloader`` builds it, and stare's ``StareSamplesGenerator``,
``StarePPOTrainer`` and ``StareRolloutActor``. What is stood in: Ray (``ray.wait`` hands the groups back in an order
the test chooses: as dispatched, reversed, or shuffled), the vLLM engines (a sample's tokens and score are a function
of its prompt and seed alone, as a seeded request on an engine whose arithmetic repeats), vLLM's ``SamplingParams``
(a record of its arguments) and the PPO step (it records what it was given).

The seeds are checked against SHA-256 computed here, the order against the draw order worked out from the loader,
and a resumed run against the run that was never killed. The real engine and trainer are
``tests/test_openrlhf_e2e.py``'s resume runs (same rollouts, scalars and final weights, bit for bit).
"""
from __future__ import annotations

import asyncio
import copy
import hashlib
import random
from types import SimpleNamespace as ns

import pytest
import torch

pytest.importorskip("openrlhf")
pytest.importorskip("torchdata")
import openrlhf_standins  # noqa: E402

openrlhf_standins.install()
from openrlhf.trainer import ppo_trainer  # noqa: E402
from openrlhf.trainer.ppo_utils import samples_generator  # noqa: E402
from openrlhf.utils.deepspeed import deepspeed as ds_strategy  # noqa: E402

from stare.cli.openrlhf_backend import rollouts  # noqa: E402
from stare.cli.openrlhf_backend.argv import SEED_ENV, SEEDED_ROLLOUTS_ENV  # noqa: E402
from stare.cli.openrlhf_backend.checkpoint import resume_position  # noqa: E402
from stare.cli.openrlhf_backend.engine import DRAW_KEY, StareRolloutActor  # noqa: E402

N = 4  # samples per prompt
SEED = 7


def sha_seed(stream: str, seed: int, step: int, draw: int) -> int:
    """The group seed as documented (rollouts.group_seed), written out here."""
    digest = hashlib.sha256(f"stare-rollout/{stream}/{seed}/{step}/{draw}".encode()).digest()
    return int.from_bytes(digest[:8], "big") // 4


# ---------------------------------------------------------------------------------------------------------------
# stand-ins: Ray, the engines, SamplingParams


class Ref:
    def __init__(self, value):
        self.value = value


def fake_ray(order: str):
    """``ray.get`` / ``ray.wait`` on ``Ref``s; ``wait`` returns one ready ref: the oldest (``dispatched``), the newest
    (``reversed``) or one at random (``shuffled``, a fixed generator)."""
    rng = random.Random(1)

    def get(ref):
        return [r.value for r in ref] if isinstance(ref, list) else ref.value

    def wait(refs, num_returns, timeout):
        i = {"dispatched": 0, "reversed": len(refs) - 1, "shuffled": rng.randrange(len(refs))}[order]
        return [refs[i]], refs[:i] + refs[i + 1:]

    return ns(get=get, wait=wait)


def response(prompt: str, label: str, seed: int) -> dict:
    """What the rollout actor returns for one sample: tokens and score a function of (prompt, seed); a "hard"
    prompt always scores 0 (dynamic filtering drops its group), an easy one the seed's parity (a group of
    consecutive seeds is half right: kept)."""
    tokens = [11, 12, len(prompt), seed % 997, seed // 997 % 991]
    score = 0.0 if prompt.startswith("hard") else float(seed % 2)
    return {"prompt": prompt, "label": label, "images": None, "mm_train_inputs": None, "reward": score,
            "scores": score, "observation_tokens": tokens, "action_ranges": [(2, 5)], "rollout_log_probs": None,
            "truncated": False, "extra_logs": {}}


class Engine:
    """A vLLM engine actor's handle: ``generate_seeded_responses`` answers sample i with seed ``seed + i`` (vLLM's
    rule for n samples of one seeded request) and tags the draw; ``generate_responses`` (OpenRLHF's, which the
    generator calls with ``seeded_rollouts`` off) answers sample i as seed i would, the same every time, so that
    only the order of what comes back can differ. Every request is recorded in ``calls``: (engine, prompt, draw,
    seed)."""

    def __init__(self, name: str, calls: list):
        self.name, self.calls, self.load = name, calls, 0
        self.get_num_unfinished_requests = ns(remote=lambda: Ref(self.load))
        self.generate_seeded_responses = ns(remote=self._seeded)
        self.generate_responses = ns(remote=self._unseeded)

    def _seeded(self, *, draw, seed, prompt, label, num_samples, sampling_params, **kw):
        assert sampling_params.seed is None  # the group's params stay OpenRLHF's; the seed travels on its own
        self.calls.append((self.name, prompt, draw, seed))
        self.load += num_samples
        out = [response(prompt, label, seed + i) for i in range(num_samples)]
        for r in out:
            r[DRAW_KEY] = draw
        return Ref(out)

    def _unseeded(self, *, prompt, label, num_samples, **kw):
        self.calls.append((self.name, prompt, None, None))
        return Ref([response(prompt, label, i) for i in range(num_samples)])


@pytest.fixture(autouse=True)
def _standins(monkeypatch):
    monkeypatch.setattr(samples_generator, "SamplingParams", lambda **kw: ns(seed=None, **kw))
    monkeypatch.setattr(samples_generator, "ray", fake_ray("dispatched"))
    monkeypatch.setattr(ds_strategy.dist, "is_initialized", lambda: False)  # the trainer actor has no group
    monkeypatch.setenv(SEED_ENV, str(SEED))
    monkeypatch.delenv(SEEDED_ROLLOUTS_ENV, raising=False)


def args(per_step: int, episodes: int = 1, filtering: bool = True):
    return ns(train=ns(num_episodes=episodes, seed=SEED + 1000),  # STARE_SEED wins over --train.seed
              rollout=ns(batch_size=per_step, n_samples_per_prompt=N, vllm_generate_batch_size=None),
              algo=ns(dynamic_filtering_enable=filtering, dynamic_filtering_range=(0.0, 1.0),
                      advantage=ns(is_correction_level="off")),
              vllm=ns(enable_sleep=False), eval=ns(steps=float("inf")), ckpt=ns(best_metric_key="", load_enable=False, path="/nonexistent"))


def loader(prompts, shuffle=True):
    torch.manual_seed(SEED)  # a new worker process: launch.seed_worker seeds torch from STARE_SEED
    rows = openrlhf_standins.PromptRows(prompts)
    return ds_strategy.DeepspeedStrategy.setup_dataloader(ns(), rows, 1, True, shuffle, rows.collate)


def generator(a, prompts, calls, engines=2, seeded=True, shuffle=True):
    gen = samples_generator.SamplesGenerator(strategy=ns(args=a), prompts_dataloader=loader(prompts, shuffle),
                                             eval_dataloader=None, tokenizer=None,
                                             vllm_engines=[Engine(f"e{i}", calls) for i in range(engines)])
    return rollouts.StareSamplesGenerator.install(gen, rollouts.run_seed(a)) if seeded else gen


def groups(experiences) -> list[tuple]:
    """The batch as the trainer gets it: (prompt, token ids) per sample, in order."""
    return [(e.prompts[0], tuple(e.sequences[0].tolist())) for e in experiences]


PROMPTS = ["easy0", "hard0", "easy1", "easy2", "hard1", "easy3", "easy4"]


def draws_of_a_step(drawn: list[str], per_step: int) -> int:
    """How many prompts a step with dynamic filtering draws from ``drawn`` (the loader's order), worked out by the
    rule: ``per_step`` first, and one more for every dropped ("hard") group, while there are prompts."""
    wanted, i = per_step, 0
    while i < min(wanted, len(drawn)):
        wanted += drawn[i].startswith("hard")
        i += 1
    return min(wanted, len(drawn))


# ---------------------------------------------------------------------------------------------------------------
# the seeds


def test_group_seed_is_sha256_of_the_stream_seed_step_and_draw():
    for stream, seed, step, draw in [("train", 42, 0, 0), ("train", 42, 3, 5), ("eval", 42, 3, 5), ("train", 0, 9, 1)]:
        assert rollouts.group_seed(seed, step, draw, stream) == sha_seed(stream, seed, step, draw)
    seeds = {rollouts.group_seed(s, t, d, k) for s in (1, 2) for t in range(4) for d in range(8)
             for k in (rollouts.TRAIN, rollouts.EVAL)}
    assert len(seeds) == 2 * 4 * 8 * 2 and all(0 <= s < 2 ** 62 for s in seeds)


def test_the_engine_gives_each_sample_its_own_seed_and_tags_the_draw():
    """``StareRolloutActor.generate_seeded_responses`` runs OpenRLHF's own ``generate_responses`` (its executor)
    once per sample, sample i with a copy of the group's params seeded ``seed + i``; the group's params are left
    unseeded, a cached ``sampling_type`` (vLLM caches random vs. seeded) is not carried into the copies, and every
    response, in sample order, carries the draw index."""
    seen = []

    class Executor:
        async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images=None):
            seen.append((sampling_params.seed, "sampling_type" in vars(sampling_params), sampling_params.top_p))
            return {"prompt": prompt, "seed": sampling_params.seed}

    engine = object.__new__(StareRolloutActor)
    engine.executor = Executor()
    params = ns(seed=None, top_p=0.9, sampling_type="RANDOM")  # the cached type of an unseeded request
    out = asyncio.run(engine.generate_seeded_responses(draw=5, seed=1000, prompt="p", label="l",
                                                       sampling_params=params, max_length=64, hf_tokenizer=None,
                                                       num_samples=3, images=None))
    assert seen == [(1000, False, 0.9), (1001, False, 0.9), (1002, False, 0.9)]
    assert out == [{"prompt": "p", "seed": 1000 + i, DRAW_KEY: 5} for i in range(3)]
    assert params.seed is None and params.sampling_type == "RANDOM"


def test_every_request_carries_the_seed_of_its_step_and_draw():
    """One step with dynamic filtering: the k-th prompt drawn from the loader (replacements included) is sent with
    the group seed of (STARE_SEED, step 0, draw k), whichever engine serves it; the next step's draws count from 0
    at step 1. The prompts each draw gets are the loader's, read here from a second loader with the same seed."""
    calls = []
    gen = generator(args(per_step=3), PROMPTS, calls)
    first, _, consumed, _ = gen.generate_samples()
    drawn = [p for _, batch, _, _ in loader(PROMPTS) for p in batch]  # the loader's order with this seed
    assert sorted(drawn) == sorted(PROMPTS) and consumed == draws_of_a_step(drawn, 3)
    assert [(p, d, s) for _, p, d, s in calls] == [(drawn[k], k, sha_seed("train", SEED, 0, k))
                                                     for k in range(consumed)]
    assert len({e for e, *_ in calls}) == 2  # both engines served (OpenRLHF's load balancing, unchanged)
    calls.clear()
    gen.generate_samples()
    assert [(d, s) for _, _, d, s in calls] == [(k, sha_seed("train", SEED, 1, k)) for k in range(len(calls))]
    assert [p for _, p, _, _ in calls] == drawn[consumed: consumed + len(calls)]
    # every sample of a group has its own seed (seed + i), so a group is not n copies of one answer
    assert all(len({tokens for _, tokens in groups(first)[i: i + N]}) == N for i in range(0, len(first), N))


@pytest.mark.parametrize("order", ["reversed", "shuffled"])
def test_the_groups_reach_the_trainer_in_draw_order_whatever_order_they_finish_in(order, monkeypatch):
    """The same step with the groups finishing in the order they were sent, in reverse, or shuffled: the same
    batch, sample for sample, in draw order: the accepted prompts in the order the loader gave them (replacement
    draws after the first ones), each group's samples in sample order."""
    def step(completion):
        monkeypatch.setattr(samples_generator, "ray", fake_ray(completion))
        calls = []
        samples, *_ = generator(args(per_step=4), PROMPTS, calls).generate_samples()
        return groups(samples), calls

    want, calls = step("dispatched")
    got, calls_again = step(order)
    assert got == want
    assert [c[1:] for c in calls_again] == [c[1:] for c in calls]  # same prompts, draws and seeds
    accepted = [p for _, p, _, _ in sorted(calls, key=lambda c: c[2]) if not p.startswith("hard")]
    assert [p for p, _ in want[::N]] == accepted
    assert all(len({p for p, _ in want[i: i + N]}) == 1 for i in range(0, len(want), N))


@pytest.mark.parametrize("order", ["reversed", "shuffled"])
def test_openrlhfs_own_generator_hands_them_on_in_completion_order(order, monkeypatch):
    """The behaviour the seeded generator removes, in the pinned OpenRLHF (and with ``seeded_rollouts`` off): with
    the groups finishing in another order, the trainer gets the prompts in that order. (If this stops failing after
    an upgrade, re-read ``_generate_vllm``.)"""
    def prompts_in_batch(completion):
        monkeypatch.setattr(samples_generator, "ray", fake_ray(completion))
        samples, *_ = generator(args(per_step=4), PROMPTS, [], seeded=False).generate_samples()
        return [p for p, _ in groups(samples)[::N]]

    got, want = prompts_in_batch(order), prompts_in_batch("dispatched")
    assert sorted(got) == sorted(want) and got != want


def test_the_evaluation_has_a_seed_stream_of_its_own_and_leaves_the_training_draws_alone():
    calls = []
    gen = generator(args(per_step=2), PROMPTS, calls)
    gen.eval_dataloader = loader(["easy8", "easy9", "easy10"], shuffle=False)
    gen.generate_samples()
    step_draws = gen.draws
    calls.clear()
    evaluated = gen.generate_eval_samples()
    assert [(p, d, s) for _, p, d, s in calls] == [(p, k, sha_seed("eval", SEED, 1, k))
                                                     for k, p in enumerate(["easy8", "easy9", "easy10"])]
    assert [p for p, _ in groups(evaluated)[::N]] == ["easy8", "easy9", "easy10"]
    assert (gen.stream, gen.step, gen.draws) == (rollouts.TRAIN, 1, step_draws)


# ---------------------------------------------------------------------------------------------------------------
# the trainer actor: on/off, and the step a resumed run restarts at


class Killed(Exception):
    pass


def trainer(a, prompts, saved, trained, *, restart_from=None, kill_after=None, kill_in=None, tmp_path=None):
    """OpenRLHF's PPOTrainer as stare's ``StarePPOTrainer`` (no ``__init__``: its generator installed as
    ``__init__`` installs it), OpenRLHF's real ``fit`` and ``init_checkpoint_states``. A resumed one loads
    ``restart_from`` through ``init_checkpoint_states`` (the policy actor's ``get_checkpoint_states``, stood in),
    with a new loader and a generator of its own, as a new process."""
    a = copy.deepcopy(a)
    t = object.__new__(rollouts.StarePPOTrainer)
    t.args, t.strategy = a, ns(args=a)
    t.samples_generator = generator(a, prompts, [])
    t.prompts_dataloader, t.eval_dataloader = t.samples_generator.prompts_dataloader, None
    t.generate_kwargs, t.wandb_logger, t.tensorboard_logger = {}, None, None
    t.best_eval_metric_value, t.best_eval_metric_key, t._latest_eval_metric_value = float("-inf"), "", None
    t.broadcast_to_vllm = lambda: None
    if restart_from is not None:
        (tmp_path / "_actor").mkdir(exist_ok=True)
        a.ckpt.load_enable, a.ckpt.path = True, str(tmp_path)
        t.actor_model_group = ns(async_run_method=lambda method_name: [copy.deepcopy(restart_from)])

    def train_step(samples, global_step):
        if global_step + 1 == kill_in:  # killed with this step's rollouts generated, not trained
            trained.setdefault("lost", {})[global_step + 1] = groups(samples)
            raise Killed
        trained[global_step + 1] = groups(samples)
        return {}, global_step + 1

    def save_logs_and_checkpoints(global_step, status, client_states):
        saved.append(copy.deepcopy(client_states))
        if global_step == kill_after:
            raise Killed

    t.train_step, t.save_logs_and_checkpoints = train_step, save_logs_and_checkpoints
    return t


@pytest.fixture
def _trainer_ray(monkeypatch):
    monkeypatch.setattr(ppo_trainer, "ray", ns(get=lambda x: x))  # init_checkpoint_states' ray.get


LAYOUT = dict(prompts=["easy0", "easy1", "easy2", "hard0", "easy3"], per_step=2, episodes=2)


def run(tmp_path, *, kill_after=None, kill_in=None):
    """The steps' batches of a run never killed, or of one killed after step ``kill_after``'s checkpoint or inside
    step ``kill_in`` and resumed (from the last checkpoint, through the policy actor's ``resume_position``)."""
    a = args(LAYOUT["per_step"], LAYOUT["episodes"])
    saved, trained = [], {}
    if kill_after is None and kill_in is None:
        trainer(a, LAYOUT["prompts"], saved, trained).fit()
        return trained
    with pytest.raises(Killed):
        trainer(a, LAYOUT["prompts"], saved, trained, kill_after=kill_after, kill_in=kill_in).fit()
    state = resume_position(saved[-1])[0] if saved else None  # killed in step 1: nothing saved, a fresh start
    trainer(a, LAYOUT["prompts"], saved, trained, restart_from=state, tmp_path=tmp_path).fit()
    return trained


@pytest.mark.usefixtures("_trainer_ray")
def test_a_resumed_run_samples_the_uninterrupted_runs_rollouts(tmp_path):
    """Killed after any step's checkpoint, or inside any step (its rollouts generated, not trained), and resumed
    in a new trainer (new loader, new generator, its step restored by ``init_checkpoint_states`` from the
    checkpoint's global step): every step's batch is the uninterrupted run's, sample for sample, and a step the
    kill lost is sampled again exactly as it was."""
    whole = run(tmp_path)
    assert sorted(whole) == list(range(1, len(whole) + 1)) and len(whole) >= 4, whole
    for k in range(1, len(whole) + 1):
        assert run(tmp_path, kill_after=k) == whole, f"killed after step {k}"
        resumed = run(tmp_path, kill_in=k)
        lost = resumed.pop("lost")
        assert resumed == whole and lost == {k: whole[k]}, f"killed in step {k}"


def test_a_fresh_run_starts_at_step_0_and_the_setting_turns_it_all_off(monkeypatch, _trainer_ray):
    t = trainer(args(2), PROMPTS, [], {})
    t.samples_generator.start_at(5)
    assert t.init_checkpoint_states()["global_step"] == 0 and t.samples_generator.step == 0
    # StarePPOTrainer.__init__ after OpenRLHF's: the generator re-classed unless STARE_SEEDED_ROLLOUTS=0
    base = rollouts.StarePPOTrainer.__mro__[1]
    for value, want in (("1", rollouts.StareSamplesGenerator), ("0", samples_generator.SamplesGenerator),
                        ("false", samples_generator.SamplesGenerator)):
        monkeypatch.setenv(SEEDED_ROLLOUTS_ENV, value)
        plain = generator(args(2), PROMPTS, [], seeded=False)

        def openrlhf_init(self, plain=plain):  # what OpenRLHF's __init__ leaves that ours reads
            self.samples_generator, self.args = plain, args(2)

        monkeypatch.setattr(base, "__init__", openrlhf_init)
        made = rollouts.StarePPOTrainer()
        assert type(made.samples_generator) is want, value
        if want is rollouts.StareSamplesGenerator:
            assert made.samples_generator.run_seed == SEED
    monkeypatch.setenv(SEEDED_ROLLOUTS_ENV, "maybe")
    with pytest.raises(RuntimeError, match="expected 0 or 1"):
        rollouts.seeded_rollouts_on()
    monkeypatch.delenv(SEED_ENV)
    assert rollouts.run_seed(args(2)) == SEED + 1000  # --train.seed when STARE_SEED is absent


def test_register_makes_openrlhf_build_the_trainer_and_engines_as_stares(monkeypatch):
    pytest.importorskip("ray")
    from openrlhf.trainer.ray import vllm_engine

    monkeypatch.setattr(ppo_trainer, "PPOTrainer", ppo_trainer.PPOTrainer)  # restored afterwards
    monkeypatch.setattr(vllm_engine, "RolloutRayActor", vllm_engine.RolloutRayActor)
    rollouts.register()
    assert ppo_trainer.PPOTrainer.__ray_actor_class__ is rollouts.StarePPOTrainer
    assert vllm_engine.RolloutRayActor.__ray_actor_class__ is StareRolloutActor


def test_the_plan_gives_every_worker_the_setting(tmp_path):
    from stare.cli.openrlhf_backend import launch as orl
    from stare.cli.presets import resolve

    for sets, want in (([], "1"), (["seeded_rollouts=false"], "0")):
        env = orl.plan(resolve("qwen-7b-short-cot", "stare", sets), tmp_path)["ray"]["runtime_env"]
        assert env["env_vars"][SEEDED_ROLLOUTS_ENV] == want
        assert orl.runtime_env(env["env_vars"]) == env  # forwarded to the workers as the dry run prints it
        assert rollouts.seeded_rollouts_on(env["env_vars"]) is (want == "1")
    # vLLM's batch-invariant mode, the GPU route to the same tokens (docs/openrlhf-backend.md, Resume), reaches the
    # engines when the driver's environment sets it
    assert orl.runtime_env({**env["env_vars"], "VLLM_BATCH_INVARIANT": "1"})["env_vars"]["VLLM_BATCH_INVARIANT"] == "1"


# ---------------------------------------------------------------------------------------------------------------
# the trainer's half: the order of the step's updates


def test_the_update_order_is_a_function_of_the_seed_rank_and_step(monkeypatch):
    """Before OpenRLHF's ``ppo_train`` shuffles the step's samples into micro-batches (a ``DataLoader`` with
    ``shuffle=True``, seeded from torch's global generator), ``StareStep.seed_update_order`` seeds torch with
    SHA-256 of (run seed, rank, step count), worked out here: the shuffle is then the same whatever the process drew
    before (a resumed run's new process), and another at the next step. Off, torch's generator is left alone."""
    from stare.cli.openrlhf_backend.step import StareStep

    def order_after(history: int, steps: int):
        torch.manual_seed(123)
        torch.rand(history)  # whatever this process drew before the step
        seeded = StareStep.seed_update_order(ns(trainer=ns(args=args(2)), steps=steps))
        loader = torch.utils.data.DataLoader(list(range(16)), batch_size=4, shuffle=True)
        return seeded, [b.tolist() for b in loader]

    digest = hashlib.sha256(f"stare-update-order/{SEED}/0/3".encode()).digest()
    seeded, first = order_after(0, 3)
    assert seeded == int.from_bytes(digest[:8], "big") // 4
    assert order_after(1000, 3) == (seeded, first)
    assert order_after(0, 4)[1] != first
    monkeypatch.setenv(SEEDED_ROLLOUTS_ENV, "0")
    assert order_after(0, 3)[0] is None and order_after(0, 3)[1] != order_after(1000, 3)[1]
