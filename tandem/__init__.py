"""Platform glue shared by both paths: the BentoML model store binding, code version, the CLI.

It may import bentoml (the model store is BentoML's) but never dagster, `assets`,
`orchestration` or `serving`; `inference` stays free of both frameworks.
"""
