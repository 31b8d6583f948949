"""stare eval's sampling throughput beside the engine's own limit and the old one-problem-at-a-time path.

One engine is loaded once; on it, interleaved, each repeat runs
- ``engine``: one call over every prompt (vLLM: one ``LLM.generate`` with each problem's request as stare eval sends
  it; HF: the backend's own batched ``generate_many``, what its engine can do), nothing scored or written: the
  engine's own limit;
- ``stare eval``: the harness (``stare.eval.harness.run_eval``, ``--batching all``) into a fresh folder: every
  problem in flight, scored with math-verify as each completes, written and fsynced;
- ``one problem``: the same harness with ``--batching problem``, one problem per engine call (what ``stare eval`` did
  before ``--batching``).
Throughput is sampled tokens per second of wall time, each variant's tokens counted from its own samples (the stop
token included, as the engine counts it), and the samples of the three variants are compared (``same samples``).
Medians over the repeats, ratios with a 90% interval (a paired bootstrap over the rounds of the interleaving). The
background load printed is that of other processes in the 5 s before the engine starts.

Targets (issue 53, on the vLLM CPU engine, AIME25's 30 problems, k 8): stare eval >= 0.9 x engine, >= 2 x one
problem.

    ENV/bin/python benchmarks/bench_eval.py                      # vLLM (the vLLM CPU env: scripts/vllm-cpu-env.sh)
    python benchmarks/bench_eval.py --backend hf --model PATH    # transformers, CPU or one GPU

The default model is a randomly initialised 4-layer Llama (hidden 128, head size 64 as vLLM's CPU attention needs; a
byte-level BPE tokenizer of 512 tokens trained on the bench's problems), built in a temporary folder: it rarely ends a
sample early, so every sample is about ``--max-tokens`` long. ``--model`` takes any model folder instead.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

from _timing import BackgroundLoad, median, print_result, ratio_interval

TARGETS = {"engine": 0.9, "one problem": 2.0}  # stare eval's throughput over each, at least


def random_llama(folder: Path, texts: list[str], *, layers: int = 4, hidden: int = 128, seed: int = 0) -> Path:
    """A random Llama with a byte-level BPE tokenizer (512 tokens) trained on ``texts``, saved in ``folder``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=512, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                     unk_token="<unk>")
    hf_tok.save_pretrained(folder)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(hf_tok), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                         max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("vllm", "hf"), default="vllm")
    ap.add_argument("--model", help="a model folder (default: a random 4-layer Llama built here)")
    ap.add_argument("--bench", default="aime25")
    ap.add_argument("--limit", type=int, help="only the first N problems")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds (default 3), after one untimed")
    ap.add_argument("--layers", type=int, default=4, help="the random Llama's layers (default 4)")
    ap.add_argument("--hidden", type=int, default=128, help="the random Llama's hidden size, a multiple of 64 (128)")
    ap.add_argument("--score", choices=("auto", "on", "off"), default="auto",
                    help="score with math-verify in the stare eval variants (auto: where it is installed; off: every "
                         "answer counted wrong without a check, generation and writing still timed)")
    ap.add_argument("--device", default=None, help="accepted for the GPU check; the backend picks its device")
    args = ap.parse_args()
    import importlib.util

    from stare.eval import harness as harness_module

    score = args.score == "on" or (args.score == "auto" and importlib.util.find_spec("math_verify") is not None)
    if not score:  # the GPU check's machine has no math-verify
        harness_module.score_many = lambda pairs, timeout=5.0: [False] * len(pairs)

    from stare.eval import load_bench
    from stare.eval.backends import make_backend
    from stare.eval.harness import run_eval
    from stare.eval.protocols import BOXED_INSTRUCTION, Protocol, problem_seed

    problems = load_bench(args.bench, limit=args.limit)
    proto = Protocol("bench", args.k, 1.0, 0.7, args.max_tokens)
    work = Path(tempfile.mkdtemp(prefix="bench-eval-"))
    # the other processes' load in the 5 s before the engine starts (during the runs the engine's own processes
    # would count as others)
    load = BackgroundLoad()
    time.sleep(5)
    load.cores()
    try:
        model = args.model or str(random_llama(work / "model", [f"{p.problem}\n{BOXED_INSTRUCTION}" for p in problems],
                                               layers=args.layers, hidden=args.hidden))
        t0 = time.perf_counter()
        backend = make_backend(args.backend, model, seed=0, batching="all")
        load_s = time.perf_counter() - t0
        prompts = [backend.prompt_text(p.problem, proto.instruction) for p in problems]
        requests = [(i, prompt, proto.k, problem_seed(0, i, proto.k)) for i, prompt in enumerate(prompts)]

        def engine() -> tuple[int, list]:
            if args.backend == "vllm":
                ids = [backend.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
                params = [backend._params(proto.k, proto, seed) for _, _, _, seed in requests]
                outs = backend.llm.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=False)
                samples = [[o.token_ids for o in sorted(r.outputs, key=lambda o: o.index)] for r in outs]
                texts = [[o.text for o in sorted(r.outputs, key=lambda o: o.index)] for r in outs]
                return sum(len(t) for s in samples for t in s), texts
            got = dict(backend.generate_many(requests, proto))
            texts = [[s[0] for s in got[i]] for i in range(len(problems))]
            return sum(s[1] + (0 if s[2]["truncated"] else 1) for i in got for s in got[i]), texts

        def harness(batching: str):
            def run() -> tuple[int, list]:
                out = work / f"run-{batching}"
                shutil.rmtree(out, ignore_errors=True)
                run_eval(problems, backend, proto, out, bench=args.bench, model=model, seed=0, resume=False,
                         batching=batching, warn=lambda m: None)
                rows = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
                texts = [[r["response"] for r in rows if r["problem_id"] == p.id] for p in problems]
                return sum(r["num_tokens"] + (0 if r["truncated"] else 1) for r in rows), texts
            return run

        variants = {"engine": engine, "stare eval": harness("all"), "one problem": harness("problem")}
        tokens, texts = {}, {}
        for name, fn in variants.items():  # untimed: compilation, caches, the scoring workers started
            tokens[name], texts[name] = fn()
        times: dict[str, list[float]] = {name: [] for name in variants}
        for r in range(args.repeats):
            for name in (list(variants) if r % 2 == 0 else list(reversed(variants))):
                t = time.perf_counter()
                tokens[name], got = variants[name]()
                times[name].append(time.perf_counter() - t)
                if got != texts[name]:
                    texts[name] = None  # the engine drew other samples from the same seeds on another round
        same = {name: texts[name] is not None and texts[name] == texts["engine"] for name in variants}
    finally:
        shutil.rmtree(work, ignore_errors=True)

    rate = {name: tokens[name] / median(times[name]) for name in variants}
    what = Path(model).name if args.model else f"random {args.layers}-layer Llama (hidden {args.hidden})"
    print(f"stare eval throughput: {args.backend} backend, {what}, {args.bench} ({len(problems)} problems) x k "
          f"{args.k}, {args.max_tokens} tokens, {args.repeats} rounds interleaved after one untimed; engine loaded in "
          f"{load_s:.1f} s; python {platform.python_version()}, {os.cpu_count()} CPUs; scoring "
          f"{'math-verify' if score else 'off'}")
    print(f"  {'variant':<12} {'median s':>9} {'tokens':>8} {'tokens/s':>9}  same samples as engine")
    for name in variants:
        print(f"  {name:<12} {median(times[name]):9.2f} {tokens[name]:8d} {rate[name]:9.1f}  "
              f"{'yes' if same[name] else 'no'}")
    result = {"benchmark": "eval", "backend": args.backend, "bench": args.bench, "problems": len(problems), "scored": score,
              "k": args.k, "max_tokens": args.max_tokens, "repeats": args.repeats, "load_s": load_s,
              "background_cores": None, "same_samples": same,
              "median_s": {n: median(times[n]) for n in variants}, "tokens_per_s": rate}
    for base, target in TARGETS.items():
        ratio = rate["stare eval"] / rate[base]
        # throughput ratio = the inverse of the time ratio (same tokens): invert the interval of the time ratio
        lo, hi = ratio_interval(times["stare eval"], times[base])
        lo, hi = tokens["stare eval"] / tokens[base] / hi, tokens["stare eval"] / tokens[base] / lo
        ok = "PASS" if ratio >= target else "FAIL"
        print(f"  stare eval / {base:<11} {ratio:6.2f}  90% [{lo:.2f}, {hi:.2f}]  target >= {target}  {ok}")
        result[f"ratio_vs_{base.replace(' ', '_')}"] = ratio
        result[f"interval_vs_{base.replace(' ', '_')}"] = [lo, hi]
        result[f"verdict_vs_{base.replace(' ', '_')}"] = ok
    print(load.line())
    result["background_cores"] = load.cores()
    print_result(result)


if __name__ == "__main__":
    main()
