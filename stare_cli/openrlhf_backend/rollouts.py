"""Seeded rollouts: with one seed a run samples the same rollouts, and a resumed run the very rollouts of the run
that was never stopped (on the same engine; docs/openrlhf-backend.md, "Resume", says what that covers).

The pinned OpenRLHF's ``SamplesGenerator`` (openrlhf/trainer/ppo_utils/samples_generator.py), which lives in the trainer
actor (the Ray actor ``PPOTrainer``, openrlhf/trainer/ppo_trainer.py), sends every prompt of a step to a vLLM engine
with one unseeded ``SamplingParams`` (``_dispatch_prompts_to_vllm``), chooses the engine by its pending load, and
takes the groups back in the order they finish (``_generate_vllm``: ``ray.wait(..., num_returns=1)``; dynamic
filtering draws one replacement prompt for each filtered group, in that order too). So the answers, and the order
the trainer sees them in, changed from run to run. ``StareSamplesGenerator`` changes three things, in the trainer
actor only:

- **seeds**: sample i of the prompt drawn ``draw``-th in the step's prompt stream (0, 1, ...: the step's first
  draws, then the replacements dynamic filtering draws, in the order they are drawn from the loader) is sampled
  with the seed ``seeds.group_seed(run seed, step, draw) + i`` (``seeds.sample_seed``), where the run seed is
  ``STARE_SEED`` (the ``seed`` setting) and ``step`` the number of steps trained before this one. Never from which
  engine serves it or when: the k-th draw of a step is the k-th prompt of the loader's stream wherever it goes.
  The engine's half is ``engine.StareRolloutActor.generate_seeded_responses`` (each sample its own seed: one seed
  for the whole group would give n equal samples).
- **order**: a step's accepted groups reach the trainer in draw order (a stable sort of the groups
  ``_generate_vllm`` accepted, by the draw index each response carries back); which groups are accepted, and
  which replacements are drawn, is OpenRLHF's filtering as it is.
- **step**: the step in the seed starts at the ``global_step`` OpenRLHF's ``fit`` restarts from (its
  ``init_checkpoint_states``: 0, or the checkpoint's step on resume, the same state ``fit`` itself restores the
  prompt loader's position from) and moves on exactly when ``fit`` does: after every call of ``generate_samples``
  that returned rollouts to train on. The draw index restarts at 0 with each step.

The in-training evaluation (``generate_eval_samples``) is seeded the same way from a stream of its own
(``EVAL``, the step it follows, its draw index) and ordered by draw too. The trainer's half, the order OpenRLHF's
``ppo_train`` updates on the step's samples in, is seeded in the policy actor (``step.StareStep.seed_update_order``).

Off (``--set seeded_rollouts=false``: ``STARE_SEEDED_ROLLOUTS=0`` in the workers' environment) the trainer's
generator is OpenRLHF's own, unseeded and in completion order. ``register`` (in the driver) makes OpenRLHF build
``StarePPOTrainer`` and ``engine.StareRolloutActor`` in either case; neither does anything different while off.
Not covered: ``--train.async_enable`` (``PPOTrainerAsync``, which stare does not use) and rollouts OpenRLHF keeps
across steps (``_sample_buffer``, filled only when ``--rollout.vllm_generate_batch_size`` exceeds the rollout batch:
they keep the seeds of the step that drew them).
"""
from __future__ import annotations

from collections import deque
from functools import partial
from types import SimpleNamespace

from . import compat
from .engine import DRAW_KEY, StareRolloutActor
from .seeds import EVAL, TRAIN, group_seed, run_seed, seeded_rollouts_on  # noqa: F401 (EVAL, TRAIN: re-exported)


class _SeededEngine:
    """An engine handle as ``SamplesGenerator._dispatch_prompts_to_vllm`` uses it, for one dispatch: its
    ``get_num_unfinished_requests`` is the engine's own (the load balancing stays OpenRLHF's), and
    ``generate_responses.remote(prompt=..., ...)`` sends the next pending prompt's group to the engine's
    ``generate_seeded_responses`` with that prompt's draw index and group seed. The dispatch sends the prompts in
    their order, one request each, whichever engine it picks; a prompt other than the one expected is an error (the
    pinned dispatch changed)."""

    def __init__(self, handle, pending: deque):
        self.get_num_unfinished_requests = handle.get_num_unfinished_requests
        self.generate_responses = SimpleNamespace(remote=partial(self._send, handle, pending))

    @staticmethod
    def _send(handle, pending: deque, *, prompt, **kwargs):
        if not pending:
            raise RuntimeError("seeded rollouts: OpenRLHF's dispatch sent more requests than it was given prompts")
        draw, expected, seed = pending.popleft()
        if prompt != expected:
            raise RuntimeError(f"seeded rollouts: OpenRLHF's dispatch sent draw {draw}'s request with another prompt "
                               "(its prompt order changed; re-read SamplesGenerator._dispatch_prompts_to_vllm)")
        return handle.generate_seeded_responses.remote(draw=draw, seed=seed, prompt=prompt, **kwargs)


