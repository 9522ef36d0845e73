"""The slot pool under a long line: leases a second and CPU time per lease.

``--threads`` customers share ``--slots`` slots of a ``SlotPool`` (no model: a lease is held
``--hold-ms`` by sleeping, as a turn holds its slot while the engine works), each asking again
as soon as it let go, polling every half second as ``ChatSession`` does. Printed: leases a
second against the most the slots allow (slots / hold), and the process's CPU time per lease:
what waking waiters, looking at the line and handing slots over cost.

    .venv/bin/python bench/pool_bench.py [--threads 32] [--slots 4] [--hold-ms 5,50]
"""

from __future__ import annotations

import argparse
import threading
import time

from chatctx.backends.pool import SlotPool
from chatctx.backends.swap import SwapHit
from chatctx.errors import DeadlineExceeded

POLL_S = 0.5  # ChatSession's LEASE_POLL_S
NO_SWAP = SwapHit(None, None, None)


def run(threads: int, slots: int, hold_s: float, seconds: float) -> dict[str, float]:
    pool = SlotPool(slots, swap_out=lambda seq, owner: None, swap_in=lambda seq, o: (NO_SWAP, 0))
    leases = [0] * threads
    stop = time.monotonic() + seconds

    def customer(n: int) -> None:
        while time.monotonic() < stop:
            try:
                lease = pool.lease(f"customer-{n}", timeout=POLL_S)
            except DeadlineExceeded:
                continue
            time.sleep(hold_s)
            pool.release(lease)
            leases[n] += 1

    workers = [threading.Thread(target=customer, args=(n,)) for n in range(threads)]
    cpu, wall = time.process_time(), time.monotonic()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    total = sum(leases)
    return {
        "leases_per_s": total / wall,
        "of_most": total / wall / (slots / hold_s),
        "cpu_ms_per_lease": cpu * 1000 / max(total, 1),
        "fewest_leases": min(leases),
        "most_leases": max(leases),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=32)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--hold-ms", default="5,50", help="comma-separated: one run each")
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()
    print(f"{args.threads} customers on {args.slots} slots, {args.seconds:.0f} s a run")
    print("| hold ms | leases/s | of the most | CPU ms a lease | leases a customer |")
    print("|---|---|---|---|---|")
    for hold in (float(h) for h in args.hold_ms.split(",")):
        r = run(args.threads, args.slots, hold / 1000, args.seconds)
        print(
            f"| {hold:g} | {r['leases_per_s']:.0f} | {r['of_most']:.2f} | "
            f"{r['cpu_ms_per_lease']:.3f} | {r['fewest_leases']:.0f}-{r['most_leases']:.0f} |"
        )


if __name__ == "__main__":
    main()
