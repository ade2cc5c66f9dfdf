"""Remote mode of `kvmesh generate`: `--target HOST:PORT` streams from a running system.

`add_remote_arguments(parser)` adds the remote options (skipping any flag the parser already
defines, so the offline command's own sampling flags are shared); `run_remote(args)` sends one
request with `kvmesh.client.Client`, streams its text to stdout and, with `--json`, prints a final
JSON line (request id, token ids, text, finish reason, stop reason, usage). Exit status: 0 on
success, 2 for INVALID_ARGUMENT, 1 for any other failure (message on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

# flag -> (sampling field, argparse keywords); a flag left unset is not sent (server default).
SAMPLING_FLAGS: dict[str, tuple[str, dict[str, Any]]] = {
    "--max-tokens": ("max_tokens", {"type": int}),
    "--temperature": ("temperature", {"type": float}),
    "--top-p": ("top_p", {"type": float}),
    "--top-k": ("top_k", {"type": int}),
    "--min-p": ("min_p", {"type": float}),
    "--seed": ("seed", {"type": int}),
    "--n": ("n", {"type": int}),
    "--repetition-penalty": ("repetition_penalty", {"type": float}),
    "--presence-penalty": ("presence_penalty", {"type": float}),
    "--frequency-penalty": ("frequency_penalty", {"type": float}),
    "--min-tokens": ("min_tokens", {"type": int}),
    "--logprobs": ("logprobs", {"type": int}),
    "--stop": ("stop", {"action": "append", "help": "stop string (repeatable)"}),
    "--stop-token-ids": ("stop_token_ids", {"type": str, "help": "comma-separated ids"}),
    "--ignore-eos": ("ignore_eos", {"action": "store_true", "default": None}),
    "--include-stop-str-in-output": (
        "include_stop_str_in_output",
        {"action": "store_true", "default": None},
    ),
    "--keep-special-tokens": ("skip_special_tokens", {"action": "store_false", "default": None}),
}
OTHER_FLAGS: dict[str, dict[str, Any]] = {
    "--target": {"metavar": "HOST:PORT", "help": "stream from a running system (kvmesh up)"},
    "--prompt-ids": {"metavar": "IDS", "help": "prompt as comma-separated token ids"},
    "--json": {"action": "store_true", "help": "print a final JSON line with ids and usage"},
    "--timeout": {"type": float, "default": 600.0, "help": "request deadline in seconds"},
    "--request-id": {"default": None, "help": "request id (default: a random one)"},
    "--api-key-file": {"metavar": "PATH", "default": None,
                       "help": "file whose first key line is the front door's API key "
                       "(env KVMESH_API_KEY)"},
    "--tls": {"action": "store_true", "help": "connect with TLS (system roots)"},
    "--tls-ca": {"metavar": "PEM", "default": None, "help": "TLS, verifying the server with it"},
    "--tls-cert": {"metavar": "PEM", "default": None, "help": "client certificate (mutual TLS)"},
    "--tls-key": {"metavar": "PEM", "default": None, "help": "private key of --tls-cert"},
    "--header": {"metavar": "KEY=VALUE", "action": "append", "default": None,
                 "help": "extra call metadata (repeatable)"},
}  # fmt: skip


def add_remote_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the remote options; flags the parser already has are left as they are."""
    existing = parser._option_string_actions
    for flag, kwargs in OTHER_FLAGS.items():
        if flag not in existing:
            parser.add_argument(flag, **kwargs)
    for flag, (_, kwargs) in SAMPLING_FLAGS.items():
        if flag not in existing:
            parser.add_argument(flag, **kwargs)


def _ids(text: str, flag: str) -> list[int]:
    """The integers of a comma-separated flag; a malformed one exits 2 naming `flag` (the exit
    status of every other invalid value)."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        print(f"kvmesh generate: {flag} must be comma-separated integers", file=sys.stderr)
        raise SystemExit(2) from None


def sampling_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Sampling fields the user set (None = unset = server default)."""
    sampling: dict[str, Any] = {}
    for flag, (name, _) in SAMPLING_FLAGS.items():
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is None:
            continue
        sampling[name] = _ids(value, flag) if name == "stop_token_ids" else value
    return sampling


def prompt_from_args(args: argparse.Namespace) -> Any:
    """Token ids (--prompt-ids), a conversation (--chat, --system) or the prompt text."""
    from kvmesh.cli.generate import chat_from_args

    chat = chat_from_args(args)
    if chat is not None:
        if getattr(args, "prompt", None) or getattr(args, "prompt_ids", None):
            raise SystemExit("kvmesh generate: give either a prompt, --prompt-ids or --chat")
        return chat
    if getattr(args, "prompt_ids", None):
        return _ids(args.prompt_ids, "--prompt-ids")
    prompt = getattr(args, "prompt", None)
    if isinstance(prompt, list):
        prompt = " ".join(prompt)
    if not prompt:
        raise SystemExit("kvmesh generate: give a prompt or --prompt-ids")
    return str(prompt)


