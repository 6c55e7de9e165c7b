"""What the `ringserve` subcommands share: the model positional, the sampling flags and
the SamplingParams they give, starting the LLM, and saying why an answer stopped."""

from __future__ import annotations

import argparse
import sys

from ringserve.options import OptionError, cli_error, from_cli_args


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    """The sampling flags (`sampling_params(args)` reads them back); max_tokens: its default."""
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=max_tokens, help="new tokens at most per answer")
    group.add_argument("--temperature", type=float, default=0.0, help="0 is greedy; higher is more random")
    group.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling: keep tokens up to this mass"
    )
    group.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens (0: all)")
    group.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help="drop tokens less likely than this x the likeliest's probability",
    )
    group.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="> 1 discourages tokens of the prompt and the answer",
    )
    group.add_argument(
        "--presence-penalty", type=float, default=0.0, help="minus this for each token already used"
    )
    group.add_argument(
        "--frequency-penalty", type=float, default=0.0, help="minus this times the times a token was used"
    )
    group.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")


def options_and_sampling(args):
    """(EngineOptions, SamplingParams) from the flags, or None after printing the error."""
    try:
        return from_cli_args(args), sampling_params(args)
    except OptionError as e:
        print(f"error: {cli_error(e)}", file=sys.stderr)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
    return None


def sampling_params(args):
    """The SamplingParams the sampling flags give; a bad value raises RequestError (a ValueError)."""
    from ringserve import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )


def add_model_positional(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_pos", nargs="?", default=None, metavar="MODEL", help="same as --model")


def take_model_positional(args) -> str | None:
    """Move MODEL into --model; an error message when both are given and differ."""
    if args.model_pos is not None:
        if getattr(args, "model", None) not in (None, args.model_pos):
            return "give the model once, as MODEL or --model"
        args.model = args.model_pos
    return None


def start_llm(options):
    """The LLM for these options, or None after printing why it cannot start."""
    from ringserve import LLM
    from ringserve.errors import ENGINE_START_ERRORS

    try:
        return LLM.from_options(options)
    except ENGINE_START_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return None


def finish_reason(out, params) -> str:
    """Why a request stopped: eos, stop (with the string or token), length (max_tokens or max_model_len)."""
    if out.finish_reason == "stop":
        if out.stop_reason is None:
            return "eos"
        kind = "string" if isinstance(out.stop_reason, str) else "token"
        return f"stop {kind} {out.stop_reason!r}"
    if out.finish_reason == "error":
        return f"error ({out.error})"
    if out.finish_reason == "length":
        return "length (max_tokens)" if len(out.token_ids) >= params.max_tokens else "length (max_model_len)"
    return str(out.finish_reason)
