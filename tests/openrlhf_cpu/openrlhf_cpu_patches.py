"""Test-only patches that let the pinned OpenRLHF's real ``train_ppo_ray`` loop run on a CPU-only machine.

Used by ``tests/test_openrlhf_e2e.py`` only. The product (``stare_cli/``) never patches OpenRLHF: on GPUs it runs
OpenRLHF as released. ``sitecustomize.py`` beside this file installs the patches at interpreter start-up in every
process of a run (the ``stare train`` driver, Ray's actors, and the EngineCore and Worker processes vLLM spawns,
which load OpenRLHF's ``WorkerWrap`` by name), when ``STARE_E2E_CPU_PATCHES=1`` and this folder is on
``PYTHONPATH``.

Each patch names what it replaces and why. A post-import hook applies it right after its module is first
imported, and first checks that the code it replaces still looks the way this file was written against (a marker
in the original's source). When it does not, the hook raises ``PatchDoesNotApply`` and the import fails, so an
OpenRLHF, vLLM or torch upgrade that moves the code makes the end-to-end test fail instead of silently testing
something else. Every applied patch is recorded as a line in ``$STARE_E2E_PATCH_LOG`` (the test checks that all
of them ran somewhere).

Test hooks ride along: ``STARE_E2E_CRASH_AFTER_STEP=N`` makes the policy actor exit right after writing step N's
checkpoint, and ``STARE_E2E_CRASH_IN_STEP=N`` when it is handed step N's rollouts to train on (kills, for the resume
tests); ``STARE_E2E_POSITIONS=FILE`` appends to FILE, at every checkpoint, the position OpenRLHF's trainer saves with
it (episode, global step, prompts consumed, whether the prompt loader ran dry); ``STARE_E2E_SKIP_WEIGHT_LOAD=1`` makes
the vLLM worker receive each weight sync but load nothing (the negative control of the weight-sync check).
``STARE_E2E_SYNC_LOG=FILE`` records both sides of every weight sync, bit for bit (``patch_sync_checksums``), and
``STARE_E2E_SYNC_SKIP_PARAM=NAME`` plants a sync that leaves one parameter out (what that record must catch).
``STARE_E2E_ROLLOUT_LOG=FILE`` appends every step's rollouts, as the trainer is handed them, to FILE
(``patch_rollout_log``: a checksum of each sample's tokens, in the order it trains on them).
``STARE_E2E_EXTRA_ARGS`` appends OpenRLHF flags that only a CPU run needs (argparse keeps the last value of a repeated
flag). ``STARE_E2E_FP32_MATMUL=1`` makes the trainer's linear layers multiply in float32 (``patch_fp32_matmul``: speed
only, for a real model on a CPU without bf16 instructions).
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import inspect
import os
import shlex
import sys

PATCH_LOG_ENV = "STARE_E2E_PATCH_LOG"
CRASH_ENV = "STARE_E2E_CRASH_AFTER_STEP"
CRASH_IN_STEP_ENV = "STARE_E2E_CRASH_IN_STEP"
POSITIONS_ENV = "STARE_E2E_POSITIONS"
SKIP_LOAD_ENV = "STARE_E2E_SKIP_WEIGHT_LOAD"
EXTRA_ARGS_ENV = "STARE_E2E_EXTRA_ARGS"
HOLD_ENV = "STARE_E2E_HOLD"  # ALGO:SEED:STEP: that run's trainer stops (sleeps) after step STEP's checkpoint
FAIL_ENV = "STARE_E2E_FAIL_RUN"  # ALGO:SEED: that run's driver fails at launch, before Ray starts
SYNC_LOG_ENV = "STARE_E2E_SYNC_LOG"  # FILE: both sides of every weight sync append the checksum of every parameter
FP32_MATMUL_ENV = "STARE_E2E_FP32_MATMUL"  # 1: the trainer's bf16 linear layers multiply in float32 (speed)
SYNC_SKIP_ENV = "STARE_E2E_SYNC_SKIP_PARAM"  # NAME: the trainer leaves that parameter out of every sync (a planted bug)
ROLLOUT_LOG_ENV = "STARE_E2E_ROLLOUT_LOG"  # FILE: every step's rollouts (checksums, in the trainer's order) appended
HOLD_MESSAGE = "STARE e2e: holding after step {step}'s checkpoint"
CRASH_EXIT_CODE = 17


class PatchDoesNotApply(RuntimeError):
    """The code a patch replaces is not what the patch was written against (a version moved it)."""


def _record(name: str) -> None:
    path = os.environ.get(PATCH_LOG_ENV)
    if path:
        with open(path, "a") as f:
            f.write(f"{name} {os.getpid()}\n")


def _expect(obj, marker: str, patch: str) -> None:
    """Refuse to patch ``obj`` unless its source still contains ``marker``."""
    try:
        source = inspect.getsource(obj)
    except (OSError, TypeError) as exc:
        raise PatchDoesNotApply(f"patch {patch}: cannot read the source of {obj!r} ({exc})") from None
    if marker not in source:
        raise PatchDoesNotApply(f"patch {patch}: {getattr(obj, '__qualname__', obj)} no longer contains "
                                f"{marker!r}; re-read it and update tests/openrlhf_cpu/openrlhf_cpu_patches.py")


# ---- 1. torch.cuda's device functions ----------------------------------------------------------------------
def patch_torch_cuda(torch) -> None:
    """Replaces ``torch.cuda.current_device`` (returns ``"cpu"``), ``set_device``, ``synchronize`` and
    ``current_stream`` (no-ops). On the CPU build of torch they raise, and OpenRLHF calls them unconditionally
    (``BaseModelActor.empty_cache``, ``ActorPPOTrainer.__init__/ppo_train/fit/broadcast_to_vllm``,
    ``DeepspeedStrategy.setup_distributed``, ``torch_dist_barrier_and_cuda_sync``). ``is_available()`` stays
    False, and ``device=torch.cuda.current_device()`` then means the CPU."""
    if torch.version.cuda is not None:
        raise PatchDoesNotApply(f"patch torch-cuda: torch {torch.__version__} is a CUDA build; these patches are "
                                "for the CPU build only")
    cuda = torch.cuda
    cuda.current_device = lambda: "cpu"
    cuda.set_device = lambda device: None
    cuda.synchronize = lambda device=None: None
    cuda.current_stream = lambda device=None: None
    _record("torch-cuda")


# ---- 2. vLLM CPU's bf16 attention kernel and AMX ---------------------------------------------------------------
def patch_vllm_cpu_attn(module) -> None:
    """Asks Linux for the AMX tile-data permission once per process (``torch._C._cpu._init_amx``). vLLM CPU's
    ``_get_attn_isa`` picks its "amx" kernel for bf16 on CPUs that report AMX, and that kernel runs tile
    instructions without asking, so the worker dies with SIGILL on its first forward; OpenRLHF hard-codes
    ``dtype="bfloat16"`` for its engines. Harmless where the CPU has no AMX."""
    _expect(module._get_attn_isa, '"amx"', "vllm-amx")
    import torch

    if torch.cpu._is_amx_tile_supported():
        torch._C._cpu._init_amx()
    _record("vllm-amx")


# ---- 3. the replay buffer's device -----------------------------------------------------------------------------
def patch_replay_buffer(module) -> None:
    """Replaces ``NaiveReplayBuffer.__init__``'s ``target_device``: it builds ``torch.device(f"cuda:{
    torch.cuda.current_device()}")``, the device every training micro-batch is moved to; here it is the CPU."""
    cls = module.NaiveReplayBuffer
    _expect(cls.__init__, 'torch.device(f"cuda:{torch.cuda.current_device()}")', "replay-buffer")
    original = cls.__init__

    def __init__(self, *args, **kwargs):
        import torch

        current = torch.cuda.current_device
        torch.cuda.current_device = lambda: 0  # only for the f-string; replaced right after
        try:
            original(self, *args, **kwargs)
        finally:
            torch.cuda.current_device = current
        self.target_device = torch.device("cpu")

    cls.__init__ = __init__
    _record("replay-buffer")


