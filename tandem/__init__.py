"""Platform glue shared by both paths: the BentoML model store binding, code version, the CLI.

It may import bentoml (the model store is BentoML's) but never dagster, `assets`,
`orchestration` or `serving`; `inference` stays free of both frameworks.
"""

from inference.homes import apply_default_homes

# Here, before any module of the package imports bentoml, which reads BENTOML_HOME once per process.
apply_default_homes()
