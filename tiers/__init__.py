"""corekv's builtin storage tiers (installed as ``corekv.tiers``)."""
