"""The text an FP8 KV cache is calibrated on at start-up (worker/kv_calibration.py): a few
kinds of what a served model reads (prose, a chat turn, code, numbers, a list), so each
head's largest keys and values come from ordinary input. Written for ringserve."""

from __future__ import annotations

CALIBRATION_TEXT = """\
The river ran high that spring. By the time the ferry reached the far bank, the morning fog
had lifted from the valley and the farmers were already out in the fields, turning the dark
soil with horses and, here and there, a small red tractor. Nobody in the village remembered
a year with so much rain; the old mill, idle for decades, creaked as its wheel turned again.

User: Can you explain why the sky is blue, in two sentences?
Assistant: Sunlight is scattered by the molecules of the air, and shorter (blue) wavelengths
scatter far more than longer (red) ones. So wherever you look away from the sun, the light
that reaches your eyes is mostly scattered blue light.

def merge_sorted(a: list[int], b: list[int]) -> list[int]:
    \"\"\"Merge two sorted lists into one sorted list.\"\"\"
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i]); i += 1
        else:
            out.append(b[j]); j += 1
    return out + a[i:] + b[j:]

Quarterly results (in millions): revenue 412.7 (+8.3%), operating costs 287.1, net income
61.9; cash at the end of the period 1,204.5. Shipments: 3,150 units in Q1, 3,420 in Q2.

Steps to replace a bicycle tire:
1. Release the brake and remove the wheel.
2. Use two tire levers to lift one side of the tire off the rim.
3. Pull out the old tube, check the inside of the tire for thorns or glass.
4. Fit the new tube, seat the tire, and inflate it to the pressure printed on its side.
"""

_FALLBACK_TOKENS = 256  # a model without a tokenizer: this many spread-out token ids


def kv_calibration_ids(tokenizer, vocab_size: int, max_tokens: int) -> list[int]:
    """CALIBRATION_TEXT's token ids (at most max_tokens); without a tokenizer, ids spread
    over the vocabulary by a fixed stride."""
    if tokenizer is not None:
        ids = tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=True)
    else:
        ids = [(i * 7919 + 1) % vocab_size for i in range(_FALLBACK_TOKENS)]
    return ids[: max(1, max_tokens)]
