"""Builds the API reference (HTML) from the docstrings with pdoc.

    pip install ".[test]"            # brings pdoc
    python docs/build_api.py [OUT]    # default OUT: docs/api (not committed)

Run with ``python -W error`` to turn any pdoc warning into a failure (the test suite does).
"""

import os
import pathlib
import sys

import pdoc
import pdoc.render


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "api")
    pdoc.render.configure(docformat="google", show_source=False, footer_text="rlx API reference")
    pdoc.pdoc("rlx", output_directory=pathlib.Path(out))  # submodules (nn, optim, lr_scheduler, models) included
    print(f"API reference written to {out}/rlx.html")


if __name__ == "__main__":
    main()
