"""The store's device side (profile ``cuda``): tables resident in device memory, and the device L1.

:mod:`.tier` holds the tables that fit ``[store] device_memory_mib`` on the device and looks a
batch's keys up there; :mod:`.resident` is one table's (or delta's) rows on the device, sorted by
key; :mod:`.cache` is the device L1 in front of the host tiers for the tables that do not fit.
"""