# ---- 4. the DeepSpeed strategy's device mesh ------------------------------------------------------------------
def patch_device_mesh(module) -> None:
    """Replaces the module-level ``init_device_mesh`` that ``DeepspeedStrategy.setup_distributed`` calls with
    ``"cuda"``: the DP/SP/TP mesh is built on ``"cpu"`` (gloo)."""
    _expect(module.DeepspeedStrategy.setup_distributed, '"cuda", (dp_size', "device-mesh")
    original = module.init_device_mesh

    def init_device_mesh(device_type, *args, **kwargs):
        return original("cpu", *args, **kwargs)

    module.init_device_mesh = init_device_mesh
    _record("device-mesh")


# ---- 5. the DeepSpeed -> vLLM weight-sync group -----------------------------------------------------------------
class GlooBroadcastGroup:
    """What OpenRLHF uses of vLLM's ``PyNcclCommunicator``: ``broadcast(tensor, src, stream)``, over gloo, on a
    ``TCPStore`` with the same address, port and ranks (rank 0, the DeepSpeed side, hosts the store)."""

    def __init__(self, host: str, port: int, rank: int, world_size: int):
        from datetime import timedelta

        import torch.distributed as dist

        timeout = timedelta(seconds=600)
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
        self.group = dist.ProcessGroupGloo(dist.PrefixStore("stare-weight-sync", store), rank, world_size, timeout)

    def broadcast(self, tensor, src: int, stream=None) -> None:
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = src
        options.rootTensor = 0
        self.group.broadcast([tensor], options).wait()


