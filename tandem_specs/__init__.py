"""Model specs that ship with Tandem: the reference payment-risk model (the default)."""
