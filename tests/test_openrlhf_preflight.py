"""What the pinned OpenRLHF would assert (or hang on) at run time, refused up front by `stare train` (and `--dry-run`):
one line naming our settings, exit 2. Each refusal is confirmed against OpenRLHF's (or DeepSpeed's) own code run
on the same numbers: the check refuses what that code fails on, and accepts the boundary case it accepts.

Also: Ray starts without its dashboard unless the ``ray_dashboard`` setting says so."""
from __future__ import annotations

import json
import shlex
import sys
from types import SimpleNamespace as ns

import pytest
import torch
from typer.testing import CliRunner

from stare.algorithms import ALGORITHMS
from stare.cli.main import app
from stare.cli.openrlhf_backend import launch as orl
from stare.cli.gpu_schema import SettingsError
from stare.cli.openrlhf_backend.argv import check_settings
from stare.cli.presets import load_preset, preset_names, resolve

pytest.importorskip("openrlhf")
pytest.importorskip("ray")
from test_openrlhf_argv import EXTRA_SETS, GPU_PRESETS, parse_with_openrlhf  # noqa: E402

runner = CliRunner()
LOCAL_PRESETS = [n for n in preset_names() if load_preset(n).backend == "local"]


def dry_run(preset: str, algo: str, *sets: str):
    args = ["train", "--preset", preset, "--algo", algo, "--out", "runs/x", "--dry-run"]
    for s in (*EXTRA_SETS.get(preset, []), *sets):
        args += ["--set", s]
    return runner.invoke(app, args, terminal_width=200)


def refused(res) -> str:
    """The one error line of a refused dry run (exit 2, nothing on stdout, no traceback)."""
    assert res.exit_code == 2, (res.exit_code, res.stdout, res.stderr, res.exception)
    assert res.stdout == ""
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in res.stderr, res.stderr
    return lines[0]


def accepted(res) -> dict:
    assert res.exit_code == 0, (res.stdout, res.stderr, res.exception)
    return json.loads(res.stdout)


def experiences(lengths):
    """What OpenRLHF's length penalty reads of an Experience: response lengths and rewards (zeros)."""
    return [ns(response_length=torch.tensor(lengths), rewards=torch.zeros(len(lengths)))]


# --- every preset x every algorithm -----------------------------------------------------------------------------

# what the GPU memory plan refuses on 80 GiB cards (tests/test_gpu_memory.py has the numbers): the entropy bonus on
# the long chain-of-thought presets, whose float32 logits with two gradients outgrow the card at their token budgets
MEMORY_REFUSED = {("qwen-1.5b-long-cot", "entropy-adaptive"), ("qwen-7b-long-cot", "entropy-adaptive")}

@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_every_gpu_preset_and_algorithm_passes_the_preflight_and_openrlhfs_own_checks(preset, monkeypatch, tmp_path):
    from openrlhf.trainer.ppo_utils.length_penalty import apply_overlong_penalty

    for algo in ALGORITHMS:
        res = dry_run(preset, algo)
        if (preset, algo) in MEMORY_REFUSED:  # the memory plan's refusal: the plan printed, then one line
            assert res.exit_code == 2 and json.loads(res.stdout)["memory"]["verdict"] == "does not fit"
            lines = [x for x in res.stderr.splitlines() if x.strip()]
            assert len(lines) == 1 and lines[0].startswith("error: this layout does not fit the GPU: train: ")
            res = dry_run(preset, algo, "memory_check=warn")  # launched anyway: the argv must still be OpenRLHF's
        if res.exit_code != 0:  # a refusal must be one line; no other shipped combination is refused
            pytest.fail(f"{preset} x {algo} refused: {refused(res)}")
        plan = accepted(res)
        args = parse_with_openrlhf(plan["openrlhf_argv"], monkeypatch)  # OpenRLHF's parser and argument asserts
        cfg = resolve(preset, algo, EXTRA_SETS.get(preset, []))["algo"]
        if cfg["overlong_shaping"]:
            # OpenRLHF's own reward shaping on these numbers: a full-length response gets the whole penalty, one
            # that stops where the zone starts none (and nothing asserts)
            limit, buf = args.rollout.max_new_tokens, args.reward.overlong_buffer_len
            exps = experiences([limit, limit - buf])
            assert apply_overlong_penalty(exps, limit, buf, args.reward.overlong_penalty_factor) == 1
            assert exps[0].rewards.tolist() == [-cfg["overlong_penalty"], 0.0]