class StareSamplesGenerator(compat.SamplesGenerator):
    """OpenRLHF's ``SamplesGenerator`` with seeded requests and groups in draw order (the module's docstring). Never
    constructed: ``install`` re-classes OpenRLHF's own."""

    run_seed: int
    step: int  # steps trained before the rollouts now drawn (what fit's global_step is while it draws them)
    stream: str  # TRAIN, or EVAL inside generate_eval_samples
    draws: int  # prompts dispatched so far in this step (this evaluation)
    _draw_of: dict  # id(experience) -> its prompt's draw index, inside one _generate_vllm

    @classmethod
    def install(cls, generator, seed: int) -> "StareSamplesGenerator":
        generator.__class__ = cls
        generator.run_seed, generator.stream, generator._draw_of = int(seed), TRAIN, {}
        generator.start_at(0)
        return generator

    def start_at(self, step: int) -> None:
        """The next rollouts are step ``step``'s (0: the run's first), their draws counted from 0."""
        self.step, self.draws = int(step), 0

    def generate_samples(self, **generate_kwargs):
        out = super().generate_samples(**generate_kwargs)
        if out[0]:  # fit trains on them and counts a step: so does the seed
            self.start_at(self.step + 1)
        return out

    def generate_eval_samples(self, **generate_kwargs):
        saved = self.stream, self.draws
        self.stream, self.draws = EVAL, 0
        try:
            return super().generate_eval_samples(**generate_kwargs)
        finally:
            self.stream, self.draws = saved

    def _generate_vllm(self, dataloader_iter, num_prompts, dynamic_filtering, **generate_kwargs):
        """OpenRLHF's: draw, send, filter, replace; the accepted groups then sorted by draw index (stable: a group's
        samples keep their order)."""
        self._draw_of = {}
        try:
            experiences, consumed, exhausted = super()._generate_vllm(dataloader_iter, num_prompts,
                                                                      dynamic_filtering, **generate_kwargs)
            draws = [self._draw_of[id(e)] for e in experiences]
        finally:
            self._draw_of = {}
        order = sorted(range(len(experiences)), key=draws.__getitem__)
        return [experiences[i] for i in order], consumed, exhausted

    def _process_response_into_experience(self, response, **generate_kwargs):
        experience = super()._process_response_into_experience(response, **generate_kwargs)
        if DRAW_KEY not in response:
            raise RuntimeError("seeded rollouts: a response without its draw index (the vLLM engine is not "
                               "stare's StareRolloutActor: was rollouts.register() called in the driver?)")
        self._draw_of[id(experience)] = response[DRAW_KEY]
        return experience

    def _dispatch_prompts_to_vllm(self, prompts, labels, *, images=None, **generate_kwargs):
        """OpenRLHF's dispatch (its engine choice), each prompt's request sent with its draw index and group seed."""
        first = self.draws
        self.draws += len(prompts)
        pending = deque((first + k, prompt, group_seed(self.run_seed, self.step, first + k, self.stream))
                        for k, prompt in enumerate(prompts))
        engines = self.vllm_engines
        self.vllm_engines = [_SeededEngine(engine, pending) for engine in engines]
        try:
            refs = super()._dispatch_prompts_to_vllm(prompts, labels, images=images, **generate_kwargs)
        finally:
            self.vllm_engines = engines
        if pending or len(refs) != len(prompts):
            raise RuntimeError(f"seeded rollouts: OpenRLHF's dispatch sent {len(refs)} requests for {len(prompts)} "
                               "prompts (re-read SamplesGenerator._dispatch_prompts_to_vllm)")
        return refs


_BaseTrainer = compat.ppo_trainer.PPOTrainer.__ray_actor_class__  # the class behind OpenRLHF's trainer actor


class StarePPOTrainer(_BaseTrainer):
    """OpenRLHF's single-controller trainer (the class behind ``PPOTrainer``), whose samples generator is
    ``StareSamplesGenerator`` unless ``seeded_rollouts`` is off, its step started where ``fit`` restarts."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if seeded_rollouts_on():
            StareSamplesGenerator.install(self.samples_generator, run_seed(self.args))

    def init_checkpoint_states(self):
        states = super().init_checkpoint_states()  # what fit restarts from: its global_step and loader state
        if isinstance(self.samples_generator, StareSamplesGenerator):
            self.samples_generator.start_at(states.get(compat.CLIENT_GLOBAL_STEP) or 0)
        return states


def register() -> None:
    """Make OpenRLHF's driver create ``StarePPOTrainer`` for its ``PPOTrainer`` and ``StareRolloutActor`` for its vLLM
    engines (``create_vllm_engines`` looks ``RolloutRayActor`` up in its module when it runs)."""
    import ray

    compat.ppo_trainer.PPOTrainer = ray.remote(StarePPOTrainer)
    compat.vllm_engine.RolloutRayActor = ray.remote(StareRolloutActor)
