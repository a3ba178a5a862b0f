"""What several ``corekv`` commands print with: a plain-text table (``plugins``, ``store ls``) and a
progress bar over a few slow items (``bench hit-rate``, ``warm``)."""
from __future__ import annotations

import sys


def print_table(title: str, header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    """``title:``, then ``header`` and ``rows`` in left-aligned columns, or ``(none)``."""
    print(f"{title}:")
    if not rows:
        print("  (none)")
        return
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  " + "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())


def progress(items: list, desc: str, unit: str):
    """A tqdm bar on stderr when it is a terminal, tqdm is installed and there are several items."""
    if len(items) < 2 or not sys.stderr.isatty():
        return items
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    # NOTE: disable=False explicitly: main() sets TQDM_DISABLE for the model loaders' own bars.
    # mininterval=0: items are few and slow, so redraw on each one (tqdm's default 0.1 s throttle
    # skips every update of a run that finishes fast, leaving only "0/N" ever drawn).
    return tqdm(items, desc=desc, unit=unit, file=sys.stderr, disable=False, leave=False,
                mininterval=0)
