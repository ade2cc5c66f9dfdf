"""`kvmesh generate [--model MODEL] "prompt"`: generate offline and stream the text.

`--chat "question"` (with an optional `--system "..."`) sends a conversation instead, rendered
with the model's chat template.

The request is built from the arguments once (`request_from_args`) and run on an in-process
engine; with `--target HOST:PORT` it goes to a running system instead (`generate_remote`). Both
read the same sampling flags (`generate_remote.sampling_from_args`): offline, every one of them
(--n, the penalties, --min-tokens, --logprobs, --stop-token-ids, ...) reaches the engine's
`SamplingParams`, and an invalid value exits 2 naming the field.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvmesh.engine.sampling_params import SamplingParams


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "generate", help="generate text for one prompt (streams to stdout)"
    )
    add_arguments(parser)
    # Remote mode (--target HOST:PORT): kvmesh.cli.generate_remote adds its extra options.
    from kvmesh.cli.generate_remote import add_remote_arguments

    add_remote_arguments(parser)
    parser.set_defaults(func=run_generate)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="?", default=None, help="prompt text")
    parser.add_argument("--prompt-ids", default=None, help="token-id prompt: 1,2,3")
    parser.add_argument(
        "--chat", default=None, metavar="TEXT", help="a user message, in the chat template"
    )
    parser.add_argument("--system", default=None, metavar="TEXT", help="system message (--chat)")
    parser.add_argument(
        "--model",
        default=None,
        help="checkpoint folder, .gguf file or hub id Org/Name (default: SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--json", action="store_true", help="end with a JSON line of results")


def chat_from_args(args: argparse.Namespace) -> list[dict[str, str]] | None:
    """The conversation of `--chat` (after `--system` when given), or None without `--chat`."""
    if getattr(args, "chat", None) is None:
        if getattr(args, "system", None) is not None:
            raise SystemExit("kvmesh generate: --system needs --chat")
        return None
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    return [*system, {"role": "user", "content": args.chat}]


def request_from_args(args: argparse.Namespace) -> tuple[Any, Any]:
    """(prompt: str | list[int] | conversation, SamplingParams) from the command line."""
    from kvmesh.engine.errors import InvalidParameterError

    chat = chat_from_args(args)
    given = [x is not None for x in (args.prompt, args.prompt_ids, chat)]
    if sum(given) != 1:
        raise InvalidParameterError("prompt", "give one of a prompt text, --prompt-ids or --chat")
    prompt: Any = args.prompt if chat is None else chat
    if args.prompt_ids is not None:
        try:
            prompt = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            raise InvalidParameterError("prompt_ids", "expected integers like 1,2,3") from None
    return prompt, sampling_params_from_args(args)


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    """The offline SamplingParams of every sampling flag, read as `--target` reads them
    (`sampling_from_args`: the flags set, this command's defaults for the others); an invalid
    value raises InvalidParameterError naming the field."""
    from kvmesh.cli.generate_remote import sampling_from_args
    from kvmesh.engine.sampling_params import SamplingParams

    return SamplingParams(**sampling_from_args(args))


def stream_local(args: argparse.Namespace, prompt: Any, params: Any) -> Iterator[Any]:
    """RequestOutputs of one request run on an in-process engine (a conversation is rendered
    with the model's chat template)."""
    from kvmesh.engine.chat import chat_prompt_ids
    from kvmesh.engine.config import EngineConfig
    from kvmesh.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=args.model, show_progress=True))
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        prompt = chat_prompt_ids(engine.tokenizer, prompt, engine.parts.max_model_len, "chat")
    engine.add_request("cli-0", prompt, params)
    while engine.has_unfinished():
        yield from engine.step()


def run_generate(args: argparse.Namespace) -> int:
    if getattr(args, "target", None):
        from kvmesh.cli.generate_remote import run_remote

        return run_remote(args)
    from kvmesh.engine.errors import InvalidParameterError, UnsupportedModelError

    try:
        prompt, params = request_from_args(args)
        final = None
        for output in stream_local(args, prompt, params):
            sys.stdout.write(output.outputs[0].new_text)
            sys.stdout.flush()
            final = output
    except InvalidParameterError as error:
        print(f"kvmesh generate: {error}", file=sys.stderr)
        return 2
    except UnsupportedModelError as error:
        print(f"kvmesh generate: model: {error}", file=sys.stderr)
        return 2
    sys.stdout.write("\n")
    if args.json and final is not None:
        print(json.dumps(result_json(final)))
    return 0


def result_json(final: Any) -> dict[str, Any]:
    """The --json line: the first completion's fields at top level, every completion (n > 1)
    under completions."""
    completions = [
        {
            "index": c.index, "text": c.text, "token_ids": c.token_ids,
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
        }
        for c in final.outputs
    ]  # fmt: skip
    first = final.outputs[0]
    return {
        "token_ids": first.token_ids,
        "text": first.text,
        "finish_reason": first.finish_reason,
        "stop_reason": first.stop_reason,
        "prompt_tokens": len(final.prompt_token_ids),
        "completion_tokens": len(first.token_ids),
        "ttft_s": final.metrics.ttft,
        "completions": completions,
    }
