"""Client SDK over tritonclient (HTTP and gRPC, sync and asyncio).

Read Criteo-style rows with :func:`read_rows` and score them with :class:`CTRClient` or
:class:`AsyncCTRClient`; failures are raised as :class:`RecserveClientError` subclasses.
"""

from recserve.clients.async_sdk import AsyncCTRClient
from recserve.clients.errors import (
    InvalidRequestError,
    RecserveClientError,
    RequestTimeoutError,
    ServerError,
    ServerUnavailableError,
    map_exception,
)
from recserve.clients.fields import RowFormatError
from recserve.clients.rows import Rows, read_rows
from recserve.clients.sdk import CTRClient, Scores
from recserve.clients.writers import write_csv, write_tsv

__all__ = [
    "AsyncCTRClient",
    "CTRClient",
    "Rows",
    "InvalidRequestError",
    "RecserveClientError",
    "RequestTimeoutError",
    "RowFormatError",
    "Scores",
    "ServerError",
    "ServerUnavailableError",
    "map_exception",
    "read_rows",
    "write_csv",
    "write_tsv",
]
