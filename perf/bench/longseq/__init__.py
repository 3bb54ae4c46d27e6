"""``recserve bench-longseq``: long histories through the near-line user state, against today's rows.

:mod:`.bench` runs the grid; :mod:`.setup` makes what it serves (a bench-local spec, its repository, the
users and their states); :mod:`.load` offers the workloads' requests on a schedule; :mod:`.builder` runs
the user-state builder beside the load; :mod:`.error` measures a state's accuracy cost in process;
:mod:`.steps` times the lookup step's parts (``--in-process``); :mod:`.report` writes ``summary.json``
and the table.
"""
