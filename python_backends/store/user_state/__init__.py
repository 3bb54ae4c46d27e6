"""The near-line user state: a compact state per user, built off the request path, merged per request.

Long behaviour histories (thousands of events) are served at the latency of short ones: a builder
(:mod:`.builder`, its own process: ``recserve user-state run``) reads users' events from a log
(:mod:`.events`) and writes each user's state (:mod:`.state`: the newest items kept exactly, older ones
grouped around representatives, :mod:`.groups`) to a store (:mod:`.states`: SQLite or Redis,
:mod:`.files` guards the local file); the lookup step merges a request's real-time tail into its user's
state (:mod:`.tokens`, :mod:`.merge`, the cached states' index :mod:`.index`) and asks for a rebuild of
users it could not serve from a state (:mod:`.rebuilds`). The step's side is
:mod:`recserve.backends.steps.user_history`. Design and figures: docs/design/user-state.md.

This room stands on the embedding store's shared parts (its compiled kernels, the Redis tier); the rest of
the store never imports it.
"""