def patch_sync_group(module) -> None:
    """Replaces ``distributed_util.stateless_init_process_group``: it builds vLLM's ``StatelessProcessGroup`` and a
    ``PyNcclCommunicator`` (NCCL, CUDA only). Applied when the module is imported, before ``ppo_actor.py`` imports
    the name. (``--vllm.sync_with_ray`` with gloo is no way round: Ray's gloo group calls ``dist.new_group`` on
    the default group, which DeepSpeed and vLLM have each initialised on their own.)"""
    _expect(module.stateless_init_process_group, "PyNcclCommunicator", "sync-group")

    def stateless_init_process_group(master_address, master_port, rank, world_size, device):
        return GlooBroadcastGroup(master_address, master_port, rank, world_size)

    module.stateless_init_process_group = stateless_init_process_group
    _record("sync-group")


# ---- 6. the vLLM worker's weight update ------------------------------------------------------------------------
def patch_worker_update_weight(module) -> None:
    """Replaces ``WorkerWrap.update_weight``: (a) it receives into ``torch.empty(..., device="cuda")``; here the
    worker's own device. (b) ``model_runner.model.load_weights`` fails on vLLM CPU once the engine is up (its
    linear layers' weights were prepacked for the CPU GEMM and ``weight`` removed). The broadcast tensors are kept
    until the sync's last parameter (OpenRLHF sends ``empty_cache=True`` with it), then loaded together with the
    worker's ``reload_weights`` (vLLM's in-place reload, which prepacks again; all at once, because a fused layer
    such as ``qkv_proj`` reloaded from one shard would lose the others). ``STARE_E2E_SKIP_WEIGHT_LOAD=1``:
    receive, load nothing (the negative control)."""
    cls = module.WorkerWrap
    _expect(cls.update_weight, 'device="cuda"', "worker-update-weight")
    _expect(cls.update_weight, "load_weights", "worker-update-weight")

    def update_weight(self, name, dtype, shape, empty_cache=False):
        import torch

        if dtype != self.model_config.dtype:
            raise AssertionError(f"mismatch dtype: src {dtype}, dst {self.model_config.dtype}")
        weight = torch.empty(shape, dtype=dtype, device=self.device)
        self._model_update_group.broadcast(weight, src=0, stream=None)
        pending = self.__dict__.setdefault("_stare_pending_weights", [])
        pending.append((name, weight))
        if not empty_cache:
            return
        self._stare_pending_weights = []
        if os.environ.get(SKIP_LOAD_ENV) == "1":
            _record("skip-weight-load")
            return
        self.reload_weights(weights_iterator=iter(pending))
        _log_sync(self, "engine", {n: checksum(w) for n, w in pending})

    cls.update_weight = update_weight
    _record("worker-update-weight")


