"""The one exception type for mistakes a user can make.

Its message is a single line that says what is wrong and how to fix it; the CLI prints it
without a traceback and exits non-zero. Bugs stay ordinary exceptions, with their traceback.
"""


class LmpressError(Exception):
    """A user-fixable problem: bad path, bad parameter, unsupported model, too little text."""

    def __init__(self, message: str):
        super().__init__(" ".join(message.split()))  # always one line


def require(condition: bool, message: str) -> None:
    if not condition:
        raise LmpressError(message)


def reason(error: BaseException, limit: int = 200) -> str:
    """A library's exception as the short reason inside a one-line message."""
    return " ".join(str(error).split())[:limit] or type(error).__name__
