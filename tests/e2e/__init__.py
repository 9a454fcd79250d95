"""End-to-end: the Dagster deployment (webserver + daemon on PostgreSQL) driven like an operator would."""
