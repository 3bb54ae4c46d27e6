"""Client SDK over tritonclient (HTTP and gRPC, sync and asyncio)."""
