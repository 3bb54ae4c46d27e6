"""The canary: the new version rolled out behind the proxy, and back at once when it misbehaves.

:mod:`.figures` reads what each variant did (from Envoy and the servers' metrics) into windows;
:mod:`.rules` decides from two windows (advance, hold, roll back); :mod:`.controller` runs the
rollout against a running stack and puts each decision on the proxy.
"""
