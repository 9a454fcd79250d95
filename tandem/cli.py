"""`tandem`: the command line. `tandem demo` runs the embedded platform end to end."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import bentoml
import sqlalchemy as sa
from pydantic import ValidationError
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine, make_url

from inference.batch import FORWARD_BATCH_SIZE, BatchProducer, ChunkProgress, ingest_day, score_partition
from inference.contract import TorchPredictor
from inference.demo import day_range, demo_day, demo_settings
from inference.lineage import cli_run_id, explain
from inference.migrate import upgrade
from inference.settings import TandemSettings, get_settings, settings_error
from inference.spec import (
    Categorical,
    Label,
    LoadedSpec,
    SpecError,
    configured_spec,
    load_spec,
    role_of,
)
from inference.store import (
    WithdrawalReason,
    latest_challenger_report,
    make_engine,
    mark_rejections_fixed,
    record_table_ddl,
    rejected_records,
    store_url,
)
from inference.training import train_from_store
from tandem import modelstore
from tandem.version import code_version


def _say(message: str) -> None:
    print(message, flush=True)


def run_demo(settings: TandemSettings) -> dict[str, object]:
    """generate -> ingest -> train + register -> score the last day -> upsert -> summary."""
    started = time.perf_counter()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    ls = configured_spec()
    engine = _migrated_engine(settings, ls)
    demo = demo_settings(settings)
    days = day_range(demo.start, demo.days)

    _say(f"[1/4] ingesting {len(days)} generated days into {engine.url!r}")
    for day in days:
        ingest = ingest_day(ls, engine, demo_day(ls, day, demo), day)
        _say(
            f"      {day}: {ingest.rows_stored} stored ({ingest.rows_changed} new or changed), "
            f"{ingest.rejected_at_ingest} quarantined at ingest"
        )

    _say("[2/4] training the risk model (the last day is held out)")
    config = ls.spec.model_config(settings.history_length)
    model, training = train_from_store(
        engine, ls, first_day=days[0], holdout_day=days[-1], config=config, seed=settings.demo_seed
    )
    tag = modelstore.register(model, training, name=settings.model_name, code_version=code_version())
    modelstore.promote(tag)
    flops = f", {training.flops_per_item / 1e6:.1f} MFLOP/item" if training.flops_per_item is not None else ""
    _say(
        f"      {tag}: AUC {training.auc:.4f} on {training.holdout_rows} held-out rows, "
        f"{training.parameter_count:,} parameters{flops}"
    )

    _say(f"[3/4] scoring {days[-1]} through inference/ (batch path)")
    predictor = TorchPredictor(model=model, model_version=tag, spec=ls, forward_batch_size=FORWARD_BATCH_SIZE)

    def progress(chunk: ChunkProgress) -> None:
        _say(f"      chunk {chunk.chunk}: {chunk.rows_done} rows, {chunk.rows_per_second:,.0f} rows/s")

    producer = BatchProducer(run_id=cli_run_id(), partition_key=days[-1].isoformat(), code_version=code_version())
    scored = score_partition(
        ls, engine, predictor, days[-1], producer=producer, history_length=predictor.history_length, on_chunk=progress
    )
    summary = {
        "partition": days[-1].isoformat(),
        "rows_in": scored.rows_in,
        "scored": scored.scored,
        "quarantined": scored.rejected,
        "quarantined_by_reason": dict(sorted(scored.rejected_by_reason.items())),
        "scored_with_unseen_values": scored.scored_with_unseen,
        "unseen_values_by_field": dict(sorted(scored.unseen_by_field.items())),
        "model_version": tag,
        "auc": round(training.auc, 4),
        "rows_per_second": round(scored.rows_per_second),
        "seconds_total": round(time.perf_counter() - started, 1),
    }
    _say("[4/4] summary")
    _say(json.dumps(summary, indent=2))
    engine.dispose()
    return summary


# rejected_records.rejection_id is an INTEGER: PostgreSQL's int4 on either backend's schema.
MAX_REJECTION_ID = 2**31 - 1


def _rejection_id(text: str) -> int:
    try:
        rejection_id = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a rejection id: {text!r}") from None
    if not 1 <= rejection_id <= MAX_REJECTION_ID:
        raise argparse.ArgumentTypeError(f"not a rejection id: {text} (ids run from 1 to {MAX_REJECTION_ID})")
    return rejection_id


def _existing_store(settings: TandemSettings, ls: LoadedSpec) -> Engine:
    """The store a command reads or marks, migrated, or LookupError where none was ever made: a
    typo in DATABASE_URL made an empty store there, and the command answered from it."""
    url = settings.resolved_database_url()
    try:
        parsed = store_url(url)
    except ValueError as unusable:
        raise ValueError(f"DATABASE_URL: {unusable}") from unusable
    where = f"no store at {parsed.render_as_string(hide_password=True)}"
    if parsed.get_backend_name() == "sqlite" and not Path(parsed.database or "").is_file():
        raise LookupError(f"{where}: nothing was ever stored there (DATABASE_URL, TANDEM_DATA_DIR)")
    engine = _engine(url)
    with engine.connect() as conn:
        made = sa.inspect(conn).has_table("alembic_version")
    if not made:
        engine.dispose()
        raise LookupError(f"{where}: the database holds no Tandem tables (DATABASE_URL)")
    upgrade(engine, ls)
    return engine


def _migrated_engine(settings: TandemSettings, ls: LoadedSpec) -> Engine:
    engine = _engine(settings.resolved_database_url())
    upgrade(engine, ls)
    return engine


def _engine(url: str) -> Engine:
    try:
        engine = make_engine(url)
    except ValueError as unusable:
        raise ValueError(f"DATABASE_URL: {unusable}") from unusable
    except OSError as unusable:
        # The SQLite file's folder could not be made: a file stands in its path, or no permission.
        where = make_url(url).render_as_string(hide_password=True)
        raise OSError(unusable.errno, f"{unusable.strerror} (the folder of {where})", unusable.filename) from unusable
    return engine


_WITHDRAWN_BECAUSE = {
    WithdrawalReason.NOT_RESENT.value: "the re-sent day no longer holds it (its batch answers went with it)",
    WithdrawalReason.REFUSED_AT_INGEST.value: "the re-sent day sent it as a row refused at ingest (below)",
}


def _print_lineage(settings: TandemSettings, record_id: str, *, as_json: bool) -> int:
    ls = configured_spec()
    engine = _existing_store(settings, ls)
    report = explain(
        ls,
        engine,
        record_id,
        dagster_ui_url=settings.dagster_ui_url,
        production_version=modelstore.production_tag(settings.model_name),
    )
    if as_json:
        _say(json.dumps(report.to_dict(), indent=2, default=str))
        return 0 if report.found else 1
    if not report.found:
        _say(f"{record_id}: no such record, no results and no rejections")
        return 1
    if report.source_found:
        _say(f"{record_id}: partition {report.partition_date}, current input hash {report.current_input_hash}")
    elif report.withdrawn is not None:
        withdrawn = report.withdrawn
        _say(
            f"{record_id}: withdrawn from partition {withdrawn.partition_key} at {withdrawn.withdrawn_at}: "
            f"{_WITHDRAWN_BECAUSE.get(withdrawn.reason, withdrawn.reason)}"
        )
        if withdrawn.dagster_run_url:
            _say(f"  run: {withdrawn.dagster_run_url}")
    else:
        _say(f"{record_id}: no stored record")
    for rejection in report.rejections:
        state = f"resolved ({rejection.resolution})" if rejection.resolved else "open"
        # Scoring's detail names its reason first (`describe_rejection`); a source's does not.
        why = rejection.detail or rejection.reason
        if not why.startswith(f"{rejection.reason}:"):
            why = f"{rejection.reason}: {why}" if rejection.detail else rejection.reason
        _say(f"  REJECTED at {rejection.where}: {why}")
        _say(
            f"    rejection {rejection.rejection_id}, {state}; seen {rejection.seen_count}x, "
            f"first {rejection.first_seen}, last {rejection.last_seen}"
        )
        _say(f"    received: {rejection.received}")
        if rejection.dagster_run_url:
            _say(f"    run: {rejection.dagster_run_url}")
    for result in report.results:
        flags = [
            "CURRENT" if result.current else "",
            "superseded input" if result.input_is_current is False else "",
            "degraded" if result.degraded else "",
            f"unseen {','.join(result.unseen_fields)}" if result.unseen_fields else "",
        ]
        _say(
            f"  {result.model_version}: score {result.score:.6f} via {result.path} ({result.producer}), "
            f"code {result.code_version}, input {result.input_hash}, history {result.history_hash}, "
            f"at {result.produced_at} {' '.join(flag for flag in flags if flag)}".rstrip()
        )
        if result.dagster_run_url:
            _say(f"    run: {result.dagster_run_url}")
        if result.batch_score is not None:
            _say(f"    batch path: {result.batch_score:.6f}: {result.versus_batch}")
    for result in report.challenger_results:
        _say(
            f"  challenger {result.model_version}: score {result.score:.6f} via {result.path} ({result.producer}), "
            f"input {result.input_hash}, at {result.produced_at} (never returned to a client)"
        )
    return 0


def _print_ddl(settings: TandemSettings, dialect_name: str | None) -> None:
    """The record table's statements, for a user who creates or alters it by hand."""
    dialects = {"postgresql": postgresql.dialect, "sqlite": sqlite.dialect}
    name = dialect_name
    if name is None:
        try:
            name = make_url(settings.resolved_database_url()).get_backend_name()
        except sa_exc.ArgumentError:
            # Not echoed: a URL that does not parse may still hold a password.
            raise ValueError("DATABASE_URL: not a database URL; --dialect names the SQL to print") from None
    if name not in dialects:
        raise ValueError(f"DATABASE_URL: a {name} database; Tandem's store is PostgreSQL or SQLite")
    dialect = dialects[name]()
    for statement in record_table_ddl(configured_spec(), dialect):
        _say(f"{statement};")


