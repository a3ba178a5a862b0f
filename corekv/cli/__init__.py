"""The ``corekv`` command line: ``plugins``, ``config``, ``bench hit-rate|plot-reload``,
``generate``, ``warm``, ``store stats|ls|verify|clear``, ``serve``, ``route``, ``doctor`` and
``prepare``.

One module per command group (:mod:`~corekv.cli.plugins`, :mod:`~corekv.cli.config`,
:mod:`~corekv.cli.bench`, :mod:`~corekv.cli.generate` for generate and warm,
:mod:`~corekv.cli.store`, :mod:`~corekv.cli.serve`, :mod:`~corekv.cli.route`,
:mod:`~corekv.cli.doctor` for doctor and prepare); what they share (exit
codes, :class:`~corekv.cli.args.UsageError`, the parser class, argument types, the config a command
reads) is :mod:`corekv.cli.args`, with :mod:`corekv.cli.output`'s table and progress bar;
:mod:`corekv.cli.entry` builds the parser from them and runs :func:`main`. Imports run one way:
entry -> command modules -> args/output.

Config: ``--config FILE``, else ``$COREKV_CONFIG``, else the packaged ``corekv/defaults.yaml`` (the
default model plus an lmdb tier at ``./kvstore``, so two runs of the same prompt share its
prefix). The Python API's ``corekv.load_config()`` keeps the device-only dataclass defaults.

Errors a user can fix (bad config, bad arguments, a broken plugin) print one line,
``corekv: error: <message>``, and exit 2 (config or usage) or 1 (runtime); ``--debug`` shows the
traceback instead. Anything else is a bug and keeps its traceback.

``main`` (the ``corekv`` console script, ``corekv.cli:main``) and ``build_parser`` are imported on
first use, so importing a command module or :mod:`corekv.cli.args` does not build every command.
"""
from corekv._lazy import lazy_getattr

_LAZY = {"main": "corekv.cli.entry", "build_parser": "corekv.cli.entry"}
__all__ = sorted(_LAZY)
__getattr__ = lazy_getattr(__name__, _LAZY)
