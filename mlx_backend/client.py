#!/usr/bin/env python3
"""A small terminal client: stream a chat reply from a running backend.

Usage: python -m mlx_backend.client [--addr 127.0.0.1:50051] "What is the capital of France?"
"""

import argparse
import os
import sys

import grpc

import backend_pb2
import backend_pb2_grpc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Stream a chat reply from the MLX backend"
    )
    parser.add_argument("prompt", nargs="+", help="the user message")
    parser.add_argument("--addr", default="127.0.0.1:50051")
    parser.add_argument("--system", default="", help="an optional system message")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=-1, help="-1 for a random seed")
    args = parser.parse_args(argv)

    messages = (
        [backend_pb2.Message(role="system", content=args.system)] if args.system else []
    )
    messages.append(backend_pb2.Message(role="user", content=" ".join(args.prompt)))
    request = backend_pb2.PredictOptions(
        UseTokenizerTemplate=True,
        Messages=messages,
        Tokens=args.max_tokens,
        Temperature=args.temperature,
        Seed=args.seed,
    )
    token = os.environ.get("LOCALAI_GRPC_AUTH_TOKEN")
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    with grpc.insecure_channel(args.addr) as channel:
        stub = backend_pb2_grpc.BackendStub(channel)
        try:
            for reply in stub.PredictStream(request, metadata=metadata):
                for delta in reply.chat_deltas:
                    # Reasoning goes to stderr, so stdout holds only the answer.
                    sys.stderr.write(delta.reasoning_content)
                    for call in delta.tool_calls:
                        sys.stdout.write(f"\n[tool call {call.name}({call.arguments})]")
                sys.stdout.write(reply.message.decode("utf-8"))
                sys.stdout.flush()
        except grpc.RpcError as e:
            sys.stderr.write(f"\nerror: {e.code().name}: {e.details()}\n")
            return 1
    sys.stdout.write(
        f"\n[{reply.tokens} tokens, prompt {reply.prompt_tokens} tokens, "
        f"{reply.timing_token_generation:.0f} ms generating]\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
