"""Part 6 of ``make bench``: speculative decoding (n-gram prompt lookup).

Three workloads, greedy, on the backend with speculation on and off:
- copy: one stream returns ~250 tokens of Python code with one line fixed, so most
  of its output is in its prompt; ``mlx_lm.server`` on the same weights runs it too
  (it has no draft model, so nothing to speculate with);
- open: one stream writes a story, where prompt lookup finds little;
- mix: 8 streams at once, half of each, where the batch decodes as usual.
Decode tok/s counts from the first token to the last. Rounds alternate which
server goes first.
"""

import json
import logging
import statistics

import backend_pb2 as pb
from bench.batching import (
    grpc_stream,
    http_stream,
    mlx_lm_server,
    run_concurrently,
)

logger = logging.getLogger(__name__)

TOKENS = 160
MIX_STREAMS = 8
MIX_TOKENS = 64
# "Return this code with one line fixed": most of the answer is in the prompt.
CODE = """\
def load_orders(path):
    orders = []
    with open(path) as f:
        for line in f:
            fields = line.strip().split(",")
            if len(fields) != 4:
                continue
            order_id, customer, amount, status = fields
            orders.append({
                "id": int(order_id),
                "customer": customer.strip(),
                "amount": float(amount),
                "status": status.strip().lower(),
            })
    return orders


def total_by_customer(orders):
    totals = {}
    for order in orders:
        if order["status"] != "paid":
            continue
        customer = order["customer"]
        totals[customer] = totals.get(customer, 0) + order["amount"]
    return totals


def top_customers(orders, count=3):
    totals = total_by_customer(orders)
    ranked = sorted(totals.items(), key=lambda item: item[1])
    return [name for name, _ in ranked[:count]]
"""
COPY = (
    "Return this Python code unchanged except for one fix: top_customers must sort "
    f"from the largest total to the smallest.\n\n{CODE}"
)
OPEN = "Write a story about a lighthouse keeper who finds a message in a bottle."


def decode_rate(stream) -> float:
    """Tokens per second from the first reply to the last."""
    seconds = stream.arrivals[-1] - stream.arrivals[0]
    return (stream.tokens - 1) / seconds if seconds > 0 else float("nan")


def acceptance(stub) -> tuple[int, int]:
    metrics = json.loads(stub.GetMetrics(pb.MetricsRequest()).prompt_json_for_slot)
    return metrics["draft_tokens_proposed"], metrics["draft_tokens_accepted"]


def proposed(stub) -> int:
    """Tokens the server has proposed so far (Status)."""
    return stub.Status(pb.HealthMessage()).memory.breakdown["draft_tokens_proposed"]


def mix(stub, eos: int) -> float:
    """Aggregate tok/s of MIX_STREAMS streams at once, half copying, half open."""
    prompts = [(COPY if i % 2 else OPEN) + f" ({i})" for i in range(MIX_STREAMS)]
    streams = run_concurrently(
        lambda prompt: grpc_stream(stub, prompt, MIX_TOKENS, eos), prompts
    )
    begin = min(s.start for s in streams)
    end = max(s.arrivals[-1] for s in streams)
    return sum(s.tokens for s in streams) / (end - begin)


def bench_speculative(
    on, off, folder: str, log_folder: str, rounds: int
) -> tuple[dict, list[str]]:
    """Args:
    on: A backend stub with speculation on (the default); ``off``: with it off.
    folder: The exported MLX folder that ``mlx_lm.server`` serves.
    """
    eos = 2
    runs: dict = {
        "copy": {"on": [], "off": [], "mlx_lm": []},
        "open": {"on": [], "off": []},
        "mix": {"on": [], "off": []},
    }
    accepted: dict = {"copy": [], "open": []}
    mix_proposed = 0
    with mlx_lm_server(folder, log_folder) as port:
        sides = {
            "on": lambda p, n: grpc_stream(on, p, n, eos),
            "off": lambda p, n: grpc_stream(off, p, n, eos),
            "mlx_lm": lambda p, n: http_stream(port, "default_model", p, n, eos),
        }
        for side in sides.values():
            side("Warm up.", 8)
        for r in range(rounds):
            order = ["on", "off", "mlx_lm"]
            order = order[r % 3 :] + order[: r % 3]
            for workload, prompt in (("copy", COPY), ("open", OPEN)):
                for side in order:
                    if side not in runs[workload]:
                        continue
                    logger.info("speculation: %s, %s, round %d", workload, side, r + 1)
                    stream = sides[side](prompt, TOKENS)
                    runs[workload][side].append(decode_rate(stream))
                    if side == "on":
                        accepted[workload].append(acceptance(on))
            for side, stub in (("on", on), ("off", off))[:: 1 if r % 2 else -1]:
                logger.info("speculation: mix, %s, round %d", side, r + 1)
                before = proposed(on)
                runs["mix"][side].append(mix(stub, eos))
                if side == "on":
                    mix_proposed += proposed(on) - before
    summary = {
        workload: {side: statistics.median(v) for side, v in sides_.items()}
        for workload, sides_ in runs.items()
    }
    totals = {
        workload: (sum(p for p, _ in pairs), sum(a for _, a in pairs))
        for workload, pairs in accepted.items()
    }
    rates = {workload: a / max(1, p) for workload, (p, a) in totals.items()}
    shown = {
        workload: f"{a}/{p} ({a / p:.0%})" if p else "none proposed"
        for workload, (p, a) in totals.items()
    }
    copy, open_, mixed = summary["copy"], summary["open"], summary["mix"]
    lines = [
        f"6. speculative decoding (n-gram prompt lookup), greedy, median of {rounds} "
        f"rounds; decode tok/s from the first token",
        f"{'workload':<26}{'on':>9}{'off':>9}{'on/off':>9}  accepted/proposed",
        f"{'copy, 1 stream':<26}{copy['on']:>9.1f}{copy['off']:>9.1f}"
        f"{copy['on'] / copy['off']:>8.2f}x  {shown['copy']}",
        f"{'open, 1 stream':<26}{open_['on']:>9.1f}{open_['off']:>9.1f}"
        f"{open_['on'] / open_['off']:>8.2f}x  {shown['open']}",
        f"{f'mix, {MIX_STREAMS} streams (aggregate)':<26}{mixed['on']:>9.1f}"
        f"{mixed['off']:>9.1f}{mixed['on'] / mixed['off']:>8.2f}x"
        f"   ({mix_proposed} tokens proposed: batches decode plainly)",
        f"copy on mlx_lm.server: {copy['mlx_lm']:.1f} tok/s; the backend with "
        f"speculation is {copy['on'] / copy['mlx_lm']:.2f}x",
    ]
    report = {
        "runs": runs,
        "summary": summary,
        "acceptance": rates,
        "mix_proposed": mix_proposed,
    }
    return report, lines
