"""What ``stare run`` trains: the arms and the seeds per arm of a preset (local or GPU), each arm's settings resolved.

The arms are ``--algos`` when given, else the preset's ``algos`` setting, each once per combination of the
``--sweep`` values (``stare.cli.sweep``: arms named ``<algo>[KEY=V]``); the seeds ``--seeds``, else the ``seeds``
setting. Both settings take ``--set`` like any other and are checked by ``stare.cli.presets.resolve`` (the
schema's words, as ``stare train --set`` reports them). No torch import here: a bad flag fails in a moment.

``plan_json`` is the plan ``stare run --dry-run`` prints, one shape for both engines: every step (arm x seed x
step) with the decision the run makes for it (``KEPT`` / ``RESUME`` / ``NEW``, the same code as the run's), where
the comparison goes, and how many steps are kept and to run; then each engine's own keys.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from stare.algorithms.registry import parse_algorithm_list

from .presets import PresetError, load_preset, resolve
from .sweep import expand, parse_label, parse_sweeps

KEPT, RESUME, NEW = "kept", "resume", "new"  # what the run does with a step: finished, interrupted, not started


def plan_json(preset: str, out, arms: list[str], seeds: int, steps: list[dict], **engine) -> dict:
    """``stare run --dry-run``'s plan: the preset, the folder, the arms and seeds, the engine's own keys
    (``engine``, in the order given), then ``steps`` (each ``{"step", "arm", "seed", "out", "state", ...}``: a GPU
    preset's ``train`` and ``eval`` child processes; a local preset's one ``train`` job per arm and seed, which
    ends with its held-out evaluation), the comparison's path, and the counts of kept steps and steps to run."""
    return {"preset": preset, "out": str(out), "arms": arms, "seeds": seeds, **engine, "steps": steps,
            "comparison": str(Path(out) / "comparison.md"), "kept": sum(s["state"] == KEPT for s in steps),
            "to_run": sum(s["state"] != KEPT for s in steps)}


@dataclass
class RunSet:
    preset: str
    arms: list[str]  # the arms' names (and folders): the algorithm, or algo[KEY=V,...] in a sweep
    seeds: int
    resolved: dict[str, dict]  # arm -> its resolved settings (presets.resolve)
    backend: str = "local"  # local | openrlhf (the preset's)
    sweeps: dict[str, list[str]] = field(default_factory=dict)  # --sweep: key -> the values as typed

    def algo(self, arm: str) -> str:
        return self.resolved[arm]["algo"]["name"]

    def swept(self, arm: str) -> list[str]:
        """The ``--set KEY=V`` items that make ``arm`` what it is in the sweep (none without one)."""
        parsed = parse_label(arm) if self.sweeps else None
        return [f"{k}={v}" for k, v in parsed[1].items()] if parsed else []

    @property
    def settings(self) -> dict:
        """The run settings the arms share (the preset's, ``--set`` applied)."""
        return next(iter(self.resolved.values()))["settings"]


def parse_arms(text: str, flag: str = "--algos") -> list[str]:
    """The algorithms of a comma-separated ``flag`` value; ``PresetError`` naming the flag and the value for none, an
    unknown one or one named twice (``registry.parse_algorithm_list``)."""
    try:
        return parse_algorithm_list(text)
    except ValueError as exc:
        raise PresetError(f"{flag} {text!r}: {exc}") from None


def resolve_run_set(preset: str, sets: list[str], *, algos: str | None = None, seeds: int | None = None,
                    sweeps: list[str] | None = None) -> RunSet:
    """The arms (``algos``, a comma-separated ``--algos``, else the ``algos`` setting; each once per combination of
    the ``sweeps``, ``--sweep KEY=V1,V2,...`` items), the seeds per arm (``seeds``, else the ``seeds`` setting) and
    each arm's resolved settings, ``--set`` applied. ``PresetError`` for any bad flag or setting."""
    p = load_preset(preset)
    swept = parse_sweeps(sweeps or [])
    arms = parse_arms(algos) if algos is not None else None  # given, even empty: what was given is what is checked
    # the preset's first arm stands in until the arms are known: the algos and seeds settings do not depend on it
    first = resolve(preset, arms[0] if arms else parse_arms(p.settings["algos"], "algos")[0], sets)
    arms = arms or parse_arms(first["settings"]["algos"], "--set algos")
    if swept:
        resolved = expand(preset, arms, sets, swept)
    else:
        resolved = {a: first if a == first["algo"]["name"] else resolve(preset, a, sets) for a in arms}
    return RunSet(p.name, list(resolved), seeds or first["settings"]["seeds"], resolved, p.backend,
                  swept)  # a file preset: its name


# the flags of ``stare run`` that a setting also gives: both at once is refused (which one would win is a guess)
FLAG_SETTINGS = {"--algos": "algos", "--seeds": "seeds", "--bench": "benches"}


def check_flags_against_sets(sets: list[str], flags: dict[str, object]) -> None:
    """``PresetError`` when a flag of ``FLAG_SETTINGS`` is given (``flags``: flag -> value or None) and a ``--set`` of
    its setting too, naming both values."""
    from .presets import parse_sets

    given = dict(parse_sets(sets))
    for flag, key in FLAG_SETTINGS.items():
        if flags.get(flag) is not None and key in given:
            raise PresetError(f"{flag} {flags[flag]} and --set {key}={given[key]} are both given; give one of them "
                              f"({flag} sets the {key} setting)")


def inert_sets(sets: list[str], resolved: dict[str, dict]) -> list[str]:
    """A warning line for each ``--set`` algorithm setting that none of the arms reads (``AlgoConfig.unused_settings``:
    ``w`` on grpo, ``band_low`` under the paper gate), with why; ``resolved``: arm -> its resolved settings. Such a
    value changes no weight and no number, so it is said, not refused: one ``--set`` list often serves several
    algorithms."""
    from .presets import parse_sets
    from .sweep import resolved_unused

    unused = {arm: resolved_unused(r) for arm, r in resolved.items()}
    lines = []
    for key, raw in parse_sets(sets):
        if unused and all(key in u for u in unused.values()):
            why = next(iter(unused.values()))[key]  # the first arm's reason
            lines.append(f"--set {key}={raw} changes nothing for {', '.join(unused)}: {why}")
    return lines
