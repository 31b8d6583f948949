"""Several engines for one evaluation (``stare eval --engines N``): each a Ray actor holding one backend, every
problem's samples handed back as soon as it completes.

How problems are dealt follows ``--batching`` (``stare.eval.batching``): with ``all`` (or ``invariant``) the problems
not yet done are dealt among the engines up front, in turn (problem i to engine i mod N, so each engine gets easy and
hard ones alike), and each engine puts its whole share in flight at once (``Engine.stream``, a Ray streaming
generator that yields each problem as it completes); with ``problem`` each engine gets one problem at a time, the next
one queued behind it (``IN_FLIGHT``), dealt to whichever engine is free.

Ray is imported here only, when a pool is made, so a one-engine evaluation never starts Ray. An engine is built in
its actor's process by ``factory()`` (a picklable callable that returns a backend: ``HFBackend``, ``VLLMBackend``,
or one wrapped for tool use); it asks Ray for ``gpus`` GPUs where the cluster has GPUs and for none on a CPU-only
cluster. A problem's seeds depend only on (seed, its position, k) (``problem_seed``), not on which engine draws
them, so any N draws every sample from the same seeds (what that gives bit for bit: ``stare.eval.batching``); the
problems come back in the order they complete.

An engine that dies (its process killed, its node lost) has its unfinished problems dealt again among the others, with
one warning line; when none is left the pool raises ``EngineError`` (one line). A problem that fails inside a live
engine (an exception from ``generate``) stops the run as it would with one engine.
"""
from __future__ import annotations

import logging
import os
from collections import deque

from .backends import PromptTooLong
from .harness import sample_stream, stderr_warning
from .protocols import problem_seed

IN_FLIGHT = 2  # problems queued per engine: the next one waits in the actor while the driver scores the last


class EngineError(RuntimeError):
    """The engines cannot start (too few GPUs, a backend that fails to load) or none is left (one line)."""


class Engine:
    """The actor: one backend, built in the actor's own process."""

    def __init__(self, factory):
        self.backend = factory()

    def info(self) -> dict:
        b = self.backend
        return {"name": b.name, "context_length": getattr(b, "context_length", None),
                "tools_info": getattr(b, "tools_info", None), "pid": os.getpid()}

    def prompt_text(self, problem: str, instruction: str) -> str:
        return self.backend.prompt_text(problem, instruction)

    def prompt_tokens(self, prompt: str) -> int:
        return self.backend.prompt_tokens(prompt)

    def sample(self, problem: str, instruction: str, n: int, proto, seed: int):
        """One problem's n samples, or ("too_long", prompt tokens, context) when its prompt does not fit."""
        prompt = self.backend.prompt_text(problem, instruction)
        try:
            return self.backend.generate(prompt, n, proto, seed)
        except PromptTooLong as err:
            return _wire(err)

    def stream(self, todo: list, proto, seed: int, batching: str):
        """Every ``(index, problem)`` of ``todo`` in flight at once on this engine (``harness.sample_stream``);
        yields ``(index, samples)`` as each completes (called as a Ray streaming generator)."""
        for i, result in sample_stream(self.backend, todo, proto, seed, batching):
            yield i, _wire(result)


def _wire(result):
    """A result as it crosses to the driver: a ``PromptTooLong`` as a plain tuple."""
    if isinstance(result, PromptTooLong):
        return ("too_long", result.prompt_tokens, result.context_length)
    return result


def _unwire(result):
    if isinstance(result, tuple) and result and result[0] == "too_long":
        return PromptTooLong(result[1], result[2])
    return result


def one_line(exc: BaseException) -> str:
    """The last line of an error: for an error from a Ray actor, the cause after its traceback."""
    text = str(exc).strip()
    return text.splitlines()[-1] if text else type(exc).__name__