def test_the_overlong_algorithms_are_the_ones_the_short_cot_presets_override():
    overlong = {n for n, c in ALGORITHMS.items() if c.overlong_shaping}
    assert overlong == {"dapo", "80-20"}
    for preset in ("qwen-7b-short-cot", "qwen-14b-short-cot", "qwen-32b-short-cot"):
        s = load_preset(preset).settings
        for algo in overlong:
            buf = resolve(preset, algo)["algo"]["overlong_buffer_len"]
            # DAPO's ratio (4096 of 20480 response tokens) on this preset's limit, rounded down
            assert buf == s["max_response_len"] * 4096 // 20480 == 614, (preset, algo)


@pytest.mark.parametrize("preset", LOCAL_PRESETS)
def test_every_local_preset_and_algorithm_resolves_with_a_buffer_that_fits(preset):
    from stare.algorithms import overlong_penalty

    limit = load_preset(preset).settings["max_new_tokens"]
    for algo in ALGORITHMS:
        res = dry_run(preset, algo)
        cfg = accepted(res)["algo"]
        if cfg["overlong_shaping"]:  # the local engine's own penalty accepts it, and a short reply is not penalised
            pen = overlong_penalty(torch.tensor([1, limit]), max_len=limit, buffer_len=cfg["overlong_buffer_len"])
            assert pen.tolist() == [0.0, -1.0], (preset, algo)


# --- overlong buffer --------------------------------------------------------------------------------------------

def test_an_overlong_buffer_past_the_response_limit_is_refused_as_openrlhf_asserts():
    from openrlhf.trainer.ppo_utils.length_penalty import apply_overlong_penalty

    # what the 3k presets built before: the registry's 4096 against 3072 (OpenRLHF asserted at the first step)
    for algo in ("dapo", "80-20"):
        line = refused(dry_run("qwen-7b-short-cot", algo, "overlong_buffer_len=4096"))
        assert "overlong_buffer_len (4096) must be <= max_response_len (3072)" in line and algo in line, line
    with pytest.raises(AssertionError, match=r"max_new_tokens \(3072\) must be >= overlong_buffer_len \(4096\)"):
        apply_overlong_penalty(experiences([10]), 3072, 4096)
    # the boundary: one token past the limit is refused by both, the whole limit accepted by both
    assert "overlong_buffer_len (3073)" in refused(dry_run("qwen-7b-short-cot", "dapo", "overlong_buffer_len=3073"))
    with pytest.raises(AssertionError):
        apply_overlong_penalty(experiences([10]), 3072, 3073)
    plan = accepted(dry_run("qwen-7b-short-cot", "dapo", "overlong_buffer_len=3072"))
    assert plan["openrlhf_argv"][plan["openrlhf_argv"].index("--reward.overlong_buffer_len") + 1] == "3072"
    apply_overlong_penalty(experiences([10]), 3072, 3072)
    # shrinking the limit under the preset's buffer is caught the same way; an algorithm without shaping is free
    line = refused(dry_run("qwen-14b-short-cot", "80-20", "max_response_len=600"))
    assert "overlong_buffer_len (614) must be <= max_response_len (600)" in line
    accepted(dry_run("qwen-14b-short-cot", "grpo", "max_response_len=600"))


def test_the_local_engine_refuses_an_overlong_buffer_too():
    from stare.algorithms import overlong_penalty

    line = refused(dry_run("tiny-cpu", "80-20", "overlong_buffer_len=10"))
    assert "overlong_buffer_len (10) must be <= max_new_tokens (9)" in line and "80-20" in line
    line = refused(dry_run("smollm-cpu", "dapo", "max_new_tokens=1"))
    assert "overlong_buffer_len (2) must be <= max_new_tokens (1)" in line
    with pytest.raises(ValueError):  # the local engine's own penalty refuses it as well
        overlong_penalty(torch.tensor([3]), max_len=9, buffer_len=10)
    accepted(dry_run("tiny-cpu", "80-20", "overlong_buffer_len=9"))


