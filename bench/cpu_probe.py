"""`python -m bench.cpu_probe`: the service's CPU per served request at a few open-loop rates, on the
embedded default (SQLite) and on PostgreSQL, beside the do-nothing endpoint on the same stack, and
optionally a py-spy profile of each process.

A quick instrument for one change against the code it started from: run it from both checkouts in
one session (`--out` apart) and compare. `make bench` measures the same figure over its whole sweep.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import psutil

from bench.harness import (
    RunningService,
    ServiceSpec,
    fresh_bodies,
    request_bodies,
    service_specs,
    start_service,
    tandem_postgres_spec,
    tandem_spec,
)
from bench.online import online_environment, sweep
from bench.run import prepare_environment


def _py_spy() -> str | None:
    """py-spy beside this interpreter (the bench extra installs it) or on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def _profile(service: RunningService, seconds: float, out: Path, pyspy: str) -> list[subprocess.Popen[bytes]]:
    """py-spy records of the server and each child (the scoring process) while the load runs."""
    out.mkdir(parents=True, exist_ok=True)
    parent = psutil.Process(service.process.pid)
    return [
        subprocess.Popen(
            [
                *(pyspy, "record", "-p", str(p.pid), "-d", str(int(seconds)), "-r", "200", "-f", "speedscope"),
                *("-o", str(out / f"profile-{p.pid}.json"), "--nonblocking"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for p in [parent, *parent.children(recursive=True)]
    ]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rates", default="100,800", help="open-loop rates, comma-separated")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--profile-rate", type=int, default=0, help="py-spy Tandem (each store) at this rate")
    parser.add_argument("--stores", default="sqlite,postgres", help="Tandem's stores, comma-separated")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    rates = [int(r) for r in args.rates.split(",")]
    pyspy = _py_spy()
    if args.profile_rate and pyspy is None:
        parser.error("--profile-rate needs py-spy: pip install -e '.[bench]'")
    stores = set(args.stores.split(","))
    bench = prepare_environment(rows_per_day=2000, days=3)
    args.out.mkdir(parents=True, exist_ok=True)
    good, _ = request_bodies(bench, 20_000)
    # The services' own databases with the same history: SQLite unless told, PostgreSQL where reachable.
    online, postgres_url = online_environment(bench, rows_per_day=2000, days=3)
    do_nothing = next(s for s in service_specs() if s.name == "do_nothing")
    results: dict[str, object] = {}
    specs: list[ServiceSpec] = [do_nothing]
    if "sqlite" in stores:
        specs.append(tandem_spec())
    if "postgres" in stores:
        if postgres_url is None:
            results["tandem_postgres"] = {"error": "no PostgreSQL reachable"}
        else:
            specs.append(tandem_postgres_spec(postgres_url, bench.root / "probe_postgres"))
    try:
        for spec in specs:
            service = start_service(spec, online)
            if isinstance(service, str):
                results[spec.name] = {"error": service}
                continue
            try:
                body = fresh_bodies(bench.model_spec, good, spec.name)
                results[spec.name] = sweep(service, rates, args.seconds, body)
                if pyspy is not None and args.profile_rate and spec.name != do_nothing.name:
                    recorders = _profile(service, args.seconds, args.out / spec.name, pyspy)
                    sweep(service, [args.profile_rate], args.seconds, body)
                    for recorder in recorders:
                        recorder.wait(timeout=60)
            finally:
                service.stop()
    finally:
        online.drop()
        bench.drop()
    (args.out / "cpu_probe.json").write_text(json.dumps(results, indent=2, default=str))
    for name, levels in results.items():
        if isinstance(levels, list):
            for level in levels:
                print(
                    f"{name} @ {level['offered_rps']:.0f} rps: CPU {level['cpu_ms_per_served']:.2f} ms/served, "
                    f"p99 {level['p99_ms']:.1f} ms, goodput {level['goodput_rps']:.0f}, shed {level['shed']}"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