def checksum(tensor) -> str:
    """SHA-256 of a tensor's bytes (its dtype, shape and every bit of its values)."""
    import hashlib

    import torch

    t = tensor.detach().cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype} {tuple(t.shape)} ".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _log_sync(owner, side: str, params: dict) -> None:
    """Append one weight sync's checksums to ``$STARE_E2E_SYNC_LOG``: {"side", "sync" (1, 2, ... in this process),
    "params": {name: sha256}}."""
    path = os.environ.get(SYNC_LOG_ENV)
    if not path:
        return
    import json

    owner._stare_syncs = getattr(owner, "_stare_syncs", 0) + 1
    with open(path, "a") as f:
        f.write(json.dumps({"side": side, "sync": owner._stare_syncs, "pid": os.getpid(), "params": params}) + "\n")


# ---- test hook: the weight sync, bit for bit --------------------------------------------------------------------
def patch_sync_checksums(module) -> None:
    """``STARE_E2E_SYNC_LOG=FILE``: after each ``ActorPPOTrainer.broadcast_to_vllm`` (the sync after every update), the
    trainer's rank 0 records the checksum of every parameter of its model (gathered under ZeRO-3, by every rank
    together, as the sync gathers them), and the vLLM worker records the checksum of every tensor it handed to its
    weight reload (``patch_worker_update_weight``): the weights its next generation samples with. The two records of a
    sync must be equal. The trainer's record lists the model's parameters, not what the sync sent, so a parameter the
    sync leaves out is missing on the engine's side only. ``STARE_E2E_SYNC_SKIP_PARAM=NAME`` plants that bug: the
    sync iterates the model's parameters without NAME. (vLLM's CPU build prepacks its linear layers' weights for its
    GEMM kernels and keeps no copy in the HF layout, so what the engine loaded is the last point where its weights
    can be read as sent.)"""
    path, skip = os.environ.get(SYNC_LOG_ENV), os.environ.get(SYNC_SKIP_ENV)
    if not (path or skip):
        return
    cls = module.ActorPPOTrainer
    _expect(cls.broadcast_to_vllm, "model.named_parameters()", "sync-checksums")
    _expect(cls.broadcast_to_vllm, "GatheredParameters", "sync-checksums")
    original = cls.broadcast_to_vllm

    def broadcast_to_vllm(self):
        import deepspeed
        import torch

        model = self.actor.model.module
        if skip:  # the planted bug: one parameter never sent
            every = type(model).named_parameters
            model.named_parameters = lambda *a, **k: ((n, p) for n, p in every(model, *a, **k) if n != skip)
            _record("sync-skip-param")
        try:
            original(self)
        finally:
            model.__dict__.pop("named_parameters", None)
        if not path:
            return
        sums = {}
        for name, param in model.named_parameters():
            with deepspeed.zero.GatheredParameters([param], enabled=self.strategy.args.ds.zero_stage == 3):
                if torch.distributed.get_rank() == 0:
                    sums[name] = checksum(param.data)
        if torch.distributed.get_rank() == 0:
            _log_sync(self, "trainer", sums)

    cls.broadcast_to_vllm = broadcast_to_vllm
    _record("sync-checksums")


# ---- test hook: every step's rollouts ----------------------------------------------------------------------------
def patch_rollout_log(module) -> None:
    """``STARE_E2E_ROLLOUT_LOG=FILE``: OpenRLHF's trainer (``BasePPOTrainer.train_step``, in the trainer actor) appends,
    before it makes the experiences of a step's rollouts, one JSON line to FILE: {"step": the global step they train,
    "pid", "samples": [[prompt, SHA-256 of the sample's token ids (prompt and response, as vLLM returned them),
    reward], ...]} in the order the trainer was handed them (the samples generator's). A run killed inside a step
    has that step's line already; its resume writes the step again."""
    path = os.environ.get(ROLLOUT_LOG_ENV)
    if not path:
        return
    cls = module.BasePPOTrainer
    _expect(cls.train_step, "make_experience_batch(rollout_samples)", "rollout-log")
    original = cls.train_step

    def train_step(self, rollout_samples, global_step):
        import json

        rows = [[s.prompts[0], checksum(s.sequences[0]), None if s.rewards is None else float(s.rewards[0])]
                for s in rollout_samples]
        with open(path, "a") as f:
            f.write(json.dumps({"step": global_step + 1, "pid": os.getpid(), "samples": rows}) + "\n")
        return original(self, rollout_samples, global_step)

    cls.train_step = train_step
    _record("rollout-log")


