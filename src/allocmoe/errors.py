"""The one exception type users see: a problem with their input, stated with its fix.

The CLI prints `allocmoe: error: <message>` and exits with status 2 for these; anything else is a
bug and keeps its traceback.
"""


class AllocMoeError(ValueError):
    """Bad input (budget, plan, profile, model, text): the message names the problem and the fix."""
