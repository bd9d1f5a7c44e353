"""The ``specengine serve`` subcommand: load a model and serve it over HTTP with uvicorn."""

from __future__ import annotations

import argparse
import sys

from specengine.models.registry import DEFAULT_MODEL


def add_serve_cli(sub) -> None:
    """Add the ``serve`` subparser to ``specengine``'s subcommands (imports nothing heavy)."""
    s = sub.add_parser("serve", help="serve a model over HTTP (OpenAI- and TRL-compatible)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       description="Serve a model over HTTP: OpenAI /v1/completions and "
                       "/v1/chat/completions (streaming too), TRL vllm-serve routes, /health, "
                       "/metrics. Concurrent requests are batched together.")
    s.add_argument("--model", default=DEFAULT_MODEL,
                   help="known alias, Hugging Face directory or .gguf file")
    s.add_argument("--served-model-name", default=None,
                   help="the 'model' name clients send (None: the --model value)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=8000, help="TCP port")
    s.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="the target's dtype")
    s.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (None: the model's)")
    s.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="bytes for the paged KV cache (None: 1 GiB)")
    s.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    s.add_argument("--seed", type=int, default=0,
                   help="seeds the requests that carry no seed of their own")
    s.add_argument("--logprobs-mode", default="raw_logprobs",
                   choices=["raw_logprobs", "processed_logprobs"],
                   help="processed_logprobs is what TRL and verl use for importance sampling")
    s.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])


def serve_main(args: argparse.Namespace) -> int:
    """Run the server until interrupted; 2 for bad arguments or a missing ``serve`` extra."""
    try:
        import uvicorn

        from specengine.server.app import build_app
    except ImportError as e:
        print(f"error: specengine serve needs FastAPI and uvicorn "
              f"(pip install 'specengine[serve]'): {e}", file=sys.stderr)
        return 2
    from specengine.api import LLM
    from specengine.cli import speculative_config_arg

    if not 0 <= args.port <= 65535:
        print(f"error: --port {args.port} must be in [0, 65535]", file=sys.stderr)
        return 2
    try:
        spec = speculative_config_arg(args.speculative_config)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                  kv_cache_memory_bytes=args.kv_cache_memory_bytes, seed=args.seed,
                  speculative_config=spec, logprobs_mode=args.logprobs_mode)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    app = build_app(llm, args.served_model_name or args.model)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
