"""`python -m serving.front`: the service with HAProxy in front, which refuses past the service's
adaptive concurrency limit so that refusals do not cost the service's event loop (docs/decisions/0007).

Runs `bentoml serve` on a private port of 127.0.0.1 and HAProxy (deploy/haproxy/haproxy.cfg) on the
public address, joined by HAProxy's runtime API socket, to which the service publishes its adaptive
concurrency limit (serving/proxy_limit.py). Stops both when either exits, or on SIGTERM / SIGINT.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from pydantic import ValidationError

from serving.settings import ServingSettings

CONFIG_DIR = Path(__file__).resolve().parents[1] / "deploy" / "haproxy"
PROXY_SERVER = "tandem/score"  # deploy/haproxy/haproxy.cfg's backend and server
DEFAULT_PORT = 3001  # the service's documented port: clients do not change with the proxy
# A request over the limit waits this long for a slot before HAProxy's 503, so that a slot freed
# just after it arrived is still taken. Past capacity the queue stays full and every request let in
# has waited about this long: 5 ms put shed p99 at 8.4-10.7 ms against the 10 ms target, and the
# stamped wait lowered the limit; 1 ms halved the shed p99 and kept more goodput (bench/findings.md).
DEFAULT_QUEUE_MS = 1
STOP_TIMEOUT_S = 60.0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m serving.front", description=__doc__.splitlines()[0])
    parser.add_argument("service", nargs="?", default="serving.service:RiskScorer", help="what `bentoml serve` serves")
    parser.add_argument("--host", default="127.0.0.1", help="the public address HAProxy binds")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="the public port HAProxy binds")
    parser.add_argument(
        "--backend-port", type=int, default=0, help="the service's private port on 127.0.0.1 (default: a free one)"
    )
    parser.add_argument(
        "--queue-ms", type=int, default=DEFAULT_QUEUE_MS, help="how long HAProxy holds a request over the limit"
    )
    parser.add_argument(
        "--runtime-socket", type=Path, default=None, help="HAProxy's runtime API socket (default: a temporary one)"
    )
    args = parser.parse_args(argv)
    for name in ("port", "backend_port"):
        if not 0 <= getattr(args, name) <= 65535:
            parser.error(f"--{name.replace('_', '-')} must be a port number, 0-65535")
    if args.queue_ms < 1:
        parser.error("--queue-ms must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _arguments(argv)
    haproxy = shutil.which("haproxy")
    if haproxy is None:
        print(
            "serving.front: haproxy is not installed (Debian: apt-get install haproxy); "
            "`bentoml serve serving.service:RiskScorer` serves without it",
            file=sys.stderr,
        )
        return 2
    try:
        settings = ServingSettings()
    except ValidationError as error:
        print(f"serving.front: {error.errors()[0]['loc']}: {error.errors()[0]['msg']}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="tandem-front-") as scratch:
        socket_path = args.runtime_socket or Path(scratch) / "haproxy.sock"
        backend_port = args.backend_port or _free_port()
        service_env = os.environ | {
            "TANDEM_SERVING_PROXY_RUNTIME_SOCKET": str(socket_path),
            "TANDEM_SERVING_PROXY_SERVER": PROXY_SERVER,
            # HAProxy sets X-Request-Start on every request, over any client's.
            "TANDEM_SERVING_TRUST_REQUEST_START": "true",
        }
        proxy_env = os.environ | {
            "TANDEM_FRONT_RUNTIME_SOCKET": str(socket_path),
            "TANDEM_FRONT_BIND": f"{args.host}:{args.port}",
            "TANDEM_FRONT_BACKEND": f"127.0.0.1:{backend_port}",
            # Where the service's limit starts; it publishes its own value once it is up.
            "TANDEM_FRONT_MAXCONN": str(settings.max_concurrency * settings.workers),
            "TANDEM_FRONT_QUEUE_MS": f"{args.queue_ms}ms",
            "TANDEM_FRONT_ERRORFILE": str(CONFIG_DIR / "overloaded.http"),
        }
        config = str(CONFIG_DIR / "haproxy.cfg")
        checked = subprocess.run(
            [haproxy, "-c", "-q", "-f", config], env=proxy_env, capture_output=True, text=True, check=False
        )
        if checked.returncode != 0:
            print(f"serving.front: HAProxy refused {config}: {checked.stderr.strip()}", file=sys.stderr)
            return 2
        bentoml = [sys.executable, "-m", "bentoml", "serve", args.service]
        children = {
            "bentoml serve": subprocess.Popen(
                [*bentoml, "--host", "127.0.0.1", "--port", str(backend_port)], env=service_env
            ),
            # -db: in the foreground, so that it stops with this process.
            "haproxy": subprocess.Popen([haproxy, "-db", "-f", config], env=proxy_env),
        }
        return _supervise(children)


def _supervise(children: dict[str, subprocess.Popen[bytes]]) -> int:
    """Wait until a signal or the first child to exit, then stop the rest. Returns 0 after a
    signal; a child that exited by itself is a failure, so its exit code, or 1 where that was 0."""
    stopping: list[int] = []

    def stop(signum: int, _frame: FrameType | None) -> None:
        stopping.append(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    code = 0
    while not stopping:
        exited = [(name, child.returncode) for name, child in children.items() if child.poll() is not None]
        if exited:
            name, returncode = exited[0]
            code = returncode or 1
            print(f"serving.front: {name} exited with {returncode}", file=sys.stderr)
            break
        time.sleep(0.2)
    for child in children.values():
        if child.poll() is None:
            child.terminate()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for child in children.values():
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    return code


if __name__ == "__main__":
    sys.exit(main())
