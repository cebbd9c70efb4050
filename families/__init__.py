"""One module per HF ``model_type``; importing this package registers them all."""

from . import bert  # noqa: F401
