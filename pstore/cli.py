"""The ``pstore`` command line. Each command calls the same public API users call."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import numpy as np

import pstore


def _cmd_demo(args: argparse.Namespace) -> int:
    from pstore import demo

    return demo.main(args)


def _cmd_version(args: argparse.Namespace) -> int:
    print(f"pstore {pstore.__version__} (numpy {np.__version__}, python {sys.version.split()[0]})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``pstore`` command."""
    parser = argparse.ArgumentParser(
        prog="pstore", description="pstore: an embedding-table parameter store."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    from pstore import demo

    p = sub.add_parser(
        "demo",
        help="train a matrix-factorisation recommender on the embedded store (MovieLens-100k "
        "when available, else synthetic data)",
    )
    demo.add_arguments(p)
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("version", help="print the versions of pstore and numpy")
    p.set_defaults(func=_cmd_version)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``pstore`` command with ``argv`` (default: ``sys.argv[1:]``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except pstore.PstoreError as e:
        print(f"pstore: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("pstore: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `pstore demo | head`: the reader left, nothing to report
        # Point stdout at /dev/null so the interpreter's final flush does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