# --- one sample per prompt --------------------------------------------------------------------------------------

def _with_flag(argv: list[str], flag: str, value) -> list[str]:
    argv = list(argv)
    argv[argv.index(flag) + 1] = str(value)
    return argv


def test_one_sample_per_prompt_is_refused_as_openrlhfs_parser_asserts(monkeypatch, tmp_path):
    line = refused(dry_run("qwen-7b-short-cot", "grpo", "samples_per_prompt=1", "prompts_per_step=512"))
    assert "samples_per_prompt must be >= 2" in line and "got 1" in line
    accepted(dry_run("qwen-7b-short-cot", "grpo", "samples_per_prompt=2", "prompts_per_step=256"))
    good = orl.plan(resolve("qwen-7b-short-cot", "grpo"), tmp_path)["openrlhf_argv"]
    for estimator in ("group_norm", "dr_grpo"):  # the two our algorithms map to
        argv = _with_flag(_with_flag(good, "--rollout.n_samples_per_prompt", 1), "--algo.advantage.estimator",
                          estimator)
        with pytest.raises(AssertionError, match="requires n_samples_per_prompt > 1"):
            parse_with_openrlhf(argv, monkeypatch)


# --- rollout micro-batches and actor ranks ----------------------------------------------------------------------

# 8 prompts x 8 samples = 64 sequences on the preset's 8 ranks
SMALL = ("prompts_per_step=8", "samples_per_prompt=8", "train_batch_size=64")


def test_fewer_rollout_micro_batches_than_actor_ranks_is_refused_as_openrlhfs_parser_asserts(monkeypatch, tmp_path):
    line = refused(dry_run("qwen-7b-short-cot", "grpo", *SMALL, "rollout_micro_batch_size=16"))
    assert "rollout_micro_batch_size (16) = 4 rollout micro-batches must be >=" in line
    assert "gpus_per_node x nodes (8 x 1 = 8 actor ranks)" in line
    accepted(dry_run("qwen-7b-short-cot", "grpo", *SMALL, "rollout_micro_batch_size=8"))  # 8 micro-batches: enough
    good = orl.plan(resolve("qwen-7b-short-cot", "grpo", list(SMALL)), tmp_path)["openrlhf_argv"]
    parse_with_openrlhf(_with_flag(good, "--rollout.micro_batch_size", 8), monkeypatch)
    with pytest.raises(AssertionError, match="number of sample batches must be greater than or equal"):
        parse_with_openrlhf(_with_flag(good, "--rollout.micro_batch_size", 16), monkeypatch)


def openrlhf_deal(rollout: int, micro: int, ranks: int, monkeypatch, dynamic=False, lengths=None):
    """Run OpenRLHF's own experience_maker.split_rollout_samples and launcher.async_run_method_batch on a rollout of
    ``rollout`` samples: per actor rank, (forwards, samples). Ray's put and the actors are stand-ins that record."""
    import ray
    from openrlhf.trainer.ppo_utils import experience_maker
    from openrlhf.trainer.ray.launcher import RayActorGroup

    monkeypatch.setattr(experience_maker.Experience, "concat_experiences", staticmethod(lambda items, pad: list(items)))
    monkeypatch.setattr(ray, "put", lambda x: x)
    args = ns(train=ns(dynamic_batch_enable=dynamic), rollout=ns(micro_batch_size=micro, max_tokens_per_gpu=100),
              actor=ns(num_nodes=1, num_gpus_per_node=ranks), ds=ns(ring_attn_size=1, tensor_parallel_size=1))
    lengths = lengths or [10] * rollout
    samples = [ns(total_length=torch.tensor(n)) for n in lengths]
    maker = ns(args=args, tokenizer=ns(pad_token_id=0))
    micro_batches = experience_maker.RemoteExperienceMaker.split_rollout_samples(maker, samples)

    dealt = []

    class Actor:
        class execute_batch:  # noqa: N801 - mimics a Ray actor method's .remote
            @staticmethod
            def remote(method, chunk, start, end):
                dealt.append(chunk["sequences"][start:end])

    group = ns(_actor_handlers=[Actor() for _ in range(ranks)], duplicate_actors=1)
    RayActorGroup.async_run_method_batch(group, method_name="forward", sequences=micro_batches)
    return [(len(d), sum(len(m) for m in d)) for d in dealt]


