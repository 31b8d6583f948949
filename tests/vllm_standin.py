"""A strict stand-in for vLLM 0.29.0's offline API (``LLM``, ``SamplingParams``, the request outputs), for tests on
machines without a GPU. It enforces what the real package enforces; each rule names the file and function of the
vllm 0.29.0 wheel (``pip download --no-deps vllm==0.29.0``) it copies the behaviour of.

The model is a function the test supplies: ``model(child) -> iterable of token ids``, the tokens the model would
emit for one sample (``child.prompt_ids``, ``child.index`` in the request's n, ``child.seed`` the per-sample seed, or
None for greedy and unseeded requests, ``child.params``). The engine stops that stream the way vLLM does (EOS,
stop token ids, stop strings, ``max_tokens``, ``max_model_len``) and detokenizes it as vLLM does.

Besides ``LLM.generate`` the stand-in has the engine's request API that ``LLM.generate`` runs on
(``LLM.llm_engine``: ``add_request``, ``step``, ``has_unfinished_requests``, ``abort_request``; vllm/v1/engine/
llm_engine.py, vllm/entrypoints/common/offline.py ``_run_engine``). A request's samples are drawn when it is added;
``step`` hands back the requests in the order a real engine finishes them, the one with the fewest tokens to
generate first (``finish_order="shortest"``, ties in the order added) or in the order added (``"added"``).

Use: ``module, calls = make_vllm(model, max_model_len=...)`` and ``monkeypatch.setitem(sys.modules, "vllm",
module)``. ``calls`` records ``llm`` (constructor keywords), ``generate`` (prompts, params list), ``add_request``
(request id, prompt ids, params), ``requests`` (prompt ids, params: every request either way), ``steps`` (the
request ids each ``step`` returned), ``aborted`` and ``samples`` (one dict per generated sample: prompt_ids, index,
seed, request seed).
"""
from __future__ import annotations

import importlib.machinery
import json
import math
import types
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

VERSION = "0.29.0"
SAMPLING_EPS = 1e-5  # vllm/sampling_params.py _SAMPLING_EPS: below it, greedy
MAX_TEMP = 1e-2  # vllm/sampling_params.py _MAX_TEMP: 0 < temperature < 1e-2 is raised to 1e-2


class VLLMValidationError(Exception):
    """vllm/exceptions.py: VLLMValidationError(VLLMClientError(VLLMError(Exception))) - not a ValueError."""


# vllm/sampling_params.py, class SamplingParams(PydanticMsgspecMixin, msgspec.Struct, omit_defaults=True, dict=True):
# its public fields in declaration order, with their defaults. A msgspec Struct's __init__ takes exactly these
# (positionally in this order, or by name) and raises TypeError("Unexpected keyword argument 'x'") for any other.
# (Its private fields _eos_token_id, _all_stop_token_ids, _bad_words_token_ids are left out: nothing here sets them.)
SAMPLING_FIELDS = {
    "n": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "temperature": 1.0,
    "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": None, "stop": None, "stop_token_ids": None, "ignore_eos": False,
    "max_tokens": 16, "min_tokens": 0, "logprobs": None, "prompt_logprobs": None, "logprob_token_ids": None,
    "flat_logprobs": False, "detokenize": True, "skip_special_tokens": True, "spaces_between_special_tokens": True,
    "include_stop_str_in_output": False, "output_kind": 0, "stream_interval": None, "skip_clone": False,
    "output_text_buffer_length": 0, "structured_outputs": None, "logit_bias": None, "allowed_token_ids": None,
    "extra_args": None, "bad_words": None, "skip_reading_prefix_cache": None, "thinking_token_budget": None,
    "repetition_detection": None, "routed_experts_prompt_start": 0, "trace_decode_token_ids": None,
}


