"""The seed documents the benchmarks tokenize for their long prompts (``*.md`` files).

They live beside the repository, not in it: ``<repository>/../shared/seeds`` by default, or the
folder a benchmark's ``--seeds`` argument names.
"""
from __future__ import annotations

import argparse
from pathlib import Path

#: ``<repository>/../shared/seeds``, found from this file (``<repository>/benchmarks/``)
DEFAULT_SEEDS = Path(__file__).resolve().parent.parent.parent / "shared" / "seeds"


def add_seeds_argument(parser: argparse.ArgumentParser) -> None:
    """Give ``parser`` the ``--seeds DIR`` option (default :data:`DEFAULT_SEEDS`)."""
    parser.add_argument("--seeds", type=Path, default=DEFAULT_SEEDS, metavar="DIR",
                        help=f"folder of the seed documents (*.md) the prompts are cut from (default: {DEFAULT_SEEDS})")


def read_seeds(folder: Path) -> str:
    """The seed documents in ``folder``, in name order, joined by blank lines.

    :raises SystemExit: naming the folder and the fix when it is missing or holds no ``*.md`` file.
    """
    documents = sorted(folder.glob("*.md")) if folder.is_dir() else []
    if not documents:
        problem = "holds no *.md file" if folder.is_dir() else "is not a folder"
        raise SystemExit(f"the seed documents' folder {folder} {problem}; pass --seeds DIR with the seed "
                         f"documents (by default the repository's ../shared/seeds)")
    return "\n\n".join(path.read_text() for path in documents)
