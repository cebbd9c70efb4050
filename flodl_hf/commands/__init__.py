"""The ``flodl-hf`` subcommands: each module parses its arguments and calls the library."""
