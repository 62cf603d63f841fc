"""Exceptions raised by storch."""

__all__ = ["IllegalStorchExposeError"]


class IllegalStorchExposeError(Exception):
    """A function exposed plain torch values where storch tensors were required."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