def _print_spec(loaded: LoadedSpec) -> None:
    spec = loaded.spec
    _say(f"{loaded.path}: {spec.name} scored by {spec.model_name}, spec version {spec.version}, digest {loaded.digest}")
    history = f"{spec.history_length} earlier records of {loaded.entity.name}" if loaded.entity else "none"
    _say(f"  history for new models: {history}; record table {loaded.table}; request list {spec.plural!r}")
    for field in (*spec.fields, *([spec.label] if spec.label else [])):
        role = role_of(field) if not isinstance(field, Label) else "label"
        detail = f" ({len(field.vocabulary)} values)" if isinstance(field, Categorical) else ""
        _say(f"  {field.name:<24} {role}{detail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="generate, train, score one day, print a summary")
    models = commands.add_parser("models", help="model versions and the production pointer")
    model_commands = models.add_subparsers(dest="action", required=True)
    model_commands.add_parser("list", help="every version; * production, c challenger")
    promote = model_commands.add_parser("promote", help="make a version production")
    promoted = promote.add_mutually_exclusive_group(required=True)
    promoted.add_argument("tag", nargs="?")
    promoted.add_argument(
        "--from-challenger",
        action="store_true",
        help="promote the challenger, if its latest challenger_report passed every check of the gate",
    )
    promote.add_argument("--force", action="store_true", help="with --from-challenger: promote past failed checks")
    model_commands.add_parser("rollback", help="production back to the version before it")
    register = model_commands.add_parser(
        "register", help="register a model trained elsewhere: a folder with weights.pt and config.json"
    )
    register.add_argument("directory", type=Path)
    register.add_argument("--promote", action="store_true", help="and make it production")
    challenge = model_commands.add_parser("challenge", help="set (or --clear) the challenger")
    challenged = challenge.add_mutually_exclusive_group(required=True)
    challenged.add_argument("tag", nargs="?")
    challenged.add_argument("--clear", action="store_true", help="empty the challenger slot")
    spec = commands.add_parser("spec", help="check a model spec and print its fields, roles and digest")
    spec.add_argument(
        "path",
        nargs="?",
        help="package.module:attribute (default: the spec TANDEM_MODEL_SPEC names, else the reference)",
    )
    lineage = commands.add_parser("lineage", help="why does a record have its score")
    lineage.add_argument("record_id")
    lineage.add_argument("--json", action="store_true", help="machine-readable output")
    store = commands.add_parser("store", help="the configured spec's record table")
    store_commands = store.add_subparsers(dest="action", required=True)
    ddl = store_commands.add_parser("ddl", help="print the CREATE statements of the record table")
    ddl.add_argument("--dialect", choices=("postgresql", "sqlite"), help="SQL dialect (default: that of DATABASE_URL)")
    rejects = commands.add_parser("rejects", help="quarantined records")
    reject_commands = rejects.add_subparsers(dest="action", required=True)
    fixed = reject_commands.add_parser("fixed", help="mark rejections fixed upstream (the sensor reruns their days)")
    fixed.add_argument("rejection_ids", nargs="+", type=_rejection_id, metavar="rejection_id")
    args = parser.parse_args(argv)
    if args.command == "models" and args.action == "promote" and args.force and not args.from_challenger:
        parser.error("--force goes with --from-challenger (a plain promote has no gate to force)")
    try:
        settings = get_settings()
    except ValidationError as error:
        print(f"tandem: {settings_error(error, TandemSettings)}", file=sys.stderr)
        return 1
    except SpecError as error:
        # The settings' defaults read the configured spec: a TANDEM_MODEL_SPEC that cannot be
        # loaded (its package not on PYTHONPATH, say) is one line, whatever the command.
        print(f"tandem: {error}", file=sys.stderr)
        return 1
    try:
        return _run(args, settings)
    except (LookupError, ValueError, PromotionRefused, bentoml.exceptions.BentoMLException) as error:
        print(f"tandem: {error}", file=sys.stderr)
        return 1
    except OSError as error:
        # A path from the environment (TANDEM_DATA_DIR, a SQLite DATABASE_URL) that is a file, or
        # not writable, or on a full disk.
        print(f"tandem: {error.filename}: {error.strerror}" if error.filename else f"tandem: {error}", file=sys.stderr)
        return 1
    except sa_exc.DatabaseError as error:
        # Only what the database's state or the URL's options say, never a statement the code got
        # wrong (ProgrammingError, IntegrityError, DataError: a bug, its traceback wanted). A plain
        # DatabaseError is SQLite's "file is not a database": DATABASE_URL names something else.
        # While connecting no statement has run: a ProgrammingError there is the URL's
        # (`?connect_timeout=abc`, an unknown option).
        connecting = error.statement is None
        if not (connecting or isinstance(error, sa_exc.OperationalError) or type(error) is sa_exc.DatabaseError):
            raise
        # The driver's own first line says why (refused, no such database, bad password, no disk).
        reason = str(error.orig).strip().splitlines()[0] if error.orig is not None else str(error)
        where = make_url(get_settings().resolved_database_url()).render_as_string(hide_password=True)
        print(f"tandem: the database at {where} is unavailable: {reason}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace, settings: TandemSettings) -> int:
    if args.command == "demo":
        run_demo(settings)
    elif args.command == "lineage":
        return _print_lineage(settings, args.record_id, as_json=args.json)
    elif args.command == "spec":
        _print_spec(load_spec(args.path) if args.path else configured_spec())
    elif args.command == "store":
        _print_ddl(settings, args.dialect)
    elif args.command == "rejects":
        _mark_fixed(settings, sorted(set(args.rejection_ids)))
    elif args.action == "list":
        current = modelstore.production_tag(settings.model_name)
        challenger = modelstore.challenger_tag(settings.model_name)
        stored = modelstore.versions(settings.model_name)
        if not stored:
            _say(modelstore.missing_production(settings.model_name))
        for version in stored:
            marker = "*" if version.tag == current else "c" if version.tag == challenger else " "
            _say(f"{marker} {version.tag}  created {version.created_at}  auc={version.metadata.get('auc')}")
    else:
        _run_models(args, settings)
    return 0


def _run_models(args: argparse.Namespace, settings: TandemSettings) -> None:
    """`tandem models ...` but list; every version is checked against the spec Tandem runs."""
    spec = configured_spec()
    if args.action == "promote" and args.from_challenger:
        _promote_challenger(settings, spec, force=args.force)
    elif args.action == "promote":
        modelstore.promote(_version_of(settings, args.tag, refused="nothing promoted"), spec)
        _say(f"production -> {modelstore.production_tag(settings.model_name)}")
    elif args.action == "rollback":
        _say(f"production -> {modelstore.rollback(settings.model_name, spec)}")
    elif args.action == "register":
        tag = modelstore.register_dir(args.directory, name=settings.model_name, code_version=code_version(), spec=spec)
        _say(tag)
        if args.promote:
            modelstore.promote(tag, spec)
            _say(f"production -> {tag}")
    elif args.action == "challenge" and args.clear:
        cleared = modelstore.clear_challenger(settings.model_name)
        _say(f"challenger cleared (was {cleared})" if cleared else "no challenger was set")
    elif args.action == "challenge":
        _say(
            f"challenger -> {modelstore.challenge(_version_of(settings, args.tag, refused='no challenger set'), spec)}"
        )


class PromotionRefused(Exception):
    pass


def _version_of(settings: TandemSettings, tag: str, *, refused: str) -> str:
    """`tag`, resolved, if it is a version of the configured model. The store keeps one pointer per
    name: another name's version moved that name's pointer, and the command reported the
    configured model's, which had not moved, as the new production."""
    resolved = str(bentoml.models.get(tag).tag)
    name = resolved.split(":", 1)[0]
    if name != settings.model_name:
        raise ValueError(
            f"{resolved} is a version of {name}, not of {settings.model_name} (TANDEM_MODEL_NAME): {refused}"
        )
    return resolved


def _mark_fixed(settings: TandemSettings, rejection_ids: list[int]) -> None:
    """All of them or none: an id that names no rejection is a typo, and marking the others would
    leave the user to work out which of their list took effect."""
    engine = _existing_store(settings, configured_spec())
    try:
        with engine.begin() as conn:
            marked = mark_rejections_fixed(conn, rejection_ids)
            if marked == len(rejection_ids):
                _say(f"{marked} rejection(s) marked fixed")
                return
            found = set(
                conn.execute(
                    sa.select(rejected_records.c.rejection_id).where(rejected_records.c.rejection_id.in_(rejection_ids))
                ).scalars()
            )
            missing = [rejection_id for rejection_id in rejection_ids if rejection_id not in found]
            if missing:
                # Raised inside the transaction: nothing is marked.
                raise LookupError(f"no rejection {', '.join(map(str, missing))}: nothing marked fixed")
            _say(f"{marked} rejection(s) marked fixed, {len(rejection_ids) - marked} already fixed")
    finally:
        engine.dispose()


def _promote_challenger(settings: TandemSettings, spec: LoadedSpec, *, force: bool) -> None:
    """The gate: the newest challenger_report that compared this challenger with this champion
    passed every check of the gate; --force promotes past a failed or missing report, and says so."""
    challenger = modelstore.challenger_tag(settings.model_name)
    champion = modelstore.production_tag(settings.model_name)
    if challenger is None:
        raise PromotionRefused("no challenger to promote: `tandem models challenge TAG` sets one")
    engine = _existing_store(settings, spec)
    try:
        with engine.connect() as conn:
            report = latest_challenger_report(conn, challenger=challenger, champion=champion or "")
    finally:
        engine.dispose()
    if report is None:
        refusal = (
            f"no challenger_report compares {challenger} with {champion}: backfill challenger_predictions and "
            "materialize challenger_report"
        )
    elif not report.passed:
        reasons = "; ".join(f"{name}: {why}" for name, why in sorted(report.failures.items()))
        refusal = f"challenger_report {report.report_id} ({report.created_at:%Y-%m-%d %H:%M} UTC) failed: {reasons}"
    else:
        refusal = None
    if refusal is not None and not force:
        raise PromotionRefused(f"not promoting {challenger}: {refusal} (--force promotes anyway)")
    if refusal is not None:
        _say(f"forced past the gate: {refusal}")
    else:
        assert report is not None
        _say(f"challenger_report {report.report_id} passed every check of the gate")
    modelstore.promote(challenger, spec)
    _say(f"production -> {modelstore.production_tag(settings.model_name)} (was {champion}); challenger slot empty")


if __name__ == "__main__":
    sys.exit(main())
