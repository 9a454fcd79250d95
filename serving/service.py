"""The BentoML service, the composition root of the online path:
`bentoml serve serving.service:TandemScorer` (127.0.0.1:3001; Dagster has 3000).

One worker by default: on two cores one runs the event loop and one the scoring process. Workers
share the outbox file and the Prometheus values. The class-scope model is served at start; a
promotion later is picked up without a restart unless TANDEM_SERVING_MODEL_TAG pins a version.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import typing

import bentoml
from bentoml import get_current_service
from bentoml.models import BentoModel
from sqlalchemy.engine import Engine

from inference.migrate import upgrade
from inference.settings import TandemSettings
from inference.spec import LoadedSpec, configured_spec
from inference.store import is_transient_db_error, make_engine
from serving import worker
from serving.app import answer, build_app
from serving.backends import ScoringBackend
from serving.breaker import StatementBound
from serving.gate import ScoreGate, call_in
from serving.lifecycle import ChallengerWatcher, DeferredMigration, ModelWatcher, PoolSupervisor
from serving.metrics import ServingMetrics
from serving.openapi import ApiDocs, service_document
from serving.outbox import Outbox
from serving.runtime import OnlineScorer
from serving.schemas import ScoreResponseBase, api_models
from serving.scoring_process import terminate
from serving.security import SecuritySettings
from serving.settings import ServingSettings
from serving.shadow import SHADOW_NICE
from tandem import modelstore
from tandem.version import code_version

logger = logging.getLogger(__name__)

MODEL_LOAD_TIMEOUT_S = 120.0  # starting and warming a new version's scoring process
MODEL_RETRY_MAX_S = 60.0  # the longest wait before retrying a version that failed to load
POOL_CHECK_INTERVAL_S = 0.5  # how soon a dead scoring process is noticed and replaced
SCHEMA_RETRY_S = 5.0  # how often a service started without its database retries the schema check


def production_model() -> BentoModel:
    """The version to serve: a pinned tag, else the production pointer, else the only stored
    version (a built Bento carries exactly one), if it was trained with the spec Tandem runs.
    Runs at import: `bentoml build` packs the class-scope model.
    """
    if (foreign := modelstore.foreign_store()) is not None:
        raise LookupError(foreign)
    name = TandemSettings().model_name
    tag = ServingSettings().model_tag or modelstore.production_tag(name)
    if tag is None:
        stored = modelstore.versions(name)
        if len(stored) != 1:
            raise LookupError(
                f"{modelstore.missing_production(name)}; found {len(stored)} stored versions, promote one "
                "or set TANDEM_SERVING_MODEL_TAG"
            )
        tag = stored[0].tag
    return BentoModel(modelstore.check_spec(tag, configured_spec()))


def bounded_engine(url: str, serving: ServingSettings) -> tuple[Engine, StatementBound]:
    """The store's engine with every statement bounded; the bound's `on_cut` is the breaker's trip
    once there is a breaker."""
    engine = make_engine(url, **serving.engine_options(url))
    bound = StatementBound(serving.statement_bound_s)
    bound.watch(engine)
    return engine, bound


def migrate_or_defer(engine: Engine, spec: LoadedSpec) -> DeferredMigration | None:
    """Check the schema now; a database that is down defers the check rather than the start, so a
    restart during an outage still answers (degraded, rows to the outbox), as a running service does."""
    try:
        upgrade(engine, spec)
    except Exception as error:
        if not is_transient_db_error(error):
            raise
        logger.warning("database unreachable at start, serving degraded until it answers: %s", error)
        return DeferredMigration(engine, spec, interval_s=SCHEMA_RETRY_S)
    return None


def api_document() -> dict[str, typing.Any]:
    scorer = current_scorer()
    return service_document(scorer.spec, scorer.settings, SecuritySettings(), scorer.model_version)


def current_scorer() -> OnlineScorer:
    service: TandemScorer = get_current_service()
    return service.scorer


# The spec the service scores: BentoML reads an API's input and output specs at class definition,
# so the request and response models are the configured spec's from import on.
SPEC = configured_spec()
API = api_models(SPEC)


# /lineage/{id}, /openapi.json and /metrics; /score is the @bentoml.api below, behind the gate.
@bentoml.asgi_app(build_app(current_scorer), path="/")
@bentoml.service(
    workers=ServingSettings().workers,
    http={"host": "127.0.0.1", "port": 3001},
    # BentoML's metrics middleware and access log cost more per request than the model's share;
    # /metrics is served by the mounted app instead.
    metrics={"enabled": False},
    logging={"access": {"enabled": False}},
    # Only a backstop: requests carry their own, shorter deadlines and are answered 504 first.
    traffic={"timeout": ServingSettings().backstop_timeout_s},
    # No trace exporter is configured; BentoML's tracing middleware costs event-loop CPU per request.
    tracing={"excluded_urls": ["/score"]},
)
class TandemScorer:
    model_ref = production_model()

    def __init__(self) -> None:
        settings = TandemSettings()
        serving = ServingSettings()
        SecuritySettings()  # a bad token or body limit fails the start, not the first request
        self.spec = SPEC
        url = settings.resolved_database_url()
        engine, bound = bounded_engine(url, serving)
        self.migration = migrate_or_defer(engine, self.spec)
        self.worker_config = worker.WorkerConfig(
            spec_path=self.spec.path,
            model_dir=str(self.model_ref.path),
            model_version=str(self.model_ref.tag),
            database_url=url,
            forward_batch_size=serving.max_batch_size,
            code_version=code_version(),
            torch_threads=serving.torch_threads,
            breaker_failure_threshold=serving.breaker_failure_threshold,
            breaker_reset_s=serving.breaker_reset_s,
            engine_options=serving.engine_options(url),
            statement_bound_s=serving.statement_bound_s,
        )
        first = ScoringBackend(self.worker_config.model_version, worker.start_pool(self.worker_config), worker.score)
        self.scorer = OnlineScorer(
            spec=self.spec,
            process=first.process,
            executor=first.executor,
            model_version=first.model_version,
            engine=engine,
            settings=serving,
            outbox=Outbox(settings.data_dir / "serving" / "outbox.sqlite3"),
            metrics=ServingMetrics(
                code_version=self.worker_config.code_version,
                settings=serving,
                vocabulary_fields=tuple(field.name for field in self.spec.categoricals),
            ),
        )
        bound.on_cut = self.scorer.breaker.trip
        # Not ready until real inferences have run end to end.
        self.scorer.warm_up()
        # Everything allocated so far lives as long as the process: full collections need not scan it.
        gc.freeze()
        # Empty counts as unset, as in production_model(): the deployment ships TANDEM_SERVING_MODEL_TAG=.
        follow = not serving.model_tag and serving.model_poll_interval_s > 0
        self.shutdown_drain_s = serving.shutdown_drain_s
        self.watcher = (
            ModelWatcher(
                self.scorer,
                production_tag=functools.partial(modelstore.production_tag, settings.model_name),
                load=self.load_version,
                interval_s=serving.model_poll_interval_s,
                load_timeout_s=MODEL_LOAD_TIMEOUT_S,
                retry_max_s=MODEL_RETRY_MAX_S,
                discard=terminate,
            )
            if follow
            else None
        )
        # The challenger is followed as production is, and only then: a pinned service shadows nothing.
        self.challenger_watcher = (
            ChallengerWatcher(
                self.scorer.shadow,
                challenger_tag=functools.partial(modelstore.challenger_tag, settings.model_name),
                load=functools.partial(self.load_version, nice=SHADOW_NICE),
                interval_s=serving.model_poll_interval_s,
                load_timeout_s=MODEL_LOAD_TIMEOUT_S,
                retry_max_s=MODEL_RETRY_MAX_S,
                discard=terminate,
            )
            if follow and serving.shadow_sample > 0
            else None
        )
        # Always on: a pinned version needs its dead scoring process replaced as much as any.
        self.supervisor = PoolSupervisor(
            self.scorer,
            load=self.load_version,
            interval_s=POOL_CHECK_INTERVAL_S,
            load_timeout_s=MODEL_LOAD_TIMEOUT_S,
            discard=terminate,
        )

    @bentoml.api(route="/score", input_spec=API.request, output_spec=API.response)
    async def score(self, ctx: bentoml.Context, **batch: typing.Any) -> ScoreResponseBase:
        """Score records, each answered on its own (a model failure or a non-finite score fails
        only that item). Refusals: 401 token, 400 header, 408 a body slower than the deadline, 413
        size, 422 schema or a reused Idempotency-Key, 409 key in flight, 503 overload or no scoring
        process (Retry-After), 504 deadline. Send the key and the deadline as headers
        (Idempotency-Key, X-Deadline-Ms) or, from a BentoML client, as the fields of the same names."""
        # BentoML passes the request's fields as keywords: the spec's list (`plural`), the key and
        # the deadline; and the context by its parameter's name.
        call = call_in(ctx.request.scope)
        records = batch[self.spec.spec.plural]
        response = await answer(call, self.scorer, records, batch["idempotency_key"], batch["deadline_ms"])
        # BentoML answers with the context's status, not the response's: a refusal keeps its own.
        ctx.response.status_code = response.status_code
        return response  # type: ignore[return-value]

    def load_version(self, tag: str, nice: int = 0) -> ScoringBackend:
        """A scoring process for another stored version, started at once (its model loads before the
        first call); SpecMismatch, before any process starts, for a version of another spec."""
        stored = bentoml.models.get(modelstore.check_spec(tag, self.spec))
        config = dataclasses.replace(
            self.worker_config, model_dir=str(stored.path), model_version=str(stored.tag), nice=nice
        )
        return ScoringBackend(config.model_version, worker.start_pool(config), worker.score)

    @bentoml.on_startup
    async def start_scorer(self) -> None:
        await self.scorer.start()
        self.supervisor.start()
        if self.watcher is not None:
            self.watcher.start()
        if self.challenger_watcher is not None:
            self.challenger_watcher.start()
        if self.migration is not None:
            self.migration.start()

    @bentoml.on_shutdown
    async def stop_scorer(self) -> None:
        """SIGTERM: the server has answered what it held. Submitted rows are written, then one last
        outbox drain bounded by shutdown_drain_s (the outbox leaves with the pod)."""
        await self.supervisor.close()
        if self.migration is not None:
            await self.migration.close()
        if self.watcher is not None:
            await self.watcher.close()
        if self.challenger_watcher is not None:
            await self.challenger_watcher.close()
        await self.scorer.close(drain_s=self.shutdown_drain_s)
        # The pool of the version serving now, which a swap may have replaced since __init__.
        self.scorer.executor.shutdown(wait=True)

    def __is_ready__(self) -> bool:
        return self.scorer.ready()

    def __is_alive__(self) -> bool:
        return self.scorer.alive() and (self.migration is None or self.migration.failed is None)


# Before BentoML reads or parses the body: a refusal costs no parse, and a schema error is Tandem's
# 422 (naming the field, the items quarantined) rather than BentoML's 400.
typing.cast("bentoml.Service[TandemScorer]", TandemScorer).add_asgi_middleware(ScoreGate, get_scorer=current_scorer)
# BentoML's /docs.json (and its docs page) with every answer /score gives, the limits and the model.
typing.cast("bentoml.Service[TandemScorer]", TandemScorer).add_asgi_middleware(ApiDocs, document=api_document)

# The service's name before it served any team's model: deployments started with it serve on.
RiskScorer = TandemScorer