def client_options(args: argparse.Namespace) -> dict[str, Any]:
    """Client keywords of the security flags: API key (file or KVMESH_API_KEY), TLS, metadata."""
    import os

    from kvmesh.security.credentials import CredentialError, read_secret_lines

    key = os.environ.get("KVMESH_API_KEY", "").split(",")[0].strip() or None
    if getattr(args, "api_key_file", None):
        try:  # the server's format: one key a line, `#` comments
            lines = read_secret_lines(args.api_key_file, "--api-key-file")
        except CredentialError as error:
            raise SystemExit(f"kvmesh generate: {error}") from None
        key = lines[0] if lines else None
    metadata = []
    for header in getattr(args, "header", None) or ():
        name, sep, value = header.partition("=")
        if not sep or not name:
            raise SystemExit(f"kvmesh generate: --header {header!r} is not KEY=VALUE")
        metadata.append((name.strip().lower(), value))
    return {"api_key": key, "metadata": tuple(metadata), "tls": bool(getattr(args, "tls", False)),
            "ca": getattr(args, "tls_ca", None), "cert": getattr(args, "tls_cert", None),
            "key": getattr(args, "tls_key", None)}  # fmt: skip


def run_remote(args: argparse.Namespace) -> int:
    """Send one request to `args.target`, stream its text, optionally print the JSON line."""
    from kvmesh.client import Client, KvmeshError, collect

    prompt = prompt_from_args(args)
    sampling = sampling_from_args(args)
    with Client(args.target, **client_options(args)) as client:
        try:
            stream = client.generate(
                prompt, request_id=args.request_id, timeout=args.timeout, **sampling
            )
            chunks = []
            for chunk in stream:
                chunks.append(chunk)
                if chunk.index == 0:
                    print(chunk.text, end="", flush=True)
        except KvmeshError as error:
            print(f"\nkvmesh generate: {error}", file=sys.stderr)
            return 2 if error.code.name == "INVALID_ARGUMENT" else 1
    print(flush=True)
    result = collect(stream.request_id, chunks)
    if args.json:
        print(json.dumps(result_json(result)), flush=True)
    return 0


def result_json(result: Any) -> dict[str, Any]:
    """The --json line: the first completion's fields at top level, all under completions."""
    completions = [
        {
            "index": c.index, "text": c.text, "token_ids": c.token_ids,
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
            "usage": c.usage.as_dict() if c.usage else None,
        }
        for c in result.completions
    ]  # fmt: skip
    first = completions[0] if completions else {}
    return {"request_id": result.request_id, **first, "completions": completions}


def demo(endpoint: str, prompt: str, max_tokens: int, **client: Any) -> int:
    """`kvmesh up --demo`: one greedy request, streamed, then its usage and TTFT breakdown.

    The prompt goes as a chat question when the served model has a chat template (the default
    model does), as plain text otherwise.
    """
    from kvmesh.client import Client, KvmeshError, collect

    with Client(endpoint, timeout=120.0, **client) as conn:
        info = conn.model_info()
        form = "chat" if info.has_chat_template else "text"
        print(f"model {info.model_name} ({info.architecture}, {info.mode}); {form}: {prompt!r}")
        try:
            if info.has_chat_template:
                messages = [{"role": "user", "content": prompt}]
                stream = conn.chat(messages, max_tokens=max_tokens, temperature=0.0)
            else:
                stream = conn.generate(prompt, max_tokens=max_tokens, temperature=0.0)
            print("> ", end="")
            chunks = []
            for chunk in stream:
                chunks.append(chunk)
                print(chunk.text, end="", flush=True)
        except KvmeshError as error:
            print(f"\nkvmesh up --demo: {error}", file=sys.stderr)
            return 1
    result = collect(stream.request_id, chunks)
    print()
    print_usage(result)
    return 0


def print_usage(result: Any) -> None:
    u = result.usage
    print(f"finish: {result.finish_reason}; tokens: {len(result.token_ids)}")
    if u is None:
        return
    ms = 1000.0
    print(f"usage: prompt {u.prompt_tokens}, completion {u.completion_tokens}, "
          f"cached {u.cached_tokens}")  # fmt: skip
    print(f"TTFT {u.ttft_seconds * ms:.1f} ms = queue {u.queue_seconds * ms:.1f} + prefill "
          f"{u.prefill_seconds * ms:.1f} + transfer {u.transfer_seconds * ms:.1f} + first decode "
          f"{u.first_decode_seconds * ms:.1f} (+ routing/RPC); total {u.e2e_seconds * ms:.1f} ms",
          flush=True)  # fmt: skip
