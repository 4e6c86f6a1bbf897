"""A cached prefix moved between clusters: its full-attention KV and the state at its end (pure).

One message per prefix (msgpack, array-like)::

    [version, token_ids, page_size, [kv blob, ...], [state blob, ...]]
    blob = [name, dtype, shape, data]

``kv`` holds, per full-attention layer, the key then the value rows of the prefix's tokens
(token-major, ``len(token_ids)`` rows); ``state`` the linear-attention state at the prefix's
last token (one slot of each state tensor: conv windows, then the temporal state). ``dtype`` is
torch's name (``bfloat16``), ``data`` the raw bytes, C order. The receiver refuses a message
whose layout differs from its own pools (:class:`PrefixTransferError`): a prefix is only
moved between workers of one model and one parallel layout.

History:
  v1: first version.
"""

from __future__ import annotations

import msgspec

PREFIX_TRANSFER_VERSION = 1


class PrefixTransferError(ValueError):
    """A prefix message that is malformed, of another version, or does not fit the receiver."""


class TensorBlob(msgspec.Struct, array_like=True, gc=False):
    name: str
    dtype: str
    shape: list[int]
    data: bytes


class PrefixTransfer(msgspec.Struct, array_like=True, gc=False):
    version: int
    token_ids: list[int]
    page_size: int
    kv: list[TensorBlob]
    state: list[TensorBlob]

    def nbytes(self) -> int:
        return sum(len(b.data) for b in self.kv) + sum(len(b.data) for b in self.state)


_DECODER = msgspec.msgpack.Decoder(PrefixTransfer)


def encode(transfer: PrefixTransfer) -> bytes:
    return msgspec.msgpack.encode(transfer)


def decode(payload: bytes) -> PrefixTransfer:
    """Raise PrefixTransferError for anything that is not a well-formed v1 message."""
    try:
        transfer = _DECODER.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        raise PrefixTransferError(f"not a prefix transfer: {err}") from None
    if transfer.version != PREFIX_TRANSFER_VERSION:
        raise PrefixTransferError(f"unsupported prefix transfer version {transfer.version}")
    if not transfer.token_ids or transfer.page_size < 1 or len(transfer.token_ids) % transfer.page_size:
        raise PrefixTransferError(f"{len(transfer.token_ids)} tokens is not a positive multiple of the page "
                                  f"size {transfer.page_size}")
    for blob in transfer.kv + transfer.state:
        if any(d < 0 for d in blob.shape):
            raise PrefixTransferError(f"{blob.name}: negative dimension in {blob.shape}")
    return transfer