class SamplingParams:
    def __init__(self, *args, **kwargs):
        names = list(SAMPLING_FIELDS)
        if len(args) > len(names):
            raise TypeError(f"Extra positional arguments provided: {len(args)} > {len(names)}")
        values = dict(SAMPLING_FIELDS)
        values.update(zip(names, args))
        for name, value in kwargs.items():
            if name not in SAMPLING_FIELDS:
                raise TypeError(f"Unexpected keyword argument '{name}'")  # msgspec.Struct.__init__
            if name in names[:len(args)]:
                raise TypeError(f"Argument '{name}' given by name and by position")
            values[name] = value
        self.__dict__.update(values)
        self._post_init()

    def _post_init(self):
        # SamplingParams.__post_init__
        if 0 < self.temperature < MAX_TEMP:
            self.temperature = MAX_TEMP
        if self.seed == -1:
            self.seed = None
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop_token_ids = [] if self.stop_token_ids is None else list(dict.fromkeys(self.stop_token_ids))
        self._verify_args()
        if self.temperature < SAMPLING_EPS:  # greedy: top_p 1, top_k 0, min_p 0, and one sample
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
            if self.n > 1:  # SamplingParams._verify_greedy_sampling
                raise VLLMValidationError(f"n must be 1 when using greedy sampling, got {self.n}.")

    def _verify_args(self):
        # SamplingParams._verify_args (and _verify_num_sequences for n), the checks that concern this project
        if not isinstance(self.n, int):
            raise VLLMValidationError(f"n must be an int, but is of type {type(self.n)}")
        if self.n < 1:
            raise VLLMValidationError(f"n must be at least 1, got {self.n}.")
        if not math.isfinite(self.temperature):
            raise VLLMValidationError(f"temperature must be a finite number, got {self.temperature}.")
        if self.temperature < 0.0:
            raise VLLMValidationError(f"temperature must be non-negative, got {self.temperature}.")
        if self.temperature > 2.0:
            raise VLLMValidationError(f"temperature must be in [0, 2], got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise VLLMValidationError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1 or not isinstance(self.top_k, int):
            raise VLLMValidationError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise VLLMValidationError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens != 0:
            raise NotImplementedError("the stand-in does not model min_tokens")
        if not all(isinstance(t, int) for t in self.stop_token_ids):
            raise VLLMValidationError(f"stop_token_ids must contain only integers, got {self.stop_token_ids}.")
        if any(not s for s in self.stop):
            raise VLLMValidationError("stop cannot contain an empty string.")
        if self.stop and not self.detokenize:
            raise VLLMValidationError("stop strings are only supported when detokenize is True. "
                                      "Set detokenize=True to use stop.")

    @property
    def greedy(self) -> bool:  # SamplingParams.sampling_type: GREEDY ignores the seed
        return self.temperature < SAMPLING_EPS

    def __repr__(self):
        return f"SamplingParams({', '.join(f'{k}={v!r}' for k, v in self.__dict__.items() if SAMPLING_FIELDS.get(k) != v)})"


@dataclass
class CompletionOutput:  # vllm/outputs.py CompletionOutput
    index: int
    text: str
    token_ids: list
    cumulative_logprob: float | None
    logprobs: object
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string; None for EOS and for "length"
    lora_request: object = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:  # vllm/outputs.py RequestOutput
    request_id: str
    prompt: str | None
    prompt_token_ids: list
    prompt_logprobs: object
    outputs: list = field(default_factory=list)
    finished: bool = True


def _context_length(model_dir: Path, tokenizer) -> int:
    """vllm/config/model.py _get_and_verify_max_len: the config's position limit, capped by tokenizer_config.json's
    model_max_length; 2048 when the config has none."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    derived = cfg.get("max_position_embeddings") or 2048
    tok_cfg = Path(model_dir) / "tokenizer_config.json"
    if tok_cfg.exists():
        derived = min(derived, json.loads(tok_cfg.read_text()).get("model_max_length", derived))
    return int(derived)


# vllm/entrypoints/llm.py LLM.__init__: its keyword parameters; the rest go to EngineArgs (a dataclass: an unknown
# name is a TypeError). Only the EngineArgs fields a test here may pass are listed.
_LLM_KEYWORDS = {
    "runner", "convert", "tokenizer", "tokenizer_mode", "skip_tokenizer_init", "trust_remote_code",
    "allowed_local_media_path", "allowed_media_domains", "tensor_parallel_size", "dtype", "quantization",
    "revision", "tokenizer_revision", "chat_template", "seed", "gpu_memory_utilization", "cpu_offload_gb",
    "enforce_eager", "disable_custom_all_reduce", "hf_token", "hf_overrides", "kv_cache_memory_bytes",
    "compilation_config", "logits_processors",
    "max_model_len", "enable_prefix_caching", "max_num_seqs", "max_num_batched_tokens", "disable_log_stats",
    "enable_chunked_prefill",
}


class RequestOutputKind:  # vllm/sampling_params.py: an IntEnum
    CUMULATIVE, DELTA, FINAL_ONLY = 0, 1, 2


def make_vllm(model, *, max_model_len: int | None = None, finish_order: str = "shortest"):
    """A ``vllm`` module whose ``LLM`` samples from ``model`` (see the module docstring). ``max_model_len``: the
    engine's context when the test does not pass one to ``LLM`` (default: derived from the model folder as vLLM
    does). ``finish_order``: the order ``llm_engine.step`` hands requests back in (module docstring)."""
    if finish_order not in ("shortest", "added"):
        raise ValueError(f"finish_order must be shortest or added, got {finish_order!r}")
    calls = {"llm": [], "generate": [], "samples": [], "add_request": [], "steps": [], "aborted": [], "requests": []}
    default_len = max_model_len

    class LLMEngine:
        """vllm/v1/engine/llm_engine.py LLMEngine: the request API (one sampled request per step here)."""

        def __init__(self, llm):
            self.llm, self.model_config = llm, llm.model_config
            self.pending: list = []  # (tokens to generate, order added, RequestOutput)
            self.added = 0

        def add_request(self, request_id, prompt, params, **kwargs):
            if not isinstance(request_id, str):
                raise TypeError(f"request_id must be a string, got {type(request_id)}")
            if not isinstance(params, SamplingParams):
                raise TypeError("params must be SamplingParams")
            if any(r.request_id == request_id for _, _, r in self.pending):
                raise ValueError(f"request id {request_id} is already running")
            (ids,) = self.llm._prompt_ids([prompt])
            calls["add_request"].append((request_id, ids, params))
            calls["requests"].append((ids, params))
            outputs = [self.llm._sample(ids, params, j) for j in range(params.n)]
            # only FINAL_ONLY requests are modelled: the parent's output comes once, when every child is done
            # (vllm/v1/engine/parallel_sampling.py ParentRequest.get_outputs)
            if params.output_kind != RequestOutputKind.FINAL_ONLY:
                raise NotImplementedError("the stand-in models output_kind=FINAL_ONLY requests only")
            length = max(len(o.token_ids) for o in outputs) if finish_order == "shortest" else 0
            self.pending.append((length, self.added, RequestOutput(request_id, None, ids, None, outputs)))
            self.added += 1
            return f"{request_id}-0000abcd"  # the internal id (vllm/v1/engine/input_processor.py assign_request_id)

        def has_unfinished_requests(self) -> bool:
            return bool(self.pending)

        def get_num_unfinished_requests(self) -> int:
            return len(self.pending)

        def step(self):
            if not self.pending:
                return []
            self.pending.sort(key=lambda x: (x[0], x[1]))
            done = self.pending.pop(0)[2]
            calls["steps"].append([done.request_id])
            return [done]

        def abort_request(self, request_ids, internal: bool = False):
            ids = set(request_ids)
            calls["aborted"].append(sorted(ids))
            self.pending = [x for x in self.pending if x[2].request_id not in ids]

    class LLM:
        def __init__(self, model: str, **kwargs):
            unknown = set(kwargs) - _LLM_KEYWORDS
            if unknown:
                raise TypeError(f"EngineArgs.__init__() got an unexpected keyword argument '{sorted(unknown)[0]}'")
            from transformers import AutoTokenizer

            calls["llm"].append({"model": model, **kwargs})
            self.tokenizer = AutoTokenizer.from_pretrained(model)
            length = kwargs.get("max_model_len") or default_len or _context_length(model, self.tokenizer)
            # vllm/entrypoints/llm.py: self.model_config = self.llm_engine.model_config
            self.model_config = SimpleNamespace(max_model_len=length, seed=kwargs.get("seed", 0))
            self.llm_engine = LLMEngine(self)
            self._requests = 0

        def get_tokenizer(self):
            return self.tokenizer

        def generate(self, prompts, sampling_params=None, *, use_tqdm=True, lora_request=None, priority=None,
                     tokenization_kwargs=None, mm_processor_kwargs=None):
            seq = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
            if sampling_params is None:
                sampling_params = SamplingParams()
            # vllm/entrypoints/offline_utils.py _params_to_seq
            if isinstance(sampling_params, (list, tuple)):
                if len(sampling_params) != len(seq):
                    raise VLLMValidationError(f"The lengths of prompts ({len(seq)}) and params "
                                              f"({len(sampling_params)}) must be the same.")
                params = list(sampling_params)
            else:
                params = [sampling_params] * len(seq)
            if not all(isinstance(p, SamplingParams) for p in params):
                raise TypeError("sampling_params must be SamplingParams")
            calls["generate"].append((seq, params))
            ids_list = self._prompt_ids(seq)
            calls["requests"].extend(zip(ids_list, params))
            out = []
            for ids, sp in zip(ids_list, params):
                rid = str(self._requests)
                self._requests += 1
                outputs = [self._sample(ids, sp, j) for j in range(sp.n)]
                # FINAL_ONLY aggregation puts each child at its index (vllm/v1/engine/parallel_sampling.py get_outputs)
                out.append(RequestOutput(rid, None, ids, None, outputs))
            return out

        def _prompt_ids(self, seq):
            """Each prompt's token ids, every one validated before any is sampled (one bad prompt fails the whole
            call: vllm/v1/engine/input_processor.py InputProcessor._validate_prompt_len)."""
            ids_list = []
            for p in seq:
                if isinstance(p, dict):
                    ids = list(p["prompt_token_ids"])
                else:  # a text prompt is tokenized with the special tokens (a BOS where the tokenizer adds one)
                    ids = self.tokenizer(p)["input_ids"]
                ids_list.append(ids)
            limit = self.model_config.max_model_len
            for ids in ids_list:
                if not ids:
                    raise VLLMValidationError("The decoder prompt cannot be empty")
                if len(ids) > limit:
                    raise VLLMValidationError(f"The decoder prompt (length {len(ids)}) is longer than the maximum "
                                              f"model length of {limit}. Make sure that `max_model_len` is no "
                                              f"smaller than the number of text tokens.")
                if len(ids) == limit:
                    raise VLLMValidationError(f"The decoder prompt (length {len(ids)}) plus the number of requested "
                                              f"output tokens (at least 1) is longer than the maximum model length "
                                              f"of {limit}. Make sure that `max_model_len` is no smaller than the "
                                              f"number of text tokens (prompt + requested output tokens).")
            return ids_list

        def _sample(self, prompt_ids, sp, index):
            # per-sample seed: vllm/v1/engine/parallel_sampling.py ParentRequest._get_child_sampling_params gives
            # child `index` the seed `seed + index` when n > 1; with n = 1 the request keeps its seed
            # (vllm/v1/engine/llm_engine.py add_request). Greedy requests use no generator
            # (vllm/v1/worker/gpu_model_runner.py: a generator only for SamplingType.RANDOM_SEED).
            seed = sp.seed if sp.n == 1 or sp.seed is None else sp.seed + index
            calls["samples"].append({"prompt_ids": list(prompt_ids), "index": index, "seed": seed,
                                     "request_seed": sp.seed})
            child = SimpleNamespace(prompt_ids=list(prompt_ids), index=index, seed=None if sp.greedy else seed,
                                    params=sp)
            tok = self.tokenizer
            eos = None if sp.ignore_eos else tok.eos_token_id
            limit = self.model_config.max_model_len
            max_tokens = sp.max_tokens if sp.max_tokens is not None else limit - len(prompt_ids)
            stream = iter(model(child))
            token_ids, finish, reason, text = [], None, None, ""
            while finish is None:
                try:
                    t = next(stream)
                except StopIteration:
                    raise AssertionError("the scripted model ended before vLLM would stop it") from None
                token_ids.append(t)
                # vllm/v1/core/sched/utils.py check_stop, in its order: EOS, stop token ids, then the length cap
                # (prompt + output reaching max_model_len, or max_tokens output tokens)
                if t == eos:
                    finish = "stop"
                elif t in sp.stop_token_ids:
                    finish, reason = "stop", t
                elif len(prompt_ids) + len(token_ids) >= limit or len(token_ids) >= max_tokens:
                    finish = "length"
                # vllm/v1/engine/detokenizer.py IncrementalDetokenizer.update: a token that stopped the request
                # (finish "stop" from the engine) is not detokenized unless include_stop_str_in_output; the text
                # is decoded with skip_special_tokens
                shown = token_ids[:-1] if finish == "stop" and not sp.include_stop_str_in_output else token_ids
                text = tok.decode(shown, skip_special_tokens=sp.skip_special_tokens) if sp.detokenize else ""
                # stop strings (detokenizer.check_stop_strings), checked after the engine's own stop and overriding
                # it (vllm/v1/engine/output_processor.py process_outputs): finish "stop", stop_reason the string;
                # the text ends before the string, or after it with include_stop_str_in_output
                hits = [(text.find(s) + len(s), text.find(s), s) for s in sp.stop if s in text]
                if hits:
                    end, start, s = min(hits)
                    text = text[:end] if sp.include_stop_str_in_output else text[:start]
                    finish, reason = "stop", s
            return CompletionOutput(index, text, token_ids, None, None, finish, reason)

    module = types.ModuleType("vllm")
    module.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    module.__version__ = VERSION
    module.LLM, module.SamplingParams = LLM, SamplingParams
    module.CompletionOutput, module.RequestOutput = CompletionOutput, RequestOutput
    sampling_params = types.ModuleType("vllm.sampling_params")
    sampling_params.SamplingParams, sampling_params.RequestOutputKind = SamplingParams, RequestOutputKind
    module.sampling_params = sampling_params
    exceptions = types.ModuleType("vllm.exceptions")
    exceptions.VLLMValidationError = VLLMValidationError
    module.exceptions = exceptions
    return module, calls


def scripted(tokenizer, texts_for, *, eos: bool = True):
    """A model for ``make_vllm``: ``texts_for(prompt_text, index) -> text``; it emits the text's tokens and then
    EOS (``eos``), or keeps repeating the text's last token (a model that never stops)."""

    def model(child):
        text = texts_for(tokenizer.decode(child.prompt_ids), child.index)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        yield from ids
        if eos:
            yield tokenizer.eos_token_id
        while True:
            yield ids[-1] if ids else tokenizer.eos_token_id

    return model
