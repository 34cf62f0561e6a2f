"""The one exception type users see: a problem with their input, stated with its fix.

The CLI prints `allocmoe: error: <message>` and exits with status 2 for these; anything else is a
bug and keeps its traceback.
"""


class AllocMoeError(ValueError):
    """Bad input (budget, plan, profile, model, text): the message names the problem and the fix."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM while a resumable command ran; `resume` says what a rerun of the same command
    picks up ("3 of 10 cells kept in p.json.partial.json"). The CLI prints it and exits 130."""

    def __init__(self, resume: str):
        super().__init__(resume)
        self.resume = resume
