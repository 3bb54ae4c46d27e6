"""The command line of recserve: the top floor, which may import anything below it.

:mod:`recserve.commands.main` builds the parser and dispatches; one module per group of commands.
"""
