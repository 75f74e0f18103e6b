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


def require_input(path, directory: bool, what: str, fix: str) -> None:
    """An input the user named exists and is the kind it must be (a folder or a file)."""
    from pathlib import Path

    path = Path(path)
    require(path.exists(), f"{what} {path} does not exist; {fix}")
    kind, other = ("folder", "file") if directory else ("file", "folder")
    require(path.is_dir() == directory, f"{what} {path} is a {other}, not a {kind}; {fix}")


def reason(error: BaseException, limit: int = 200) -> str:
    """A library's exception as the short reason inside a one-line message."""
    return " ".join(str(error).split())[:limit] or type(error).__name__
