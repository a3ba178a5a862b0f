"""corekv's builtin prefix-cache backends and plugins (installed as ``corekv.plugins``)."""