def start_ray(address: str | None, engines: int):
    """Connect to the cluster at ``address``, or start a small local one sized for ``engines`` engines (CPU slots:
    at least one per engine); no dashboard, actors' logs not copied to this terminal. Returns the ray module and
    whether this process started the cluster (then it shuts it down).

    Within a bound (``stare.eval.ray_attach``), or ``EngineError`` (one line): a cluster is first attached to by a
    probe in a child process (an unreachable port, or a driver that cannot see its node's raylet socket, would
    otherwise wait or die with a native stack trace), and one empty task must run right after ``ray.init`` (a Ray
    whose workers never register would otherwise leave the engines pending for good)."""
    import warnings

    import ray

    from .ray_attach import (LOCAL_HEAD_CONFIG, RayAttachError, check_attach, check_reachable, check_workers,
                             session_logs)

    if ray.is_initialized():
        return ray, False
    if address is not None:
        try:
            check_reachable(address)
            check_attach(address)
        except RayAttachError as exc:
            raise EngineError(str(exc)) from None
    # Ray 2.55 warns that a later Ray will stop hiding GPUs from actors that ask for none; engines ask for GPUs
    # wherever the cluster has any, so either way is the same here
    warnings.filterwarnings("ignore", message="Tip: In future versions of Ray", category=FutureWarning)
    kwargs = dict(include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING,
                  configure_logging=True)
    where = f"the Ray cluster at {address}"
    if address is None:  # "local": a new Ray, never one another job started on this machine
        address, kwargs["num_cpus"] = "local", max(os.cpu_count() or 1, engines)
        kwargs["_system_config"] = LOCAL_HEAD_CONFIG
        where = "the Ray started here for the engines"
    ray.init(address=address, **kwargs)
    try:
        check_workers(ray, where, logs=session_logs(ray))
    except RayAttachError as exc:
        ray.shutdown()
        raise EngineError(str(exc)) from None
    return ray, True


