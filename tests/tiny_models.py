"""Tiny Llama models for the eval tests, built from a config with a BPE tokenizer trained here (no download).

Imported by the test files as ``from tiny_models import ...`` (pytest puts tests/ on sys.path; tests/ is not a
package, and ``tests.*`` would collide with the ``tests`` package the OpenRLHF wheel installs).
"""
from __future__ import annotations

import json
from pathlib import Path

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
CORPUS = ["Find the number of integers n. " + INSTRUCTION + " The answer is \\boxed{33}.",
          "0123456789 + - = ( ) { } \\frac"]

# Three problems whose gold answers are 2, 5 and 33 (the last one written "033" by the trained model below).
PROBLEMS = [{"id": "p1", "problem": "What is 1+1?", "answer": "2"},
            {"id": "p2", "problem": "What is 2+3?", "answer": "5"},
            {"id": "p3", "problem": "Find 033.", "answer": "33"}]
# What the trained model learns to say after any of them, in equal shares: one answer right per problem.
COMPLETIONS = ["\\boxed{2}", "\\boxed{5}", "\\boxed{033}"]


def write_problems(path: Path, rows=PROBLEMS) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def build_tiny_model(folder: Path, *, train: bool = False, seed: int = 0, steps: int = 300,
                     hidden_size: int | None = None) -> Path:
    """Save a random 1-layer Llama (and its tokenizer) in ``folder``.

    ``train=True``: first fit it (a few seconds on a CPU) so that after each of ``PROBLEMS``' prompts, asked the way
    ``stare eval`` asks (problem, newline, instruction; no chat template), it samples one of ``COMPLETIONS`` and
    stops (EOS). Every answer then stays possible for every problem, so avg@k is neither 0 nor 1.
    ``hidden_size`` (two heads; default 32, or 64 when trained): 128 gives head size 64, which vLLM's CPU attention
    supports.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder = Path(folder)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.decoder = decoders.ByteLevel()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                     unk_token="<unk>")
    hf_tok.save_pretrained(folder)
    torch.manual_seed(seed)
    hidden = hidden_size or (64 if train else 32)
    config = LlamaConfig(vocab_size=len(hf_tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config)
    if train:
        _fit(model, hf_tok, steps)
    model.save_pretrained(folder)
    return folder


def _fit(model, tok, steps: int) -> None:
    import torch

    seqs, labels = [], []
    for row in PROBLEMS:
        prompt = tok(f"{row['problem']}\n{INSTRUCTION}", add_special_tokens=False)["input_ids"]
        for completion in COMPLETIONS:
            answer = tok(completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            seqs.append(prompt + answer)
            labels.append([-100] * len(prompt) + answer)
    width = max(map(len, seqs))
    ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])
    lab = torch.tensor([s + [-100] * (width - len(s)) for s in labels])
    att = (torch.arange(width)[None, :] < torch.tensor([len(s) for s in seqs])[:, None]).long()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        opt.zero_grad()
        model(input_ids=ids, attention_mask=att, labels=lab).loss.backward()
        opt.step()
    model.eval()
