"""`service.client`: kept for code written against earlier releases; the client lives in
the `kda_client` package (which imports nothing of the server)."""
from kda_client import *  # noqa: F401,F403  (the re-export is this module's whole job)
from kda_client import __all__  # noqa: F401