class EnginePool:
    """``engines`` actors running ``factory``'s backend; the interface ``run_eval`` uses (``name``,
    ``context_length``, ``prompt_text``, ``prompt_tokens``, ``tools_info``) plus ``stream``, which draws many
    problems at once. Use as a context manager: leaving it ends the actors (and the local Ray it started)."""

    def __init__(self, factory, engines: int, *, gpus: int = 1, ray_address: str | None = None, warn=None):
        if engines < 1:
            raise ValueError(f"--engines must be >= 1, got {engines}")
        self.ray, self._own_ray = start_ray(ray_address, engines)
        self.warn = warn or stderr_warning
        self.engines = engines
        self.actors: list = []  # filled as they are created, so close() ends them even when one fails to start
        try:
            self._start(factory, engines, gpus)
        except BaseException:
            self.close()
            raise
        self.alive = set(range(engines))

    def _start(self, factory, engines: int, gpus: int) -> None:
        ray = self.ray
        have = ray.cluster_resources()
        if have.get("GPU", 0) > 0:
            options = {"num_gpus": gpus, "num_cpus": 1}
            need, unit = engines * gpus, "GPU"
        else:
            options = {"num_gpus": 0, "num_cpus": 1}
            need, unit = engines, "CPU"
        if have.get(unit, 0) < need:
            per = f" ({gpus} per engine)" if unit == "GPU" else ""
            raise EngineError(f"--engines {engines} needs {need} {unit}s in the Ray cluster{per}; it has "
                              f"{have.get(unit, 0):g}")
        remote = ray.remote(Engine)
        self.actors = [remote.options(**options).remote(factory) for _ in range(engines)]
        infos = []
        for e, actor in enumerate(self.actors):
            try:
                infos.append(ray.get(actor.info.remote()))
            except Exception as exc:  # the backend failed to load in the actor (the last line of its error)
                raise EngineError(f"engine {e + 1} of {engines} did not start: {one_line(exc)}") from None
        self.name = infos[0]["name"]
        self.context_length = infos[0]["context_length"]
        self.tools_info = infos[0]["tools_info"]
        self.pids = [i["pid"] for i in infos]

    def _ask(self, method: str, *args):
        """One call on a live engine (the next one when an engine is found dead)."""
        from ray.exceptions import RayActorError

        while self.alive:
            e = min(self.alive)
            try:
                return self.ray.get(getattr(self.actors[e], method).remote(*args))
            except RayActorError as exc:
                self._lost(e, exc)
        raise EngineError(f"all {self.engines} engines died")

    def _lost(self, e: int, exc: BaseException) -> None:
        """Engine ``e`` is dead: one warning, or ``EngineError`` when it was the last."""
        if e not in self.alive:
            return
        self.alive.discard(e)
        if not self.alive:
            raise EngineError(f"all {self.engines} engines died (the last: {one_line(exc)})") from None
        self.warn(f"engine {e + 1} of {self.engines} died ({one_line(exc)}); its problems go to the "
                  f"{len(self.alive)} left")

    def prompt_text(self, problem: str, instruction: str) -> str:
        return self._ask("prompt_text", problem, instruction)

    def prompt_tokens(self, prompt: str) -> int:
        return self._ask("prompt_tokens", prompt)

    def stream(self, todo, proto, seed: int, batching: str = "all"):
        """Yield ``(index, samples)`` for every ``(index, problem)`` of ``todo`` as each completes (``samples`` is
        what ``generate`` returns, or a ``PromptTooLong``); problem ``index`` draws from ``problem_seed(seed, index,
        k)`` on whichever engine runs it. ``batching`` ``problem``: one problem at a time per engine; else each
        engine's share all at once (module docstring)."""
        if batching == "problem":
            yield from self._one_at_a_time(todo, proto, seed)
        else:
            yield from self._shares(todo, proto, seed, batching)

    def _shares(self, todo, proto, seed: int, batching: str):
        """Deal ``todo`` among the live engines in turn, each share in flight at once on its engine; the problems
        of an engine that dies are dealt again among the others."""
        from ray.exceptions import RayActorError, WorkerCrashedError

        ray = self.ray
        running: dict = {}  # streaming generator -> (engine, {index: problem} not yet returned)

        def deal(items) -> None:
            live = sorted(self.alive)
            for n, e in enumerate(live):
                share = items[n::len(live)]
                if share:
                    gen = self.actors[e].stream.options(num_returns="streaming").remote(share, proto, seed, batching)
                    running[gen] = (e, dict(share))

        deal(list(todo))
        while running:
            ready, _ = ray.wait(list(running), num_returns=1)
            gen = ready[0]
            e, left = running[gen]
            try:
                i, result = ray.get(next(gen))
            except StopIteration:
                running.pop(gen)
                if left:  # the engine ended its share without these: a broken engine, not a lost one
                    raise EngineError(f"engine {e + 1} of {self.engines} ended without {len(left)} of its problems")
                continue
            except (RayActorError, WorkerCrashedError) as exc:
                running.pop(gen)
                lost = [(i, p) for i, p in sorted(left.items())]
                for other, (oe, oleft) in list(running.items()):  # every share of the dead engine
                    if oe == e:
                        running.pop(other)
                        lost += sorted(oleft.items())
                self._lost(e, exc)
                deal(sorted(lost))
                continue
            left.pop(i, None)
            yield i, _unwire(result)

    def _one_at_a_time(self, todo, proto, seed: int):
        """One problem per call, ``IN_FLIGHT`` queued per engine, each to whichever engine is free."""
        from ray.exceptions import RayActorError, WorkerCrashedError

        ray = self.ray
        queue = deque(todo)
        running: dict = {}  # object ref -> (engine, (index, problem))
        load = {e: 0 for e in self.alive}

        def fill():
            for e in sorted(self.alive):
                while queue and load[e] < IN_FLIGHT:
                    i, p = queue.popleft()
                    ref = self.actors[e].sample.remote(p.problem, proto.instruction, proto.k, proto,
                                                       problem_seed(seed, i, proto.k))
                    running[ref] = (e, (i, p))
                    load[e] += 1

        fill()
        while running:
            (ref,), _ = ray.wait(list(running), num_returns=1)
            e, (i, p) = running.pop(ref)
            load[e] -= 1
            try:
                result = ray.get(ref)
            except (RayActorError, WorkerCrashedError) as exc:
                queue.appendleft((i, p))  # redone elsewhere; its other queued problems come back the same way
                self._lost(e, exc)
                fill()
                continue
            fill()
            yield i, _unwire(result)

    def close(self) -> None:
        """End the actors, and the local Ray this pool started."""
        for actor in self.actors:
            try:
                self.ray.kill(actor)
            except Exception:  # already dead
                pass
        if self._own_ray:
            self.ray.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
