"""Typed errors of kv_transfer. Each names the field or peer fact that was wrong."""

from __future__ import annotations

from kvmesh.v1.transfer import TransferCode


class TransferError(Exception):
    """Base class: a transfer could not proceed. `code` is its stable code on the wire."""

    code: TransferCode = TransferCode.TRANSFER_ERROR


class LayoutMismatchError(TransferError):
    """The two sides disagree on a layout field; raised at handshake, before any bytes move."""

    code: TransferCode = TransferCode.LAYOUT_MISMATCH

    def __init__(self, field: str, ours: object, theirs: object) -> None:
        super().__init__(f"layout field {field!r} differs: ours={ours!r}, theirs={theirs!r}")
        self.field = field
        self.ours = ours
        self.theirs = theirs


class FrameError(TransferError):
    """A frame or header is malformed (`field` names what was wrong)."""

    code: TransferCode = TransferCode.BAD_FRAME

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class ChecksumError(FrameError):
    """The payload does not match the checksum in its header."""

    code: TransferCode = TransferCode.CHECKSUM


class UnknownTransferError(TransferError):
    """A frame names a transfer id the receiver did not reserve blocks for."""

    code: TransferCode = TransferCode.UNKNOWN_TRANSFER


class StaleEpochError(TransferError):
    """A frame carries an epoch other than the one the receiver reserved blocks under."""

    code: TransferCode = TransferCode.STALE_EPOCH


class TransferStateError(TransferError):
    """A frame or call arrived in a state that does not allow it (`field` is the state)."""

    code: TransferCode = TransferCode.BAD_STATE


class IllegalTransitionError(TransferError):
    """A state change the transfer state machine does not allow (a bug in the caller)."""

    code: TransferCode = TransferCode.ILLEGAL_TRANSITION


class TransferCancelledError(TransferError):
    """The transfer was cancelled by one side."""

    code: TransferCode = TransferCode.CANCELLED


class DeadlineExpiredError(TransferError):
    """A wait ran past its deadline."""

    code: TransferCode = TransferCode.DEADLINE


class PeerError(TransferError):
    """The peer went away, refused the connection, or failed the transfer."""

    code: TransferCode = TransferCode.PEER


class AuthenticationError(TransferError):
    """The local peer could not prove it is allowed to share memory handles."""

    code: TransferCode = TransferCode.AUTH


class BackendUnavailableError(TransferError, RuntimeError):
    """The backend cannot run here (missing CUDA, missing package)."""

    code: TransferCode = TransferCode.UNAVAILABLE


_BY_CODE: dict[TransferCode, type[TransferError]] = {
    cls.code: cls
    for cls in (
        TransferError,
        FrameError,
        ChecksumError,
        UnknownTransferError,
        StaleEpochError,
        TransferStateError,
        IllegalTransitionError,
        TransferCancelledError,
        DeadlineExpiredError,
        PeerError,
        AuthenticationError,
        BackendUnavailableError,
    )
}


def error_from_wire(code: str, message: str) -> TransferError:
    """Rebuild a peer's error from its code and text (unknown codes become `PeerError`)."""
    try:
        cls = _BY_CODE.get(TransferCode(code), PeerError)
    except ValueError:
        cls = PeerError
    if issubclass(cls, FrameError):
        return cls("peer", message)
    return cls(message)


def error_to_wire(error: BaseException) -> bytes:
    """Encode an error as `code\\0message` UTF-8 for an ERROR message payload."""
    code = error.code if isinstance(error, TransferError) else TransferCode.TRANSFER_ERROR
    return f"{code}\0{error}".encode()[:4096]


def parse_wire_error(payload: bytes) -> TransferError:
    """Inverse of `error_to_wire`; never raises on garbage."""
    text = payload.decode("utf-8", errors="replace")
    code, _, message = text.partition("\0")
    return error_from_wire(code, message or code)


def unraised(error: TransferError) -> TransferError:
    """A new error of `error`'s class, text and fields, without traceback, cause or context:
    what a transfer's record keeps, and what it raises again for each late message, so that no
    raise extends a kept error's traceback (each raise adds its frames, with their locals: a
    late frame's payload among them)."""
    copied = type(error).__new__(type(error))
    copied.args = error.args
    copied.__dict__.update(error.__dict__)
    return copied
