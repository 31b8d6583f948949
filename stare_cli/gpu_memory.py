"""The GPU memory plan of a GPU preset: what one GPU holds while the actor trains, while vLLM generates the
rollouts and while ``stare eval`` evaluates, checked against the card before anything starts.

Every dry run shows it (``stare train --dry-run``: ``memory``; ``stare run --dry-run``: ``memory`` and the
evaluation's tensor parallelism it chose); a layout that cannot fit is refused in one line (exit 2) naming the term
that does not fit, the numbers and the setting that fixes it, and one within 10% of the card gets a warning.

The model's shapes come from its ``config.json``: a local folder, then the local Hugging Face hub cache, then the
shapes shipped for the shipped presets' models (``configs/model_shapes.json``), so the plan works offline. Sizes
are in bytes; ``GIB`` is 2**30. What each term counts and what it leaves out is docs/openrlhf-backend.md's "GPU
memory plan"; in short:

- training, per actor GPU (``N`` = actor ranks, ``P`` = parameters, ``T`` = tokens of one micro-batch: the
  packing budget ``max_tokens_per_gpu``, or ``micro_batch_size`` x (prompt + response) without packing):
  bf16 weights (2P), bf16 gradients (2P) and the fp32 master weights with Adam's two moments (12P), each divided
  by N where the ZeRO stage shards it; under ZeRO-3 the gathered parameters of the largest module twice (the one
  computed and the one prefetched); the activation checkpoints (one bf16 hidden state per layer and token) and
  one layer's activations with their gradients (recomputed in the backward); the logits (OpenRLHF casts them to
  float32: the float32 copy kept for the backward, its gradient, the bf16 gradient: 10 bytes per token and
  vocabulary entry); the entropy bonus (6 more bytes per entry: its own gradient of the logits and the sum autograd
  makes of the two, plus at most two chunks' buffers: stare computes OpenRLHF's entropy term chunk by chunk); a reference model's bf16 shard when ``kl_coef`` > 0 and
  colocated; what sleeping vLLM keeps (its CUDA context and, without ``vllm_enforce_eager``, its CUDA graphs);
  a CUDA context per process.
- rollout, per GPU of a vLLM engine: vLLM takes ``vllm_gpu_memory_utilization`` of the card (its weights at
  ``vllm_tensor_parallel``, the activations of its profiling run, its CUDA graphs, and the KV cache in what is
  left, which must hold one sequence of ``max_prompt_len + max_response_len`` tokens, or vLLM refuses to start);
  when colocated the sleeping actor keeps its bf16 weight shard and its CUDA context beside it.
- evaluation, per GPU of a ``stare eval`` engine: vLLM's default share (0.92) with the weights at the
  evaluation's tensor parallelism, and a KV cache that must hold one sequence of the model's own context
  (``stare eval`` does not cap vLLM's ``max_model_len``).

No torch import: ``stare train --dry-run`` must stay fast and work where torch is not installed.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

GIB = 1024 ** 3
DEFAULT_GPU_GIB = 80.0
WARN_SHARE = 0.90          # a phase above this share of the card is a warning
BF16 = 2
FP32 = 4
CUDA_CONTEXT = 1 * GIB     # per process on a GPU: CUDA context, cuBLAS/NCCL workspaces (not measured here)
VLLM_GRAPHS = 1 * GIB      # CUDA graphs of one vLLM worker when not enforce_eager (vLLM reports 0.5-2 GiB)
# vLLM 0.29.0's defaults for the offline LLM on a large GPU (engine/arg_utils.py): the profiling run's batch
VLLM_MAX_BATCHED_TOKENS = 16384
VLLM_MAX_SEQS = 1024
EVAL_UTILIZATION = 0.92    # vLLM 0.29.0's default gpu_memory_utilization (stare eval passes none)
LOGIT_BYTES = 10           # per token x vocabulary entry: float32 logits kept (4) + their gradient (4) + bf16 grad (2)
ENTROPY_BYTES = 6          # the bonus's float32 gradient of the logits and the new tensor autograd sums the two
#                            gradients into (4 + 4), less the bf16 copy the logits term counts, made after (2)
ENTROPY_CHUNK_ROWS = 1024  # rows of one chunk of the chunked entropy (stare.algorithms.entropy_bonus.DEFAULT_CHUNK_ROWS)
ENTROPY_CHUNK_COPIES = 2   # float32 chunk-sized buffers alive at once in its forward (its backward: one)
ZERO3_GATHER_COPIES = 2    # ZeRO-3: the module being computed and the one prefetched
SHAPES_FILE = "model_shapes.json"


class MemoryPlanError(ValueError):
    """A layout that cannot fit the card (the CLI exits with code 2)."""


# ---- the model's shapes ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Shapes:
    """What the plan needs of a dense decoder (Qwen2/Qwen3/Llama style) and where it was read."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    max_positions: int | None
    qkv_bias: bool
    qk_norm: bool
    source: str = ""

    @classmethod
    def from_config(cls, cfg: dict, source: str = "") -> "Shapes":
        cfg = cfg.get("text_config", cfg)  # a multimodal config keeps its decoder's shapes there
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        kind = str(cfg.get("model_type", ""))
        return cls(hidden=hidden, layers=int(cfg["num_hidden_layers"]), heads=heads,
                   kv_heads=int(cfg.get("num_key_value_heads") or heads),
                   head_dim=int(cfg.get("head_dim") or hidden // heads), intermediate=int(cfg["intermediate_size"]),
                   vocab=int(cfg["vocab_size"]), tied=bool(cfg.get("tie_word_embeddings", False)),
                   max_positions=cfg.get("max_position_embeddings"),
                   qkv_bias=bool(cfg.get("attention_bias", kind == "qwen2")), qk_norm=kind.startswith("qwen3"),
                   source=source)

    def layer_params(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = self.hidden * (q + 2 * kv) + q * self.hidden
        if self.qkv_bias:
            attention += q + 2 * kv
        if self.qk_norm:
            attention += 2 * self.head_dim
        return attention + 3 * self.hidden * self.intermediate + 2 * self.hidden  # + the two RMSNorm weights

    def params(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return embeddings + self.layers * self.layer_params() + self.hidden  # + the final norm

    def kv_bytes_per_token(self, tp: int = 1, dtype_bytes: int = BF16) -> int:
        """The KV cache of one token on one of ``tp`` ranks: keys and values of every layer; vLLM gives each rank
        ``kv_heads / tp`` heads (at least one: a rank replicates a head when tp > kv_heads)."""
        return 2 * self.layers * max(1, self.kv_heads // tp) * self.head_dim * dtype_bytes


def _hub_cache_config(model: str) -> Path | None:
    """A hub model's config.json in the local hub cache (``HF_HUB_CACHE``, ``HF_HOME``/hub or
    ~/.cache/huggingface/hub), the snapshot ``refs/main`` names first."""
    roots = [os.environ.get("HF_HUB_CACHE"),
             os.path.join(os.environ["HF_HOME"], "hub") if os.environ.get("HF_HOME") else None,
             os.path.join(os.path.expanduser("~"), ".cache", "huggingface", "hub")]
    for root in filter(None, roots):
        repo = Path(root) / ("models--" + model.replace("/", "--"))
        if not repo.is_dir():
            continue
        ref = repo / "refs" / "main"
        first = [repo / "snapshots" / ref.read_text().strip() / "config.json"] if ref.is_file() else []
        for candidate in [*first, *sorted(repo.glob("snapshots/*/config.json"))]:
            if candidate.is_file():
                return candidate
    return None


def shipped_shapes() -> dict[str, dict]:
    text = resources.files("stare.configs").joinpath(SHAPES_FILE).read_text()
    return {k: v for k, v in json.loads(text).items() if not k.startswith("_")}


def load_shapes(model: str) -> Shapes | None:
    """The shapes of ``model`` (a folder or a hub id), or None where no config.json is known for it."""
    folder = Path(model).expanduser()
    candidates = [folder / "config.json"] if folder.is_dir() else []
    cached = _hub_cache_config(model) if not folder.is_dir() else None
    candidates += [cached] if cached else []
    for path in candidates:
        try:
            return Shapes.from_config(json.loads(path.read_text()), source=str(path))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    shipped = shipped_shapes().get(model)
    return Shapes.from_config(shipped, source=f"shipped shapes ({SHAPES_FILE})") if shipped else None


# ---- the plan --------------------------------------------------------------------------------------------------

@dataclass
class Phase:
    """One phase's terms per GPU (bytes, in order), the card, and the KV check where vLLM runs."""

    name: str
    what: str
    terms: dict[str, int]
    gpu: int
    kv_left: int | None = None       # vLLM's KV cache: what its share leaves after its weights and activations
    kv_needed: int | None = None     # one sequence of the engine's max_model_len
    kv_tokens: int | None = None     # that max_model_len
    fixes: dict[str, str] = field(default_factory=dict)  # term -> the setting that shrinks it

    @property
    def total(self) -> int:
        return sum(self.terms.values())

    def to_json(self) -> dict:
        out = {"what": self.what, "terms_gib": {k: _gib(v) for k, v in self.terms.items()},
               "total_gib": _gib(self.total), "share_of_gpu": round(self.total / self.gpu, 3)}
        if self.kv_needed is not None:
            out["kv_cache"] = {"available_gib": _gib(self.kv_left), "one_sequence_gib": _gib(self.kv_needed),
                               "max_model_len": self.kv_tokens,
                               "full_sequences": max(0, self.kv_left // self.kv_needed) if self.kv_needed else None}
        return out


def _gib(n: int | float) -> float:
    return round(n / GIB, 2)


def micro_batch_tokens(s: dict) -> int:
    """Tokens of one training micro-batch per GPU: the packing budget, or micro_batch_size full-length rows."""
    return s["max_tokens_per_gpu"] if s["packing"] else s["micro_batch_size"] * (s["max_prompt_len"] +
                                                                                  s["max_response_len"])


def _layer_bytes_per_token(sh: Shapes) -> int:
    """One decoder layer's bf16 activations per token, with their gradients: the two norms' inputs and outputs
    (4 hidden), q, k, v and the attention output (2 q + 2 kv), the MLP's gate, up, activation and product (4
    intermediate), each once as the forward keeps it and once as its gradient in the backward."""
    q, kv = sh.heads * sh.head_dim, sh.kv_heads * sh.head_dim
    return (4 * sh.hidden + 2 * q + 2 * kv + 4 * sh.intermediate) * BF16 * 2


def token_terms(sh: Shapes, s: dict, bonus: bool) -> dict[str, int]:
    """The training terms that grow with the micro-batch, in bytes per token."""
    layer = _layer_bytes_per_token(sh)
    terms = ({"activation checkpoints": sh.layers * sh.hidden * BF16} if s["gradient_checkpointing"]
             else {"activations (no checkpointing)": (sh.layers - 1) * layer // 2})
    terms["one layer's activations with gradients"] = layer
    terms["logits (fp32, with gradients)"] = sh.vocab * LOGIT_BYTES
    if bonus:
        terms["entropy bonus"] = sh.vocab * ENTROPY_BYTES
    return terms


def train_phase(sh: Shapes, s: dict, gpu: int, bonus: bool) -> Phase:
    n = s["gpus_per_node"] * s["nodes"]
    stage = s["zero_stage"]
    p = sh.params()
    t = micro_batch_tokens(s)
    terms = {
        "weights (bf16)": BF16 * p // (n if stage >= 3 else 1),
        "gradients (bf16)": BF16 * p // (n if stage >= 2 else 1),
        "optimizer (fp32 weights, Adam m and v)": 3 * FP32 * p // (n if stage >= 1 else 1),
    }
    fixes = {k: "more GPUs (nodes) or zero_stage 3" for k in terms}
    if stage >= 3:
        terms["ZeRO-3 gathered modules"] = ZERO3_GATHER_COPIES * BF16 * max(sh.layer_params(), sh.vocab * sh.hidden)
    for k, per_token in token_terms(sh, s, bonus).items():
        terms[k] = t * per_token
        fixes[k] = "lower max_tokens_per_gpu" if s["packing"] else "lower micro_batch_size"
    if bonus:  # the chunked entropy's own buffers: a few float32 chunks, whatever the micro-batch
        terms["entropy bonus"] += ENTROPY_CHUNK_COPIES * min(t, ENTROPY_CHUNK_ROWS) * sh.vocab * FP32
    if s["kl_coef"] > 0 and s["colocate"]:
        terms["reference model (bf16 shard)"] = BF16 * p // n
    if s["colocate"]:
        terms["vLLM asleep (context, CUDA graphs)"] = CUDA_CONTEXT + (0 if s.get("vllm_enforce_eager", True)
                                                                      else VLLM_GRAPHS)
    terms["CUDA context"] = CUDA_CONTEXT
    return Phase("train", f"one training micro-batch of {t} tokens on each of {n} actor GPU(s), ZeRO-{stage}",
                 terms, gpu, fixes=fixes)


def vllm_activations(sh: Shapes, tp: int, max_seqs: int = VLLM_MAX_SEQS) -> int:
    """vLLM's profiling run per rank: a batch of ``VLLM_MAX_BATCHED_TOKENS`` through the widest layer (hidden
    states in and out, the larger of qkv and the MLP's gate, up and product) and the sampler's float32 logits and
    probabilities for ``max_seqs`` sequences."""
    q, kv = sh.heads * sh.head_dim, sh.kv_heads * sh.head_dim
    widest = max(q + 2 * kv, 3 * sh.intermediate) // tp
    return VLLM_MAX_BATCHED_TOKENS * (2 * sh.hidden + widest) * BF16 + 2 * max_seqs * sh.vocab * FP32


def _vllm_terms(sh: Shapes, tp: int, eager: bool) -> dict[str, int]:
    return {"weights (bf16)": BF16 * sh.params() // tp, "activations (profiling run)": vllm_activations(sh, tp),
            "CUDA graphs": 0 if eager else VLLM_GRAPHS, "CUDA context": CUDA_CONTEXT}


def rollout_phase(sh: Shapes, s: dict, gpu: int) -> Phase:
    tp, util = s["vllm_tensor_parallel"], s["vllm_gpu_memory_utilization"]
    share = int(util * gpu)
    inside = _vllm_terms(sh, tp, s.get("vllm_enforce_eager", True))
    kv_tokens = s["max_prompt_len"] + s["max_response_len"]
    terms = {f"vLLM's share ({util:g} of the card)": share}
    fixes = {next(iter(terms)): "lower vllm_gpu_memory_utilization"}
    if s["colocate"]:
        n = s["gpus_per_node"] * s["nodes"]
        terms["actor asleep (bf16 weight shard, context)"] = BF16 * sh.params() // (
            n if s["zero_stage"] >= 3 else 1) + CUDA_CONTEXT
        if s["kl_coef"] > 0:
            terms["reference model (bf16 shard)"] = BF16 * sh.params() // n
    return Phase("rollout", f"vLLM at tensor parallel {tp}: {', '.join(f'{k} {_gib(v)} GiB' for k, v in inside.items())}",
                 terms, gpu, kv_left=share - sum(inside.values()), kv_needed=sh.kv_bytes_per_token(tp) * kv_tokens,
                 kv_tokens=kv_tokens, fixes=fixes)


def eval_phase(sh: Shapes, tp: int, gpu: int, response_tokens: int, prompt_tokens: int) -> Phase:
    inside = _vllm_terms(sh, tp, eager=False)
    share = int(EVAL_UTILIZATION * gpu)
    context = sh.max_positions or prompt_tokens + response_tokens
    phase = Phase("eval", f"stare eval's vLLM at tensor parallel {tp}: "
                  + ", ".join(f"{k} {_gib(v)} GiB" for k, v in inside.items()),
                  {f"vLLM's share ({EVAL_UTILIZATION:g} of the card)": share}, gpu, kv_left=share - sum(inside.values()),
                  kv_needed=sh.kv_bytes_per_token(tp) * context, kv_tokens=context)
    return phase


def eval_fits(sh: Shapes, tp: int, gpu: int) -> bool:
    p = eval_phase(sh, tp, gpu, 0, 0)
    return p.kv_left >= p.kv_needed


def eval_tp(sh: Shapes | None, gpu: int, start: int, gpus: int) -> int:
    """The smallest power of two >= ``start`` (and <= ``gpus``) at which the evaluation fits a card; ``start``
    when the shapes are unknown or none fits (the plan then refuses with the numbers)."""
    if sh is None:
        return start
    tp = start
    while not eval_fits(sh, tp, gpu) and tp * 2 <= gpus:
        tp *= 2
    return tp if eval_fits(sh, tp, gpu) else start


@dataclass
class MemoryPlan:
    gpu: int
    shapes: Shapes | None
    model: str
    phases: list[Phase]
    fit: str = ""  # what the training micro-batch may be on this card (largest_fit)

    def problems(self) -> list[str]:
        """One line per phase that cannot fit: the term, the numbers, the setting that fixes it."""
        out = []
        for ph in self.phases:
            if ph.total > ph.gpu:
                big = max(ph.terms, key=ph.terms.get)
                fix = ph.fixes.get(big, "a larger card (gpu_memory_gib) or more GPUs")
                if ph.name == "train" and fix.startswith("lower"):
                    fix = f"lower {self.fit}" if self.fit.startswith(("max_tokens", "micro_batch")) else self.fit
                out.append(f"{ph.name}: {_gib(ph.total)} GiB per GPU of {_gib(ph.gpu)} GiB (gpu_memory_gib); the "
                           f"largest term is {big} at {_gib(ph.terms[big])} GiB: {fix}")
            if ph.kv_needed is not None and ph.kv_left < ph.kv_needed:
                fix = ("raise vllm_gpu_memory_utilization or vllm_tensor_parallel, or lower max_response_len"
                       if ph.name == "rollout" else "evaluate at a higher tensor parallelism (--tp)")
                out.append(f"{ph.name}: vLLM's KV cache has {_gib(ph.kv_left)} GiB per GPU after the weights and "
                           f"activations, and one sequence of {ph.kv_tokens} tokens needs {_gib(ph.kv_needed)} GiB "
                           f"(vLLM refuses to start): {fix}")
        return out

    def warnings(self) -> list[str]:
        return [f"{ph.name}: {_gib(ph.total)} GiB per GPU is within {100 - round(100 * WARN_SHARE)}% of the card "
                f"({_gib(ph.gpu)} GiB): the plan's estimate leaves little room (allocator fragmentation, buffers "
                "it does not count)" for ph in self.phases
                if WARN_SHARE * ph.gpu < ph.total <= ph.gpu and ph.name != "eval"]

    def to_json(self) -> dict:
        out = {"gpu_gib": _gib(self.gpu), "model": self.model}
        if self.shapes is None:
            out["unknown"] = (f"no config.json for {self.model} here (not a folder, not in the hub cache, not one of "
                              "the shipped shapes): memory not planned")
            return out
        out["shapes"] = {"source": self.shapes.source, "parameters": self.shapes.params(),
                         "kv_bytes_per_token_tp1": self.shapes.kv_bytes_per_token(1)}
        out["phases"] = {ph.name: ph.to_json() for ph in self.phases}
        out["verdict"] = "does not fit" if self.problems() else "tight" if self.warnings() else "fits"
        out["problems"], out["warnings"] = self.problems(), self.warnings()
        out["train_fit"] = self.fit
        return out


def plan_memory(settings: dict, algo: dict, *, eval_tp_: int | None = None, eval_response_tokens: int = 0) -> MemoryPlan:
    """The plan for an ``openrlhf`` preset's checked settings and algorithm (and, for ``stare run``, its evaluation
    at tensor parallelism ``eval_tp_`` with responses of ``eval_response_tokens``)."""
    gpu = int(settings.get("gpu_memory_gib", DEFAULT_GPU_GIB) * GIB)
    model = settings.get("cold_start_checkpoint") or settings["model"]
    sh = load_shapes(model) or (load_shapes(settings["model"]) if model != settings["model"] else None)
    if sh is None:
        return MemoryPlan(gpu, None, model, [])
    bonus = entropy_bonus(algo)
    phases = [train_phase(sh, settings, gpu, bonus), rollout_phase(sh, settings, gpu)]
    if eval_tp_ is not None:
        phases.append(eval_phase(sh, eval_tp_, gpu, eval_response_tokens, settings["max_prompt_len"]))
    plan = MemoryPlan(gpu, sh, model, phases, fit=largest_fit(sh, settings, phases[0], bonus))
    return plan


def largest_fit(sh: Shapes, s: dict, train: Phase, bonus: bool) -> str:
    """How to make the training fit, from the terms' growth per token: the largest ``max_tokens_per_gpu`` (a
    multiple of 1024, at least one full prompt and response, as OpenRLHF requires) or ``micro_batch_size`` within
    ``WARN_SHARE`` of the card, else within the card, else what else shrinks."""
    per_token = sum(token_terms(sh, s, bonus).values())
    fixed = train.total - micro_batch_tokens(s) * per_token
    row = s["max_prompt_len"] + s["max_response_len"]
    for share, tight in ((WARN_SHARE, ""), (1.0, f", within {100 - round(100 * WARN_SHARE)}% of the card")):
        fit = (int(share * train.gpu) - fixed) // per_token
        if s["packing"] and fit >= row:
            value = max(row, fit // 1024 * 1024)
            return f"max_tokens_per_gpu {s['max_tokens_per_gpu']} -> {value}{tight}"
        if not s["packing"] and fit >= row:
            return f"micro_batch_size {s['micro_batch_size']} -> {fit // row}{tight}"
    return (f"not even a micro-batch of one full sequence ({row} tokens) fits: shorten max_response_len, or spread "
            f"the {_gib(fixed)} GiB that do not grow with the micro-batch (mostly the ZeRO-sharded weights, gradients "
            "and optimizer) over more GPUs (nodes)")


def entropy_bonus(algo: dict) -> bool:
    """The algorithm turns OpenRLHF's entropy term on (a fixed coefficient, or the adaptive one)."""
    return bool(algo.get("entropy_adaptive")) or float(algo.get("entropy_coef") or 0.0) > 0


def refusal(memory_json: dict, mode: str) -> str | None:
    """The one line that refuses a plan (its first problem) when ``mode`` (``memory_check``) is refuse."""
    problems = memory_json.get("problems") or []
    if not problems or mode != "refuse":
        return None
    return (f"this layout does not fit the GPU: {problems[0]} (the dry run prints the whole memory plan; --set "
            "memory_check=warn launches anyway)")