# ---- 7. flash_attn, imported at module level ---------------------------------------------------------------------
def install_flash_attn_standins() -> None:
    """``flash_attn``, ``flash_attn.bert_padding`` and ``flash_attn.utils.distributed`` as import-only stand-ins
    that raise if called (``tests/openrlhf_standins.py``): ``models/ring_attn_utils.py`` imports them at module
    level, and the STARE plugin imports that module. ``flash_attn.ops`` stays missing, so ``models/utils.py``
    ``log_probs_from_logits`` takes its pure-torch fallback."""
    import openrlhf_standins

    openrlhf_standins.install(openrlhf_standins.FLASH_ATTN_MODULES)
    _record("flash-attn")


# ---- 8. vLLM CPU: a seeded request's discarded sample -------------------------------------------------------------
def patch_cpu_seeded_rewind(module) -> None:
    """Replaces how vLLM's model runner (``GPUModelRunner``, which vLLM's ``CPUModelRunner`` inherits) undoes the
    random numbers a seeded request drew for a sample it discards (a prompt whose prefill the scheduler split over
    steps samples a token after each chunk but the last, and drops it): ``_bookkeeping_sync`` moves the request's
    generator back with ``gen.set_offset(gen.get_offset() - 4)``, which only CUDA's Philox generator has; a CPU
    generator raises "CPU Generator does not use offset" and kills the engine. That happens on the CPU whenever
    seeded requests (stare's seeded rollouts) meet a split prefill: the resume runs' 64 prompts of about 45 tokens
    exceed the CPU engine's 2,048-token step. Here ``_sample`` saves the state of every such request's CPU generator
    before sampling and puts it back after (the same undo, exactly), and ``_bookkeeping_sync`` runs without those
    generators in the batch's table, so that it has nothing to move. CUDA generators are left to vLLM."""
    cls = module.GPUModelRunner
    _expect(cls._bookkeeping_sync, "gen.set_offset(gen.get_offset() - 4)", "cpu-seeded-rewind")
    _expect(cls._bookkeeping_sync, "discard_request_mask", "cpu-seeded-rewind")
    _expect(cls._sample, "self.sampler(", "cpu-seeded-rewind")
    original_sample, original_bookkeeping = cls._sample, cls._bookkeeping_sync

    def _discarded_cpu_generators(self) -> dict:
        import numpy as np

        generators = self.input_batch.generators
        found = {}
        for i in np.nonzero(self.discard_request_mask.np[: self.input_batch.num_reqs])[0]:
            gen = generators.get(int(i))
            if gen is not None and gen.device.type == "cpu":
                found[int(i)] = gen
        return found

    def _sample(self, logits, spec_decode_metadata):
        saved = {i: (gen, gen.get_state()) for i, gen in _discarded_cpu_generators(self).items()}
        try:
            return original_sample(self, logits, spec_decode_metadata)
        finally:
            for gen, state in saved.values():
                gen.set_state(state)

    def _bookkeeping_sync(self, *args, **kwargs):
        generators = self.input_batch.generators
        held = {i: generators.pop(i) for i in _discarded_cpu_generators(self)}
        try:
            return original_bookkeeping(self, *args, **kwargs)
        finally:
            generators.update(held)

    cls._sample, cls._bookkeeping_sync = _sample, _bookkeeping_sync
    _record("cpu-seeded-rewind")


