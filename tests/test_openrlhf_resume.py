"""Resume through the pinned OpenRLHF's real ``PPOTrainer.fit`` loop, exactly and in a second: which steps a run
killed after step k takes when it resumes, against the run that was never killed.

What runs for real: OpenRLHF 0.11.2's ``PPOTrainer.fit`` (the episode loop, its ``client_states`` and restart),
its ``SamplesGenerator`` (the prompt draws, dynamic filtering and the replacement draws), the prompt loader as
``DeepspeedStrategy.setup_dataloader`` builds it (torchdata's ``StatefulDataLoader``, shuffled), and stare's
``checkpoint.resume_position``, which the policy actor applies to the states it loads. What is stood in: vLLM (a
prompt's group of answers comes back at once, with a score fixed by the prompt: the "hard" prompts are always
wrong, so dynamic filtering always drops them, the others always pass), the PPO step (it records what it was
given), and the checkpoint files (the states ``fit`` saves are kept in memory, deep-copied as a save and load would,
and a kill is an exception right after step k's save). A resumed run is a new trainer with a new loader, seeded as a
new process's is, as in a real restart.

The real loop with DeepSpeed, vLLM and the controller is ``tests/test_openrlhf_e2e.py`` (the ``stare-killed*``
runs); this module holds the exact guarantee for every kill point and prompt layout, in about a second.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
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

from stare.cli.openrlhf_backend import compat  # noqa: E402
from stare.cli.openrlhf_backend.checkpoint import resume_position  # noqa: E402

N_SAMPLES = 4  # answers per prompt


@dataclass(frozen=True)
class Layout:
    """A prompt file and a rollout size: ``easy`` prompts always pass dynamic filtering, ``hard`` ones never."""

    name: str
    easy: int
    hard: int
    per_step: int  # prompts per step (rollout batch)
    episodes: int
    filtering: bool = True
    steps_per_episode: int = 0  # what the intended loop takes, worked out by hand for every order of the prompts
    consumed_per_episode: int = 0

    def prompts(self) -> list[str]:
        return [f"easy{i}" for i in range(self.easy)] + [f"hard{i}" for i in range(self.hard)]


LAYOUTS = [
    # the reported run: 3 prompts a step over 3 prompts, one always filtered: its replacement draw finds none left,
    # so every step empties the loader inside itself and ends its episode
    Layout("one-step-episodes", easy=2, hard=1, per_step=3, episodes=3, steps_per_episode=1, consumed_per_episode=3),
    # two steps an episode; the hard prompt's replacement draw empties the loader in the second step, whatever the
    # order (hard first: step 1 draws 3 and step 2 finds one prompt and the end; hard third or fourth: its
    # replacement draw finds the end)
    Layout("two-step-episodes", easy=3, hard=1, per_step=2, episodes=2, steps_per_episode=2, consumed_per_episode=4),
    # no filtering, a last step of one prompt: its draw for a second one finds the end inside the step
    Layout("short-last-step", easy=5, hard=0, per_step=2, episodes=2, filtering=False, steps_per_episode=3,
           consumed_per_episode=5),
    # no filtering, steps that divide the prompts: the end is found by the next step's first draw, which saves
    # nothing (the case a resume always got right)
    Layout("even-steps", easy=4, hard=0, per_step=2, episodes=2, filtering=False, steps_per_episode=2,
           consumed_per_episode=4),
]


class Killed(Exception):
    """The process died right after step k's checkpoint was written."""


def _answers(prompt: str) -> list:
    """A prompt's group as the rollout actor returns it: all wrong for a hard prompt, half right otherwise."""
    scores = [0.0] * N_SAMPLES if prompt.startswith("hard") else [float(i % 2) for i in range(N_SAMPLES)]
    return [ns(prompt=prompt, score=s) for s in scores]


def _args(layout: Layout):
    return ns(
        train=ns(num_episodes=layout.episodes),
        rollout=ns(batch_size=layout.per_step, n_samples_per_prompt=N_SAMPLES, vllm_generate_batch_size=None),
        algo=ns(dynamic_filtering_enable=layout.filtering, dynamic_filtering_range=(0.0, 1.0),
                advantage=ns(is_correction_level="off")),
        vllm=ns(enable_sleep=False),
        eval=ns(steps=float("inf")),
        ckpt=ns(best_metric_key=""),
    )


@pytest.fixture(autouse=True)
def _no_ray(monkeypatch):
    """The generator's Ray calls on plain lists: a "ref" is the group itself, and every ref is ready at once."""
    monkeypatch.setattr(samples_generator, "ray", ns(get=lambda ref: ref,
                                                     wait=lambda refs, num_returns, timeout: (refs[:1], refs[1:])))
    monkeypatch.setattr(ds_strategy.dist, "is_initialized", lambda: False)  # the trainer actor has no group


