"""The `strata` command line: `main` is the front door (`strata.cli.main`).

One module per subcommand; `errors` holds `UsageError`, the one error path (one line on stderr,
exit status 2). Nothing below this package imports it.
"""

from strata.cli.errors import UsageError
from strata.cli.main import main

__all__ = ["UsageError", "main"]
