"""The result store: Tandem's tables in SQLAlchemy Core and every statement run on them.

This package is the only place that speaks SQL on Tandem's tables (the spec's record table,
`predictions`, `rejected_records`, `idempotency_keys`, `challenger_predictions`,
`challenger_reports`, `tandem_spec`, `withdrawn_records`); the service's local outbox file
(serving/outbox.py) is the one exception, and it is not one of these tables. All statements are
built with SQLAlchemy (parameterised). Writes are idempotent upserts keyed by the data contract's
keys, never blind appends, so a retried or replayed write changes nothing.

Modules, by concern: `schema` (core tables, enums, row schemas), `record_table` (the spec's record
table, generated), `engine` (engines, the clock, which errors are transient), `merge` (the upsert
machinery), `source_rows` (the record table: source rows and history), `answers` (`predictions`:
the row builder, upserts, reads of answers), `rejections` (quarantine and its resolution), `checks`
(what the batch asset checks read back), `watch` (what the sensors watch), `withdrawals` (records a
re-sent day no longer holds), `idempotency` (idempotency keys), `challenger` (a challenger's
answers and the reports that gate its promotion). Every function that reads or writes the record
table takes the spec first. Import from the package: `from inference.store import X`. No module is
named after a table, so `inference.store.predictions` stays the table even after a submodule
import.
"""

from inference.store.answers import (
    ANSWER_PAIR_SCHEMA,
    PARITY_TOLERANCE,
    ROW_COLUMNS,
    BatchProducer,
    OnlineProducer,
    answer_key_expr,
    answer_pairs,
    delete_batch_predictions,
    lineage_rows,
    online_answers,
    prediction_frame,
    prediction_rows,
    read_predictions,
    upsert_predictions,
)
from inference.store.challenger import (
    COMPARISON_SCHEMA,
    SHADOW_SCHEMA,
    StoredReport,
    challenger_lineage_rows,
    champion_challenger_pairs,
    latest_challenger_report,
    latest_replayed_day,
    online_latencies,
    record_challenger_report,
    upsert_challenger_predictions,
)
from inference.store.checks import PartitionCounts, batch_scores, partition_counts, sample_batch_predictions
from inference.store.engine import is_missing_schema, is_transient_db_error, make_engine, store_url, utc_now
from inference.store.idempotency import (
    KeyClaim,
    claim_idempotency_key,
    complete_idempotency_key,
    release_idempotency_key,
    take_over_idempotency_key,
)
from inference.store.merge import ConflictPolicy
from inference.store.record_table import RecordTable, record_table, record_table_ddl
from inference.store.rejections import (
    count_rejected,
    mark_rejections_fixed,
    open_score_rejections,
    quarantine,
    quarantine_unwritable_result,
    rejection_rows,
    resolve_rescored_rejections,
    resolve_superseded_rejections,
    resolve_unsent_ingest_rejections,
)
from inference.store.schema import (
    NO_HISTORY,
    PREDICTION_COLUMNS,
    PREDICTION_SCHEMA,
    UNWRITABLE_RESULT,
    RejectStage,
    Resolution,
    ResultPath,
    challenger_predictions,
    challenger_reports,
    idempotency_keys,
    metadata,
    predictions,
    rejected_records,
    tandem_spec,
    withdrawn_records,
)
from inference.store.source_rows import (
    StoreHistory,
    fetch_history,
    prior_history,
    read_partition_rows,
    stored_elsewhere,
    stored_partition_dates,
    stream_partition_rows,
    upsert_records,
    valid_rows_between,
    warm_history_statements,
)
from inference.store.watch import (
    OnlineActivity,
    PartitionChange,
    fixed_rejection_partitions,
    online_activity,
    stale_scored_partitions,
)
from inference.store.withdrawals import (
    WithdrawalReason,
    WithdrawalRefused,
    withdraw_unsent_records,
    withdrawal_row,
)

__all__ = [
    "ANSWER_PAIR_SCHEMA",
    "COMPARISON_SCHEMA",
    "NO_HISTORY",
    "PARITY_TOLERANCE",
    "PREDICTION_COLUMNS",
    "PREDICTION_SCHEMA",
    "ROW_COLUMNS",
    "SHADOW_SCHEMA",
    "UNWRITABLE_RESULT",
    "BatchProducer",
    "ConflictPolicy",
    "KeyClaim",
    "OnlineActivity",
    "OnlineProducer",
    "PartitionChange",
    "PartitionCounts",
    "RecordTable",
    "RejectStage",
    "Resolution",
    "ResultPath",
    "StoreHistory",
    "StoredReport",
    "WithdrawalReason",
    "WithdrawalRefused",
    "answer_key_expr",
    "answer_pairs",
    "batch_scores",
    "challenger_lineage_rows",
    "challenger_predictions",
    "challenger_reports",
    "champion_challenger_pairs",
    "claim_idempotency_key",
    "complete_idempotency_key",
    "count_rejected",
    "delete_batch_predictions",
    "fetch_history",
    "fixed_rejection_partitions",
    "idempotency_keys",
    "is_missing_schema",
    "is_transient_db_error",
    "latest_challenger_report",
    "latest_replayed_day",
    "lineage_rows",
    "make_engine",
    "mark_rejections_fixed",
    "metadata",
    "online_activity",
    "online_answers",
    "online_latencies",
    "open_score_rejections",
    "partition_counts",
    "prediction_frame",
    "prediction_rows",
    "predictions",
    "prior_history",
    "quarantine",
    "quarantine_unwritable_result",
    "read_partition_rows",
    "read_predictions",
    "record_challenger_report",
    "record_table",
    "record_table_ddl",
    "rejected_records",
    "rejection_rows",
    "release_idempotency_key",
    "resolve_rescored_rejections",
    "resolve_superseded_rejections",
    "resolve_unsent_ingest_rejections",
    "sample_batch_predictions",
    "stale_scored_partitions",
    "store_url",
    "stored_elsewhere",
    "stored_partition_dates",
    "stream_partition_rows",
    "take_over_idempotency_key",
    "tandem_spec",
    "upsert_challenger_predictions",
    "upsert_predictions",
    "upsert_records",
    "utc_now",
    "valid_rows_between",
    "warm_history_statements",
    "withdraw_unsent_records",
    "withdrawal_row",
    "withdrawn_records",
]
