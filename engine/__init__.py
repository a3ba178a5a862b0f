"""corekv's inference engine (installed as ``corekv.engine``)."""
