"""The `strata` command line: `main` is the front door (`strata.cli.main`).

One module per subcommand; `errors` holds `UsageError`. `main` reports bad input, a UsageError
or the settings' and the policy API's errors, as one line on stderr with exit status 2. No
module here imports torch or the engine until its command runs. Nothing below this package
imports it.
"""

from strata.cli.errors import UsageError
from strata.cli.main import main

__all__ = ["UsageError", "main"]
