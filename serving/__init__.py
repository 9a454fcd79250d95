"""The online path: a BentoML service with a warm model, admission control and adaptive batching."""

from tandem.modelstore import restart_in_default_home

# `bentoml serve` reads BENTOML_HOME before it imports the service; tandem/ sets Tandem's default.
restart_in_default_home()
