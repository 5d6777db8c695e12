"""The fleet simulator's conversation study alone (the `chat` part of `vtoken bench fleet`, which runs every other
study first): each placement's prefix-cache hit rate and TTFT on 16-256 simulated replicas, against the oracle
that reads every cache. No engine; minutes on 2 cores.

    .venv/bin/python scripts/fleet_chat_study.py --chat-replicas 16,64,256 --chat-rates 1 --chat-horizon 20 \
        --out /tmp/fleet_chat.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.sim import calibration  # noqa: E402
from vtoken.bench import fleet  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    fleet.add_args(p)
    p.add_argument("--out", default="fleet_chat.json")
    a = vars(p.parse_args())
    t = time.time()
    out = fleet._chat(calibration.load(a["calibration"]), a)
    out["seconds"] = round(time.time() - t, 1)
    Path(a["out"]).write_text(json.dumps(out, indent=1))
    for r in out["rows"]:
        print(f"{r['replicas']:4d} {r['strategy']:14s} hit {r['hit_rate']:.3f} TTFT p50 {1e3 * r['ttft_p50_s']:.1f} ms "
              f"p99 {1e3 * r['ttft_p99_s']:.1f} ms imbalance {r['imbalance']:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
