"""Online updates of embedding tables: versions published on disk, and the Redis stream announcing them."""
