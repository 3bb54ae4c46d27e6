"""Feature transforms: raw request values to keys and normalised dense values, and the key hash."""
