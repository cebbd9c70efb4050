"""The ``flodl-hf`` subcommands: each module parses its arguments and calls the library.

One module per command group; ``flodl_hf.cli`` is the thin entry that lists them. Each defines
``register_cli(subparsers)``; a subcommand's ``func(args) -> int`` is its exit code. No library
logic lives here: the functions the commands call are the ones the tests call.
"""