def test_the_deadlock_reproduced_on_gpus_is_what_openrlhfs_chunking_does(monkeypatch):
    # 12 samples in micro-batches of 4 on 2 ranks: 3 micro-batches, dealt 2 + 1 (the second rank's ZeRO-3 forward
    # never meets the first's)
    assert openrlhf_deal(12, 4, 2, monkeypatch) == [(2, 8), (1, 4)]
    assert openrlhf_deal(12, 2, 2, monkeypatch) == [(3, 6), (3, 6)]
    layout = ("gpus_per_node=2", "nodes=1", "vllm_engines=2", "vllm_tensor_parallel=1", "packing=false",
              "prompts_per_step=3", "samples_per_prompt=4", "train_batch_size=12", "micro_batch_size=1",
              "memory_check=off")  # the layout rule under test, not whether a 7B model fits two 80 GiB cards
    line = refused(dry_run("qwen-7b-short-cot", "grpo", *layout, "rollout_micro_batch_size=4"))
    assert ("with packing off, prompts_per_step x samples_per_prompt (3 x 4 = 12) must be a multiple of "
            "rollout_micro_batch_size x gpus_per_node x nodes (4 x 2 x 1 = 8)") in line
    accepted(dry_run("qwen-7b-short-cot", "grpo", *layout, "rollout_micro_batch_size=2"))
    # with packing OpenRLHF deals the rollout out in a multiple of the ranks itself: nothing to refuse
    lengths = [7, 30, 12, 50, 9, 41, 22, 3, 18, 27, 35, 14]
    dealt = openrlhf_deal(12, 4, 2, monkeypatch, dynamic=True, lengths=lengths)
    assert len({forwards for forwards, _ in dealt}) == 1 and sum(n for _, n in dealt) == 12
    accepted(dry_run("qwen-7b-short-cot", "grpo", *layout[:4], *layout[5:], "rollout_micro_batch_size=4"))


def _layout(rollout: int, micro: int, ranks: int, packing=False) -> dict:
    return {**load_preset("qwen-7b-short-cot").settings, "gpus_per_node": ranks, "nodes": 1, "vllm_engines": ranks,
            "vllm_tensor_parallel": 1, "packing": packing, "prompts_per_step": 1, "samples_per_prompt": rollout,
            "train_batch_size": rollout, "micro_batch_size": 1, "rollout_micro_batch_size": micro}


def test_without_packing_the_check_refuses_exactly_what_openrlhf_deals_unevenly(monkeypatch):
    """Over a grid of rollouts, micro-batch sizes and ranks: refused iff OpenRLHF's own chunking gives some rank a
    different number of forwards or of samples (among layouts its parser accepts: micro-batches >= ranks)."""
    seen = {True: 0, False: 0}
    for ranks in (1, 2, 3, 4):
        for micro in (1, 2, 3, 4, 5):
            for rollout in range(2, 41):
                if rollout // micro < ranks:
                    continue  # OpenRLHF's parser refuses these (tested above)
                dealt = openrlhf_deal(rollout, micro, ranks, monkeypatch)
                uneven = len(set(dealt)) > 1
                try:
                    check_settings(_layout(rollout, micro, ranks), "grid")
                    refused_ = False
                except SettingsError as exc:
                    assert "actor ranks get unequal micro-batches" in str(exc), str(exc)
                    refused_ = True
                assert refused_ == uneven, (rollout, micro, ranks, dealt)
                seen[uneven] += 1
    assert seen[True] > 50 and seen[False] > 50  # both kinds occur


# --- batch sizes: DeepSpeed and the dynamic batch ---------------------------------------------------------------

