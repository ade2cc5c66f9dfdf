"""Typed errors of kv_transfer. Each names the field or peer fact that was wrong."""

from __future__ import annotations


class TransferError(Exception):
    """Base class: a transfer could not proceed. `code` is a stable short name for the wire."""

    code = "transfer_error"


class LayoutMismatchError(TransferError):
    """The two sides disagree on a layout field; raised at handshake, before any bytes move."""

    code = "layout_mismatch"

    def __init__(self, field: str, ours: object, theirs: object) -> None:
        super().__init__(f"layout field {field!r} differs: ours={ours!r}, theirs={theirs!r}")
        self.field = field
        self.ours = ours
        self.theirs = theirs


class FrameError(TransferError):
    """A frame or header is malformed (`field` names what was wrong)."""

    code = "bad_frame"

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class ChecksumError(FrameError):
    """The payload does not match the checksum in its header."""

    code = "checksum"


class UnknownTransferError(TransferError):
    """A frame names a transfer id the receiver did not reserve blocks for."""

    code = "unknown_transfer"


class StaleEpochError(TransferError):
    """A frame carries an epoch other than the one the receiver reserved blocks under."""

    code = "stale_epoch"


class TransferStateError(TransferError):
    """A frame or call arrived in a state that does not allow it (`field` is the state)."""

    code = "bad_state"


class IllegalTransitionError(TransferError):
    """A state change the transfer state machine does not allow (a bug in the caller)."""

    code = "illegal_transition"


class TransferCancelledError(TransferError):
    """The transfer was cancelled by one side."""

    code = "cancelled"


class DeadlineExpiredError(TransferError):
    """A wait ran past its deadline."""

    code = "deadline"


class PeerError(TransferError):
    """The peer went away, refused the connection, or failed the transfer."""

    code = "peer"


class AuthenticationError(TransferError):
    """The local peer could not prove it is allowed to share memory handles."""

    code = "auth"


class BackendUnavailableError(TransferError, RuntimeError):
    """The backend cannot run here (missing CUDA, missing package)."""

    code = "unavailable"


_BY_CODE: dict[str, type[TransferError]] = {
    cls.code: cls
    for cls in (
        TransferError,
        FrameError,
        ChecksumError,
        UnknownTransferError,
        StaleEpochError,
        TransferStateError,
        TransferCancelledError,
        DeadlineExpiredError,
        PeerError,
        AuthenticationError,
        BackendUnavailableError,
    )
}


def error_from_wire(code: str, message: str) -> TransferError:
    """Rebuild a peer's error from its code and text (unknown codes become `PeerError`)."""
    cls = _BY_CODE.get(code, PeerError)
    if issubclass(cls, FrameError):
        return cls("peer", message)
    return cls(message)


def error_to_wire(error: BaseException) -> bytes:
    """Encode an error as `code\\0message` UTF-8 for an ERROR message payload."""
    code = error.code if isinstance(error, TransferError) else "transfer_error"
    return f"{code}\0{error}".encode()[:4096]


def parse_wire_error(payload: bytes) -> TransferError:
    """Inverse of `error_to_wire`; never raises on garbage."""
    text = payload.decode("utf-8", errors="replace")
    code, _, message = text.partition("\0")
    return error_from_wire(code, message or code)
