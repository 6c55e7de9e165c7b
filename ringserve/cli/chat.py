"""`ringserve chat`: a conversation with the model on the terminal (or through a pipe).

Each line read is a user turn; the history goes through the model's chat template every
turn, so the prefix cache makes the earlier turns nearly free. An answer streams to
stdout; why it stopped goes to stderr when it was not the model's own end (length, error,
Ctrl-C). `/exit`, `/quit`, Ctrl-D or the end of the piped input end the chat.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading

from ringserve.cli import common as cli
from ringserve.errors import RequestError, RingserveError
from ringserve.options import add_cli_args

EXIT_COMMANDS = ("/exit", "/quit")


def add_chat_parser(sub) -> None:
    chat = sub.add_parser(
        "chat",
        help="chat with the model: each line is a turn, the history is kept",
        description="Interactive chat through the model's chat template. Each line on stdin is a "
        "user turn (a pipe works too: one turn per line, the chat ends at its end). /exit or "
        "Ctrl-D ends the chat; Ctrl-C stops the answer being written.",
    )
    cli.add_model_positional(chat)
    chat.add_argument("--system", default=None, metavar="PROMPT", help="system prompt that opens the chat")
    cli.add_sampling_args(chat, max_tokens=512)
    add_cli_args(chat)


def run_chat(args) -> int:
    problem = cli.take_model_positional(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    parsed = cli.options_and_sampling(args)
    if parsed is None:
        return 2
    options, params = parsed
    llm = cli.start_llm(options)
    if llm is None:
        return 2
    with llm:
        try:  # refuse a model without a chat template, or a bad flag, before the first turn
            llm.engine.input_processor.chat_prompt([{"role": "user", "content": "hi"}])
            llm.engine.input_processor.check_params(params)
        except RequestError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return _converse(llm, params, args.system)


def _converse(llm, params, system: str | None) -> int:
    interactive = sys.stdin is not None and sys.stdin.isatty()
    if interactive:
        print("Chat with the model: /exit or Ctrl-D ends, Ctrl-C stops an answer.", file=sys.stderr)
    history = [{"role": "system", "content": system}] if system else []
    while True:
        line = _read_turn(interactive)
        if line is None:
            return 0
        text = line.strip()
        if not text:
            continue
        if text in EXIT_COMMANDS:
            return 0
        history.append({"role": "user", "content": text})
        try:
            _, token_ids = llm.engine.input_processor.chat_prompt(history)
            answer = _answer(llm, token_ids, params)
        except RequestError as e:  # e.g. the history outgrew the context: this turn is dropped
            history.pop()
            print(f"error: {e}", file=sys.stderr)
            continue
        except RingserveError as e:  # the engine cannot go on (a parallel rank died)
            print(f"\nerror: {e}", file=sys.stderr)
            return 1
        history.append({"role": "assistant", "content": answer})


def _read_turn(interactive: bool) -> str | None:
    """The next user line; None at the end of input (or Ctrl-C at the prompt: quit quietly)."""
    try:
        if interactive:
            return input("> ")
        line = sys.stdin.readline()
        return line if line else None
    except (EOFError, KeyboardInterrupt):
        if interactive:
            print(file=sys.stderr)
        return None


def _answer(llm, token_ids: list[int], params) -> str:
    """Stream one answer to stdout; the text the model wrote (so far, if Ctrl-C stopped it).

    Ctrl-C only sets a flag that is checked between steps, so a step is never cut in half
    (on several ranks, half a step would leave them waiting on each other)."""
    interrupted = threading.Event()
    final = None
    with _sigint_sets(interrupted), contextlib.closing(llm.generate_stream([token_ids], params)) as stream:
        for out in stream:
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
            final = out
            if interrupted.is_set():
                break  # closing the stream aborts the request and frees its blocks
    sys.stdout.write("\n")
    sys.stdout.flush()
    if interrupted.is_set():
        print("(stopped: interrupted)", file=sys.stderr)
    elif final is not None and final.finish_reason != "stop":
        print(f"(stopped: {cli.finish_reason(final, params)})", file=sys.stderr)
    return final.text if final is not None else ""


@contextlib.contextmanager
def _sigint_sets(flag: threading.Event):
    """While inside, Ctrl-C sets `flag` instead of raising KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda *_: flag.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