def deepspeed_batch_check(train_batch, micro, grad_acc, world):
    """DeepSpeed's own batch arithmetic and assertion (runtime/config.py), on the values OpenRLHF's
    DeepspeedStrategy puts in its config (get_ds_train_config / get_ds_eval_config)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = object.__new__(DeepSpeedConfig)
    cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu = train_batch, micro
    cfg.gradient_accumulation_steps, cfg.world_size = grad_acc, world
    cfg._configure_train_batch_size()


def test_a_train_batch_deepspeed_cannot_split_is_refused():
    # packing off: the actor's DeepSpeed config gets train_batch_size and micro_batch_size (512 over 3 x 8: no)
    line = refused(dry_run("qwen-7b-short-cot", "grpo", "packing=false", "micro_batch_size=3"))
    assert ("with packing off, train_batch_size (512) must be a multiple of micro_batch_size x gpus_per_node x "
            "nodes (3 x 8 x 1 = 24)") in line
    with pytest.raises(AssertionError, match="Check batch related parameters"):
        deepspeed_batch_check(512, 3, None, 8)
    accepted(dry_run("qwen-7b-short-cot", "grpo", "packing=false", "micro_batch_size=2"))
    deepspeed_batch_check(512, 2, None, 8)
    # packing: the actor's config is micro 1 x accumulation 1, whatever micro_batch_size says ...
    accepted(dry_run("qwen-7b-short-cot", "grpo", "micro_batch_size=3"))
    deepspeed_batch_check(None, 1, 1, 8)
    # ... but a reference model (kl_coef > 0) gets train_batch_size and micro_batch_size even then
    line = refused(dry_run("qwen-7b-short-cot", "grpo", "micro_batch_size=3", "kl_coef=0.01"))
    assert "with kl_coef > 0 (a reference model), train_batch_size (512) must be a multiple of" in line


def test_a_train_batch_smaller_than_the_ranks_is_refused_with_packing():
    from openrlhf.trainer.ppo_utils import replay_buffer

    line = refused(dry_run("qwen-7b-short-cot", "grpo", "train_batch_size=4"))
    assert "with packing, train_batch_size (4) must be >= gpus_per_node x nodes (8 x 1 = 8 actor ranks)" in line
    accepted(dry_run("qwen-7b-short-cot", "grpo", "train_batch_size=8"))

    def setup(train_batch, ranks=8):  # OpenRLHF's own per-step split of the replay buffer, up to its first collective
        class Reached(Exception):
            pass

        strategy = ns(args=ns(train=ns(batch_size=train_batch, max_tokens_per_gpu=100),
                              rollout=ns(batch_size=64, n_samples_per_prompt=8)),
                      ds_device_mesh={"dp": ns(get_group=lambda: None)})
        buffer = ns(items=[ns(total_length=torch.tensor(10)) for _ in range(512 // ranks)])
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(replay_buffer.dist, "get_world_size", lambda group=None: ranks)
            mp.setattr(replay_buffer.torch.cuda, "current_device", lambda: (_ for _ in ()).throw(Reached()))
            with pytest.raises(Reached):
                replay_buffer.NaiveReplayBuffer.setup_dynamic_batch(buffer, strategy)

    setup(8)
    with pytest.raises(ZeroDivisionError):
        setup(4)


def test_the_reference_model_gets_the_actors_layout(tmp_path):
    """train_ppo_ray.py train() asserts the reference model's nodes and GPUs equal the actor's when colocated: we
    always build them equal, so there is nothing to refuse."""
    argv = orl.plan(resolve("qwen-32b-short-cot", "grpo", ["kl_coef=0.01"]), tmp_path)["openrlhf_argv"]

    def value(flag):
        return argv[argv.index(flag) + 1]

    assert (value("--ref.num_nodes"), value("--ref.num_gpus_per_node")) == \
        (value("--actor.num_nodes"), value("--actor.num_gpus_per_node")) == ("4", "8")


# --- the Ray dashboard ------------------------------------------------------------------------------------------

class Stop(Exception):
    pass


def capture_ray_init(monkeypatch) -> list[dict]:
    import ray

    calls = []

    def fake_init(**kwargs):
        calls.append(kwargs)
        raise Stop

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return calls


def test_ray_init_takes_include_dashboard():
    import inspect

    import ray

    assert inspect.signature(ray.init).parameters["include_dashboard"].default is None  # None: on when installed


@pytest.mark.parametrize("sets, want", [([], False), (["ray_dashboard=true"], True)])
def test_launch_starts_ray_without_its_dashboard_unless_the_setting_says(sets, want, monkeypatch, tmp_path):
    calls = capture_ray_init(monkeypatch)
    plan = orl.plan(resolve("qwen-7b-short-cot", "grpo", sets), tmp_path)
    assert plan["ray"]["dashboard"] is want
    env = plan["ray"]["runtime_env"]["env_vars"]
    with pytest.raises(Stop):
        orl.launch(plan["openrlhf_argv"], ray_address=None, dashboard=plan["ray"]["dashboard"], environ=env)
    assert calls[-1]["include_dashboard"] is want and calls[-1]["address"] is None
    # the printed command: its environment carries the setting, and launch.main (what it runs) reads it
    words = shlex.split(plan["command"])
    for word in words[: words.index("python")]:
        key, value = word.split("=", 1)
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(sys, "argv", words[words.index("python") + 2:])
    with pytest.raises(Stop):
        orl.main()
    assert calls[-1]["include_dashboard"] is want and calls[-1]["address"] is None
    assert words[: words.index("python")].count(f"STARE_RAY_DASHBOARD={int(want)}") == 1


def test_stare_train_passes_the_setting_to_launch(monkeypatch, tmp_path):
    from stare.cli.openrlhf_backend import data

    seen = {}
    for key in orl.plan(resolve("qwen-7b-short-cot", "grpo"), tmp_path)["ray"]["runtime_env"]["env_vars"]:
        monkeypatch.setenv(key, "")  # start() exports the workers' variables: restored afterwards
    monkeypatch.setattr(data, "prepare_prompts", lambda *a, **k: {"problems": 1, "rows": 1})
    monkeypatch.setattr(orl, "launch", lambda argv, **kw: seen.update(kw))
    for sets, want in (([], False), (["ray_dashboard=true"], True)):
        resolved = resolve("qwen-7b-short-cot", "grpo", sets)
        plan = orl.plan(resolved, tmp_path)
        (tmp_path / "data").mkdir(exist_ok=True)
        orl.start(resolved, plan, log=lambda *a: None)
        assert seen == {"ray_address": None, "dashboard": want}


@pytest.mark.parametrize("address, env", [("10.0.0.1:6379", None), ("ray://head:10001", None), (None, "auto")])
def test_joining_a_cluster_passes_no_include_dashboard(address, env, monkeypatch, tmp_path):
    """Joining, the cluster's head has decided: Ray ignores include_dashboard for HOST:PORT and forwards it to a
    ray.init on the cluster for ray://, so it is not passed at all (RAY_ADDRESS is an address too)."""
    calls = capture_ray_init(monkeypatch)
    if env:
        monkeypatch.setenv("RAY_ADDRESS", env)
    plan = orl.plan(resolve("qwen-7b-short-cot", "grpo", ["ray_dashboard=true"]), tmp_path, address)
    assert bool(address) == any("ray_dashboard" in n for n in plan["notes"])
    with pytest.raises(Stop):
        orl.launch(plan["openrlhf_argv"], ray_address=address, dashboard=True,
                   environ=plan["ray"]["runtime_env"]["env_vars"])
    assert "include_dashboard" not in calls[-1] and calls[-1]["address"] == address


def test_a_bad_dashboard_variable_is_one_line(monkeypatch):
    monkeypatch.setenv("STARE_RAY_DASHBOARD", "maybe")
    with pytest.raises(orl.LaunchError, match="STARE_RAY_DASHBOARD='maybe': expected 0 or 1"):
        orl.dashboard_from_env()
    assert orl.dashboard_from_env({"STARE_RAY_DASHBOARD": "1"}) and not orl.dashboard_from_env({})


def test_a_gpu_run_folder_from_before_the_dashboard_setting_resumes_with_it_on_or_off(tmp_path):
    import yaml

    from stare.cli.rundir import RunDirError, check_run_dir

    resolved = resolve("qwen-7b-short-cot", "stare")
    old = {**resolved, "settings": {k: v for k, v in resolved["settings"].items() if k != "ray_dashboard"}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
    for sets in ([], ["ray_dashboard=true"]):
        assert check_run_dir(tmp_path, resolve("qwen-7b-short-cot", "stare", sets), resume=True) is True
    with pytest.raises(RunDirError, match="other settings"):  # a setting the training sees still counts
        check_run_dir(tmp_path, resolve("qwen-7b-short-cot", "stare", ["lr=2e-6"]), resume=True)