def _trainer(layout: Layout, saved: list, *, restart_from: dict | None = None, kill_after: int | None = None):
    """OpenRLHF's PPOTrainer (the class behind the Ray actor), with the stand-ins described above."""
    args = _args(layout)
    torch.manual_seed(0)  # a new process: the loader's shuffling generator is drawn from torch's default one
    rows = openrlhf_standins.PromptRows(layout.prompts())
    loader = ds_strategy.DeepspeedStrategy.setup_dataloader(ns(), rows, 1, True, True, rows.collate)
    generator = samples_generator.SamplesGenerator(strategy=ns(args=args), prompts_dataloader=loader,
                                                   eval_dataloader=None, tokenizer=None, vllm_engines=[])
    generator._dispatch_prompts_to_vllm = lambda prompts, labels, images=None, **kw: [_answers(p) for p in prompts]
    generator._process_response_into_experience = lambda response, **kw: ns(
        scores=torch.tensor([response.score]), prompts=[response.prompt])

    trainer = object.__new__(ppo_trainer.PPOTrainer.__ray_actor_class__)
    trainer.args, trainer.prompts_dataloader, trainer.eval_dataloader = args, loader, None
    trainer.samples_generator, trainer.generate_kwargs = generator, {}
    trainer.wandb_logger = trainer.tensorboard_logger = None
    trainer.best_eval_metric_value, trainer.best_eval_metric_key = float("-inf"), ""
    trainer._latest_eval_metric_value = None
    trainer.broadcast_to_vllm = lambda: None
    if restart_from is None:
        trainer.init_checkpoint_states = lambda: {"episode": 0, "global_step": 0, "total_consumed_prompts": 0,
                                                  "data_loader_state_dict": {}}
    else:
        trainer.init_checkpoint_states = lambda: copy.deepcopy(restart_from)
    trained: dict[int, list[str]] = {}

    def train_step(rollout_samples, global_step):
        trained[global_step + 1] = sorted({s.prompts[0] for s in rollout_samples})
        return {}, global_step + 1

    def save_logs_and_checkpoints(global_step, status, client_states):
        saved.append({"trained": trained[global_step], **copy.deepcopy(client_states)})
        if global_step == kill_after:
            raise Killed

    trainer.train_step, trainer.save_logs_and_checkpoints = train_step, save_logs_and_checkpoints
    return trainer


def _steps(saved: list) -> list[tuple]:
    """What each step did: (global step, episode, prompts consumed so far, prompts it trained on)."""
    return [(s["global_step"], s["episode"], s["total_consumed_prompts"], s["trained"]) for s in saved]


def run(layout: Layout, kill_after: int | None = None, *, correct: bool = True) -> list[tuple]:
    """The steps of a run never killed (``kill_after`` None), or of a run killed right after step ``kill_after``'s
    checkpoint and resumed from it (through ``resume_position`` unless ``correct`` is False)."""
    saved: list = []
    if kill_after is None:
        _trainer(layout, saved).fit()
        return _steps(saved)
    with pytest.raises(Killed):
        _trainer(layout, saved, kill_after=kill_after).fit()
    state = {k: v for k, v in saved[-1].items() if k != "trained"}
    if correct:
        state, _ = resume_position(state)
    _trainer(layout, saved, restart_from=state).fit()
    return _steps(saved)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.name)
def test_the_uninterrupted_run_takes_the_steps_worked_out_by_hand(layout):
    """The stand-ins behave as described: per episode, the steps and prompts worked out by hand for every order,
    every easy prompt trained once and no hard one."""
    steps = run(layout)
    total = layout.steps_per_episode * layout.episodes
    assert [s[0] for s in steps] == list(range(1, total + 1)), steps
    assert [s[1] for s in steps] == [e for e in range(layout.episodes) for _ in range(layout.steps_per_episode)]
    for e in range(layout.episodes):
        episode = [s for s in steps if s[1] == e]
        assert episode[-1][2] == layout.consumed_per_episode * (e + 1), steps
        assert sorted(p for s in episode for p in s[3]) == [f"easy{i}" for i in range(layout.easy)], steps


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.name)
def test_a_run_killed_after_any_step_resumes_to_the_uninterrupted_runs_steps(layout):
    """Killed right after step k's checkpoint (every k, the last one included: then nothing is left to do) and
    resumed, the run takes exactly the uninterrupted run's steps: the same global steps (so the same learning-rate
    schedule and controller path), episodes, prompts consumed, and prompts trained on, in the same order."""
    whole = run(layout)
    for k in range(1, len(whole) + 1):
        assert run(layout, kill_after=k) == whole, f"killed after step {k}"


@pytest.mark.parametrize("layout", [lay for lay in LAYOUTS if lay.name != "even-steps"], ids=lambda lay: lay.name)
def test_without_the_correction_openrlhf_repeats_the_episode_a_step_ended(layout):
    """The bug in the pinned OpenRLHF that ``resume_position`` corrects: resumed from a step that emptied the loader,
    ``fit`` runs that step's episode again (one episode more, every later step shifted). If this stops failing
    after an OpenRLHF upgrade, the upstream loop has changed and ``resume_position`` must be re-read (it would then
    skip an episode)."""
    whole = run(layout)
    boundary = layout.steps_per_episode  # the last step of the first episode
    resumed = run(layout, kill_after=boundary, correct=False)
    assert len(resumed) == len(whole) + layout.steps_per_episode, resumed
    assert resumed[boundary][1] == 0, "the resumed run did not start in the episode it had finished"


