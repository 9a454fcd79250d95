"""The online path: a BentoML service with a warm model, admission control and adaptive batching."""
