"""Stand-ins for ``flash_attn`` and ``vllm``, so the pinned OpenRLHF's trainer modules import on a CPU machine.

Only tests use this (installed into ``sys.modules`` of the test process). Each stand-in raises if it is
ever called: the code paths the tests run must not reach flash-attn kernels or a vLLM engine.
"""
from __future__ import annotations

import importlib.machinery
import sys
import types

FLASH_ATTN_MODULES = ("flash_attn", "flash_attn.bert_padding", "flash_attn.utils", "flash_attn.utils.distributed")
MODULES = (
    *FLASH_ATTN_MODULES,
    "vllm", "vllm.inputs", "vllm.utils", "vllm.distributed", "vllm.distributed.device_communicators",
    "vllm.distributed.device_communicators.pynccl", "vllm.distributed.utils",
)


def _unavailable(name: str):
    def call(*args, **kwargs):
        raise RuntimeError(f"{name} is a test stand-in; this code path needs the real package")

    call.__name__ = name.rsplit(".", 1)[-1]
    return call


def _stub_class(name: str):
    return type(name.rsplit(".", 1)[-1], (), {"__init__": _unavailable(name)})


def install(modules=MODULES) -> None:
    """Put the stand-ins for ``modules`` into ``sys.modules`` (no-op for a module that really is installed)."""
    attrs = {
        "flash_attn.bert_padding": ["index_first_axis", "pad_input", "rearrange", "unpad_input"],
        "flash_attn.utils.distributed": ["all_gather"],
        "vllm.utils": ["random_uuid"],
    }
    classes = {
        "vllm": ["SamplingParams", "LLM"],
        "vllm.inputs": ["TokensPrompt"],
        "vllm.distributed.device_communicators.pynccl": ["PyNcclCommunicator"],
        "vllm.distributed.utils": ["StatelessProcessGroup"],
    }
    for name in modules:
        root = name.split(".")[0]
        if root in sys.modules and not getattr(sys.modules[root], "__stare_standin__", False):
            continue
        if name in sys.modules:
            continue
        mod = types.ModuleType(name)
        mod.__stare_standin__ = True
        mod.__path__ = []  # a package, so submodules import
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        for attr in attrs.get(name, []):
            setattr(mod, attr, _unavailable(f"{name}.{attr}"))
        for cls in classes.get(name, []):
            setattr(mod, cls, _stub_class(f"{name}.{cls}"))
        if name == "vllm":
            mod.__version__ = "0.29.0"
        sys.modules[name] = mod
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, mod)


def openrlhf_args(agg: str = "token-mean", clip=(0.2, 0.28), dual_clip=10.0):
    """The slice of the pinned OpenRLHF's parsed arguments its ``ActorPPOTrainer`` and ``PolicyLoss`` read, as the
    tests and benchmarks/bench_plugin_step.py build their trainers."""
    from types import SimpleNamespace as ns

    return ns(
        train=ns(max_epochs=1, dynamic_batch_enable=False, colocate_all=False, async_enable=False,
                 max_tokens_per_gpu=4096),
        actor=ns(eps_clip_low_high=clip, dual_clip=dual_clip, loss_agg_mode=agg, policy_loss_type="ppo",
                 aux_loss_coef=0.0, entropy_coef=None),
        algo=ns(advantage=ns(is_correction_level="off", is_correction_mode="mask", is_correction_gating="ratio",
                             is_correction_threshold=(0.5, 5.0)),
                kl=ns(use_loss=False, init_coef=0.0)),
        ds=ns(packing_samples=False, tensor_parallel_size=1),
        vllm=ns(sync_backend="nccl"),
    )


class PromptRows:
    """A prompt set in the layout of OpenRLHF's ``PromptDataset`` rows (datasource, prompt, label, image), for its
    real dataloaders; ``collate`` is ``PromptDataset.collate_fn``'s layout: datasources, prompts, labels, images."""

    def __init__(self, prompts):
        self.prompts = prompts

    def __len__(self):
        return len(self.prompts)

    def __getitem__(self, i):
        return "data", self.prompts[i], "label", None

    @staticmethod
    def collate(rows):
        return tuple(list(column) for column in zip(*rows))