def test_resume_position_moves_only_a_finished_loader_to_the_next_episode():
    finished = {compat.CLIENT_LOADER_STATE: {compat.LOADER_FINISHED: True, "x": 1}, compat.CLIENT_EPISODE: 2,
                compat.CLIENT_GLOBAL_STEP: 9, compat.CLIENT_CONSUMED_PROMPTS: 30}
    fixed, note = resume_position(finished)
    assert fixed == {**finished, compat.CLIENT_EPISODE: 3} and finished[compat.CLIENT_EPISODE] == 2
    assert note == ("STARE: checkpoint step 9 was the last of episode 3 (its prompts ran out inside the step); "
                    "resuming at episode 4")
    running = {**finished, compat.CLIENT_LOADER_STATE: {compat.LOADER_FINISHED: False}}
    assert resume_position(running) == (running, None)
    assert resume_position({}) == ({}, None)
    assert resume_position({compat.CLIENT_LOADER_STATE: {}, compat.CLIENT_EPISODE: 0}) == (
        {compat.CLIENT_LOADER_STATE: {}, compat.CLIENT_EPISODE: 0}, None)
    other = {**finished, compat.CLIENT_LOADER_STATE: {"position": 3}}
    kept, note = resume_position(other)
    assert kept == other and "cannot tell whether checkpoint step 9 ended its episode" in note


# ---------------------------------------------------------------------------------------------------------------
# what the driver says before a resume, and the prompt order's seed


class _Controller:
    def __init__(self, steps):
        self.stare = ns(state_dict=lambda: {"controller": None, "prev": {}, "algo": "stare", "steps": steps})


def test_resume_line_names_the_checkpoint_and_where_it_stands(tmp_path):
    from stare.cli.openrlhf_backend.checkpoint import describe_resume, save_stare_state

    ckpt = tmp_path / "ckpt"
    assert describe_resume(ckpt) == "no OpenRLHF checkpoint yet: training starts from step 0"
    (ckpt / "_actor").mkdir(parents=True)
    loader = {compat.LOADER_FINISHED: False}
    for step, consumed, finished in ((1, 3, False), (2, 4, True)):
        client = {"episode": 0, "global_step": step, "total_consumed_prompts": consumed,
                  "data_loader_state_dict": {**loader, compat.LOADER_FINISHED: finished}}
        (ckpt / "_actor" / f"global_step{step}").mkdir()  # DeepSpeed's folder, saved just before the state
        save_stare_state(_Controller(step), str(ckpt), f"global_step{step}", 2, client)
    (ckpt / "_actor" / "latest").write_text("global_step1")  # DeepSpeed's tag file names what OpenRLHF loads
    tail = ("; a step past it is trained again from the same prompts with the same rollout seeds (the same rollouts "
            "where the engine's arithmetic repeats: docs/openrlhf-backend.md, Resume)")
    assert describe_resume(ckpt) == "resuming from checkpoint global_step1 (episode 1, 3 prompts drawn)" + tail
    (ckpt / "_actor" / "latest").write_text("global_step2")
    assert describe_resume(ckpt) == ("resuming from checkpoint global_step2 (episode 1, 4 prompts drawn; the episode "
                                     "had ended, so the next one starts)" + tail)
    (ckpt / "stare" / "global_step2.json").unlink()  # a checkpoint from before positions were kept
    assert describe_resume(ckpt) == "resuming from checkpoint global_step2" + tail
    assert describe_resume(ckpt, seeded_rollouts=False) == ("resuming from checkpoint global_step2; a step past it "
                                                            "is trained again from the same prompts, its rollouts "
                                                            "sampled anew (seeded_rollouts is off)")


def test_every_ray_worker_seeds_torch_from_the_runs_seed(tmp_path):
    """The prompt order follows --set seed: the plan gives every worker the seed and the setup hook, the hook named
    there is launch.seed_worker, and it seeds torch's generator (a new process's is random otherwise)."""
    import importlib

    from stare.cli.openrlhf_backend import launch as orl
    from stare.cli.openrlhf_backend.argv import SEED_ENV
    from stare.cli.presets import resolve

    plan = orl.plan(resolve("qwen-7b-short-cot", "grpo", ["seed=7"]), tmp_path)
    env = plan["ray"]["runtime_env"]
    assert env["env_vars"][SEED_ENV] == "7"
    assert orl.runtime_env(env["env_vars"]) == env  # what ray.init gets equals what the dry run prints
    module, _, name = env["worker_process_setup_hook"].rpartition(".")
    hook = getattr(importlib.import_module(module), name)
    assert hook is orl.seed_worker
    state = torch.get_rng_state()
    try:
        hook({SEED_ENV: "7"})
        first = torch.randperm(10).tolist()
        torch.manual_seed(123)
        hook({SEED_ENV: "7"})
        assert torch.randperm(10).tolist() == first and torch.initial_seed() == 7
        hook({})  # no seed given: torch's generator is left alone
        assert torch.initial_seed() == 7
    finally:
        torch.set_rng_state(state)
