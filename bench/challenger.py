"""A challenger beside the champion, as the shadow and rollout scenarios set one up and watch it:
an untrained version registered in the model store, and the service's /metrics showing it shadow.
"""

from __future__ import annotations

import time
import urllib.request
from typing import TYPE_CHECKING

from prometheus_client.parser import text_string_to_metric_families

from bench.harness import RunningService

if TYPE_CHECKING:  # the bench's own modules start without the platform's imports
    from inference.spec import LoadedSpec

CHALLENGER_READY_S = 90.0  # pointer poll, the challenger process's start, model load and warm-up


def register_untrained(ls: LoadedSpec, seed: int) -> str:
    """An untrained version of the spec's model in the store, as bench.run.prepare_environment
    registers the champion."""
    import torch

    from inference.model import default_model, untrained_report
    from tandem import modelstore

    torch.manual_seed(seed)
    model = default_model(ls)
    return modelstore.register(model, untrained_report(model), name=ls.spec.model_name, code_version="bench")


# ---------------------------------------------------------------- /metrics
Metrics = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape_prefixed(port: int, prefixes: tuple[str, ...]) -> Metrics:
    """The samples of the service's /metrics whose names start with one of `prefixes`, by name and labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): float(sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith(prefixes)
    }


def scrape(port: int) -> Metrics:
    """The tandem_shadow_* samples."""
    return scrape_prefixed(port, ("tandem_shadow",))


def metric_sum(metrics: Metrics, name: str, **labels: str) -> float:
    """The sum over every series of `name` carrying `labels` (0 when there is none)."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in metrics.items() if n == name and wanted <= set(ls))


def wait_for_challenger(service: RunningService, tag: str, timeout_s: float = CHALLENGER_READY_S) -> float:
    """Seconds until /metrics shows `tandem_shadow_model_info{model_version=tag}` at 1."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if metric_sum(scrape(service.port), "tandem_shadow_model_info", model_version=tag) >= 1:
            return time.monotonic() - started
        if service.process.poll() is not None:
            break
        time.sleep(0.25)
    raise RuntimeError(f"challenger {tag} not shadowing within {timeout_s:.0f} s")
