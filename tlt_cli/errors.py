"""The base of every error a user can cause and fix: a bad recipe, a missing file, a model that does not load.

Its message is one sentence naming the key or file to fix. The CLI prints it and exits with code 2
wherever it is raised: in the command itself, in the checks before a run, or in a worker process
(the worker marks its failure as the user's, the driver re-raises it; tlt_cli/processes/driver.py).
"""


class UserError(ValueError):
    """A problem the user can fix; the message is one sentence naming the key or file."""
