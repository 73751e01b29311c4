"""``python -m mpdoctor``: the command line (:mod:`mpdoctor.front.cli`)."""

from __future__ import annotations

import sys

from .front.cli import main

if __name__ == "__main__":
    sys.exit(main())
