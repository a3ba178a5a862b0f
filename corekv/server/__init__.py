"""``corekv serve``: an OpenAI-compatible HTTP server over one :class:`corekv.Engine`."""
