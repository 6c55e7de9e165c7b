"""The two halves of GrammarMasks.apply at a batch size, apart: llguidance filling the
bitmasks of B rows that stand inside a JSON string (the costliest state: most tokens fit),
and the device turning them into -inf on the logits.

  PYTHONPATH=. python bench/profile_grammar_masks.py --tokenizer TOKENIZER_FOLDER [--batch 64]
"""

from __future__ import annotations

import argparse
import time

import llguidance
import llguidance.hf
import torch
from transformers import AutoTokenizer

from ringserve.engine.structured_output import GrammarMasks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    hf = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab = len(hf)
    tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"}}}}
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    prefix = hf.encode('{"items":["ab', add_special_tokens=False)
    matchers = []
    for _ in range(args.batch):
        m = llguidance.LLMatcher(tok, grammar, log_level=0)
        assert m.consume_tokens(prefix), m.get_error()
        matchers.append(m)
    words = (vocab + 31) // 32
    bitmask = torch.zeros((args.batch, words), dtype=torch.int32)
    for threads in (1, 4, 8, None):
        executor = llguidance.LLExecutor(num_threads=threads)
        rows = [(m, i) for i, m in enumerate(matchers)]
        start = time.perf_counter()
        for _ in range(args.repeats):
            executor.unsafe_compute_mask_ptr(rows, bitmask.data_ptr(), words * 4, args.batch)
        print(
            f"llguidance, {threads or 'default'} threads: {1e3 * (time.perf_counter() - start) / args.repeats:.3f} ms"
        )
    start = time.perf_counter()
    for m in matchers[:8]:
        for _ in range(args.repeats):
            m.unsafe_compute_mask_ptr(bitmask[0].data_ptr(), words * 4)
    print(f"one row alone: {1e3 * (time.perf_counter() - start) / args.repeats / 8:.3f} ms")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    masks = GrammarMasks(vocab, device)
    logits = torch.randn(args.batch, vocab, device=device)

    class Done:  # a grammar the masks leave alone: the device half alone is timed
        done, error = True, None

    rows = list(range(args.batch))
    for _ in range(3):
        masks.apply(logits, rows, [Done()] * args.batch)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.repeats):
        masks.apply(logits, rows, [Done()] * args.batch)
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(f"device half (host launch + kernels): {1e3 * (time.perf_counter() - start) / args.repeats:.3f} ms")


if __name__ == "__main__":
    main()