# ---- test hooks --------------------------------------------------------------------------------------------------
def patch_trainer_crash(module) -> None:
    """``STARE_E2E_CRASH_AFTER_STEP=N``: the policy actor exits right after writing step N's checkpoint (DeepSpeed's
    and the STARE controller state beside it), which fails OpenRLHF's trainer and the driver as a kill would.
    ``STARE_E2E_CRASH_IN_STEP=N``: it exits when asked to train on step N's rollouts (generated, scored, not yet
    trained: what a kill in the middle of a step loses). ``STARE_E2E_POSITIONS=FILE``: every checkpoint appends one
    JSON line to FILE with the trainer's saved position (the ``client_states`` OpenRLHF's ``PPOTrainer.fit`` hands
    to ``save_checkpoint``)."""
    after = int(os.environ.get(CRASH_ENV) or 0)
    during = int(os.environ.get(CRASH_IN_STEP_ENV) or 0)
    positions = os.environ.get(POSITIONS_ENV)
    hold_asked = os.environ.get(HOLD_ENV)
    if not (after or during or positions or hold_asked):
        return
    cls = module.StarePolicyModelActor
    _expect(cls.save_checkpoint, "save_stare_state", "trainer-crash")
    original_save, original_fit = cls.save_checkpoint, cls.fit

    def save_checkpoint(self, tag, client_states=None, *args, **kwargs):
        original_save(self, tag, client_states, *args, **kwargs)
        if positions and client_states:
            import json

            loader = client_states.get("data_loader_state_dict") or {}
            keys = ("episode", "global_step", "total_consumed_prompts")
            row = {"tag": tag, **{k: client_states.get(k) for k in keys},
                   "loader_finished": loader.get("_iterator_finished")}
            with open(positions, "a") as f:
                f.write(json.dumps(row) + "\n")
        hold = _this_run(HOLD_ENV) if hold_asked else None  # read when the run's variables are surely set
        if hold and tag == f"global_step{hold}":  # the test kills the whole session while it sleeps here
            print(HOLD_MESSAGE.format(step=hold), flush=True)
            import time

            time.sleep(3600)
        if after and tag == f"global_step{after}":
            print(f"STARE e2e: exiting after step {after}'s checkpoint", flush=True)
            os._exit(CRASH_EXIT_CODE)

    def fit(self, *args, **kwargs):
        if during and self.trainer.stare.steps == during - 1:
            print(f"STARE e2e: exiting with step {during}'s rollouts untrained", flush=True)
            os._exit(CRASH_EXIT_CODE)
        return original_fit(self, *args, **kwargs)

    cls.save_checkpoint, cls.fit = save_checkpoint, fit
    _record("trainer-crash")


def _this_run(variable: str) -> str | None:
    """What ``variable`` (``ALGO:SEED[:VALUE]``) asks of this run, when it names this run's algorithm and seed (read
    from the variables ``stare train`` gives the run: STARE_SETTINGS and STARE_SEED); None otherwise."""
    import json

    spec = os.environ.get(variable, "")
    if not spec:
        return None
    algo, seed, *value = spec.split(":")
    try:
        this = json.loads(os.environ.get("STARE_SETTINGS") or "{}").get("algo", {}).get("name")
    except ValueError:
        return None
    if (this, os.environ.get("STARE_SEED")) != (algo, seed):
        return None
    return value[0] if value else "yes"


def patch_extra_args(module) -> None:
    """``STARE_E2E_EXTRA_ARGS``: OpenRLHF flags a CPU run needs, appended to what ``stare train`` builds.
    ``STARE_E2E_FAIL_RUN=ALGO:SEED``: that run fails at launch (a planted failure of one arm of a ``stare run``)."""
    extra = shlex.split(os.environ.get(EXTRA_ARGS_ENV, ""))
    if not extra:
        return
    original = module.launch

    def launch(argv, *args, **kwargs):
        if _this_run(FAIL_ENV):
            raise module.LaunchError(f"planted failure of this run ({FAIL_ENV}={os.environ[FAIL_ENV]})")
        return original([*argv, *extra], *args, **kwargs)

    module.launch = launch
    _record("extra-args")


