"""The codec's one documented exception family: every bad input surfaces as a `CodecError`.

Callers that only care whether input was bad catch `CodecError`; the subclasses say why, so a gateway
can answer 401/403 for a bad signature and 409 for a wrong base without parsing messages.
"""


class CodecError(ValueError):
    """Input the codec cannot accept: truncated, corrupted, mis-signed, or for another base."""


class SignatureError(CodecError):
    """A manifest whose signature does not verify, or was signed by a key that is not trusted."""


class KeyFileError(SignatureError):
    """A key file that cannot be read, or that holds the wrong kind of key (a private key where the
    public one belongs): the operator's input to fix, which commands report as one line (exit code 2)."""


class CorruptError(CodecError):
    """Bytes that do not match their recorded hash or length, or do not decode."""


class BaseMismatchError(CodecError):
    """A delta applied to weights that are not its base version."""