def _fp32_linear(linear):
    """``linear(x, weight, bias)`` that multiplies bf16/fp16 CPU tensors in float32 and returns the input's dtype."""
    import torch

    def fp32_linear(x, weight, bias=None):
        if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16):
            out = linear(x.float(), weight.float(), None if bias is None else bias.float())
            return out.to(x.dtype)
        return linear(x, weight, bias)

    fp32_linear._stare_fp32 = True
    return fp32_linear


def patch_fp32_matmul(module) -> None:
    """``STARE_E2E_FP32_MATMUL=1``: the trainer's linear layers on bf16/fp16 CPU tensors cast their inputs to float32,
    multiply, and cast the result back to the input's dtype: ``torch.nn.functional.linear`` (ZeRO 0-2) and DeepSpeed's
    ``zero3_linear_wrap``, which ZeRO-3 installs as ``F.linear`` while it builds the model (its backward multiplies
    the saved tensors itself, so wrapping ``F.linear`` alone leaves ZeRO-3's backward in bf16). The parameters stay
    bf16 (so the weight sync and its checksums are unchanged) and their gradients arrive in bf16 as before; only the
    GEMM's arithmetic is float32, with float32 accumulation as a GPU's bf16 GEMM has. Why: on a CPU without
    AVX-512 BF16 or AMX, torch's bf16 GEMM runs about 40x slower than float32 (1 against 40 GFLOPS measured here),
    which makes a 135M-parameter model take minutes per micro-batch. Applied when DeepSpeed's
    ``partition_parameters`` is imported: in the trainer's processes only (vLLM's engine has its own CPU GEMM)."""
    if os.environ.get(FP32_MATMUL_ENV) != "1":
        return
    _expect(module.InsertPostInitMethodToModuleSubClasses._enable_mem_efficient_linear, "zero3_linear_wrap",
            "fp32-matmul")
    import torch.nn.functional as F

    if not getattr(F.linear, "_stare_fp32", False):
        F.linear = _fp32_linear(F.linear)
    module.zero3_linear_wrap = _fp32_linear(module.zero3_linear_wrap)
    _record("fp32-matmul")


PATCHES = {
    "torch": patch_torch_cuda,
    "vllm.v1.attention.backends.cpu_attn": patch_vllm_cpu_attn,
    "vllm.v1.worker.gpu_model_runner": patch_cpu_seeded_rewind,
    "openrlhf.trainer.ppo_utils.replay_buffer": patch_replay_buffer,
    "openrlhf.utils.deepspeed.deepspeed": patch_device_mesh,
    "openrlhf.utils.distributed_util": patch_sync_group,
    "openrlhf.trainer.ray.vllm_worker_wrap": patch_worker_update_weight,
    "openrlhf.trainer.ray.ppo_actor": patch_sync_checksums,
    "openrlhf.trainer.ppo_trainer": patch_rollout_log,
    "deepspeed.runtime.zero.partition_parameters": patch_fp32_matmul,
    "stare.cli.openrlhf_backend.actor": patch_trainer_crash,
    "stare.cli.openrlhf_backend.launch": patch_extra_args,
}
# the eight patches of the CPU run (the test hooks are not counted)
CPU_PATCHES = ("torch-cuda", "vllm-amx", "replay-buffer", "device-mesh", "sync-group", "worker-update-weight",
               "flash-attn", "cpu-seeded-rewind")


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader, patch):
        self.loader, self.patch = loader, patch

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        self.patch(module)

    def __getattr__(self, name):  # get_resource_reader, get_filename, is_package, ...
        return getattr(self.loader, name)


class _PostImportHook(importlib.abc.MetaPathFinder):
    """Finds each patched module with the other finders, then wraps its loader so the patch runs right after the
    module's own code."""

    def find_spec(self, name, path, target=None):
        patch = PATCHES.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            raise PatchDoesNotApply(f"{name}: its loader {spec.loader!r} cannot be wrapped")
        spec.loader = _PatchingLoader(spec.loader, patch)
        return spec


def install() -> None:
    """Install the hook (once per process); modules already imported are patched at once."""
    if any(isinstance(f, _PostImportHook) for f in sys.meta_path):
        return
    install_flash_attn_standins()
    for name, patch in PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    sys.meta_path.insert(0, _PostImportHook())
